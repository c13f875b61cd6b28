"""Gated DeltaNet in MindSpore, as HF's Qwen3.5 computes it: a causal depthwise conv (a sum of
shifted products: no float64 conv1d kernel on CPU), the gated delta rule (``chunk_terms`` /
``chunk_scan`` over a prefill, ``delta_step_rows`` a decode token) and a gated RMSNorm, with packed
prefill rows and context parallelism (the conv halo and the recurrent-state relay)."""

from __future__ import annotations

import numpy as np
from mindspore import Tensor, mint, nn, ops

from hyper_gen.backends.mindspore.primitives import (
    add,
    bmm,
    cached,
    cast,
    exp,
    gather_rows,
    l2_normalize,
    matmul,
    mul,
    mul_kernel,
    mul_tiled,
    normalize,
    numpy_dtype,
    ones,
    pad_axis,
    product,
    rms_norm,
    scalar,
    sigmoid,
    silu,
    softplus,
    split_whole,
    sub,
    take,
    take_split,
    transpose_copy,
    zeros,
)
from hyper_gen.backends.mindspore.weights import Weights
from hyper_gen.models.arrays import round_to
from hyper_gen.models.qwen3_5 import Qwen3_5Config
from hyper_gen.models.qwen3_5.shards import GatedDeltaNetShard
from hyper_gen.parallel.context_parallel import CPStep
from hyper_gen.token_packing import GroupedPacking

CHUNK = 64  # Gated DeltaNet prefill chunk, as HF/FLA
_solve_lower = ops.MatrixTriangularSolve(lower=True)


def _chunk_constants(size: int, dtype) -> tuple:
    """(upper, strict_lower, eye) for one chunk size: -inf above the diagonal (added before exp),
    1 strictly below it, and the identity."""

    def make():
        np_dtype = numpy_dtype(dtype)
        upper = np.triu(np.full((size, size), -np.inf), 1).astype(np_dtype)
        strict_lower = np.tril(np.ones((size, size)), -1).astype(np_dtype)
        return Tensor(upper), Tensor(strict_lower), Tensor(np.eye(size, dtype=np_dtype))

    return cached(("chunk", size, dtype), make)


def chunk_terms(q, k, v, g, beta, chunk: int = 0) -> dict:
    """The gated delta rule over a whole sequence, chunk by chunk (HF ``torch_chunk_gated_delta_rule``),
    first phase: everything that does not depend on the incoming state.

    q, k (B, H, S, Dk) l2-normalised, v (B, H, S, Dv), g (log decay) and beta (B, H, S); all in the
    compute dtype. Inside a chunk the delta updates are a unit lower-triangular system solved at once
    (the UT transform); ``chunk_scan`` then scans the chunks in order, carrying the state (a
    context-parallel rank once the previous rank's final state has arrived). Sequences shorter than a
    chunk use a chunk of their own length (the zero padding HF adds changes nothing but the cost)
    unless ``chunk`` fixes the size."""
    b, h, s, dk = k.shape
    dv = v.shape[-1]
    size = chunk or min(CHUNK, s)
    n = -(-s // size)
    pad = n * size - s
    if pad:
        q, k, v = (pad_axis(t, 2, pad) for t in (q, k, v))
        g, beta = (pad_axis(t, 2, pad) for t in (g, beta))
    q = q.reshape(b, h, n, size, dk)
    k = k.reshape(b, h, n, size, dk)
    v = v.reshape(b, h, n, size, dv)
    beta = beta.reshape(b, h, n, size, 1)
    cum = ops.cumsum(g.reshape(b, h, n, size), -1)  # log decay from the chunk start
    upper, strict_lower, eye = _chunk_constants(size, cum.dtype)
    # (.., i, j): decay j -> i, 0 for j > i. Products are MulNoNan and sums Add / Sub, as in decode
    # (the Tensor operators dispatch the slower Mul: primitives); no operand is inf or nan
    decay = exp(add(sub(cum[..., :, None], cum[..., None, :]), upper))
    k_beta = mul_tiled(k, beta)
    system = add(eye, mul_tiled(product(bmm(k_beta, k, tb=True), decay), strict_lower))
    exp_cum = exp(cum)[..., None]
    solved = _solve_lower(system, ops.concat([mul_tiled(v, beta), mul_tiled(k_beta, exp_cum)], -1))
    return {
        "length": s,
        "padded": bool(pad),
        "shape": (b, h, dk, dv),
        "values": take(solved, -1, 0, dv),
        "k_cumdecay": take(solved, -1, dv, solved.shape[-1]),
        "intra": product(bmm(q, k, tb=True), decay),
        "q": mul_tiled(q, exp_cum),
        "k_decayed": mul_tiled(k, exp(sub(cum[..., -1:], cum))[..., None]),  # k^T of the state update
        "chunk_decay": exp(cum[..., -1])[..., None, None],
        "dtype": cum.dtype,
    }


def chunk_scan(terms: dict, state, trim: bool = True):
    """The chunks in order, carrying the recurrent state (B, H, Dk, Dv) or None: (output (B, H, S,
    Dv), final state); ``trim=False`` keeps the padded chunk positions (contiguous, for
    ``gather_rows``)."""
    values, k_cumdecay, intra = terms["values"], terms["k_cumdecay"], terms["intra"]
    q, k_decayed, chunk_decay = terms["q"], terms["k_decayed"], terms["chunk_decay"]
    if state is None:
        state = zeros(terms["shape"], terms["dtype"])  # (read only: cached, no zeros kernel a prefill)
    outputs = []
    for i in range(values.shape[2]):  # chunk i of each term by take: a [:, :, i] view copies slowly
        v_new = sub(take(values, 2, i), bmm(take(k_cumdecay, 2, i), state))
        outputs.append(add(bmm(take(q, 2, i), state), bmm(take(intra, 2, i), v_new)))
        state = add(product(state, take(chunk_decay, 2, i)), bmm(take(k_decayed, 2, i), v_new, ta=True))
    out = outputs[0] if len(outputs) == 1 else ops.concat(outputs, 2)
    return (out[:, :, : terms["length"]] if terms["padded"] and trim else out), state


def recurrent_step(q, k, v, g, beta, state):
    """One decode step of the gated delta rule: q, k (B, H, 1, Dk), v (B, H, 1, Dv), ``g`` (the
    log decay) and beta (B, H, 1, 1), state (B, H, Dk, Dv); all in the compute dtype. The decay
    is HF's ``S * exp(g)``, with the factor broadcast to the state's shape first: a broadcasting
    product or quotient over a batched state is several times slower, and so is MulNoNan's
    kernel than Mul's on a state of any batch (docs/performance.md)."""
    state = mul_kernel(state, ops.broadcast_to(exp(g), state.shape))
    delta = mul(sub(v, bmm(k, state)), beta)
    state = add(state, bmm(k.reshape(k.shape[:-2] + (k.shape[-1], 1)), delta))  # + k^T delta (k^T: a reshape)
    return bmm(q, state), state


def gated_output(out, z, heads: int, eps, out_t, dtype, acc):
    """The gated RMSNorm of each value head of ``out`` (N rows of ``heads`` heads), with HF's casts
    (exact no-ops in float32/float64), times silu(z) (N, heads * Dv), then out_proj (which holds
    the norm's weight)."""
    n = z.shape[0]
    out = cast(cast(out, dtype), acc).reshape(n, heads, -1)
    out = cast(cast(normalize(out, eps), dtype), acc)
    out = product(out.reshape(n, -1), silu(cast(z, acc)))
    return matmul(cast(out, dtype), out_t)


class GatedDeltaNet(nn.Cell):
    """Linear attention: causal depthwise conv, then the gated delta rule, then a gated RMSNorm.

    q and k are l2-normalised together and the query scale Dk ** -0.5 is never applied: the gated
    norm's epsilon absorbs it exactly (see ``gated_norm_eps``). The gated norm's weight lives in
    out_proj's rows.

    Under tensor parallelism this rank holds a block of key heads and the value heads they serve
    (value head j uses key head j // (num_v_heads / num_k_heads)): their q | k | v channels,
    z / b / a rows, decay parameters and out_proj columns; the head counts are local."""

    def __init__(
        self, cfg: Qwen3_5Config, weights: Weights, shard: GatedDeltaNetShard, layer_idx: int, in_scale: np.ndarray
    ):
        super().__init__()
        self.layer_idx = layer_idx
        dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.num_k_heads = shard.num_k_heads
        self.num_v_heads = shard.num_v_heads
        self.head_k_dim = dk
        self.head_v_dim = dv
        self.key_dim = self.num_k_heads * dk
        self.value_dim = self.num_v_heads * dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel = cfg.linear_conv_kernel_dim
        self.acc = weights.acc
        self.step_sizes = (self.conv_dim, self.value_dim, self.num_k_heads, self.num_v_heads, dk, dv, weights.acc)
        self.l2_eps = scalar(1e-6, weights.acc)
        # The queries stay unscaled: their output o = q @ S is then Dk ** 0.5 times HF's, and
        # o / sqrt(mean(o^2) + eps * Dk) is exactly HF's gated norm of it (o only feeds that norm).
        self.gated_norm_eps = scalar(cfg.rms_norm_eps * dk, weights.acc)
        # one projection: [q | k | v] (this rank's conv channels) | z | b | a
        self.in_proj_t = weights.linear_t([shard.qkv, shard.z, shard.b, shard.a], in_scale, pad=True)
        self.split_sizes = (self.conv_dim, self.value_dim, self.num_v_heads, self.num_v_heads)
        conv = weights.read(shard.conv)  # (channels, 1, kernel)
        self.conv_t = weights.constant(conv[None, :, 0, :].transpose(0, 2, 1))  # (1, kernel, channels)
        self.conv_taps = tuple(weights.constant(np.ascontiguousarray(conv[:, 0, j])) for j in range(self.kernel))
        # (1, heads), as every constant an op broadcasts: MindSpore CPU broadcasts slower across ranks
        # g = a * softplus(.), a = -exp(A_log) as HF computes it
        self.a = ops.neg(ops.exp(weights.constant(weights.read(shard.a_log)[None])))
        self.dt_bias = weights.constant(weights.read(shard.dt_bias)[None])
        norm_weight = round_to(weights.read(shard.norm), weights.dtype)
        self.out_t = weights.linear_t([shard.out_proj], np.tile(norm_weight, self.num_v_heads))

    def decode_states(self, cache):
        """(conv state, recurrent state) for a decode step; None before a prefill wrote them."""
        conv_state, state = cache.conv_states.get(self.layer_idx), cache.recurrent_states.get(self.layer_idx)
        return None if conv_state is None or state is None else (conv_state, state)

    def step_weights(self, b: int) -> tuple:
        """``delta_step_rows``' weights after the input norm's epsilon, for a batch of ``b`` rows."""
        taps_sum = ones((b, 1, self.kernel), self.conv_t.dtype)
        return self.in_proj_t, self.conv_t, taps_sum, self.a, self.dt_bias, self.out_t, self.l2_eps, self.gated_norm_eps

    def _conv_sequence(self, mixed, state, cache):
        """The conv over (B, S, channels) as a sum of shifted multiplies, continuing from ``state``
        (B, channels, kernel-1) when there is one. The rows are shifted as one flat
        (B * (S + kernel - 1), channels) sequence, whose shifted slices are contiguous (a strided
        slice per row copies ~10x slower on MindSpore CPU); the outputs that straddle two rows
        are dropped once at the end."""
        b, s, c = mixed.shape
        keep = self.kernel - 1
        if state is None:
            padded = ops.concat([zeros((b, keep, c), mixed.dtype), mixed], 1)
        else:
            padded = ops.concat([mint.transpose(state, 1, 2), mixed], 1)
        # the state is the last kernel-1 inputs, (B, channels, kernel-1) as HF and the torch port
        # keep it, held as a transposed view of channels-last memory
        cache.conv_states[self.layer_idx] = mint.transpose(padded[:, s:], 1, 2)
        width = s + keep
        flat = cast(padded, self.conv_t.dtype).reshape(b * width, c)
        rows = b * width - keep
        out = mul_tiled(flat[:rows], self.conv_taps[0])
        for j in range(1, self.kernel):
            out = add(out, mul_tiled(flat[j : j + rows], self.conv_taps[j]))
        if b > 1:
            out = take(ops.concat([out, zeros((keep, c), out.dtype)], 0).reshape(b, width, c), 1, 0, s)
        return silu(cast(out, mixed.dtype)).reshape(b * s, c)

    def _conv_context_parallel(self, mixed, cp_step: CPStep, cache):
        """The conv over this rank's slice (B, s, channels) of a sharded prefill, its halo from the
        previous rank (``CPStep.conv_halo``, which also gives the whole prompt's conv state)."""
        keep, s = self.kernel - 1, mixed.shape[1]
        tail = mixed[:, -keep:] if s >= keep else ops.pad(mixed, (0, 0, keep - s, 0))
        halo, history = cp_step.conv_halo(tail, axis=1)
        out = self._conv_sequence(mixed, None if halo is None else mint.transpose(halo, 1, 2), cache)
        cache.conv_states[self.layer_idx] = mint.transpose(history, 1, 2)
        return out

    def _relayed_chunks(self, q, k, v, g, beta, cp_step: CPStep):
        """The chunked delta rule of a sharded prefill, its state relayed in rank order
        (``CPStep.relay_state``); every slice starts on a chunk boundary."""
        terms = chunk_terms(q, k, v, g, beta, CHUNK)
        return cp_step.relay_state(lambda state: chunk_scan(terms, state), ops.zeros(terms["shape"], terms["dtype"]))

    def construct(self, x, b, s, cache, cp_step=None, packing=None):
        if isinstance(packing, GroupedPacking):
            return self._construct_groups(x, packing)
        n = b * s
        sharded = cp_step is not None and cp_step.sharded
        if packing is None and cache.seq_length == 0 and cache.prompt_mask is not None:
            prompt_mask = cache.prompt_mask
            if sharded:
                prompt_mask = prompt_mask[:, cp_step.start : cp_step.stop]
            x = x * prompt_mask.reshape(n, 1)  # left padding must not enter conv or state
        projected = matmul(x, self.in_proj_t)
        if packing is not None:  # padding rows: the zeros HF's masked input projects to
            z = take(projected, -1, self.conv_dim, self.conv_dim + self.value_dim)
            projected = packing.unpack(projected)
        mixed, z_rows, beta, a = take_split(projected, self.split_sizes)
        if packing is None:
            z = z_rows
        out = self._mix(mixed, beta, a, b, s, cache, cp_step)
        if packing is not None:  # the gated norm and out_proj on the real rows
            out = packing.pack(out.reshape(n, self.value_dim))
        return gated_output(out, z, self.num_v_heads, self.gated_norm_eps, self.out_t, x.dtype, self.acc)

    def _construct_groups(self, x, step: GroupedPacking):
        """A grouped step (``token_packing.GroupedPacking``): the projections and the gated norm over
        every packed row, each group's conv and delta rule on its own rows (``_mix_group``)."""
        projected = matmul(x, self.in_proj_t)
        z = take(projected, -1, self.conv_dim, self.conv_dim + self.value_dim)
        out = step.map(projected, self._mix_group)
        return gated_output(out, z, self.num_v_heads, self.gated_norm_eps, self.out_t, x.dtype, self.acc)

    def _mix_group(self, group, rows):
        """A group's (batch, seq, projection columns) rows through the core its own forward runs:
        one token a row after a state, the decode step's (``delta_step``); else the sequence's
        (``_mix``). (batch, seq, value_dim)."""
        b, s, cache = group.batch, group.seq, group.cache
        states = self.decode_states(cache) if s == 1 else None
        if states is not None:
            mixed, _, beta, a = split_whole(rows.reshape(b, -1), self.split_sizes)
            taps_sum = ones((b, 1, self.kernel), self.conv_t.dtype)
            out, conv_state, state = delta_step(
                self.step_sizes, mixed, beta, a, *states, self.conv_t, taps_sum, self.a, self.dt_bias, self.l2_eps
            )
            cache.conv_states[self.layer_idx], cache.recurrent_states[self.layer_idx] = conv_state, state
            return out.reshape(b, 1, self.value_dim)
        mixed, _, beta, a = take_split(rows.reshape(b * s, -1), self.split_sizes)
        return self._mix(mixed, beta, a, b, s, cache, None).reshape(b, s, self.value_dim)

    def _mix(self, mixed, beta, a, b, s, cache, cp_step):
        """The conv and the delta rule over (B * S) rows of conv channels, beta and decay logits,
        through the cache's states: (B * S, nv, Dv); (B, S, nv, Dv) in a sharded context-parallel
        prefill."""
        n = b * s
        sharded = cp_step is not None and cp_step.sharded
        mixed = mixed.reshape(b, s, self.conv_dim)
        if sharded:
            mixed = self._conv_context_parallel(mixed, cp_step, cache)
        else:
            mixed = self._conv_sequence(mixed, cache.conv_states.get(self.layer_idx), cache)
        nk, nv, dk, dv = self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim
        mixed = cast(mixed, self.acc)
        qk = l2_normalize(take(mixed, -1, 0, 2 * self.key_dim).reshape(n, 2 * nk, dk), self.l2_eps)
        beta = sigmoid(cast(beta, self.acc))
        g = mul(softplus(add(cast(a, self.acc), self.dt_bias)), self.a)  # the log decay
        # (B, heads, S, D) copies of the token-major q / k / v by Gather (``gather_rows``): row
        # (token, head) of qk is token * 2nk + head (k after the nk q heads), of mixed
        # token * (conv_dim / dv) + 2 key_dim / dv + head; value head j reads key head j // (nv / nk)
        tokens = np.arange(b)[:, None, None] * s + np.arange(s)[None, None, :]  # (B, 1, S)
        key_head = (np.arange(nv) // (nv // nk))[None, :, None]
        rows = qk.reshape(n * 2 * nk, dk)
        q = gather_rows(rows, tokens * (2 * nk) + key_head, (b, nv, s, dk))
        k = gather_rows(rows, tokens * (2 * nk) + nk + key_head, (b, nv, s, dk))
        if mixed.is_contiguous() and self.conv_dim % dv == 0 and (2 * self.key_dim) % dv == 0:
            per_token = self.conv_dim // dv
            value_rows = tokens * per_token + 2 * self.key_dim // dv + np.arange(nv)[None, :, None]
            v = gather_rows(mixed.reshape(n * per_token, dv), value_rows, (b, nv, s, dv))
        else:
            v = mint.split(mixed, (2 * self.key_dim, self.value_dim), -1)[1]
            v = v.reshape(b, s, nv, dv).transpose(0, 2, 1, 3)
        g = g.reshape(b, s, nv).transpose(0, 2, 1)
        beta = beta.reshape(b, s, nv).transpose(0, 2, 1)
        if sharded:
            out, state = self._relayed_chunks(q, k, v, g, beta, cp_step)
            out = out.transpose(0, 2, 1, 3)
        else:
            state = cache.recurrent_states.get(self.layer_idx)
            out, state = chunk_scan(chunk_terms(q, k, v, g, beta), state, trim=False)
            length = out.shape[2]  # padded to whole chunks: row (b, head, position)
            out_rows = (np.arange(b)[:, None, None] * nv + np.arange(nv)[None, None, :]) * length
            out_rows = out_rows + np.arange(s)[None, :, None]  # (B, S, nv)
            out = gather_rows(out.reshape(-1, dv), out_rows, (n, nv, dv))
        cache.recurrent_states[self.layer_idx] = state
        return out


def delta_step_rows(
    sizes, x, conv_state, state, eps, in_proj_t, conv_t, taps_sum, a, dt_bias, out_t, l2_eps, gated_eps
):
    """One decode token of a Gated DeltaNet mixer on (B, hidden) rows, its input RMSNorm included:
    (partial output, new conv state, new recurrent state); ``delta_step`` between the projections."""
    conv_dim, value_dim, nk, nv, dk, dv, acc = sizes
    mixed, z, beta, a_logits = split_whole(matmul(rms_norm(x, eps), in_proj_t), (conv_dim, value_dim, nv, nv))
    out, new_conv, state = delta_step(
        sizes, mixed, beta, a_logits, conv_state, state, conv_t, taps_sum, a, dt_bias, l2_eps
    )
    return gated_output(out, z, nv, gated_eps, out_t, x.dtype, acc), new_conv, state


def delta_step(sizes, mixed, beta, a_logits, conv_state, state, conv_t, taps_sum, a, dt_bias, l2_eps):
    """One decode token's conv and delta rule from (B, channels) conv inputs and (B, nv) beta and
    decay logits: (output (B, nv, 1, Dv), new conv state, new recurrent state). The conv is one
    (B, kernel, channels) window times the taps, summed over the window by a product with
    ``taps_sum`` (ones: faster than a sum over axis 1); the delta rule is ``recurrent_step``."""
    conv_dim, value_dim, nk, nv, dk, dv, acc = sizes
    b = mixed.shape[0]
    window = ops.concat([mint.transpose(conv_state, 1, 2), mixed.reshape(b, 1, conv_dim)], 1)  # (B, kernel, C)
    # a contiguous copy: the next step's input (compile.jitted). (Concatenating conv_state[:, :, 1:]
    # with the new column instead rounds float64 to float32 precision in a graph, ~1e-7, when the
    # split-off row also feeds the window's concat.)
    new_conv = transpose_copy(window[:, 1:], (0, 2, 1))
    taps = product(cast(window, conv_t.dtype), conv_t)
    mixed = silu(cast(bmm(taps_sum, taps).reshape(b, conv_dim), mixed.dtype))
    qk, v = mint.split(cast(mixed, acc), (2 * nk * dk, value_dim), -1)
    q, k = mint.split(l2_normalize(qk.reshape(b, 2 * nk, dk), l2_eps), (nk, nk), 1)
    if nk != nv:  # value head j reads key head j // (nv / nk)
        q = ops.broadcast_to(q.reshape(b, nk, 1, dk), (b, nk, nv // nk, dk))
        k = ops.broadcast_to(k.reshape(b, nk, 1, dk), (b, nk, nv // nk, dk))
    beta = sigmoid(cast(beta, acc))
    g = mul(softplus(add(cast(a_logits, acc), dt_bias)), a)  # the log decay
    q, k, v = q.reshape(b, nv, 1, dk), k.reshape(b, nv, 1, dk), v.reshape(b, nv, 1, dv)
    out, state = recurrent_step(q, k, v, g.reshape(b, nv, 1, 1), beta.reshape(b, nv, 1, 1), state)
    return out, new_conv, state
