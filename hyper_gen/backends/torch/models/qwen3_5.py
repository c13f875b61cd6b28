"""Qwen3.5 (dense and MoE) in plain torch, loaded from HF checkpoints: gated attention, the MLPs,
the decoder layer, the model and ``load`` (Gated DeltaNet: ``..gated_deltanet``).

It follows HF op for op where HF computes in float32 whatever the model dtype (a float64 model computes
those in float64: ``compute_dtype``); weights are (in, out) matrices run by the model's ``TorchKernels``.
Layout, numerics, tensor and context parallelism: docs/architecture.md, "The native Qwen3.5 ports".
"""

from __future__ import annotations

import contextlib
from functools import partial
from types import SimpleNamespace
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hyper_gen.backends.torch import invariant_ops, paged_kernel
from hyper_gen.backends.torch.context_parallel import all_to_all
from hyper_gen.backends.torch.devices import resolve_device
from hyper_gen.backends.torch.gated_deltanet import GatedDeltaNet
from hyper_gen.backends.torch.invariant_products import InvariantKernels
from hyper_gen.backends.torch.kernels import PLAIN, TorchKernels, budget_bytes
from hyper_gen.backends.torch.layers import (
    ZeroCentredRMSNorm,
    apply_rotary,
    attention_lse,
    compute_dtype,
    rotary_cos_sin,
    rotary_inverse_frequencies,
)
from hyper_gen.backends.torch.ops import TorchOps, dtype_name, torch_dtype
from hyper_gen.kernel_plan import KernelPlan
from hyper_gen.masks import contract_defaults
from hyper_gen.models.checkpoint import Checkpoint, Piece, generation_defaults
from hyper_gen.models.loading import DTYPES
from hyper_gen.models.qwen3_5 import Qwen3_5Config, describe
from hyper_gen.models.qwen3_5.routing import RoutedExpertsSource
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
from hyper_gen.models.weight_update import touches
from hyper_gen.parallel.context_parallel import CPStep
from hyper_gen.parallel.cp_plan import CPPlan, check_ulysses_heads
from hyper_gen.parallel.groups import shard_groups
from hyper_gen.parallel.rank_sum import RankSum
from hyper_gen.parallel.sharded_model import set_parallel, whole_vocabulary
from hyper_gen.parallel.tp_plan import TPPlan
from hyper_gen.token_packing import GroupedPacking, TokenPacking

BATCH_INVARIANT = True  # load(batch_invariant=True) is supported (hyper_gen.models.loading)

# ---------------------------------------------------------------------------------- attention


class GatedAttention(nn.Module):
    """Full attention with an output gate: q_proj emits, per head, [query (D) | gate (D)];
    output = o_proj(attention * sigmoid(gate)). Zero-centred q/k RMSNorm, partial rotary, GQA."""

    kernels = PLAIN  # the model's TorchKernels, set by load

    def __init__(self, config: Qwen3_5Config, layer_idx: int, shard: AttentionShard, trainable: bool = False):
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
        self.q_norm = ZeroCentredRMSNorm(d, config.rms_norm_eps, trainable)
        self.k_norm = ZeroCentredRMSNorm(d, config.rms_norm_eps, trainable)

    def forward(self, x, cos, sin, attention_mask, cache, cp_step: Optional[CPStep] = None, packing=None):
        projected = self.kernels.project(x, self.qkv_proj)
        if isinstance(packing, GroupedPacking):  # each group's rows attend on their own
            out = packing.map(projected, lambda g, rows: self._mix(rows, g.cos, g.sin, g.mask, g.cache, None))
            return self.kernels.project(out, self.o_proj)
        if packing is not None:
            projected = packing.unpack_batch(projected)
        out = self._mix(projected, cos, sin, attention_mask, cache, cp_step)
        if packing is not None:
            out = packing.pack(out)
        return self.kernels.project(out, self.o_proj)

    def _mix(self, projected, cos, sin, attention_mask, cache, cp_step):
        """(B, S, qkv columns) of the projection -> (B, S, H*D) gated attention output."""
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
                out = cache.attend(
                    query, key, value, attention_mask, self.layer_idx, self._attend, self._attend_lse, self.scale
                )
            else:
                out = self._attend(query, key, value, attention_mask)
        sigmoid = invariant_ops.sigmoid_like if self.kernels.invariant else torch.sigmoid
        return out.transpose(1, 2).reshape(b, s, h * d) * sigmoid(gate)

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
        pieces = all_to_all(step.cp.group, list(heads.unbind(1)), shapes)
        q, k, v = torch.cat(pieces, dim=2).split([hq, hk, hk], dim=1)  # the whole sequence, these heads
        out = self._attend(q, k, v, mask)  # (B, hq, width, D)
        slices = [out[:, :, layout.starts[r] : layout.stops[r]] for r in range(cp)]
        pieces = all_to_all(step.cp.group, slices, [(b, hq, n, d)] * cp)
        return torch.cat(pieces, dim=1)  # (B, h, n, D): this rank's slice, every head in order

    def _attend_partial(self, query, key, value, mask, cache, step: CPStep):
        """One decode token: this rank's (output, log-sum-exp) over its keys, then the merge."""
        b, h, _, d = query.shape
        kv = self.num_kv_heads
        keys, values, mask = step.decode_keys(cache, self.layer_idx, key, value, mask)
        compute = compute_dtype(query.dtype)
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

    def _attend_lse(self, query, key, value, mask):
        """(output, log-sum-exp) of ``query`` (B, H, S, D) over one piece of the keys (B, KV, T, D):
        the paged pool's attention merges the pieces (``TorchOps.paged_attention``)."""
        b, h, s, d = query.shape
        groups = h // key.shape[1]
        if groups > 1 and s > 1:  # a kv head's queries are rows (head-major, then position)
            mask = mask.repeat(1, 1, groups, 1)
        out, lse = attention_lse(query.reshape(b, key.shape[1], groups * s, d), key, value, mask, self.scale)
        return out.reshape(b, h, s, d), lse.reshape(b, h, s, 1)

    def _attend(self, query, key, value, mask):
        if self.kernels.invariant:
            return invariant_ops.attention(query, key, value, mask, self.scale, compute_dtype(query.dtype))
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


# ------------------------------------------------------------------------------------ MLP / MoE


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)); gate_up columns: gate (I) | up (I)."""

    kernels = PLAIN  # the model's TorchKernels, set by load

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(hidden_size, 2 * intermediate_size))
        self.down_proj = nn.Parameter(torch.empty(intermediate_size, hidden_size))

    def forward(self, x):
        gate, up = self.kernels.project(x, self.gate_up_proj).chunk(2, dim=-1)
        silu = invariant_ops.silu if self.kernels.invariant else F.silu
        return self.kernels.project(silu(gate) * up, self.down_proj)


class SparseMoE(nn.Module):
    """Softmax top-k router (top-k weights renormalised), routed SwiGLU experts, and a shared
    SwiGLU expert scaled by sigmoid(shared_expert_gate(x))."""

    kernels = PLAIN  # the model's TorchKernels, set by load
    routes = None  # a list each forward appends its (tokens, top_k) expert ids to (``record_routes``)

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
        logits = self.kernels.project(x, self.router)
        invariant = self.kernels.invariant
        if invariant:
            probs = invariant_ops.softmax(logits.to(compute_dtype(logits.dtype)))
        else:
            probs = F.softmax(logits, dim=-1, dtype=compute_dtype(logits.dtype))
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.routes is not None:
            self.routes.append(experts)
        total = invariant_ops.tree_sum(weights) if invariant else weights.sum(dim=-1, keepdim=True)
        weights = (weights / total).to(logits.dtype)
        if self.kernels.invariant:
            out = self._experts_invariant(x, experts, weights)
            sigmoid = invariant_ops.sigmoid_like
        else:
            out = self._experts(x, experts, weights)
            sigmoid = torch.sigmoid
        out = out + sigmoid(self.kernels.project(x, self.shared_expert_gate)) * self.shared_expert(x)
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

    def _experts_invariant(self, x, experts, weights):
        """``_experts`` through the batch-invariant products (each expert's rows padded to its
        quantum), out of place (autograd); a token's expert outputs are added in expert order."""
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        token = order // self.top_k
        routed = x.index_select(0, token)
        outs, start = [], 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            rows = routed[start : start + count]
            gate, up = self.kernels.project(rows, self.experts_gate_up[expert]).chunk(2, dim=-1)
            outs.append(self.kernels.project(invariant_ops.silu(gate) * up, self.experts_down[expert]))
            start += count
        out = torch.cat(outs) * weights.reshape(-1, 1).index_select(0, order)
        return torch.zeros_like(x).index_add(0, token, out)


# -------------------------------------------------------------------------------------- model


class DecoderLayer(nn.Module):
    def __init__(
        self, config: Qwen3_5Config, layer_idx: int, shard: LayerShard, rank_sum: RankSum, trainable: bool = False
    ):
        super().__init__()
        self.is_linear = shard.is_linear
        self.input_norm = ZeroCentredRMSNorm(config.hidden_size, config.rms_norm_eps, trainable)
        self.mixer = (GatedDeltaNet if self.is_linear else GatedAttention)(config, layer_idx, shard.mixer, trainable)
        self.post_attention_norm = ZeroCentredRMSNorm(config.hidden_size, config.rms_norm_eps, trainable)
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


class Qwen3_5ForCausalLM(RoutedExpertsSource, nn.Module):
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
    supports_grouped_step = True  # forward(past_key_values=GroupedPacking): several row groups in one forward

    kernels = PLAIN  # the model's TorchKernels, set by load

    def __init__(
        self, shard: ModelShard, group=None, cp_plan: Optional[CPPlan] = None, cp_group=None, trainable: bool = False
    ):
        super().__init__()
        config, plan = shard.config, shard.plan
        self.config = config
        self.vocab_size = config.vocab_size
        set_parallel(self, plan, group, cp_plan, cp_group, TorchOps())
        self.vocab_start, rows = shard.vocab_start, shard.vocab_stop - shard.vocab_start
        self.rank_sum = RankSum(TorchOps(), plan.tp, group)
        # the embedding matrix transposed, (H, rows): a lookup gathers columns; when tied it is
        # also the LM head (one copy), read by ``hidden @ embed_tokens``
        self.embed_tokens = nn.Parameter(torch.empty(config.hidden_size, rows))
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, layer, self.rank_sum, trainable) for i, layer in enumerate(shard.layers)
        )
        self.norm = ZeroCentredRMSNorm(config.hidden_size, config.rms_norm_eps, trainable)
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
        cache, ops = past_key_values, TorchOps(input_ids.device)
        if isinstance(cache, GroupedPacking):
            return self._forward_groups(input_ids, cache)
        batch, seq = input_ids.shape
        position_ids, attention_mask = contract_defaults(
            ops, cache, batch, seq, position_ids, attention_mask, dtype_name(self.dtype)
        )
        prompt_mask = cache.prompt_mask if cache is not None and cache.seq_length == 0 else None
        if cache is None and self.kernels.invariant:  # a trainer's forward: its padding as score()'s
            prompt_mask = _real_positions(attention_mask, dtype_name(self.dtype))
        step = None
        if self.context_parallel is not None:
            self.context_parallel.ops = ops  # CP buffers where the model runs
            step = self.context_parallel.step(cache, seq)
            # this rank's slice of the positions in a sharded prefill; the mask keeps its global columns
            input_ids, position_ids, prompt_mask = step.local_positions(input_ids, position_ids, prompt_mask)

        packing = TokenPacking.of(ops, prompt_mask) if step is None else None
        hidden = self._embed(input_ids if packing is None else packing.pack(input_ids.reshape(-1, 1)).reshape(-1))
        cos, sin = rotary_cos_sin(position_ids, self.inv_freq, hidden.dtype)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        for layer in self.layers:
            hidden = layer(hidden, cos, sin, attention_mask, cache, prompt_mask, step, packing)
        if packing is not None:
            hidden = packing.unpack_batch(hidden)
        if step is not None and step.sharded:
            hidden = step.gather_rows(hidden, logits_to_keep)
        elif logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        hidden = self.norm(hidden)
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        return {"logits": whole_vocabulary(self, self.kernels.project(hidden, head), ops)}

    def _forward_groups(self, input_ids, step: GroupedPacking):
        """One forward over several groups of rows (``token_packing.GroupedPacking``): the packed
        (1, N) tokens through every row-wise layer once, each group's mixers on its own rows; the
        logits of the packed rows ``step.keep``, (len(keep), 1, V)."""
        hidden = self._embed(input_ids.reshape(-1))
        for group in step.groups:
            cos, sin = rotary_cos_sin(group.positions, self.inv_freq, hidden.dtype)
            group.cos, group.sin = cos.unsqueeze(1), sin.unsqueeze(1)
        for layer in self.layers:
            hidden = layer(hidden, None, None, None, None, None, None, step)
        hidden = self.norm(hidden[torch.as_tensor(step.keep, device=hidden.device)])
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        logits = whole_vocabulary(self, self.kernels.project(hidden, head), TorchOps(input_ids.device))
        return {"logits": logits[:, None]}

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


def _real_positions(attention_mask, dtype: str):
    """The (B, S) 1/0 mask of the positions some query sees in an additive (B, 1, S, S) mask (a
    cache-less forward's padding, which Gated DeltaNet must skip as a prefill does), None if every
    position is real."""
    visible = (attention_mask == 0).any(dim=2)[:, 0]
    return None if bool(visible.all()) else visible.to(torch_dtype(dtype))


# ------------------------------------------------------------------------------------ loading


class _Weights:
    """The pieces ``describe`` names -> torch tensors of the model dtype on the target device.

    Each piece is read (and shape-checked) by ``Checkpoint.read``, in float64 for a float64
    model and float32 otherwise, then cast. A matrix is assembled in the checkpoint's (out, in)
    layout -- a fused one is its pieces' output rows concatenated, in order -- and stored as
    its kernels' layout of its (in, out) view (``TorchKernels.layout``: (in, out)-contiguous, or the
    (out, in) memory for float64, which keeps HF's ``F.linear`` sums, and for column blocks)."""

    def __init__(self, checkpoint: Checkpoint, dtype: torch.dtype, device, kernels, trainable: bool = False):
        self.checkpoint = checkpoint
        self.trainable = trainable  # batch-invariant mode: norm weights and A_log as HF holds them
        self.kernels = kernels
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
        """An (..., out, in) array stored as (..., in, out) in its kernel's layout."""
        return self.kernels.layout(self.cast(array).transpose(-1, -2))

    def norm_scale(self, piece: Piece) -> torch.Tensor:
        """``1 + w`` in ``compute_dtype`` from w in the model dtype: what HF's zero-centred RMSNorm multiplies by."""
        return 1.0 + self.tensor(piece).to(compute_dtype(self.dtype))


def _attention_state(w: _Weights, s: AttentionShard) -> dict:
    return {
        "qkv_proj": w.matrix(s.query_gate, s.key, s.value),  # q_proj (per head [query | gate]) | k | v
        "o_proj": w.matrix(s.o_proj),
        **{f"q_norm.{k}": v for k, v in _norm_state(w, s.q_norm).items()},
        **{f"k_norm.{k}": v for k, v in _norm_state(w, s.k_norm).items()},
    }


def _norm_state(w: _Weights, piece: Piece) -> dict:
    return {"weight": w.tensor(piece)} if w.trainable else {"scale": w.norm_scale(piece)}


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
    if w.trainable:
        state["A_log"] = w.tensor(s.a_log)
    else:
        state["neg_decay_rate"] = -w.tensor(s.a_log).to(compute_dtype(w.dtype)).exp()  # model dtype first, as HF
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


def _state(w: _Weights, shard: ModelShard, wanted=lambda unit: True) -> dict:
    """The model's state dict read through ``w``: of the units (a piece, a mixer's or an MLP's shard)
    ``wanted`` accepts (update_weights: those its tensors touch)."""
    rows = lambda name: {"": w.transposed(vocab_rows(w.checkpoint, shard, name, w.read_dtype))}  # noqa: E731
    norm = partial(_norm_state, w)
    units = [("embed_tokens", EMBED_TOKENS, rows), ("lm_head", shard.lm_head, rows), ("norm.", shard.final_norm, norm)]
    for i, layer in enumerate(shard.layers):
        q, mixer = f"layers.{i}.", partial(_gated_deltanet_state if layer.is_linear else _attention_state, w)
        mlp = partial(_moe_state if isinstance(layer.mlp, MoEShard) else _swiglu_state, w)
        units += [(q + "input_norm.", layer.input_norm, norm), (q + "mixer.", layer.mixer, mixer)]
        units += [(q + "post_attention_norm.", layer.post_attention_norm, norm), (q + "mlp.", layer.mlp, mlp)]
    state = [(key + k, v) for key, unit, build in units if unit and wanted(unit) for k, v in build(unit).items()]
    return dict(state)


class _Pieces(tuple):
    """A fused (in, out) matrix as its pieces' (in, out_k) views, in order: update_weights copies each
    into its columns of the parameter instead of first concatenating a new matrix."""


class _UpdateWeights(_Weights):
    """update_weights' reads: views of the given tensors where they can be, a fused matrix as ``_Pieces``."""

    def matrix(self, *pieces: Piece):
        parts = [part for piece in pieces for part in self._rows(piece)]
        return self.transposed(parts[0]) if len(parts) == 1 else _Pieces(self.transposed(part) for part in parts)

    def _rows(self, piece: Piece) -> list:
        """A piece's output-row ranges as views of the given tensor (``read`` would concatenate them:
        a copy of every interleaved projection before the copy into the parameter)."""
        if piece.ranges is None or len(piece.ranges) < 2 or piece.axis not in (0, -2) or len(piece.shape) != 2:
            return [self.array(piece)]
        self.checkpoint.check_shape(piece.name, piece.shape)
        return [self.checkpoint.get_slice(piece.name, piece.axis, a, b, self.read_dtype) for a, b in piece.ranges]


def prepare_update(model: Qwen3_5ForCausalLM, checkpoint, names):
    """update_weights' conversion (``hyper_gen.models.weight_update``) and its write: one copy of each
    given tensor into its place in the parameter's own layout (the kernels remake a oneDNN-packed copy
    at its next use: they track each weight's version)."""
    trainable = model.kernels.invariant
    w = _UpdateWeights(checkpoint, model.dtype, model.device, SimpleNamespace(layout=lambda w_t: w_t), trainable)
    state = _state(w, describe(checkpoint, model.config, model.tp_plan), lambda unit: touches(unit, names))
    params = model.state_dict(keep_vars=True)

    def write() -> None:
        # detach(), not .data: a copy through .data would not bump the weight's version counter, and the
        # kernels would keep projecting with the oneDNN copy packed from the old values
        with _one_thread():
            for key, value in state.items():
                _copy(params[key].detach(), value)

    return write


def stage_update(model: Qwen3_5ForCausalLM, name: str, array: np.ndarray) -> np.ndarray:
    """A received (out, in) matrix in the (in, out) memory the model keeps it in (an (out, in) view of
    it), made while the next tensor is still on the wire: the update's write then copies rows
    instead of transposing. Float64 models (kept in (out, in) memory), devices other than the CPU
    and every other tensor are left as they are."""
    if array.ndim != 2 or model.device.type != "cpu" or model.dtype == torch.float64 or not array.flags.c_contiguous:
        return array
    with _one_thread():
        return torch.from_numpy(array).t().contiguous().numpy().T


@contextlib.contextmanager
def _one_thread():
    """The calling thread's CPU copies on one thread (OpenMP's count is per thread: a forward on
    another thread keeps its own). These copies are memory-bound, and thousands of small parallel
    regions each wait for the pool's every thread: on a busy host, a descheduled one costs
    milliseconds a region (a 1 GB embedding's blocked copy took 31 s on two threads, 2 s on one)."""
    threads = torch.get_num_threads()
    if threads > 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if threads > 1:
            torch.set_num_threads(threads)


def _copy(dst: torch.Tensor, src, block: int = 64) -> None:
    """``dst.copy_(src)`` (``_Pieces``: each into its columns); a transposing copy into a slice in
    blocks of ``block`` columns (3x faster on CPU), and into a whole contiguous parameter through torch's
    own cache-blocked transpose (``copy_`` takes it when ``src`` is the transpose of a contiguous tensor)."""
    if isinstance(src, _Pieces):
        start = 0
        for piece in src:
            _copy(dst[..., start : start + piece.shape[-1]], piece, block)
            start += piece.shape[-1]
        return
    whole = src.dim() == 2 and dst.is_contiguous() and src.t().is_contiguous()
    rows = src.stride(-1) == 1 or dst.stride(-1) != 1  # (not a transposing copy)
    if src.dim() < 2 or rows or whole or dst.device.type != "cpu":
        dst.copy_(src)
        return
    for j in range(0, src.shape[-1], block):
        dst[..., j : j + block].copy_(src[..., j : j + block])


def load(
    checkpoint: Checkpoint,
    dtype: str = "float32",
    device=None,
    plan: Optional[TPPlan] = None,
    group=None,
    cp_plan: Optional[CPPlan] = None,
    kernels=None,
    batch_invariant: bool = False,
) -> Qwen3_5ForCausalLM:
    """Build the model from an opened checkpoint (``hyper_gen.models.checkpoint.Checkpoint``).

    ``plan``: a ``TPPlan(tp, rank)`` to load this rank's tensor-parallel shard (None: the whole
    model); ``group``: the torch.distributed group of the ``tp`` ranks (None: the world group,
    whose size and this process's rank must then be ``tp`` and ``plan.rank``).
    ``cp_plan``: a ``CPPlan(cp, rank)`` for context parallelism (``hyper_gen.parallel.cp_plan``):
    the world is then the ``tp x cp`` mesh (``Mesh``: tp innermost), whose tp and cp subgroups are
    made here (every rank must call this), unless ``group`` is given.
    ``batch_invariant``: batch-invariant mode (``invariant_products`` / ``invariant_ops``): a row's
    logits are the same bits whatever else is computed with it, and the model is trainable
    (parameters require grad; norm weights and ``A_log`` are parameters as in HF). tp = cp = 1 only."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    budget_bytes()  # HYPER_GEN_TORCH_ONEDNN_GEMM_MB read before any work (a bad value is a ValueError)
    paged_kernel.enabled()  # HYPER_GEN_PAGED_KERNEL likewise
    check_batch_invariant(batch_invariant, plan, cp_plan)
    # batch-invariant row quanta live in a plan of their own ("torch-invariant": its own host file)
    backend = "torch-invariant" if batch_invariant else "torch"
    kernel_plan = KernelPlan.open(kernels, backend, torch.__version__, torch.get_num_threads())
    projections = InvariantKernels(kernel_plan) if batch_invariant else TorchKernels(kernel_plan)
    device = resolve_device(None if device is None else str(device), dtype)
    config = Qwen3_5Config.from_dict(checkpoint.config)
    shard = describe(checkpoint, config, plan)  # every split checked, before any weight is read
    cp_plan = CPPlan.resolve(cp_plan)
    if cp_plan.strategy == "ulysses":
        attention = next((layer.mixer for layer in shard.layers if isinstance(layer.mixer, AttentionShard)), None)
        if attention is not None:
            check_ulysses_heads(cp_plan.cp, attention.num_heads, attention.num_kv_heads)
    launch = f"torchrun --nproc_per_node {shard.plan.tp * cp_plan.cp}"
    group, cp_group = shard_groups(TorchOps(), shard.plan, cp_plan, group, launch, "torch", _new_group)
    w = _Weights(checkpoint, torch_dtype(dtype), device, projections, trainable=batch_invariant)

    state = _state(w, shard)
    if batch_invariant:  # b / a are not laid out by the kernels, but projected by them: probed now
        for key in [k for k in state if k.endswith(("in_proj_b", "in_proj_a"))]:
            projections.kernel_for(state[key])
    with torch.device("meta"):
        model = Qwen3_5ForCausalLM(shard, group, cp_plan, cp_group, trainable=batch_invariant)
    model.load_state_dict(state, strict=True, assign=True)
    for module in model.modules():
        if hasattr(module, "kernels"):
            module.kernels = projections
    model.kernel_plan = projections.used_plan()
    model.inv_freq = rotary_inverse_frequencies(config.rotary_dim, config.rope_theta, compute_dtype(w.dtype)).to(device)
    model.requires_grad_(batch_invariant)  # the trainer's own model in batch-invariant mode
    model.batch_invariant = batch_invariant
    model.generation_defaults = generation_defaults(checkpoint)
    return model.eval()


def check_batch_invariant(batch_invariant, plan: Optional[TPPlan], cp_plan: Optional[CPPlan]) -> None:
    """``batch_invariant`` must be a bool, and (for now) tp = cp = 1."""
    if not isinstance(batch_invariant, bool):
        raise TypeError(f"batch_invariant must be a bool, got {type(batch_invariant).__name__} {batch_invariant!r}")
    if batch_invariant and ((plan is not None and plan.tp > 1) or (cp_plan is not None and cp_plan.cp > 1)):
        raise ValueError("batch_invariant=True runs on one device (tp=1, cp=1) for now")


def _new_group(name, ranks, member):
    return dist.new_group(ranks)  # torch.distributed: every rank makes every group
