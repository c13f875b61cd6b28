"""The layers of the MindSpore model ports but Gated DeltaNet (``gated_deltanet``): gated attention,
the dense and sparse MLPs, the final norm and LM head, with rotary tables, on 2-D (B * S, hidden)
activations. ``construct`` runs a sequence, the ``*_rows`` functions a decode step (``decode``);
sub-cells are called through ``construct``: ``Cell.__call__`` adds a per-call overhead."""

from __future__ import annotations

import numpy as np
from mindspore import Tensor, mint, nn, ops

from hyper_gen.backends.mindspore.primitives import (
    add,
    bmm,
    cast,
    div,
    exp,
    gather_rows,
    glu,
    matmul,
    mul,
    normalize,
    numpy_dtype,
    product,
    rms_norm,
    scalar,
    sigmoid,
    softmax,
    split_whole,
    sub,
    sum_last,
    take,
    take_split,
)
from hyper_gen.backends.mindspore.weights import Weights
from hyper_gen.models.qwen3_5 import Qwen3_5Config
from hyper_gen.models.qwen3_5.shards import AttentionShard, FusedExperts, MLPShard, MoEShard
from hyper_gen.parallel.context_parallel import CPStep
from hyper_gen.token_packing import GroupedPacking


def rotary_tables(position_ids, inv_freq, dtype):
    """cos, sin (B * S, 1, head_dim) in ``dtype``, computed in inv_freq's (compute) dtype; 1 and 0
    on the dims past rotary_dim (inv_freq 0 there)."""
    freqs = mul(cast(position_ids, inv_freq.dtype).reshape(-1, 1), inv_freq)
    freqs = freqs.reshape(freqs.shape[0], 1, freqs.shape[1])
    return cast(ops.cos(freqs), dtype), cast(ops.sin(freqs), dtype)


def norm_and_rotate(qk, eps, qk_norm, rotate, cos, sin, acc):
    """q and k heads (N, heads, D): their RMSNorms in ``acc`` (every head's ``1 + w`` and the
    queries' score scale in ``qk_norm``), then rotary, in qk's dtype."""
    n, heads, d = qk.shape
    qk = cast(product(normalize(cast(qk, acc), eps), qk_norm), qk.dtype)
    rotated = matmul(qk.reshape(n * heads, d), rotate).reshape(n, heads, d)
    return add(product(qk, cos), product(rotated, sin))


class GatedAttention(nn.Cell):
    """Full attention with a sigmoid output gate, per-head q/k RMSNorm, partial rotary, GQA.

    One projection gives [queries | keys | values | gates] (HF interleaves each head's query and
    gate rows; they are regrouped at load time). The q/k norms run on all q and k heads at once
    with one (heads, head_dim) weight, the query rows pre-multiplied by the score scale (an ulp
    from scaling the scores as HF does); rotary is ``x * cos + (x @ R) * sin`` with R the +-1
    rotate-half matrix (exact), cos/sin (B * S, 1, head_dim) being 1/0 on the non-rotary dims.

    Under tensor parallelism this rank holds a block of query heads and the KV heads they use
    (``num_heads`` / ``num_kv_heads`` are the local counts); its output is a partial sum."""

    def __init__(
        self, cfg: Qwen3_5Config, weights: Weights, shard: AttentionShard, layer_idx: int, in_scale: np.ndarray
    ):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = shard.num_heads
        self.num_kv_heads = shard.num_kv_heads
        self.head_dim = d = cfg.head_dim
        self.acc = weights.acc
        self.step_sizes = (self.num_heads, self.num_kv_heads, d, weights.acc)  # attention_pre_rows'
        self.eps = scalar(cfg.rms_norm_eps, weights.acc)
        h = cfg.hidden_size
        query_gate = weights.read(shard.query_gate).reshape(self.num_heads, 2, d, h)  # per head: [query | gate]
        query, gate = query_gate[:, 0].reshape(-1, h), query_gate[:, 1].reshape(-1, h)
        blocks = [query, weights.read(shard.key), weights.read(shard.value), gate]
        self.qkv_t = weights.projection(blocks, in_scale, pad=True)
        self.split_sizes = ((self.num_heads + self.num_kv_heads) * d, self.num_kv_heads * d, self.num_heads * d)
        self.o_t = weights.linear_t([shard.o_proj])
        # q_norm and k_norm weights (1 + w), one row per local head; queries carry the score scale
        acc = numpy_dtype(weights.acc)
        q_norm = weights.norm_scale(shard.q_norm) * acc(d**-0.5)
        k_norm = weights.norm_scale(shard.k_norm)
        heads = [np.tile(q_norm, (1, self.num_heads, 1)), np.tile(k_norm, (1, self.num_kv_heads, 1))]
        self.qk_norm = Tensor(np.concatenate(heads, 1).astype(acc))
        rot, half = cfg.rotary_dim, cfg.rotary_dim // 2
        rotate = np.zeros((d, d))  # x @ rotate = rotate_half(x) = [-x2, x1] on the rotary dims, 0 elsewhere
        rotate[np.arange(half, rot), np.arange(half)] = -1.0
        rotate[np.arange(half), np.arange(half, rot)] = 1.0
        self.rotate = Tensor(rotate, weights.ms_dtype)

    def step_weights(self) -> tuple:
        """``attention_pre_rows``' weights after the input norm's epsilon."""
        return self.qkv_t, self.eps, self.qk_norm, self.rotate

    def construct(self, x, b, s, cos, sin, attention_mask, cache, cp_step=None, packing=None):
        projected = matmul(x, self.qkv_t)
        if isinstance(packing, GroupedPacking):  # each group's rows attend on their own
            out = packing.map(projected, self._mix_group)
            return matmul(out, self.o_t)
        if packing is not None:
            projected = packing.unpack(projected)
        out = self._mix(projected, b, s, cos, sin, attention_mask, cache, cp_step)
        if packing is not None:
            out = packing.pack(out)
        return matmul(out, self.o_t)

    def _mix_group(self, group, rows):
        """A grouped step's group (``token_packing.PackedGroup``): its (batch, seq, qkv columns) rows
        through the core its own forward runs (one token a row: the decode step's) -> (batch, seq,
        nh * D). ``rows`` are the projection of the input norm's rows, as in ``attention_pre_rows``."""
        b, s = group.batch, group.seq
        if s == 1:
            nh, nkv, d = self.num_heads, self.num_kv_heads, self.head_dim
            qk, v, gate = split_whole(rows.reshape(b, -1), self.split_sizes)
            qk = norm_and_rotate(
                qk.reshape(b, nh + nkv, d), self.eps, self.qk_norm, self.rotate, group.cos, group.sin, self.acc
            )
            q, k = mint.split(qk, (nh, nkv), 1)
            q, k, v = q.reshape(b, nkv, nh // nkv, d), k.reshape(b, nkv, 1, d), v.reshape(b, nkv, 1, d)
            out = self.attend_one(q, k, v, group.mask, group.cache, None, rows.dtype)
            return product(out, sigmoid(gate)).reshape(b, 1, -1)
        out = self._mix(rows.reshape(b * s, -1), b, s, group.cos, group.sin, group.mask, group.cache, None)
        return out.reshape(b, s, -1)

    def _mix(self, projected, b, s, cos, sin, attention_mask, cache, cp_step):
        """(B * S, qkv columns) of the projection -> (B * S, nh * D) gated attention output."""
        n = b * s
        nh, nkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        heads, group = nh + nkv, nh // nkv
        qk, v, gate = take_split(projected, self.split_sizes)
        qk = norm_and_rotate(qk.reshape(n, heads, d), self.eps, self.qk_norm, self.rotate, cos, sin, self.acc)
        # head-major (B, heads, S, D) copies of the token-major rows by Gather (gather_rows); GQA
        # without repeating K/V: a kv head's queries are rows
        tokens = np.arange(b)[:, None, None] * s + np.arange(s)[None, None, :]  # (B, 1, S)
        rows = qk.reshape(n * heads, d)
        q = gather_rows(rows, tokens * heads + np.arange(nh)[None, :, None], (b, nkv, group * s, d))
        k = gather_rows(rows, tokens * heads + nh + np.arange(nkv)[None, :, None], (b, nkv, s, d))
        v = gather_rows(v.reshape(n * nkv, d), tokens * nkv + np.arange(nkv)[None, :, None], (b, nkv, s, d))
        if cp_step is None:
            keys, values = cache.update(k, v, self.layer_idx)
        else:  # context-parallel prefill: this rank's queries over the prompt's K/V (all-gathered when sharded)
            cp_step.store_prefill(cache, self.layer_idx, k, v)
            keys, values = k, v
            if cp_step.sharded:
                gathered = cp_step.cp.gather_sequence(ops.concat([k, v], -1), cp_step.layout, 2)
                keys, values = gathered[..., :d], gathered[..., d:]
                attention_mask = attention_mask[:, :, cp_step.start : cp_step.stop]
            attention_mask = attention_mask[..., : cp_step.layout.width]
        t = keys.shape[2]
        scores = add(bmm(q, keys, tb=True).reshape(b, nkv, group, s, t), attention_mask[:, :, None])
        probs = cast(softmax(cast(scores, self.acc), -1), projected.dtype)
        out = bmm(probs.reshape(b, nkv, group * s, t), values)
        # token-major again: row (b, head, position) of the (B, nh, S, D) output
        out_rows = (np.arange(b)[:, None, None] * nh + np.arange(nh)[None, None, :]) * s
        out = gather_rows(out.reshape(b * nh * s, d), out_rows + np.arange(s)[None, :, None], (n, nh * d))
        return product(out, sigmoid(gate))

    def attend_one(self, q, k, v, attention_mask, cache, cp_step, dtype):
        """One decode token's attention over the cache (after ``attention_pre_rows``): q
        (B, nkv, group, D), k, v (B, nkv, 1, D) -> (B, nh * D) in ``dtype``."""
        if cp_step is None:
            keys, values = cache.update(k, v, self.layer_idx)
            return attend_rows(q, keys, values, attention_mask, self.acc, dtype)
        out = self._attend_partial(q, k, v, attention_mask, cache, cp_step)
        return cast(out, dtype).reshape(q.shape[0], self.num_heads * self.head_dim)

    def _attend_partial(self, q, k, v, mask, cache, step: CPStep):
        """One decode token under context parallelism: this rank's (output, log-sum-exp) over its
        cached slice, merged over the ranks (``CPStep.merge_attention``); (B, nkv, group, D)."""
        keys, values, mask = step.decode_keys(cache, self.layer_idx, k, v, mask)
        q = cast(q, self.acc)
        if keys is None:  # an empty slice: a zero output of zero weight
            out = ops.zeros(q.shape, self.acc)
            lse = Tensor(np.full(q.shape[:-1] + (1,), np.finfo(numpy_dtype(self.acc)).min), self.acc)
        else:
            scores = add(bmm(q, cast(keys, self.acc), tb=True), cast(mask, self.acc))  # (B, nkv, group, T)
            top = ops.amax(scores, -1, True)
            weights = exp(sub(scores, top))
            total = sum_last(weights, -1)
            out = div(bmm(weights, cast(values, self.acc)), total)
            lse = add(top, ops.log(total))
        return step.merge_attention(out, lse)


def attention_pre_rows(sizes, x, eps, qkv_t, norm_eps, qk_norm, rotate, cos, sin):
    """One decode token of gated attention up to the cache, its input RMSNorm included:
    q (B, nkv, group, D), k, v (B, nkv, 1, D) and the output gate, sigmoid(gate logits) (B, nh * D):
    a new tensor, not a view of the projection (the next graph's input: ``compile.jitted``)."""
    nh, nkv, d, acc = sizes
    b = x.shape[0]
    qk, v, gate = split_whole(matmul(rms_norm(x, eps), qkv_t), ((nh + nkv) * d, nkv * d, nh * d))
    q, k = mint.split(
        norm_and_rotate(qk.reshape(b, nh + nkv, d), norm_eps, qk_norm, rotate, cos, sin, acc), (nh, nkv), 1
    )
    return q.reshape(b, nkv, nh // nkv, d), k.reshape(b, nkv, 1, d), v.reshape(b, nkv, 1, d), sigmoid(gate)


def attend_rows(q, keys, values, mask, acc, dtype):
    """One decode token's attention: q (B, nkv, group, D) over keys / values (B, nkv, T, D) with
    the (B, 1, 1, T) additive mask, softmax in ``acc`` -> (B, nh * D) in ``dtype``."""
    scores = add(bmm(q, keys, tb=True), mask)  # (B, 1, 1, T) over (B, nkv, group, T)
    out = cast(bmm(cast(softmax(cast(scores, acc), -1), dtype), values), dtype)
    return out.reshape(out.shape[0], -1)


def attention_out_rows(out, gate, o_t):
    """The gated attention output projection of (B, nh * D) rows (a partial sum under TP); ``gate``
    is ``attention_pre_rows``' sigmoid(gate logits)."""
    return matmul(product(out, gate), o_t)


class MLP(nn.Cell):
    """SwiGLU feed-forward: ``down(silu(x @ gate) * (x @ up))``, with up|gate as one matrix:
    ``glu`` of the two halves is ``up * sigmoid(gate)``, times gate is the SwiGLU (two kernels
    instead of a split, a sigmoid and two products)."""

    def __init__(
        self, weights: Weights, gate: np.ndarray, up: np.ndarray, down: np.ndarray, in_scale: np.ndarray = None
    ):
        super().__init__()
        # up | gate, each half zero-padded to fast_width / 2 (down gets as many zero rows):
        # glu of the padded halves is 0 on the padding
        inter, hidden = gate.shape
        self.inter = weights.fast_width(hidden, 2 * inter) // 2
        pad = np.zeros((self.inter - inter, hidden), gate.dtype)
        self.up_gate_t = weights.projection([up, pad, gate, pad], in_scale)
        self.down_t = weights.param(np.concatenate([down.T, np.zeros((self.inter - inter, down.shape[0]), down.dtype)]))

    def step_weights(self) -> tuple:
        """``mlp_rows``' weights after the post-attention norm's epsilon."""
        return self.up_gate_t, self.down_t

    def construct(self, x):
        up_gate = matmul(x, self.up_gate_t)
        hidden = product(glu(up_gate, -1), take(up_gate, -1, self.inter, 2 * self.inter))
        return matmul(hidden, self.down_t)


def mlp_rows(inter, x, eps, up_gate_t, down_t):
    """The dense MLP residual branch of (N, hidden) rows: its post-attention RMSNorm included."""
    up_gate = matmul(rms_norm(x, eps), up_gate_t)
    return matmul(product(glu(up_gate, -1), up_gate[:, inter:]), down_t)  # (no float64 NarrowView in graphs)


def dense_mlp(weights: Weights, shard: MLPShard, in_scale: np.ndarray) -> MLP:
    """An MLP with this rank's block of the intermediate dims: gate/up rows, down columns (a
    partial output under tensor parallelism)."""
    return MLP(weights, weights.read(shard.gate), weights.read(shard.up), weights.read(shard.down), in_scale)


class SparseMoE(nn.Cell):
    """Softmax top-k router over experts plus a sigmoid-gated shared expert (HF semantics).

    Routing reads the chosen expert ids on the host once per layer and runs each hit expert on
    its tokens only (so it is never compiled); experts are separate parameters (no weight copies
    per step), laid out so expert or tensor parallelism can take a subset / slice. Under tensor
    parallelism every expert and the shared expert hold this rank's block of their intermediate
    dims and the router is replicated, so every rank routes identically and returns a partial sum."""

    def __init__(self, weights: Weights, shard: MoEShard, in_scale: np.ndarray):
        super().__init__()
        self.routes = None  # a list each forward appends its (tokens, top_k) expert ids to (``record_routes``)
        self.num_experts = shard.num_experts
        self.top_k = shard.top_k
        # router logits | shared expert gate logit, one matmul
        self.route_t = weights.linear_t([shard.router, shard.shared_expert_gate], in_scale)
        self.shared_expert = dense_mlp(weights, shard.shared_expert, in_scale)
        self.acc = weights.acc
        if isinstance(shard.experts, FusedExperts):  # this rank's rows of every expert at once
            gates, ups, downs = (weights.read(p) for p in (shard.experts.gate, shard.experts.up, shard.experts.down))
            experts = [MLP(weights, gates[e], ups[e], downs[e], in_scale) for e in range(self.num_experts)]
        else:  # per-expert layout (what transformers 5.23 save_pretrained writes)
            experts = [dense_mlp(weights, expert, in_scale) for expert in shard.experts]
        self.experts = nn.CellList(experts)

    def construct(self, x):
        route = matmul(x, self.route_t)
        probs = ops.softmax(cast(route[:, : self.num_experts], self.acc), -1)
        weights, chosen = ops.topk(probs, self.top_k)
        weights = weights / weights.sum(-1, keepdims=True)  # transformers 5.23 always renormalises
        # host routing: slots (token, k) sorted by expert, so each expert sees one contiguous block
        expert_of_slot = chosen.asnumpy().reshape(-1)
        if self.routes is not None:
            self.routes.append(expert_of_slot.reshape(-1, self.top_k))
        order = np.argsort(expert_of_slot, kind="stable")
        counts = np.bincount(expert_of_slot, minlength=self.num_experts)
        tokens = ops.gather(x, Tensor((order // self.top_k).astype(np.int32)), 0)
        outputs, start = [], 0
        for e in np.flatnonzero(counts):
            end = start + int(counts[e])
            outputs.append(self.experts[int(e)].construct(tokens[start:end]))
            start = end
        routed = outputs[0] if len(outputs) == 1 else ops.concat(outputs, 0)
        routed = ops.gather(routed, Tensor(np.argsort(order).astype(np.int32)), 0).reshape(-1, self.top_k, x.shape[1])
        routed = (routed * cast(weights, x.dtype)[..., None]).sum(1)
        shared = mul(self.shared_expert.construct(x), sigmoid(route[:, self.num_experts :]))
        return add(routed, shared)


def head_rows(x, eps, norm, *blocks):
    """Final RMSNorm and the LM head blocks (concatenated) of (N, hidden) rows."""
    h = cast(product(normalize(cast(x, eps.dtype), eps), norm), x.dtype)
    logits = [matmul(h, block) for block in blocks]
    return logits[0] if len(logits) == 1 else ops.concat(logits, -1)
