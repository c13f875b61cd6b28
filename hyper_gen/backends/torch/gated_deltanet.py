"""Gated DeltaNet in torch, as HF's Qwen3.5 computes it (the chunked delta rule in float32, or float64
in a float64 model, its recurrent step, the causal conv with its state), with packed prefill rows and
context parallelism (the conv halo and the recurrent-state relay)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from hyper_gen.backends.torch import invariant_ops
from hyper_gen.backends.torch.kernels import PLAIN
from hyper_gen.backends.torch.layers import compute_dtype, gated_rms_norm, l2_normalise
from hyper_gen.models.qwen3_5 import Qwen3_5Config
from hyper_gen.models.qwen3_5.shards import GatedDeltaNetShard
from hyper_gen.parallel.context_parallel import CPStep
from hyper_gen.token_packing import GroupedPacking

CHUNK_SIZE = 64  # Gated DeltaNet prefill chunk length (HF's)


# ------------------------------------------------------------------------------ Gated DeltaNet


def chunk_gated_delta_rule(query, key, value, decay, beta, state: Optional[torch.Tensor], chunk_size: int = CHUNK_SIZE):
    """Gated delta rule over a whole sequence, 64 positions at a time (HF torch_chunk_gated_delta_rule).

    query/key (B, H, S, Dk) in the compute dtype (float32, float64 for a float64 model), l2-normalised,
    query pre-scaled; value (B, H, S, Dv); decay (log space, <= 0) and beta (B, H, S); state
    (B, H, Dk, Dv) or None. Returns the output (B, H, S, Dv) and the final state, in that dtype.
    The op order is HF's on purpose: on the same inputs it is HF's float32 arithmetic bit for bit
    (a float64 model's, HF's made to compute in float64). It is two phases: the
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
    """One decode position (HF torch_recurrent_gated_delta_rule with S == 1) through batched matrix
    products: the state is read three times and written twice instead of HF's elementwise form's
    seven passes, which sets the pace of a batched decode step (rounding ~1 ulp off HF's order).

    query/key (B, H, Dk) in the compute dtype, l2-normalised, query pre-scaled; value (B, H, Dv);
    decay/beta (B, H); state (B, H, Dk, Dv). Returns output (B, H, Dv) and the new state."""
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
    in float32 (float64 in a float64 model).

    With batch-invariant kernels (``kernels.invariant``) every step is ``invariant_ops``' (the causal
    conv as one sum for prefill and decode, the recurrent delta rule for every position) and the
    module is trainable: ``A_log`` is a parameter and ``-exp(A_log)`` is computed each call.
    """

    kernels = PLAIN  # the model's TorchKernels, set by load

    def __init__(self, config: Qwen3_5Config, layer_idx: int, shard: GatedDeltaNetShard, trainable: bool = False):
        super().__init__()
        self.layer_idx = layer_idx
        self.trainable = trainable
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
        if trainable:
            self.A_log = nn.Parameter(torch.empty(self.num_v_heads))
        else:
            self.register_buffer("neg_decay_rate", torch.empty(self.num_v_heads, dtype=torch.float32))  # -exp(A_log)
        self.norm_weight = nn.Parameter(torch.empty(self.head_v_dim))
        self.out_proj = nn.Parameter(torch.empty(self.value_dim, config.hidden_size))

    def forward(self, x, cache, prompt_mask, cp_step: Optional[CPStep] = None, packing=None):
        if packing is None and prompt_mask is not None:  # left padding adds nothing to conv or recurrent state
            x = (x * prompt_mask[:, :, None]).to(x.dtype)
        mixed, z = self.kernels.project(x, self.in_proj).split([self.conv_dim, self.value_dim], dim=-1)
        if self.kernels.invariant:
            beta, decay = self.kernels.project(x, self.in_proj_b), self.kernels.project(x, self.in_proj_a)
        else:
            beta, decay = x @ self.in_proj_b, x @ self.in_proj_a
        if isinstance(packing, GroupedPacking):  # each group's rows run the conv and delta rule on their own
            split = [self.conv_dim, self.num_v_heads, self.num_v_heads]

            def mix(group, rows):
                parts = rows.split(split, dim=-1)
                return self._mix(*parts, group.cache, None, group if group.padded else None)

            out = packing.map(torch.cat([mixed, beta, decay], dim=-1), mix)
        else:
            if packing is not None:  # padding positions: the zeros HF's masked input projects to
                mixed, beta, decay = (packing.unpack_batch(t) for t in (mixed, beta, decay))
            out = self._mix(mixed, beta, decay, cache, cp_step, packing)
            if packing is not None:
                out = packing.pack(out)
        shape = z.shape
        invariant = invariant_ops if self.kernels.invariant else None
        out = gated_rms_norm(
            out.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim), self.norm_weight, self.eps, invariant
        )
        return self.kernels.project(out.reshape(shape), self.out_proj)

    def _mix(self, mixed, beta, decay, cache, cp_step, packing):
        """The conv and the delta rule over (B, S, ...) rows, through the cache's states: (B, S, Hv*Dv)."""
        conv_state = recurrent_state = None
        if cache is not None:
            conv_state = cache.conv_states.get(self.layer_idx)
            recurrent_state = cache.recurrent_states.get(self.layer_idx)
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
        if self.kernels.invariant:
            wide = compute_dtype(beta.dtype)
            beta = invariant_ops.sigmoid(beta.to(wide)).to(beta.dtype)
            neg_decay_rate = -self.A_log.to(wide).exp() if self.trainable else self.neg_decay_rate
            decay = neg_decay_rate * invariant_ops.softplus(decay.to(wide) + self.dt_bias)
        else:
            beta = beta.sigmoid()
            decay = self.neg_decay_rate * F.softplus(decay.to(self.neg_decay_rate.dtype) + self.dt_bias)

        out, recurrent_state = self._delta_rule(
            query, key, value, decay, beta, recurrent_state, cp_step if sharded else None, packing
        )
        if cache is not None:
            cache.conv_states[self.layer_idx] = conv_state
            cache.recurrent_states[self.layer_idx] = recurrent_state
        return out.reshape(b, s, self.value_dim)

    def _conv(self, mixed: torch.Tensor, state: Optional[torch.Tensor]):
        """Depthwise causal conv + SiLU of (B, C, S); returns it and the new (B, C, K-1) state."""
        keep = self.kernel_size - 1
        if self.kernels.invariant:  # one sum for prefill, chunks and decode windows
            if state is None:
                state = mixed.new_zeros(*mixed.shape[:-1], keep)
            full = torch.cat([state.to(mixed.dtype), mixed], dim=-1)
            wide = compute_dtype(mixed.dtype)
            out = invariant_ops.causal_conv(full.to(wide), self.conv_weight.to(wide), mixed.shape[-1])
            return invariant_ops.silu(out.to(mixed.dtype)), full[..., -keep:].contiguous()
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
        """The conv over this rank's slice (B, C, s) of a sharded prefill, its halo from the
        previous rank (``CPStep.conv_halo``, which also gives the whole prompt's conv state)."""
        keep = self.kernel_size - 1
        halo, history = step.conv_halo(F.pad(mixed[..., -keep:], (max(keep - mixed.shape[-1], 0), 0)), axis=-1)
        if halo is None:
            return self._conv(mixed, None)[0], history.contiguous()
        full = torch.cat([halo, mixed], dim=-1)
        out = F.conv1d(full, self.conv_weight.unsqueeze(1), padding=keep, groups=self.conv_dim)
        return F.silu(out[..., keep : keep + mixed.shape[-1]]), history.contiguous()

    def _delta_rule(self, query, key, value, decay, beta, state, cp_step: Optional[CPStep] = None, packing=None):
        """(B, S, H, D) inputs -> (B, S, Hv, Dv) output in the model dtype, the new state.

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
            t.transpose(1, 2).to(compute_dtype(dtype), memory_format=torch.contiguous_format)
            for t in (query, key, value, beta, decay)
        )
        normalise = invariant_ops.l2_normalise if self.kernels.invariant else l2_normalise
        query = normalise(query)
        key = normalise(key)
        if self.kernels.invariant:  # every position by the recurrent step: prefill = decode, bit for bit
            query = query / (query.shape[-1] ** 0.5)
            out, state = invariant_ops.recurrent_delta_rule(query, key, value, decay, beta, state)
        elif state is not None and query.shape[2] == 1:
            query = query / (query.shape[-1] ** 0.5)
            step = (t[:, :, 0] for t in (query, key, value, decay, beta))
            out, state = recurrent_gated_delta_step(*step, state)
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
        return step.relay_state(lambda state: _chunk_scan(terms, state), placeholder)
