"""Qwen3.5 (dense and MoE) in plain torch, loaded from HF checkpoints.

Implements the cache-object contract (``docs/model_contract.md``): the model writes attention K/V
and Gated DeltaNet conv/recurrent state into the ``StaticCache``/``DynamicCache`` it is handed.

Numerics follow transformers 5.23 op for op where HF computes in float32 whatever the model
dtype (zero-centred RMSNorm, rotary angles, router softmax, the whole gated delta rule with its
float32 recurrent state): a float64 model then matches HF's float64 model bit for bit on CPU.
Float32 matches HF closely but not bitwise: HF's chunked delta rule itself turns 1-ulp input
differences into visible logit differences (its float32 cumulative decay loses precision when
heads decay fast). Elsewhere it fuses: q|k|v of attention, q|k|v|z of Gated DeltaNet and gate|up
of every MLP are one matmul each (bitwise the same as separate matmuls at real model sizes).

Weights are (in, out) matrices and every projection is ``x @ w`` (the LM head too; the embedding
is the (H, V) matrix, looked up by gathering columns, so a tied checkpoint keeps one copy). In
float32 / float16 / bfloat16 they are (in, out)-contiguous: a batch-1 decode step is a stream of
matrix-vector products bound by memory bandwidth, and MKL streams that layout faster on CPU than
the (out, in) one ``F.linear`` reads (measurements: ``docs/performance.md``). Where a float32
shape multiplies faster on this host in contiguous column blocks (timed at load,
``blocked_gemm``), it keeps the checkpoint's (out, in) memory, which the blocks are views of.
float64 keeps HF's (out, in) memory under the same (in, out) view, so it stays bit for bit HF's
(``_matrix_layout``).

Weights are read only through the framework-neutral description
``hyper_gen.models.qwen3_5.shards``: ``describe(checkpoint, config, plan)`` names every
checkpoint tensor this rank reads and the ranges of it it keeps, and ``Checkpoint.read`` reads
and shape-checks each one (a missing or misshaped tensor raises ValueError naming it). This
module only lays the arrays out: fused matrices are the concatenation of their pieces' output
rows in the checkpoint's (out, in) layout, transposed afterwards (``_Weights``).

Tensor parallelism (``load(checkpoint, dtype, device, plan=TPPlan(tp, rank), group=None)``, under
torchrun): each rank reads only its pieces (``describe`` checks every split before any weight is
read, and the split itself -- which heads, channels, intermediate dims and vocabulary rows a rank
keeps -- is documented there), so a rank's q|k|v (attention), q|k|v|z (Gated DeltaNet) and
gate|up (MLP, experts) are its slice of each segment, and o_proj, out_proj and down_proj are
split by columns (row-parallel). A decoder layer sums its mixer's and its MLP's partial outputs
with one ``torch.distributed.all_reduce`` each; the vocab-parallel embedding (ids outside this
rank's block masked, local lookup) with one more. The LM head returns this rank's block of
``plan.padded_vocab(V) // tp`` logits (rows past V are zero); the model's ``parallel_group`` /
``vocab_parallel`` / ``vocab_size`` tell generate() to all-gather and trim them. Per decode step:
``2 * num_hidden_layers + 1`` all-reduces of (B, 1, hidden) and one all-gather of the
(B, padded V / tp) logits (``hyper_gen.models.qwen3_5.tp_traffic``).

Context parallelism (``load(..., cp_plan=CPPlan(cp, rank))``; contract: docs/model_contract.md,
"Context parallelism"; bookkeeping: ``hyper_gen.parallel.cp_plan``): every rank gets the whole
batch and prefills its run of 64-position chunks (``CPStep``); attention all-gathers K|V once per
layer (``CPPlan.strategy`` "allgather", the default) or, with "ulysses", exchanges Q|K|V by one
all-to-all for the whole sequence of ``1/cp`` of the heads and the output by a second; Gated
DeltaNet all-gathers the conv halo once and relays the recurrent state in rank order
(one all-gather per hand-over), so each rank runs one device's chunks with one device's float32
arithmetic (float64 logits equal one device's). Each rank's cache holds its K/V slice; the last
rank also appends every decode token's; a decode step merges the per-rank partial attention by
log-sum-exp (one all-gather of (B, H, D + 1) per attention layer). Under a tp x cp mesh the tp
and cp subgroups are made at load, and the vocabulary blocks are gathered over the tp group here,
so generate() sees whole logits.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hyper_gen.backends.torch import blocked_gemm, onednn_gemm
from hyper_gen.backends.torch.devices import npu_available
from hyper_gen.backends.torch.projection import check_switches, project
from hyper_gen.models.checkpoint import Checkpoint, Piece, generation_defaults
from hyper_gen.models.qwen3_5 import Qwen3_5Config, describe
from hyper_gen.models.qwen3_5.shards import (
    EMBED_TOKENS,
    AttentionShard,
    FusedExperts,
    GatedDeltaNetShard,
    LayerShard,
    MLPShard,
    ModelShard,
    MoEShard,
    vocab_rows,
)
from hyper_gen.parallel.cp_plan import CPLayout, CPPlan, Mesh, check_ulysses_heads
from hyper_gen.parallel.tp_plan import TPPlan

TORCH_DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
CHUNK_SIZE = 64  # Gated DeltaNet prefill chunk length (HF's)


# --------------------------------------------------------------------------------------- norms


class ZeroCentredRMSNorm(nn.Module):
    """``x / rms(x) * (1 + w)``, computed in float32 and cast back (HF Qwen3_5RMSNorm).

    ``scale`` = ``1 + w`` in float32 is precomputed at load (a buffer, so ``parameters()`` keeps
    the model dtype); it is bitwise what HF computes each call."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.register_buffer("scale", torch.empty(dim, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * self.scale).type_as(x)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gated DeltaNet output norm: ``w * x / rms(x) * silu(gate)`` (HF Qwen3_5RMSNormGated)."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = weight * h.to(dtype)
    h = h * F.silu(gate.to(torch.float32))
    return h.to(dtype)


def l2_normalise(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


# ------------------------------------------------------------------------------------- rotary


def rotary_inverse_frequencies(rotary_dim: int, theta: float) -> torch.Tensor:
    """float32, exactly as HF computes them (the angles stay float32 for every model dtype)."""
    return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))


def rotary_cos_sin(position_ids: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype):
    """(B, S, rotary_dim) cos and sin in ``dtype`` for integer positions (B, S)."""
    freqs = position_ids[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``rotary_dim`` channels of x (B, H, S, D); cos/sin are (B, 1, S, rot)."""
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    half = rot // 2
    rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
    return torch.cat(((x_rot * cos) + (rotated * sin), x_pass), dim=-1)


# ------------------------------------------------------------------------- context parallelism


class ContextParallel:
    """The context-parallel group of a model (``hyper_gen.parallel.cp_plan``): its plan, its
    torch.distributed group (None: the world group) and the all-gather everything here uses."""

    def __init__(self, plan: CPPlan, group=None):
        self.plan = plan
        self.group = group

    def gather(self, x: torch.Tensor) -> list:
        """Every rank's ``x`` (same shape everywhere), in rank order."""
        parts = [torch.empty_like(x) for _ in range(self.plan.cp)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return parts

    def gather_sequence(self, x: torch.Tensor, layout: CPLayout, axis: int) -> torch.Tensor:
        """The whole sequence along ``axis`` from every rank's prefill slice of it: the slices are
        padded to the longest for the all-gather and their real positions concatenated in order."""
        pad = layout.longest - x.shape[axis]
        if pad:
            shape = list(x.shape)
            shape[axis] = pad
            x = torch.cat([x, x.new_zeros(shape)], dim=axis)
        parts = self.gather(x)
        return torch.cat([p.narrow(axis, 0, layout.length_of(r)) for r, p in enumerate(parts)], dim=axis)

    def all_to_all(self, parts: list, shapes: list) -> list:
        """Ulysses' exchange: ``parts[j]`` goes to rank j; rank i's piece for this rank, of shape
        ``shapes[i]``, comes back in rank order (one all_to_all_single of the flattened pieces, with
        uneven split sizes, which gloo and NCCL both support)."""
        sizes = [int(np.prod(shape)) for shape in shapes]
        send = torch.cat([p.reshape(-1) for p in parts])
        received = send.new_empty(sum(sizes))
        dist.all_to_all_single(received, send, sizes, [p.numel() for p in parts], group=self.group)
        return [piece.view(shape) for piece, shape in zip(received.split(sizes), shapes)]


class CPStep:
    """One forward of a context-parallel model: the prompt's layout and whether this forward is
    the sharded prefill (``sharded``: this rank computes only its slice), a replicated one (a
    prompt shorter than the ranks' chunks, a cacheless one-token call) or a decode step."""

    def __init__(self, cp: ContextParallel, layout: CPLayout, decode: bool):
        self.cp = cp
        self.layout = layout
        self.rank = cp.plan.rank
        self.decode = decode
        self.sharded = layout.sharded and not decode
        self.start, self.stop = layout.slice_of(self.rank)

    def store_prefill(self, cache, layer_idx: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """This rank's slice of the prompt's K/V into the cache (static: a buffer with room for
        the decode tokens on the owner); nothing for an empty slice of a dynamic cache."""
        if cache is None:
            return
        if not self.sharded:  # replicated prefill: K/V of every position, keep this rank's
            key, value = key[:, :, self.start : self.stop], value[:, :, self.start : self.stop]
        if cache.is_static:
            capacity = self.layout.static_capacity(self.rank, cache.max_length)
            if capacity == 0:
                return
            b, h, n, d = key.shape
            keys, values = key.new_zeros(b, h, capacity, d), value.new_zeros(b, h, capacity, value.shape[-1])
            keys[:, :, :n], values[:, :, :n] = key, value
            cache.keys[layer_idx], cache.values[layer_idx] = keys, values
        elif key.shape[2]:
            cache.keys[layer_idx], cache.values[layer_idx] = key, value

    def decode_keys(self, cache, layer_idx: int, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor):
        """The new token's K/V appended on the owner; (keys, values, mask columns) this rank attends
        over, or (None, None, None) when it holds none."""
        layout, rank = self.layout, self.rank
        if rank == layout.owner:
            local = cache.seq_length - self.start
            if cache.is_static:
                cache.keys[layer_idx][:, :, local : local + 1] = key
                cache.values[layer_idx][:, :, local : local + 1] = value
            elif layer_idx in cache.keys:
                cache.keys[layer_idx] = torch.cat([cache.keys[layer_idx], key], dim=2)
                cache.values[layer_idx] = torch.cat([cache.values[layer_idx], value], dim=2)
            else:
                cache.keys[layer_idx], cache.values[layer_idx] = key, value
        if layer_idx not in cache.keys:
            return None, None, None
        keys, values = cache.keys[layer_idx], cache.values[layer_idx]
        return keys, values, mask[..., self.start : self.start + keys.shape[2]]

    def merge_attention(self, out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
        """Every rank's partial attention (output normalised over its keys, log-sum-exp of its
        scores) merged in rank order: the same arithmetic on the same gathered values on every rank."""
        parts = self.cp.gather(torch.cat([out, lse], dim=-1))
        lses = [p[..., -1:] for p in parts]
        top = lses[0]
        for part in lses[1:]:
            top = torch.maximum(top, part)
        weights = [(part - top).exp() for part in lses]
        total, merged = weights[0], weights[0] * parts[0][..., :-1]
        for weight, part in zip(weights[1:], parts[1:]):
            total = total + weight
            merged = merged + weight * part[..., :-1]
        return merged / total

    def gather_rows(self, hidden: torch.Tensor, logits_to_keep: int) -> torch.Tensor:
        """After a sharded prefill: the rows whose logits are returned, the same on every rank
        (the last one comes from the rank holding the last position)."""
        if logits_to_keep == 1:
            return self.cp.gather(hidden[:, -1:])[self.layout.last_rank]
        hidden = self.cp.gather_sequence(hidden, self.layout, axis=1)
        return hidden[:, -logits_to_keep:] if logits_to_keep else hidden


# ---------------------------------------------------------------------------------- attention


class GatedAttention(nn.Module):
    """Full attention with an output gate: q_proj emits, per head, [query (D) | gate (D)];
    output = o_proj(attention * sigmoid(gate)). Zero-centred q/k RMSNorm, partial rotary, GQA."""

    def __init__(self, config: Qwen3_5Config, layer_idx: int, shard: AttentionShard):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = shard.num_heads  # this rank's heads (all of them at tp 1)
        self.num_kv_heads = shard.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        d, h, kv = self.head_dim, self.num_heads, self.num_kv_heads
        # (in, out) like every matrix here; columns: q_proj (per head [query | gate]) | k_proj | v_proj
        self.qkv_proj = nn.Parameter(torch.empty(config.hidden_size, 2 * h * d + 2 * kv * d))
        self.o_proj = nn.Parameter(torch.empty(h * d, config.hidden_size))
        self.q_norm = ZeroCentredRMSNorm(d, config.rms_norm_eps)
        self.k_norm = ZeroCentredRMSNorm(d, config.rms_norm_eps)

    def forward(self, x, cos, sin, attention_mask, cache, cp_step: Optional[CPStep] = None, packing=None):
        projected = project(x, self.qkv_proj)
        if packing is not None:
            projected = packing.unpack(projected)
        b, s, _ = projected.shape
        h, kv, d = self.num_heads, self.num_kv_heads, self.head_dim
        query_gate, key, value = projected.split([2 * h * d, kv * d, kv * d], dim=-1)
        query_gate = query_gate.view(b, s, h, 2 * d)
        query, gate = query_gate[..., :d], query_gate[..., d:].reshape(b, s, h * d)
        query = self.q_norm(query).transpose(1, 2)
        key = self.k_norm(key.view(b, s, kv, d)).transpose(1, 2)
        value = value.view(b, s, kv, d).transpose(1, 2)
        query = apply_rotary(query, cos, sin)
        key = apply_rotary(key, cos, sin)
        if cp_step is not None:
            out = self._attend_context_parallel(query, key, value, attention_mask, cache, cp_step)
        else:
            if cache is not None:
                key, value = cache.update(key, value, self.layer_idx)
            out = self._attend(query, key, value, attention_mask)
        out = out.transpose(1, 2).reshape(b, s, h * d) * torch.sigmoid(gate)
        if packing is not None:
            out = packing.pack(out)
        return project(out, self.o_proj)

    def _attend_context_parallel(self, query, key, value, mask, cache, step: CPStep):
        """Sharded prefill: this rank's queries over every rank's K/V (one all-gather of K|V), the
        mask rows of its global positions; replicated prefill: the whole prompt; both keep only
        this rank's slice of K/V. Decode: partial attention over this rank's cached slice, merged
        over the ranks by log-sum-exp (``CPStep.merge_attention``)."""
        width = step.layout.width
        if step.decode:
            return self._attend_partial(query, key, value, mask, cache, step)
        step.store_prefill(cache, self.layer_idx, key, value)
        if step.sharded and step.cp.plan.strategy == "ulysses":
            return self._attend_ulysses(query, key, value, mask[..., :width], step)
        if step.sharded:
            d = key.shape[-1]
            key, value = step.cp.gather_sequence(torch.cat([key, value], dim=-1), step.layout, axis=2).split(d, -1)
            mask = mask[:, :, step.start : step.stop]
        return self._attend(query, key, value, mask[..., :width])

    def _attend_ulysses(self, query, key, value, mask, step: CPStep):
        """Sharded prefill, Ulysses: an all-to-all turns this rank's slice of Q|K|V for every head
        into the whole sequence for its ``1/cp`` of the heads (query heads ``[j h/cp, (j+1) h/cp)``
        with their KV heads ``[j kv/cp, (j+1) kv/cp)``), causal attention runs there with the
        global mask, and a second all-to-all gives each rank its slice's output for every head."""
        cp, layout = step.cp.plan.cp, step.layout
        b, h, n, d = query.shape
        kv = key.shape[1]
        hq, hk = h // cp, kv // cp
        heads = torch.cat([x.reshape(b, cp, -1, n, d) for x in (query, key, value)], dim=2)  # (B, cp, hq+2hk, n, D)
        shapes = [(b, hq + 2 * hk, layout.length_of(r), d) for r in range(cp)]
        pieces = step.cp.all_to_all(list(heads.unbind(1)), shapes)
        q, k, v = torch.cat(pieces, dim=2).split([hq, hk, hk], dim=1)  # the whole sequence, these heads
        out = self._attend(q, k, v, mask)  # (B, hq, width, D)
        slices = [out[:, :, layout.starts[r] : layout.stops[r]] for r in range(cp)]
        pieces = step.cp.all_to_all(slices, [(b, hq, n, d)] * cp)
        return torch.cat(pieces, dim=1)  # (B, h, n, D): this rank's slice, every head in order

    def _attend_partial(self, query, key, value, mask, cache, step: CPStep):
        """One decode token: this rank's (output, log-sum-exp) over its keys, then the merge."""
        b, h, _, d = query.shape
        kv = self.num_kv_heads
        keys, values, mask = step.decode_keys(cache, self.layer_idx, key, value, mask)
        compute = query.dtype if query.dtype == torch.float64 else torch.float32
        q = query.reshape(b, kv, h // kv, d).to(compute)
        if keys is None:  # an empty slice: a zero output of zero weight
            out = q.new_zeros(b, kv, h // kv, values.shape[-1] if values is not None else d)
            lse = q.new_full((b, kv, h // kv, 1), torch.finfo(compute).min)
        else:
            scores = (q @ keys.to(compute).transpose(-1, -2)) * self.scale + mask.to(compute)
            top = scores.amax(dim=-1, keepdim=True)
            weights = (scores - top).exp()
            total = weights.sum(dim=-1, keepdim=True)
            out = (weights @ values.to(compute)) / total
            lse = top + total.log()
        return step.merge_attention(out, lse).to(query.dtype).reshape(b, h, 1, d)

    def _attend(self, query, key, value, mask):
        b, h, s, d = query.shape
        kv = key.shape[1]  # this layer's KV heads (Ulysses: this rank's share of them)
        groups = h // kv
        if groups > 1 and s == 1:
            # decode: the query heads sharing a KV head become rows of one (no KV copy)
            out = F.scaled_dot_product_attention(
                query.reshape(b, kv, groups, d), key, value, attn_mask=mask, scale=self.scale
            )
            return out.reshape(b, h, 1, d)
        return F.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, scale=self.scale, enable_gqa=groups > 1
        )


# ------------------------------------------------------------------------------ Gated DeltaNet


def chunk_gated_delta_rule(query, key, value, decay, beta, state: Optional[torch.Tensor], chunk_size: int = CHUNK_SIZE):
    """Gated delta rule over a whole sequence, 64 positions at a time (HF torch_chunk_gated_delta_rule).

    query/key (B, H, S, Dk) float32, l2-normalised, query pre-scaled; value (B, H, S, Dv);
    decay (log space, <= 0) and beta (B, H, S); state (B, H, Dk, Dv) float32 or None.
    Returns the output (B, H, S, Dv) and the final state, both float32.
    The op order is HF's on purpose: float64 models run this in float32 as HF's do, and the
    same float32 arithmetic is what makes them match HF bit for bit. It is two phases: the
    per-chunk work (``_chunk_terms``, independent across chunks) and the scan over chunks
    carrying the state (``_chunk_scan``); a context-parallel rank runs the first on its own
    chunks and the second once the previous rank's final state has arrived.
    """
    return _chunk_scan(_chunk_terms(query, key, value, decay, beta, chunk_size), state)


def chunk_gated_delta_rule_left_padded(
    query, key, value, decay, beta, leading_padding: list, chunk_size: int = CHUNK_SIZE
):
    """:func:`chunk_gated_delta_rule` from a zero state over a left-padded batch, skipping each
    row's chunks of padding only: there q, k and v are zero, so the state stays exactly zero and
    the output is zero. Rows are grouped by how many leading chunks they skip; the chunks kept
    start where the padded layout's chunks start, so each row runs the same chunks as HF's."""
    skips = [padding // chunk_size for padding in leading_padding]
    if not any(skips):
        return chunk_gated_delta_rule(query, key, value, decay, beta, None, chunk_size)
    b, h, s, dk = key.shape
    out = value.new_zeros(b, h, s, value.shape[-1])
    state = value.new_zeros(b, h, dk, value.shape[-1])
    for skip in sorted(set(skips)):
        rows = torch.tensor([row for row, k in enumerate(skips) if k == skip], device=query.device)
        start = skip * chunk_size
        part = (t.index_select(0, rows)[:, :, start:] for t in (query, key, value, decay, beta))
        out_rows, state_rows = chunk_gated_delta_rule(*part, None, chunk_size)
        out[rows, :, start:] = out_rows
        state[rows] = state_rows
    return out, state


def _chunk_terms(query, key, value, decay, beta, chunk_size: int = CHUNK_SIZE) -> dict:
    """Everything of the chunked delta rule that does not depend on the incoming state."""
    b, h, s, dk = key.shape
    pad = (chunk_size - s % chunk_size) % chunk_size
    query, key, value = (F.pad(x, (0, 0, 0, pad)) for x in (query, key, value))
    beta, decay = (F.pad(x, (0, pad)) for x in (beta, decay))
    n = (s + pad) // chunk_size

    v_beta = value * beta.unsqueeze(-1)
    k_beta = key * beta.unsqueeze(-1)
    query, key, k_beta, v_beta = (x.reshape(b, h, n, chunk_size, x.shape[-1]) for x in (query, key, k_beta, v_beta))
    decay = decay.reshape(b, h, n, chunk_size)
    strictly_upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=query.device).triu(1)

    cum_decay = decay.cumsum(dim=3)
    pairwise = (cum_decay.unsqueeze(4) - cum_decay.unsqueeze(3)).masked_fill(strictly_upper, float("-inf")).exp()
    ut_system = (k_beta @ key.transpose(-1, -2)) * pairwise
    intra_chunk = (query @ key.transpose(-1, -2)) * pairwise
    decayed_k_beta = k_beta * cum_decay.exp().unsqueeze(-1)
    new_values = torch.linalg.solve_triangular(ut_system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(ut_system, decayed_k_beta, upper=False, unitriangular=True)
    return {
        "length": s,
        "key_dim": dk,
        "new_values": new_values,
        "k_cumdecay": k_cumdecay,
        "intra_chunk": intra_chunk,
        "query": query * cum_decay.exp().unsqueeze(-1),
        "key": key * (cum_decay[..., -1:] - cum_decay).exp().unsqueeze(-1),
        "chunk_decay": cum_decay[..., -1].exp()[..., None, None],
    }


def _chunk_scan(terms: dict, state: Optional[torch.Tensor]):
    """The chunks in order, carrying the recurrent state: (output (B, H, S, Dv), final state)."""
    new_values, k_cumdecay, intra_chunk = terms["new_values"], terms["k_cumdecay"], terms["intra_chunk"]
    query, key, chunk_decay = terms["query"], terms["key"], terms["chunk_decay"]
    b, h, n, _, dv = new_values.shape
    if state is None:
        state = torch.zeros(b, h, terms["key_dim"], dv, dtype=new_values.dtype, device=new_values.device)
    else:
        state = state.to(new_values)
    out = torch.empty_like(new_values)
    for i in range(n):
        v_new = new_values[:, :, i] - k_cumdecay[:, :, i] @ state
        out[:, :, i] = query[:, :, i] @ state + intra_chunk[:, :, i] @ v_new
        state = state * chunk_decay[:, :, i] + key[:, :, i].transpose(-1, -2) @ v_new
    out = out.reshape(b, h, -1, dv)[:, :, : terms["length"]]
    return out, state


def recurrent_gated_delta_step(query, key, value, decay, beta, state: torch.Tensor):
    """One decode position (HF torch_recurrent_gated_delta_rule with S == 1).

    query/key (B, H, Dk) float32, l2-normalised, query pre-scaled; value (B, H, Dv);
    decay/beta (B, H); state (B, H, Dk, Dv) float32. Returns output (B, H, Dv) and the new state.
    """
    state = state * decay.exp()[..., None, None]
    kv_mem = (state * key.unsqueeze(-1)).sum(dim=-2)
    delta = (value - kv_mem) * beta.unsqueeze(-1)
    state = state + key.unsqueeze(-1) * delta.unsqueeze(-2)
    out = (state * query.unsqueeze(-1)).sum(dim=-2)
    return out, state


def recurrent_gated_delta_step_bmm(query, key, value, decay, beta, state: torch.Tensor):
    """The same step as :func:`recurrent_gated_delta_step` through batched matrix products: the
    state is read three times and written twice instead of the elementwise form's seven passes, which
    sets the pace of a batched decode step. Float32 rounding differs from HF's order by ~1 ulp, so
    float64 models keep the elementwise form (their float32 islands stay bitwise HF's)."""
    b, h, dk, dv = state.shape
    state = (state * decay.exp()[..., None, None]).view(b * h, dk, dv)  # a new tensor: the cache's is kept
    key = key.reshape(b * h, 1, dk)
    kv_mem = torch.bmm(key, state).view(b, h, dv)
    delta = ((value - kv_mem) * beta.unsqueeze(-1)).view(b * h, 1, dv)
    state = state.baddbmm_(key.transpose(1, 2), delta)
    out = torch.bmm(query.reshape(b * h, 1, dk), state).view(b, h, dv)
    return out, state.view(b, h, dk, dv)


class GatedDeltaNet(nn.Module):
    """Linear attention with a gated delta rule (Qwen3.5's 3-in-4 token mixer).

    in_proj columns: q (Hk*Dk) | k (Hk*Dk) | v (Hv*Dv) | z (Hv*Dv); b and a (Hv columns each)
    stay separate matmuls, over HF's (out, in) memory: fused, or (in, out)-contiguous, MKL rounds
    their few outputs differently from HF's own matmuls, and the chunked delta rule amplifies a
    1-ulp change of the decay into a visible difference in the logits.
    The q|k|v part goes through a depthwise causal conv1d (kernel K) + SiLU; the conv state is
    the last K-1 pre-conv positions, (B, q|k|v channels, K-1). Recurrent state (B, Hv, Dk, Dv)
    in float32.
    """

    def __init__(self, config: Qwen3_5Config, layer_idx: int, shard: GatedDeltaNetShard):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_k_heads = shard.num_k_heads  # this rank's heads (all of them at tp 1)
        self.num_v_heads = shard.num_v_heads
        self.head_k_dim = config.linear_key_head_dim
        self.head_v_dim = config.linear_value_head_dim
        self.kernel_size = config.linear_conv_kernel_dim
        self.eps = config.rms_norm_eps
        key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * key_dim + self.value_dim
        self.qkv_split = [key_dim, key_dim, self.value_dim]
        self.in_proj = nn.Parameter(torch.empty(config.hidden_size, self.conv_dim + self.value_dim))
        self.in_proj_b = nn.Parameter(torch.empty(config.hidden_size, self.num_v_heads))
        self.in_proj_a = nn.Parameter(torch.empty(config.hidden_size, self.num_v_heads))
        self.conv_weight = nn.Parameter(torch.empty(self.conv_dim, self.kernel_size))
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads))
        self.register_buffer("neg_decay_rate", torch.empty(self.num_v_heads, dtype=torch.float32))  # -exp(A_log)
        self.norm_weight = nn.Parameter(torch.empty(self.head_v_dim))
        self.out_proj = nn.Parameter(torch.empty(self.value_dim, config.hidden_size))

    def forward(self, x, cache, prompt_mask, cp_step: Optional[CPStep] = None, packing=None):
        if packing is None and prompt_mask is not None:  # left padding adds nothing to conv or recurrent state
            x = (x * prompt_mask[:, :, None]).to(x.dtype)
        conv_state = recurrent_state = None
        if cache is not None:
            conv_state = cache.conv_states.get(self.layer_idx)
            recurrent_state = cache.recurrent_states.get(self.layer_idx)

        mixed, z = project(x, self.in_proj).split([self.conv_dim, self.value_dim], dim=-1)
        beta, decay = x @ self.in_proj_b, x @ self.in_proj_a
        if packing is not None:  # padding positions: the zeros HF's masked input projects to
            mixed, beta, decay = packing.unpack(mixed), packing.unpack(beta), packing.unpack(decay)
        b, s, _ = mixed.shape
        sharded = cp_step is not None and cp_step.sharded
        if sharded:
            mixed, conv_state = self._conv_context_parallel(mixed.transpose(1, 2), cp_step)
        else:
            mixed, conv_state = self._conv(mixed.transpose(1, 2), conv_state)
        query, key, value = mixed.transpose(1, 2).split(self.qkv_split, dim=-1)
        query = query.reshape(b, s, -1, self.head_k_dim)
        key = key.reshape(b, s, -1, self.head_k_dim)
        value = value.reshape(b, s, -1, self.head_v_dim)
        beta = beta.sigmoid()
        decay = self.neg_decay_rate * F.softplus(decay.float() + self.dt_bias)

        out, recurrent_state = self._delta_rule(
            query, key, value, decay, beta, recurrent_state, cp_step if sharded else None, packing
        )
        if cache is not None:
            cache.conv_states[self.layer_idx] = conv_state
            cache.recurrent_states[self.layer_idx] = recurrent_state

        if packing is not None:
            out = packing.pack(out.reshape(b, s, self.value_dim))
        shape = z.shape
        out = gated_rms_norm(
            out.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim), self.norm_weight, self.eps
        )
        return project(out.reshape(shape), self.out_proj)

    def _conv(self, mixed: torch.Tensor, state: Optional[torch.Tensor]):
        """Depthwise causal conv + SiLU of (B, C, S); returns it and the new (B, C, K-1) state."""
        keep = self.kernel_size - 1
        if state is not None and mixed.shape[-1] == 1:
            window = torch.cat([state, mixed], dim=-1)  # (B, C, K)
            out = (window * self.conv_weight).sum(dim=-1, keepdim=True)
            return F.silu(out), window[..., 1:]
        if state is None:
            out = F.conv1d(mixed, self.conv_weight.unsqueeze(1), padding=keep, groups=self.conv_dim)
            out = out[..., : mixed.shape[-1]]
            history = F.pad(mixed[..., -keep:], (max(keep - mixed.shape[-1], 0), 0))
        else:  # several new positions after cached ones (chunked prefill)
            full = torch.cat([state, mixed], dim=-1)
            out = F.conv1d(full, self.conv_weight.unsqueeze(1), groups=self.conv_dim)
            history = full[..., -keep:]
        return F.silu(out), history.contiguous()

    def _conv_context_parallel(self, mixed: torch.Tensor, step: CPStep):
        """The conv over this rank's slice (B, C, s) of a sharded prefill: the previous slice's last
        K-1 pre-conv positions (the halo) come with one all-gather of every rank's last K-1, which
        also gives every rank the whole prompt's conv state (the last K-1 positions overall)."""
        keep = self.kernel_size - 1
        tail = F.pad(mixed[..., -keep:], (max(keep - mixed.shape[-1], 0), 0))
        tails = step.cp.gather(tail)
        layout = step.layout
        real = [t[..., keep - min(keep, layout.length_of(r)) :] for r, t in enumerate(tails)]
        history = torch.cat(real, dim=-1)[..., -keep:]
        history = F.pad(history, (keep - history.shape[-1], 0)).contiguous()
        if step.rank == 0:
            return self._conv(mixed, None)[0], history
        # the slices before the last are whole chunks (>= K-1 positions): the halo is the previous one's
        full = torch.cat([tails[step.rank - 1], mixed], dim=-1)
        out = F.conv1d(full, self.conv_weight.unsqueeze(1), padding=keep, groups=self.conv_dim)
        return F.silu(out[..., keep : keep + mixed.shape[-1]]), history

    def _delta_rule(self, query, key, value, decay, beta, state, cp_step: Optional[CPStep] = None, packing=None):
        """(B, S, H, D) inputs -> (B, S, Hv, Dv) output in the model dtype, new float32 state.

        In a sharded context-parallel prefill the state is relayed in rank order: rank r scans its
        chunks from rank r-1's final state; after each rank's scan one all-gather hands its final
        state on (the last one gives every rank the whole prompt's state, replicated for decode).
        Every rank's slice starts on a chunk boundary, so each runs one device's chunks exactly."""
        dtype = query.dtype
        groups = self.num_v_heads // self.num_k_heads
        if groups > 1:  # each q/k head serves `groups` consecutive value heads
            query = query.repeat_interleave(groups, dim=2)
            key = key.repeat_interleave(groups, dim=2)
        query, key, value, beta, decay = (
            t.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)
            for t in (query, key, value, beta, decay)
        )
        query = l2_normalise(query)
        key = l2_normalise(key)
        if state is not None and query.shape[2] == 1:
            query = query / (query.shape[-1] ** 0.5)
            step = recurrent_gated_delta_step if dtype == torch.float64 else recurrent_gated_delta_step_bmm
            out, state = step(query[:, :, 0], key[:, :, 0], value[:, :, 0], decay[:, :, 0], beta[:, :, 0], state)
            out = out.unsqueeze(2)
        elif cp_step is not None:
            query = query * query.shape[-1] ** -0.5
            out, state = self._relayed_chunks(_chunk_terms(query, key, value, decay, beta), cp_step)
        elif packing is not None and state is None:
            query = query * query.shape[-1] ** -0.5
            out, state = chunk_gated_delta_rule_left_padded(query, key, value, decay, beta, packing.leading_padding)
        else:
            query = query * query.shape[-1] ** -0.5
            out, state = chunk_gated_delta_rule(query, key, value, decay, beta, state)
        return out.transpose(1, 2).to(dtype, memory_format=torch.contiguous_format), state

    @staticmethod
    def _relayed_chunks(terms: dict, step: CPStep):
        b, h, _, _, dv = terms["new_values"].shape
        placeholder = terms["new_values"].new_zeros(b, h, terms["key_dim"], dv)
        state, out = None, None
        for turn in range(step.cp.plan.cp):
            if turn == step.rank:
                out, state = _chunk_scan(terms, state)
            state = step.cp.gather(state if turn == step.rank else placeholder)[turn]
        return out, state


# ------------------------------------------------------------------------------------ MLP / MoE


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)); gate_up columns: gate (I) | up (I)."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(hidden_size, 2 * intermediate_size))
        self.down_proj = nn.Parameter(torch.empty(intermediate_size, hidden_size))

    def forward(self, x):
        gate, up = project(x, self.gate_up_proj).chunk(2, dim=-1)
        return project(F.silu(gate) * up, self.down_proj)


class SparseMoE(nn.Module):
    """Softmax top-k router (top-k weights renormalised), routed SwiGLU experts, and a shared
    SwiGLU expert scaled by sigmoid(shared_expert_gate(x))."""

    def __init__(self, hidden_size: int, shard: MoEShard):
        super().__init__()
        e, h, i = shard.num_experts, hidden_size, shard.intermediate  # i: this rank's intermediate dims
        self.num_experts = e
        self.top_k = shard.top_k
        self.router = nn.Parameter(torch.empty(h, e))
        self.experts_gate_up = nn.Parameter(torch.empty(e, h, 2 * i))  # per expert columns: gate (I) | up (I)
        self.experts_down = nn.Parameter(torch.empty(e, i, h))
        self.shared_expert = SwiGLU(h, shard.shared_expert.intermediate)
        self.shared_expert_gate = nn.Parameter(torch.empty(h, 1))

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        logits = x @ self.router
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        weights = (weights / weights.sum(dim=-1, keepdim=True)).to(logits.dtype)
        out = self._experts(x, experts, weights)
        out = out + torch.sigmoid(x @ self.shared_expert_gate) * self.shared_expert(x)
        return out.reshape(shape)

    def _experts(self, x, experts, weights):
        """Tokens sorted by expert, one pair of matmuls per expert hit (one host sync per call)."""
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        token = order // self.top_k
        routed = x.index_select(0, token)
        out = torch.empty_like(routed)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            rows = slice(start, start + count)
            gate, up = (routed[rows] @ self.experts_gate_up[expert]).chunk(2, dim=-1)
            out[rows] = (F.silu(gate) * up) @ self.experts_down[expert]
            start += count
        out = out * weights.reshape(-1, 1).index_select(0, order)
        return torch.zeros_like(x).index_add_(0, token, out)


# -------------------------------------------------------------------------------------- model


class RankSum:
    """Sums a row-parallel partial output over the tensor-parallel group in place (one
    all-reduce); the identity at tp 1. ``group`` None is the world group."""

    def __init__(self, tp: int, group=None):
        self.tp = tp
        self.group = group

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp > 1:
            dist.all_reduce(x, group=self.group)
        return x


class TokenPacking:
    """The real tokens of a left-padded prefill, packed: the row-wise work of every layer (norms,
    projections, MLP / experts, residual adds) runs on the (N, H) real rows only, and just the
    sequence mixers' cores (rotary + attention, conv + delta rule) see the padded (B, S, C) layout,
    with zeros at the padding: exactly what HF's masked Gated DeltaNet input projects to, and keys
    the attention mask hides. A batch of mixed-length prompts then costs its tokens, not B x S."""

    def __init__(self, prompt_mask: torch.Tensor):
        self.batch, self.seq = prompt_mask.shape
        self.index = prompt_mask.reshape(-1).nonzero().squeeze(1)
        self.leading_padding = [self.seq - int(n) for n in prompt_mask.sum(dim=1).tolist()]  # per row

    @classmethod
    def of(cls, prompt_mask: Optional[torch.Tensor]) -> Optional["TokenPacking"]:
        """None when there is no padding to skip."""
        if prompt_mask is None or prompt_mask.shape[1] == 1:
            return None
        packing = cls(prompt_mask)
        return packing if packing.index.numel() < packing.batch * packing.seq else None

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """(B, S, C) -> (N, C): the real positions' rows, in order."""
        return x.reshape(-1, x.shape[-1]).index_select(0, self.index)

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """(N, C) -> (B, S, C), zeros at the padding."""
        out = x.new_zeros(self.batch * self.seq, x.shape[-1])
        return out.index_copy_(0, self.index, x).view(self.batch, self.seq, -1)


class DecoderLayer(nn.Module):
    def __init__(self, config: Qwen3_5Config, layer_idx: int, shard: LayerShard, rank_sum: RankSum):
        super().__init__()
        self.is_linear = shard.is_linear
        self.input_norm = ZeroCentredRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mixer = (GatedDeltaNet if self.is_linear else GatedAttention)(config, layer_idx, shard.mixer)
        self.post_attention_norm = ZeroCentredRMSNorm(config.hidden_size, config.rms_norm_eps)
        if isinstance(shard.mlp, MoEShard):
            self.mlp = SparseMoE(config.hidden_size, shard.mlp)
        else:
            self.mlp = SwiGLU(config.hidden_size, shard.mlp.intermediate)
        self.rank_sum = rank_sum

    def forward(self, x, cos, sin, attention_mask, cache, prompt_mask, cp_step=None, packing=None):
        h = self.input_norm(x)
        if self.is_linear:
            h = self.mixer(h, cache, prompt_mask, cp_step, packing)
        else:
            h = self.mixer(h, cos, sin, attention_mask, cache, cp_step, packing)
        x = x + self.rank_sum(h)
        return x + self.rank_sum(self.mlp(self.post_attention_norm(x)))


class Qwen3_5ForCausalLM(nn.Module):
    """Qwen3.5 text model + LM head (dense or MoE), cache-object contract.

    ``forward(input_ids, position_ids, attention_mask, past_key_values, logits_to_keep)`` ->
    ``{"logits": (B, S or logits_to_keep, V)}``. Outside generate() ``past_key_values`` may be
    None (no cache, unpadded batch) and ``attention_mask``/``position_ids`` None (causal, no
    padding, positions continuing from the cache).

    It is built for one rank's ``ModelShard`` (``hyper_gen.models.qwen3_5.shards.describe``);
    ``tp_plan`` is that shard's ``TPPlan``. With ``tp_plan.tp > 1`` it also has
    ``parallel_group`` (None: the world group) and ``vocab_parallel = True``: its logits are this
    rank's block of ``plan.padded_vocab(vocab_size) // tp`` columns, which generate() gathers.
    """

    supports_cache_object = True

    def __init__(self, shard: ModelShard, group=None, cp_plan: Optional[CPPlan] = None, cp_group=None):
        super().__init__()
        config, plan = shard.config, shard.plan
        self.config = config
        self.vocab_size = config.vocab_size
        self.tp_plan = plan
        self.tp_group = group
        self.cp_plan = CPPlan.resolve(cp_plan)
        self.context_parallel = ContextParallel(self.cp_plan, cp_group) if self.cp_plan.cp > 1 else None
        if self.cp_plan.cp > 1:
            # generate() checks inputs and agrees on tokens over every rank of the job (the tp x cp
            # mesh); the logits are whole on every rank (vocab blocks gathered over the tp group here)
            self.parallel_group = None
            self.vocab_parallel = False
        elif plan.tp > 1:
            self.parallel_group = group
            self.vocab_parallel = True
        self.vocab_start, rows = shard.vocab_start, shard.vocab_stop - shard.vocab_start
        self.rank_sum = RankSum(plan.tp, group)
        # the embedding matrix transposed, (H, rows): a lookup gathers columns; when tied it is
        # also the LM head (one copy), read by ``hidden @ embed_tokens``
        self.embed_tokens = nn.Parameter(torch.empty(config.hidden_size, rows))
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, layer, self.rank_sum) for i, layer in enumerate(shard.layers)
        )
        self.norm = ZeroCentredRMSNorm(config.hidden_size, config.rms_norm_eps)
        # (H, rows); None for tied checkpoints, whose head is ``embed_tokens``
        self.lm_head = None if shard.lm_head is None else nn.Parameter(torch.empty(config.hidden_size, rows))
        self.register_buffer("inv_freq", torch.empty(config.rotary_dim // 2, dtype=torch.float32), persistent=False)
        self.generation_defaults: dict = {}

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.device

    def forward(self, input_ids, position_ids=None, attention_mask=None, past_key_values=None, logits_to_keep=0):
        cache = past_key_values
        batch, seq = input_ids.shape
        past = cache.seq_length if cache is not None else 0
        if position_ids is None:
            position_ids = torch.arange(past, past + seq, device=input_ids.device).expand(batch, seq)
        if attention_mask is None:
            total = cache.max_length if cache is not None and cache.is_static else past + seq
            attention_mask = causal_mask(seq, past, total, self.dtype, input_ids.device)
        prompt_mask = cache.prompt_mask if cache is not None and past == 0 else None
        step = None
        if self.context_parallel is not None:
            step = self._cp_step(cache, seq, past)
            if step.sharded:  # this rank's slice of the positions; the mask keeps its global columns
                input_ids, position_ids = input_ids[:, step.start : step.stop], position_ids[:, step.start : step.stop]
                if prompt_mask is not None:
                    prompt_mask = prompt_mask[:, step.start : step.stop]

        packing = TokenPacking.of(prompt_mask) if step is None else None
        if packing is not None:
            hidden = self._embed(input_ids.reshape(-1).index_select(0, packing.index))
        else:
            hidden = self._embed(input_ids)
        cos, sin = rotary_cos_sin(position_ids, self.inv_freq, hidden.dtype)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        for layer in self.layers:
            hidden = layer(hidden, cos, sin, attention_mask, cache, prompt_mask, step, packing)
        if packing is not None:
            hidden = packing.unpack(hidden)
        if step is not None and step.sharded:
            hidden = step.gather_rows(hidden, logits_to_keep)
        elif logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        hidden = self.norm(hidden)
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        logits = project(hidden, head)
        if self.context_parallel is not None and self.tp_plan.tp > 1:  # whole vocabulary on every rank
            parts = [torch.empty_like(logits) for _ in range(self.tp_plan.tp)]
            dist.all_gather(parts, logits.contiguous(), group=self.tp_group)
            logits = torch.cat(parts, dim=-1)[..., : self.vocab_size]
        return {"logits": logits}

    def _cp_step(self, cache, seq: int, past: int) -> CPStep:
        """The layout of this forward: a new one at the prefill (kept on the cache for decode)."""
        if past == 0:
            layout = self.cp_plan.layout(seq)
            if cache is not None:
                cache.cp_layout = layout
            return CPStep(self.context_parallel, layout, decode=False)
        layout = getattr(cache, "cp_layout", None)
        if layout is None or seq != 1:
            raise ValueError(
                f"a context-parallel model takes a prefill (an empty cache) or one token per row after it, got "
                f"{seq} tokens after {past} cached positions"
                + ("" if layout is not None else " in a cache it did not prefill")
            )
        return CPStep(self.context_parallel, layout, decode=True)

    def _embed(self, input_ids):
        if self.tp_plan.tp == 1:
            return self._columns(input_ids)
        # vocab-parallel: look up the ids in this rank's block, zeros for the others, sum over ranks
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.embed_tokens.shape[1])
        hidden = self._columns(local.masked_fill(outside, 0))
        return self.rank_sum(hidden.masked_fill_(outside[..., None], 0))

    def _columns(self, ids):
        """(B, S) ids -> (B, S, H) embedding rows, gathered as columns of the (H, rows) matrix."""
        if self.embed_tokens.t().is_contiguous():  # kept in (rows, H) memory: gather its rows
            return torch.index_select(self.embed_tokens.t(), 0, ids.reshape(-1)).view(*ids.shape, -1)
        columns = torch.index_select(self.embed_tokens, 1, ids.reshape(-1))  # (H, B*S)
        return columns.t().contiguous().view(*ids.shape, -1)  # contiguous: reductions sum in HF's order


def causal_mask(seq: int, past: int, total: int, dtype: torch.dtype, device) -> torch.Tensor:
    """(1, 1, seq, total) additive mask: query i (at position past + i) sees columns <= past + i."""
    rows = torch.arange(past, past + seq, device=device)[:, None]
    cols = torch.arange(total, device=device)[None, :]
    mask = torch.zeros(seq, total, dtype=dtype, device=device)
    return mask.masked_fill(cols > rows, torch.finfo(dtype).min)[None, None]


# ------------------------------------------------------------------------------------ loading


def _matrix_layout(w_t: torch.Tensor) -> torch.Tensor:
    """The stored form of a weight given as the (in, out) transposed view of its (out, in) matrix.

    Every matmul is ``x @ w`` with w of shape (in, out). A batch-1 decode step streams weights
    faster from (in, out)-contiguous memory on CPU than from the (out, in) layout ``F.linear``
    reads (MKL's axpy-form gemv vs its dot-product form), so that is the layout for float32 /
    float16 / bfloat16. float64 is the bit-for-bit check against HF: it keeps
    HF's (out, in) memory, so ``x @ w`` is exactly ``F.linear`` (MKL sums the other layout in
    another order, and the float32 islands -- norms, the delta rule -- amplify that last-bit
    difference into a visible one). A float32 CPU weight whose shape multiplies faster in column
    blocks on this host keeps the (out, in) memory too, which the blocks are cut from
    (``blocked_gemm``). Whether its products run through a oneDNN-packed copy instead is decided
    here too (``onednn_gemm``), by timing the shape on this host."""
    if w_t.dtype == torch.float64:
        return w_t
    if w_t.dtype == torch.float32 and w_t.device.type == "cpu" and w_t.dim() == 2:
        stored = blocked_gemm.stored(w_t)
        onednn_gemm.use_packed(*w_t.shape)
        return stored
    return w_t.contiguous()


class _Weights:
    """The pieces ``describe`` names -> torch tensors of the model dtype on the target device.

    Each piece is read (and shape-checked) by ``Checkpoint.read``, in float64 for a float64
    model and float32 otherwise, then cast. A matrix is assembled in the checkpoint's (out, in)
    layout -- a fused one is its pieces' output rows concatenated, in order -- and stored as
    ``_matrix_layout`` of its (in, out) view."""

    def __init__(self, checkpoint: Checkpoint, dtype: torch.dtype, device):
        self.checkpoint = checkpoint
        self.dtype = dtype
        self.device = device
        self.read_dtype = "float64" if dtype == torch.float64 else "float32"

    def array(self, *pieces: Piece) -> np.ndarray:
        """The pieces read and concatenated along their output rows (axis -2 of a matrix)."""
        arrays = [self.checkpoint.read(piece, self.read_dtype) for piece in pieces]
        return arrays[0] if len(arrays) == 1 else np.concatenate(arrays, axis=-2)

    def cast(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(device=self.device, dtype=self.dtype)

    def tensor(self, piece: Piece) -> torch.Tensor:
        """A piece as it is (vectors, the conv kernel)."""
        return self.cast(self.array(piece))

    def matrix(self, *pieces: Piece) -> torch.Tensor:
        """(out, in) pieces fused along their output rows, stored (in, out) for ``x @ w``."""
        return self.transposed(self.array(*pieces))

    def transposed(self, array: np.ndarray) -> torch.Tensor:
        """An (..., out, in) array stored as (..., in, out) (``_matrix_layout``)."""
        return _matrix_layout(self.cast(array).transpose(-1, -2))

    def norm_scale(self, piece: Piece) -> torch.Tensor:
        """``1 + w`` in float32 from w in the model dtype: what HF's zero-centred RMSNorm multiplies by."""
        return 1.0 + self.tensor(piece).float()


def _attention_state(w: _Weights, s: AttentionShard) -> dict:
    return {
        "qkv_proj": w.matrix(s.query_gate, s.key, s.value),  # q_proj (per head [query | gate]) | k | v
        "o_proj": w.matrix(s.o_proj),
        "q_norm.scale": w.norm_scale(s.q_norm),
        "k_norm.scale": w.norm_scale(s.k_norm),
    }


def _gated_deltanet_state(w: _Weights, s: GatedDeltaNetShard) -> dict:
    state = {"in_proj": w.matrix(s.qkv, s.z)}  # q | k | v | z
    # b / a stay in HF's (out, in) memory in every dtype (an (in, out) view): x @ w is then exactly
    # HF's matmul, and the chunked delta rule amplifies a 1-ulp change of the decay into a visible
    # one in float32 (these (Hv, H) matrices are too small for the layout to matter to speed)
    state["in_proj_b"] = w.tensor(s.b).t()
    state["in_proj_a"] = w.tensor(s.a).t()
    conv = w.tensor(s.conv)  # (q|k|v channels, 1, kernel)
    state["conv_weight"] = conv.reshape(conv.shape[0], conv.shape[-1])
    state["dt_bias"] = w.tensor(s.dt_bias)
    state["neg_decay_rate"] = -w.tensor(s.a_log).float().exp()  # model dtype first, then float32 as HF
    state["norm_weight"] = w.tensor(s.norm)
    state["out_proj"] = w.matrix(s.out_proj)
    return state


def _swiglu_state(w: _Weights, s: MLPShard) -> dict:
    return {"gate_up_proj": w.matrix(s.gate, s.up), "down_proj": w.matrix(s.down)}


def _moe_state(w: _Weights, s: MoEShard) -> dict:
    state = {"router": w.matrix(s.router)}
    if isinstance(s.experts, FusedExperts):  # (E, 2I, H) / (E, H, I): HF's in-memory layout
        state["experts_gate_up"] = w.matrix(s.experts.gate, s.experts.up)
        state["experts_down"] = w.matrix(s.experts.down)
    else:  # per expert (what save_pretrained writes), stacked
        state["experts_gate_up"] = w.transposed(np.stack([w.array(e.gate, e.up) for e in s.experts]))
        state["experts_down"] = w.transposed(np.stack([w.array(e.down) for e in s.experts]))
    state.update({f"shared_expert.{k}": v for k, v in _swiglu_state(w, s.shared_expert).items()})
    state["shared_expert_gate"] = w.matrix(s.shared_expert_gate)
    return state


def load(
    checkpoint: Checkpoint,
    dtype: str = "float32",
    device=None,
    plan: Optional[TPPlan] = None,
    group=None,
    cp_plan: Optional[CPPlan] = None,
    kernels=None,
) -> Qwen3_5ForCausalLM:
    """Build the model from an opened checkpoint (``hyper_gen.models.checkpoint.Checkpoint``).

    ``plan``: a ``TPPlan(tp, rank)`` to load this rank's tensor-parallel shard (None: the whole
    model); ``group``: the torch.distributed group of the ``tp`` ranks (None: the world group,
    whose size and this process's rank must then be ``tp`` and ``plan.rank``).
    ``cp_plan``: a ``CPPlan(cp, rank)`` for context parallelism (``hyper_gen.parallel.cp_plan``):
    the world is then the ``tp x cp`` mesh (``Mesh``: tp innermost), whose tp and cp subgroups are
    made here (every rank must call this), unless ``group`` is given."""
    if dtype not in TORCH_DTYPES:
        raise ValueError(f"dtype must be one of {tuple(TORCH_DTYPES)}, got {dtype!r}")
    check_switches()
    if str(device).startswith("npu") and not npu_available():
        raise ValueError(f"device {device!r} needs torch_npu and CANN, which are not available here")
    try:
        device = torch.device(device or "cpu")
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"device {device!r} is not a torch device: {error}") from None
    config = Qwen3_5Config.from_dict(checkpoint.config)
    shard = describe(checkpoint, config, plan)  # every split checked, before any weight is read
    cp_plan = CPPlan.resolve(cp_plan)
    if cp_plan.strategy == "ulysses":
        attention = next((layer.mixer for layer in shard.layers if isinstance(layer.mixer, AttentionShard)), None)
        if attention is not None:
            check_ulysses_heads(cp_plan.cp, attention.num_heads, attention.num_kv_heads)
    cp_group = None
    if cp_plan.cp > 1:
        group, cp_group = _mesh_groups(shard.plan, cp_plan, group)
    if shard.plan.tp > 1:
        _check_group(shard.plan, group)
    w = _Weights(checkpoint, TORCH_DTYPES[dtype], device)

    state = {"embed_tokens": w.transposed(vocab_rows(checkpoint, shard, EMBED_TOKENS, w.read_dtype))}
    if shard.lm_head is not None:
        state["lm_head"] = w.transposed(vocab_rows(checkpoint, shard, shard.lm_head, w.read_dtype))
    state["norm.scale"] = w.norm_scale(shard.final_norm)
    for i, layer in enumerate(shard.layers):
        q = f"layers.{i}."
        state[q + "input_norm.scale"] = w.norm_scale(layer.input_norm)
        state[q + "post_attention_norm.scale"] = w.norm_scale(layer.post_attention_norm)
        if isinstance(layer.mixer, GatedDeltaNetShard):
            mixer = _gated_deltanet_state(w, layer.mixer)
        else:
            mixer = _attention_state(w, layer.mixer)
        mlp = _moe_state(w, layer.mlp) if isinstance(layer.mlp, MoEShard) else _swiglu_state(w, layer.mlp)
        state.update({q + "mixer." + k: v for k, v in mixer.items()})
        state.update({q + "mlp." + k: v for k, v in mlp.items()})

    with torch.device("meta"):
        model = Qwen3_5ForCausalLM(shard, group, cp_plan, cp_group)
    model.load_state_dict(state, strict=True, assign=True)
    model.inv_freq = rotary_inverse_frequencies(config.rotary_dim, config.rope_theta).to(device)
    model.requires_grad_(False)
    model.generation_defaults = generation_defaults(checkpoint)
    return model.eval()


def _check_group(plan: TPPlan, group) -> None:
    """The group the shard all-reduces over must be the plan's ``tp`` ranks, this one at ``plan.rank``."""
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            f"plan tp={plan.tp} needs an initialised torch.distributed process group: launch {plan.tp} processes "
            f"(torchrun --nproc_per_node {plan.tp}) and load with hyper_gen.load_model(..., tp={plan.tp}), which "
            "joins the job"
        )
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    where = "the world group" if group is None else f"group {group!r}"
    if size != plan.tp:
        raise ValueError(f"plan tp={plan.tp} but {where} has {size} rank(s): launch {plan.tp} processes")
    if rank != plan.rank:
        raise ValueError(f"plan rank={plan.rank} but this process is rank {rank} of {where}")


def _mesh_groups(plan: TPPlan, cp_plan: CPPlan, group):
    """(tp group, cp group) of this rank in the world's ``tp x cp`` mesh; None is the world group
    (the one axis of a 1-D mesh). Every rank creates every subgroup, in the same order, as
    torch.distributed requires."""
    mesh = Mesh(plan.tp, cp_plan.cp)
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            f"cp={cp_plan.cp} needs an initialised torch.distributed process group: launch {mesh.size} processes "
            f"(torchrun --nproc_per_node {mesh.size}) and load with hyper_gen.load_model(..., cp={cp_plan.cp}), "
            "which joins the job"
        )
    world, rank = dist.get_world_size(), dist.get_rank()
    if world != mesh.size:
        raise ValueError(f"tp={plan.tp} x cp={cp_plan.cp} = {mesh.size} ranks, but the world group has {world}")
    if mesh.coordinates(rank) != (plan.rank, cp_plan.rank):
        raise ValueError(
            f"plan tp rank {plan.rank}, cp rank {cp_plan.rank} but this process is rank {rank}, which the mesh "
            f"(tp innermost) places at tp rank, cp rank {mesh.coordinates(rank)}"
        )
    if plan.tp == 1:
        return group, None
    tp_group = cp_group = None
    for ranks in mesh.tp_groups():
        made = dist.new_group(ranks)
        if rank in ranks:
            tp_group = made
    for ranks in mesh.cp_groups():
        made = dist.new_group(ranks)
        if rank in ranks:
            cp_group = made
    return (group if group is not None else tp_group), cp_group
