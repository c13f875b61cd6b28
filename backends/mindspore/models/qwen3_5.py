"""Qwen3.5 (dense and MoE) written natively in MindSpore for the cache-object contract.

Semantics follow transformers 5.23 ``modeling_qwen3_5`` / ``modeling_qwen3_5_moe`` (text part):
3 Gated DeltaNet layers to 1 gated full-attention layer, zero-centred RMSNorm, partial rotary.
Layout choices are for MindSpore on CPU (design guide, "MindSpore 2.10 on CPU: measured facts"):

* every projection is stored transposed, (in, out), and applied as ``x @ W``: 20x faster on
  MindSpore CPU than ``linear`` with the checkpoint's (out, in) layout;
* projections that read the same input are concatenated into one matrix (q|k|v, the DeltaNet
  qkv|z|b|a, the MoE router|shared-expert gate): fewer, larger ops;
* heads, experts and the vocabulary stay contiguous along the ``out`` axis, so a tensor-parallel
  loader can slice them per rank;
* mint ops without CPU kernels are avoided; nothing relies on in-place ops (they silently do
  nothing on CPU): caches are written by ``cache.update`` (slice assignment) or by rebinding.

Precision: float32 and float64 models compute everything in their own dtype; float16 models keep
what HF upcasts (norms, softmax, rotary tables, the delta rule and its state) in float32. The
linear-attention recurrent state is float32, or float64 in a float64 model.

Tensor parallelism (``load(checkpoint, dtype, plan=TPPlan(tp, rank), group=None)``, under msrun):
each rank reads only its slices with ``Checkpoint.get_slice``, exactly as
``hyper_gen.tensor_parallel.TPPlan`` assigns them (``plan.check`` runs before any weight is read,
so a tp that does not divide the heads fails at once). Attention query(+gate)/K/V heads, Gated
DeltaNet key heads with their value heads, MLP / expert / shared-expert intermediate dims and the
vocabulary are split; the router, the shared-expert gate and every norm weight are replicated.
A decoder layer sums its mixer's and its MLP's row-parallel partial outputs with one all-reduce
each; the vocab-parallel embedding (out-of-range ids masked, local gather) with one more. The LM
head returns this rank's vocabulary block of logits, zero-padded to ``plan.padded_vocab(V)``;
``parallel_group`` / ``vocab_parallel`` / ``vocab_size`` tell generate() to all-gather and trim
them. Per decode step that is ``2 * num_hidden_layers + 1`` all-reduces of (B, 1, hidden) plus
one all-gather of (B, padded V / tp) logits per rank.

MindSpore's CPU AllReduce has no float64 kernel (TypeError) and its float64 AllGather silently
rounds to float32, so a float64 model sums exactly instead: each rank's float64 bits travel as
int32 words through AllGather (exact) and every rank adds the tp parts in rank order. That costs
tp times the all-reduce volume and is meant for validation (float64 TP logits match one device
to ~1e-13); float32 / float16 use the native AllReduce.
"""

from __future__ import annotations

from typing import Dict, List

import numpy as np
import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops

from hyper_gen.backends.mindspore.ops import MindSporeOps
from hyper_gen.cache import DynamicCache
from hyper_gen.loading import SUPPORTED_ARCHITECTURES, TextConfig
from hyper_gen.tensor_parallel import TPPlan

DTYPES = {"float32": ms.float32, "float64": ms.float64, "float16": ms.float16, "bfloat16": ms.bfloat16}
_CHUNK = 64  # Gated DeltaNet prefill chunk, as HF/FLA


# ----------------------------------------------------------------------------------------------
# load-time helpers (numpy)


def _round_to(array: np.ndarray, dtype: str) -> np.ndarray:
    """``array`` rounded to ``dtype``'s precision but kept in its numpy dtype: parameters HF
    upcasts before use (norm weights, A_log, dt_bias) must first lose what the model dtype loses."""
    if dtype == "float16":
        return array.astype(np.float16).astype(array.dtype)
    if dtype == "bfloat16":  # round to nearest even on the top 16 bits of a float32
        bits = array.astype(np.float32).view(np.uint32)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.astype(np.uint32).view(np.float32).astype(array.dtype)
    return array


class _Weights:
    """Reads a checkpoint's tensors (or this tensor-parallel rank's slices of them) into
    MindSpore parameters of the model's layout and dtype."""

    def __init__(self, checkpoint, dtype: str, plan: TPPlan):
        self.checkpoint = checkpoint
        self.plan = plan
        self.dtype = dtype
        self.ms_dtype = DTYPES[dtype]
        self.acc = ms.float64 if dtype == "float64" else ms.float32
        self.np_read = "float64" if dtype == "float64" else "float32"

    def read(self, name: str, shape, axis: int = 0, window=None) -> np.ndarray:
        """The tensor, or only ``[start, stop)`` of it along ``axis`` when ``window`` is given
        (read from disk without materialising the rest); the full shape is checked either way."""
        if window is None or tuple(window) == (0, shape[axis]):
            return self.checkpoint.get(name, self.np_read, shape=shape)
        if self.checkpoint.shape(name) != tuple(shape):
            raise ValueError(f"checkpoint tensor {name!r} has shape {self.checkpoint.shape(name)}, "
                             f"expected {tuple(shape)}")
        return self.checkpoint.get_slice(name, axis, window[0], window[1], self.np_read)

    def param(self, array: np.ndarray) -> Parameter:
        """A checkpoint weight in the model dtype (every Parameter of the model is in it)."""
        if self.ms_dtype == ms.bfloat16:
            tensor = Tensor(np.ascontiguousarray(array, dtype=np.float32), dtype=ms.bfloat16)
        else:
            tensor = Tensor(np.ascontiguousarray(array, dtype=_numpy_dtype(self.ms_dtype)))
        return Parameter(tensor, requires_grad=False)

    def constant(self, array: np.ndarray) -> Tensor:
        """A derived compute-dtype tensor (not a Parameter), after model-dtype rounding: what HF
        computes with for the weights it upcasts (norm scales, decay rates, conv taps)."""
        return Tensor(np.ascontiguousarray(_round_to(array, self.dtype), dtype=_numpy_dtype(self.acc)))

    def linear_t(self, parts: List[tuple]) -> Parameter:
        """(out, in) checkpoint matrices [(name, shape) or (name, shape, (start, stop) rows)],
        concatenated along out, stored (in, out): column-parallel slices when rows are given."""
        blocks = [self.read(name, shape, 0, rows[0] if rows else None) for name, shape, *rows in parts]
        return self.param(np.concatenate(blocks, axis=0).T)

    def row_parallel_t(self, name: str, shape, columns) -> Parameter:
        """An (out, in) matrix's ``in`` columns [start, stop), stored (in, out): a row-parallel
        projection whose outputs the ranks sum."""
        return self.param(self.read(name, shape, 1, columns).T)

    def vocab_rows(self, name: str, vocab: int, hidden: int) -> np.ndarray:
        """This rank's block of a (vocab, hidden) matrix, zero rows where the block runs past the
        real vocabulary (blocks are padded to a multiple of tp)."""
        start, stop = self.plan.vocab(vocab)
        real_stop = min(stop, vocab)
        if real_stop > start:
            rows = self.read(name, (vocab, hidden), 0, (start, real_stop))
        else:
            rows = np.zeros((0, hidden), self.np_read)
        if real_stop < stop:
            rows = np.concatenate([rows, np.zeros((stop - max(real_stop, start), hidden), rows.dtype)])
        return rows

    def norm(self, name: str, size: int) -> Tensor:
        """Zero-centred RMSNorm weight as (1 + w) in the compute dtype."""
        return self.constant(self.read(name, (size,))) + Tensor(1.0, self.acc)


# ----------------------------------------------------------------------------------------------
# compute helpers (MindSpore)


def _scalar(value: float, dtype) -> Tensor:
    """A 0-d tensor constant. MindSpore turns a Python float operand into float32 even next to a
    float64 tensor (``x * 8 ** -0.5`` is off by 6e-9), so scales and epsilons are tensors of the
    dtype they meet."""
    return Tensor(value, dtype)


def _cast(x: Tensor, dtype) -> Tensor:
    return x if x.dtype == dtype else x.astype(dtype)


def _rms_norm(x: Tensor, weight_plus_one: Tensor, eps: Tensor) -> Tensor:
    """Zero-centred RMSNorm, ``norm(x) * (1 + w)``, computed in the weight's (compute) dtype."""
    h = _cast(x, weight_plus_one.dtype)
    h = h * ops.rsqrt((h * h).mean(-1, keep_dims=True) + eps)
    return _cast(h * weight_plus_one, x.dtype)


def _l2_norm(x: Tensor, eps: Tensor) -> Tensor:
    return x * ops.rsqrt((x * x).sum(-1, keepdims=True) + eps)


def _softplus(x: Tensor) -> Tensor:
    """torch's softplus (threshold 20); ops.softplus is off by ~3e-6 on CPU, even in float64."""
    return ops.where(x > 20.0, x, ops.log1p(ops.exp(ops.minimum(x, 20.0))))


def _apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the first ``cos.shape[-1]`` features of x (B, S, H, D); cos/sin (B, S, 1, R)."""
    rot = cos.shape[-1]
    half = rot // 2
    x_rot = x[..., :rot]
    rotated = ops.concat([-x_rot[..., half:], x_rot[..., :half]], -1)
    return ops.concat([x_rot * cos + rotated * sin, x[..., rot:]], -1)


class _PartialSum:
    """Sums row-parallel partial outputs over the tensor-parallel group (the identity at tp 1).

    float32 / float16 use AllReduce. MindSpore's CPU AllReduce has no float64 kernel and its
    float64 AllGather rounds to float32, so float64 bits travel as int32 words through AllGather
    (exact) and every rank adds the parts in rank order: the same float64 sum on every rank."""

    def __init__(self, tp: int, group=None):
        self.tp = tp
        self.group = group
        self.ops = MindSporeOps()

    def __call__(self, x: Tensor) -> Tensor:
        if self.tp == 1:
            return x
        if x.dtype != ms.float64:
            return self.ops.all_reduce(x, group=self.group)
        words = x.reshape(1, -1).view(ms.int32)  # each float64 as two int32 words
        parts = self.ops.all_gather(words, axis=0, group=self.group).view(ms.float64)  # (tp, numel)
        total = parts[0]
        for rank in range(1, self.tp):
            total = total + parts[rank]
        return total.reshape(x.shape)


_CONSTANTS: Dict[tuple, tuple] = {}


def _numpy_dtype(dtype):
    """numpy dtype of a MindSpore float dtype (``mindspore.dtype_to_nptype`` is deprecated)."""
    return {ms.float16: np.float16, ms.float32: np.float32, ms.float64: np.float64}[dtype]


def _chunk_constants(size: int, dtype) -> tuple:
    """(upper, strict_lower, eye) for one chunk size: -inf above the diagonal (added before exp),
    1 strictly below it, and the identity."""
    key = (size, dtype)
    if key not in _CONSTANTS:
        np_dtype = _numpy_dtype(dtype)
        upper = np.triu(np.full((size, size), -np.inf), 1).astype(np_dtype)
        strict_lower = np.tril(np.ones((size, size)), -1).astype(np_dtype)
        _CONSTANTS[key] = (Tensor(upper), Tensor(strict_lower), Tensor(np.eye(size, dtype=np_dtype)))
    return _CONSTANTS[key]


_solve_lower = ops.MatrixTriangularSolve(lower=True)


def _chunked_delta_rule(q, k, v, g, beta, state):
    """Gated delta rule over a whole sequence, chunk by chunk (HF ``torch_chunk_gated_delta_rule``).

    q, k (B, H, S, Dk) l2-normalised (q already scaled), v (B, H, S, Dv), g (log decay) and
    beta (B, H, S), state (B, H, Dk, Dv) or None; all in the compute dtype. Inside a chunk the
    delta updates are a unit lower-triangular system solved at once (the UT transform); chunks
    are scanned in order. Sequences shorter than a chunk use a chunk of their own length (the
    zero padding HF adds changes nothing but the cost).
    """
    b, h, s, dk = k.shape
    dv = v.shape[-1]
    size = min(_CHUNK, s)
    n = -(-s // size)
    pad = n * size - s
    if pad:
        q, k, v = (ops.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = (ops.pad(t, (0, pad)) for t in (g, beta))
    q = q.reshape(b, h, n, size, dk)
    k = k.reshape(b, h, n, size, dk)
    v = v.reshape(b, h, n, size, dv)
    beta = beta.reshape(b, h, n, size, 1)
    cum = ops.cumsum(g.reshape(b, h, n, size), -1)  # log decay from the chunk start
    upper, strict_lower, eye = _chunk_constants(size, cum.dtype)
    decay = ops.exp(cum[..., :, None] - cum[..., None, :] + upper)  # (.., i, j): decay j -> i, 0 for j > i
    k_t = k.swapaxes(-1, -2)
    k_beta = k * beta
    system = eye + ops.matmul(k_beta, k_t) * decay * strict_lower
    exp_cum = ops.exp(cum)[..., None]
    solved = _solve_lower(system, ops.concat([v * beta, k_beta * exp_cum], -1))
    values, k_cumdecay = solved[..., :dv], solved[..., dv:]
    intra = ops.matmul(q, k_t) * decay
    q = q * exp_cum
    k_t = (k * ops.exp(cum[..., -1:] - cum)[..., None]).swapaxes(-1, -2)
    chunk_decay = ops.exp(cum[..., -1])[..., None, None]
    if state is None:
        state = ops.zeros((b, h, dk, dv), cum.dtype)
    outputs = []
    for i in range(n):
        v_new = values[:, :, i] - ops.matmul(k_cumdecay[:, :, i], state)
        outputs.append(ops.matmul(q[:, :, i], state) + ops.matmul(intra[:, :, i], v_new))
        state = state * chunk_decay[:, :, i] + ops.matmul(k_t[:, :, i], v_new)
    out = outputs[0] if n == 1 else ops.concat(outputs, 2)
    return (out[:, :, :s] if pad else out), state


def _recurrent_delta_rule(q, k, v, g, beta, state):
    """One decode step of the gated delta rule; shapes as ``_chunked_delta_rule`` with S == 1."""
    state = state * ops.exp(g)[..., None]
    delta = (v - ops.matmul(k, state)) * beta[..., None]
    state = state + ops.matmul(k.swapaxes(-1, -2), delta)
    return ops.matmul(q, state), state


# ----------------------------------------------------------------------------------------------
# layers


class GatedAttention(nn.Cell):
    """Full attention with a sigmoid output gate, per-head q/k RMSNorm, partial rotary, GQA.

    Under tensor parallelism this rank holds a block of query heads and the KV heads they use
    (``num_heads`` / ``num_kv_heads`` are the local counts); its output is a partial sum."""

    def __init__(self, cfg: TextConfig, weights: _Weights, prefix: str, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        plan = weights.plan
        nh, nkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        q_start, q_stop = plan.block(nh, "num_attention_heads")
        kv_start, kv_stop = plan.kv_heads(nkv, nh)
        self.num_heads = q_stop - q_start
        self.num_kv_heads = kv_stop - kv_start
        self.head_dim = d
        self.acc = weights.acc
        self.eps = _scalar(cfg.rms_norm_eps, weights.acc)
        self.scale = _scalar(self.head_dim ** -0.5, weights.ms_dtype)
        h = cfg.hidden_size
        # q_proj emits (query, gate) per head: [q_0 | gate_0 | q_1 | gate_1 ...], kept as HF has it
        kv_rows = (kv_start * d, kv_stop * d)
        self.qkv_t = weights.linear_t([(f"{prefix}.q_proj.weight", (nh * 2 * d, h), (q_start * 2 * d, q_stop * 2 * d)),
                                       (f"{prefix}.k_proj.weight", (nkv * d, h), kv_rows),
                                       (f"{prefix}.v_proj.weight", (nkv * d, h), kv_rows)])
        self.o_t = weights.row_parallel_t(f"{prefix}.o_proj.weight", (h, nh * d), (q_start * d, q_stop * d))
        self.q_norm = weights.norm(f"{prefix}.q_norm.weight", self.head_dim)
        self.k_norm = weights.norm(f"{prefix}.k_norm.weight", self.head_dim)

    def construct(self, x, cos, sin, attention_mask, cache):
        b, s, _ = x.shape
        nh, nkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = ops.matmul(x, self.qkv_t)
        q_end, k_end = nh * 2 * d, nh * 2 * d + nkv * d
        query_gate = qkv[..., :q_end].reshape(b, s, nh, 2 * d)
        gate = query_gate[..., d:].reshape(b, s, nh * d)
        q = _apply_rotary(_rms_norm(query_gate[..., :d], self.q_norm, self.eps), cos, sin)
        k = _apply_rotary(_rms_norm(qkv[..., q_end:k_end].reshape(b, s, nkv, d), self.k_norm, self.eps), cos, sin)
        v = qkv[..., k_end:].reshape(b, s, nkv, d)
        keys, values = cache.update(k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), self.layer_idx)
        t = keys.shape[2]
        group = nh // nkv
        # GQA without repeating K/V: the `group` query heads of one kv head become extra rows
        q = q.transpose(0, 2, 1, 3).reshape(b, nkv, group * s, d)
        scores = ops.matmul(q, keys.swapaxes(-1, -2)) * self.scale
        scores = scores.reshape(b, nkv, group, s, t) + attention_mask[:, :, None]
        probs = _cast(ops.softmax(_cast(scores, self.acc), -1), x.dtype)
        out = ops.matmul(probs.reshape(b, nkv, group * s, t), values)
        out = out.reshape(b, nh, s, d).transpose(0, 2, 1, 3).reshape(b, s, nh * d)
        return ops.matmul(out * ops.sigmoid(gate), self.o_t)


class GatedDeltaNet(nn.Cell):
    """Linear attention: causal depthwise conv, then the gated delta rule, then a gated RMSNorm.

    Under tensor parallelism this rank holds a block of key heads and the value heads they serve
    (value head j uses key head j // (num_v_heads / num_k_heads)): their q | k | v channels,
    z / b / a rows, decay parameters and out_proj columns; the head counts are local."""

    def __init__(self, cfg: TextConfig, weights: _Weights, prefix: str, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        plan = weights.plan
        nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        k_start, k_stop = plan.block(nk, "linear_num_key_heads")
        v_start, v_stop = plan.block(nv, "linear_num_value_heads")
        self.num_k_heads = k_stop - k_start
        self.num_v_heads = v_stop - v_start
        self.head_k_dim = dk
        self.head_v_dim = dv
        self.key_dim = self.num_k_heads * dk
        self.value_dim = self.num_v_heads * dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel = cfg.linear_conv_kernel_dim
        self.acc = weights.acc
        self.eps = _scalar(cfg.rms_norm_eps, weights.acc)
        self.l2_eps = _scalar(1e-6, weights.acc)
        self.q_scale = _scalar(self.head_k_dim ** -0.5, weights.acc)
        h = cfg.hidden_size
        # this rank's channels of the checkpoint's [q | k | v] conv channels (the full layout)
        full_key_dim, full_value_dim = nk * dk, nv * dv
        full_conv_dim = 2 * full_key_dim + full_value_dim
        channels = [(k_start * dk, k_stop * dk), (full_key_dim + k_start * dk, full_key_dim + k_stop * dk),
                    (2 * full_key_dim + v_start * dv, 2 * full_key_dim + v_stop * dv)]
        value_rows, heads = (v_start * dv, v_stop * dv), (v_start, v_stop)
        # one projection: [q | k | v] (the conv channels) | z | b | a
        qkv = f"{prefix}.in_proj_qkv.weight"
        self.in_proj_t = weights.linear_t([(qkv, (full_conv_dim, h), rows) for rows in channels] +
                                          [(f"{prefix}.in_proj_z.weight", (full_value_dim, h), value_rows),
                                           (f"{prefix}.in_proj_b.weight", (nv, h), heads),
                                           (f"{prefix}.in_proj_a.weight", (nv, h), heads)])
        conv = np.concatenate([weights.read(f"{prefix}.conv1d.weight", (full_conv_dim, 1, self.kernel), 0, rows)
                               for rows in channels], axis=0)
        self.conv_t = weights.constant(conv[:, 0, :].T)  # (kernel, channels)
        self.neg_a = -ops.exp(weights.constant(weights.read(f"{prefix}.A_log", (nv,), 0, heads)))
        self.dt_bias = weights.constant(weights.read(f"{prefix}.dt_bias", (nv,), 0, heads))
        self.norm_weight = weights.param(weights.read(f"{prefix}.norm.weight", (dv,)))
        self.out_t = weights.row_parallel_t(f"{prefix}.out_proj.weight", (h, full_value_dim), value_rows)

    def _conv(self, mixed, cache):
        """Causal depthwise conv as a sum of shifted multiplies (no float64 conv1d kernel on CPU).
        The state is the last kernel-1 inputs, (B, channels, kernel-1) as HF and the torch port
        keep it."""
        b, s, c = mixed.shape
        state = cache.conv_states.get(self.layer_idx)
        if state is None:
            padded = ops.pad(mixed, (0, 0, self.kernel - 1, 0))
        else:
            padded = ops.concat([state.swapaxes(1, 2), mixed], 1)
        cache.conv_states[self.layer_idx] = padded[:, s:].swapaxes(1, 2)
        padded = _cast(padded, self.conv_t.dtype)
        out = padded[:, :s] * self.conv_t[0]
        for j in range(1, self.kernel):
            out = out + padded[:, j:j + s] * self.conv_t[j]
        return ops.silu(_cast(out, mixed.dtype))

    def construct(self, x, cache):
        b, s, _ = x.shape
        if cache.seq_length == 0 and cache.prompt_mask is not None:
            x = x * cache.prompt_mask[:, :, None]  # left padding must not enter conv or state
        proj = ops.matmul(x, self.in_proj_t)
        c, vd, nv = self.conv_dim, self.value_dim, self.num_v_heads
        mixed = self._conv(proj[..., :c], cache)
        z = proj[..., c:c + vd]
        beta = ops.sigmoid(proj[..., c + vd:c + vd + nv])
        acc = self.acc
        g = self.neg_a * _softplus(_cast(proj[..., c + vd + nv:], acc) + self.dt_bias)

        def heads(t, n, d):  # (B, S, n*d) -> (B, nv, S, d) in the compute dtype, k heads repeated
            t = _cast(t, acc).reshape(b, s, n, 1, d)
            if n != nv:
                t = ops.broadcast_to(t, (b, s, n, nv // n, d))
            return t.reshape(b, s, nv, d).transpose(0, 2, 1, 3)

        kd = self.key_dim
        q = _l2_norm(heads(mixed[..., :kd], self.num_k_heads, self.head_k_dim), self.l2_eps) * self.q_scale
        k = _l2_norm(heads(mixed[..., kd:2 * kd], self.num_k_heads, self.head_k_dim), self.l2_eps)
        v = heads(mixed[..., 2 * kd:], nv, self.head_v_dim)
        g = g.transpose(0, 2, 1)
        beta = _cast(beta, acc).transpose(0, 2, 1)
        state = cache.recurrent_states.get(self.layer_idx)
        rule = _recurrent_delta_rule if (s == 1 and state is not None) else _chunked_delta_rule
        out, cache.recurrent_states[self.layer_idx] = rule(q, k, v, g, beta, state)
        # gated RMSNorm over each value head, with HF's casts (exact no-ops in float32/float64)
        out = _cast(_cast(out.transpose(0, 2, 1, 3), x.dtype), acc)
        out = _cast(out * ops.rsqrt((out * out).mean(-1, keep_dims=True) + self.eps), x.dtype)
        out = _cast(self.norm_weight * out, acc) * ops.silu(_cast(z, acc).reshape(b, s, nv, self.head_v_dim))
        return ops.matmul(_cast(out, x.dtype).reshape(b, s, vd), self.out_t)


class MLP(nn.Cell):
    """SwiGLU feed-forward: ``down(silu(x @ gate) * (x @ up))``."""

    def __init__(self, weights: _Weights, gate: np.ndarray, up: np.ndarray, down: np.ndarray):
        super().__init__()
        self.gate_t = weights.param(gate.T)
        self.up_t = weights.param(up.T)
        self.down_t = weights.param(down.T)

    def construct(self, x):
        return ops.matmul(ops.silu(ops.matmul(x, self.gate_t)) * ops.matmul(x, self.up_t), self.down_t)


def _dense_mlp(weights: _Weights, prefix: str, hidden: int, inter: int, name: str) -> MLP:
    """An MLP with this rank's block of the ``inter`` (config field ``name``) dims: gate/up rows,
    down columns (a partial output under tensor parallelism)."""
    block = weights.plan.block(inter, name)
    return MLP(weights, weights.read(f"{prefix}.gate_proj.weight", (inter, hidden), 0, block),
               weights.read(f"{prefix}.up_proj.weight", (inter, hidden), 0, block),
               weights.read(f"{prefix}.down_proj.weight", (hidden, inter), 1, block))


class SparseMoE(nn.Cell):
    """Softmax top-k router over experts plus a sigmoid-gated shared expert (HF semantics).

    Routing reads the chosen expert ids on the host once per layer and runs each hit expert on
    its tokens only; experts are separate parameters (no weight copies per step), laid out so
    expert or tensor parallelism can take a subset / slice. Under tensor parallelism every
    expert and the shared expert hold this rank's block of their intermediate dims and the
    router is replicated, so every rank routes identically and returns a partial sum."""

    def __init__(self, cfg: TextConfig, weights: _Weights, prefix: str):
        super().__init__()
        self.num_experts = cfg.num_experts
        self.top_k = cfg.num_experts_per_tok
        h, inter = cfg.hidden_size, cfg.moe_intermediate_size
        # router logits | shared expert gate logit, one matmul
        self.route_t = weights.linear_t([(f"{prefix}.gate.weight", (self.num_experts, h)),
                                         (f"{prefix}.shared_expert_gate.weight", (1, h))])
        self.shared_expert = _dense_mlp(weights, f"{prefix}.shared_expert", h, cfg.shared_expert_intermediate_size,
                                        "shared_expert_intermediate_size")
        self.acc = weights.acc
        e_all = self.num_experts
        start, stop = weights.plan.block(inter, "moe_intermediate_size")
        if weights.checkpoint.has(f"{prefix}.experts.gate_up_proj"):  # fused layout, gate rows first
            # this rank's rows of every expert at once (its gate block, then its up block)
            gate_up = f"{prefix}.experts.gate_up_proj"
            gates = weights.read(gate_up, (e_all, 2 * inter, h), 1, (start, stop))
            ups = weights.read(gate_up, (e_all, 2 * inter, h), 1, (inter + start, inter + stop))
            downs = weights.read(f"{prefix}.experts.down_proj", (e_all, h, inter), 2, (start, stop))
            experts = [MLP(weights, gates[e], ups[e], downs[e]) for e in range(e_all)]
        else:  # per-expert layout (what transformers 5.23 save_pretrained writes)
            experts = [_dense_mlp(weights, f"{prefix}.experts.{e}", h, inter, "moe_intermediate_size")
                       for e in range(e_all)]
        self.experts = nn.CellList(experts)

    def construct(self, x):
        b, s, h = x.shape
        x = x.reshape(b * s, h)
        route = ops.matmul(x, self.route_t)
        probs = ops.softmax(_cast(route[:, :self.num_experts], self.acc), -1)
        weights, chosen = ops.topk(probs, self.top_k)
        weights = weights / weights.sum(-1, keepdims=True)  # transformers 5.23 always renormalises
        # host routing: slots (token, k) sorted by expert, so each expert sees one contiguous block
        expert_of_slot = chosen.asnumpy().reshape(-1)
        order = np.argsort(expert_of_slot, kind="stable")
        counts = np.bincount(expert_of_slot, minlength=self.num_experts)
        tokens = ops.gather(x, Tensor((order // self.top_k).astype(np.int32)), 0)
        outputs, start = [], 0
        for e in np.flatnonzero(counts):
            end = start + int(counts[e])
            outputs.append(self.experts[int(e)](tokens[start:end]))
            start = end
        routed = outputs[0] if len(outputs) == 1 else ops.concat(outputs, 0)
        routed = ops.gather(routed, Tensor(np.argsort(order).astype(np.int32)), 0).reshape(b * s, self.top_k, h)
        routed = (routed * _cast(weights, x.dtype)[..., None]).sum(1)
        shared = self.shared_expert(x) * ops.sigmoid(route[:, self.num_experts:])
        return (routed + shared).reshape(b, s, h)


class DecoderLayer(nn.Cell):
    """Mixer and MLP residual blocks; ``partial_sum`` adds up their row-parallel outputs."""

    def __init__(self, cfg: TextConfig, weights: _Weights, layer_idx: int, partial_sum: _PartialSum):
        super().__init__()
        prefix = f"model.layers.{layer_idx}"
        self.is_attention = cfg.layer_types[layer_idx] == "full_attention"
        if self.is_attention:
            self.mixer = GatedAttention(cfg, weights, f"{prefix}.self_attn", layer_idx)
        else:
            self.mixer = GatedDeltaNet(cfg, weights, f"{prefix}.linear_attn", layer_idx)
        self.mlp = (SparseMoE(cfg, weights, f"{prefix}.mlp") if cfg.is_moe else
                    _dense_mlp(weights, f"{prefix}.mlp", cfg.hidden_size, cfg.intermediate_size, "intermediate_size"))
        self.input_norm = weights.norm(f"{prefix}.input_layernorm.weight", cfg.hidden_size)
        self.post_attention_norm = weights.norm(f"{prefix}.post_attention_layernorm.weight", cfg.hidden_size)
        self.eps = _scalar(cfg.rms_norm_eps, weights.acc)
        self.partial_sum = partial_sum

    def construct(self, x, cos, sin, attention_mask, cache):
        h = _rms_norm(x, self.input_norm, self.eps)
        if self.is_attention:
            x = x + self.partial_sum(self.mixer(h, cos, sin, attention_mask, cache))
        else:
            x = x + self.partial_sum(self.mixer(h, cache))
        h = _rms_norm(x, self.post_attention_norm, self.eps)
        return x + self.partial_sum(self.mlp(h))


# ----------------------------------------------------------------------------------------------
# the model


class Qwen3_5ForCausalLM(nn.Cell):
    """Qwen3.5 / Qwen3.5-MoE language model implementing docs/model_contract.md (cache objects).

    ``config`` is the parsed ``hyper_gen.loading.TextConfig``; ``vocab_size`` the true vocabulary
    size; ``dtype`` the model dtype (every Parameter is in it; compute-dtype constants are Tensors);
    ``tp_plan`` the ``TPPlan`` it was loaded with. With ``tp_plan.tp > 1`` it also has
    ``parallel_group`` (None: the world group) and ``vocab_parallel = True``: its logits are this
    rank's block of ``plan.padded_vocab(vocab_size) // tp`` columns (generate() gathers them).
    """

    supports_cache_object = True

    def __init__(self, cfg: TextConfig, weights: _Weights, group=None):
        super().__init__()
        plan = weights.plan
        self.config = cfg
        self.vocab_size = cfg.vocab_size
        self.tp_plan = plan
        h, v = cfg.hidden_size, cfg.vocab_size
        start, stop = plan.vocab(v)
        self.vocab_start, self.vocab_stop = start, min(stop, v)  # the real ids this rank embeds
        # (hidden, vocab) for the fast `x @ W`; a tied model embeds by gathering its columns
        head = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
        self.lm_head_t = weights.param(weights.vocab_rows(head, v, h).T)
        self.embed_tokens = None if cfg.tie_word_embeddings else weights.param(
            weights.vocab_rows("model.embed_tokens.weight", v, h))
        self.partial_sum = _PartialSum(plan.tp, group)
        if plan.tp > 1:
            self.parallel_group = group
            self.vocab_parallel = True
        self.layers = nn.CellList([DecoderLayer(cfg, weights, i, self.partial_sum)
                                   for i in range(cfg.num_hidden_layers)])
        self.norm = weights.norm("model.norm.weight", h)
        self.eps = _scalar(cfg.rms_norm_eps, weights.acc)
        rot = cfg.rotary_dim
        inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, rot, 2, dtype=np.float64) / rot))
        self.inv_freq = Tensor(inv_freq.astype(_numpy_dtype(weights.acc)))
        self.generation_defaults: dict = {}

    @property
    def dtype(self):
        return self.lm_head_t.dtype

    def _embed(self, input_ids):
        vocab_parallel = self.tp_plan.tp > 1
        if vocab_parallel:  # each id's row is on one rank; the others contribute zeros to the sum
            held = (input_ids >= self.vocab_start) & (input_ids < self.vocab_stop)
            input_ids = ops.where(held, input_ids - self.vocab_start, ops.zeros_like(input_ids))
        if self.embed_tokens is not None:
            rows = ops.gather(self.embed_tokens, input_ids, 0)
        else:
            rows = ops.gather(self.lm_head_t, input_ids, 1).transpose(1, 2, 0)
        if not vocab_parallel:
            return rows
        return self.partial_sum(ops.where(held[..., None], rows, ops.zeros_like(rows)))

    def _rotary(self, position_ids, dtype):
        """cos, sin (B, S, 1, rotary_dim) in the model dtype, computed in the compute dtype."""
        freqs = _cast(position_ids, self.inv_freq.dtype)[:, :, None, None] * self.inv_freq
        freqs = ops.concat([freqs, freqs], -1)
        return _cast(ops.cos(freqs), dtype), _cast(ops.sin(freqs), dtype)

    def construct(self, input_ids, position_ids=None, attention_mask=None, past_key_values=None, logits_to_keep=0):
        """Contract call (docs/model_contract.md). Without a cache the forward is cacheless (a
        throwaway DynamicCache); without position ids / mask, positions continue from the cache
        and the mask is causal with no padding."""
        b, s = input_ids.shape
        cache = past_key_values
        if cache is None:
            cache = DynamicCache(MindSporeOps(), b, s)
        if position_ids is None:
            position_ids = Tensor(np.tile(np.arange(cache.seq_length, cache.seq_length + s), (b, 1)))
        if attention_mask is None:
            total = cache.max_length if cache.is_static else cache.seq_length + s
            attention_mask = _causal_mask(s, cache.seq_length, total, self.dtype)
        x = self._embed(input_ids)
        cos, sin = self._rotary(position_ids, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, attention_mask, cache)
        if logits_to_keep:
            x = x[:, -logits_to_keep:]
        return {"logits": ops.matmul(_rms_norm(x, self.norm, self.eps), self.lm_head_t)}


_MASK_MIN = {ms.float16: float(np.finfo(np.float16).min), ms.float32: float(np.finfo(np.float32).min),
             ms.float64: float(np.finfo(np.float64).min), ms.bfloat16: -3.3895313892515355e38}


def _causal_mask(seq: int, past: int, total: int, dtype) -> Tensor:
    """(1, 1, seq, total) additive mask: query i (at position past + i) sees columns <= past + i."""
    hidden = np.arange(total)[None, :] > np.arange(past, past + seq)[:, None]
    return Tensor(np.where(hidden, _MASK_MIN[dtype], 0.0)[None, None], dtype)


def load(checkpoint, dtype: str = "float32", plan: TPPlan = None, group=None) -> Qwen3_5ForCausalLM:
    """A Qwen3.5 model from a ``hyper_gen.checkpoint.Checkpoint``, weights in ``dtype``.

    ``plan``: a ``TPPlan(tp, rank)`` to load this rank's tensor-parallel shard (None: the whole
    model); ``group``: the communication group of the ``tp`` ranks (None: the world group, whose
    size and this process's rank must then be ``tp`` and ``plan.rank``)."""
    if plan is None:
        plan = TPPlan()
    if not isinstance(plan, TPPlan):
        raise TypeError(f"plan must be a hyper_gen.tensor_parallel.TPPlan or None, got {type(plan).__name__}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {dtype!r}")
    if dtype == "bfloat16" and ms.get_context("device_target") == "CPU":
        raise ValueError("dtype 'bfloat16' is not supported by MindSpore on CPU (storage only); "
                         "use float32, float16 or float64")
    if checkpoint.architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"checkpoint {checkpoint.path!r} has architecture {checkpoint.architecture or None!r}; "
                         f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    config = TextConfig.from_dict(checkpoint.config)
    plan.check(config)  # every split, before any weight is read
    if plan.tp > 1:
        _check_group(plan, group)
    model = Qwen3_5ForCausalLM(config, _Weights(checkpoint, dtype, plan), group)
    model.set_train(False)
    return model


def _check_group(plan: TPPlan, group) -> None:
    """The group the shard will all-reduce over must be the plan's ``tp`` ranks, this one at ``plan.rank``."""
    ops_ = MindSporeOps()
    size, rank = ops_.world_size(group), ops_.rank(group)
    where = "the world group" if group is None else f"group {group!r}"
    if size != plan.tp:
        raise ValueError(f"plan tp={plan.tp} but {where} has {size} rank(s): launch {plan.tp} processes "
                         "(msrun --worker_num) and initialise communication before loading a tensor-parallel shard")
    if rank != plan.rank:
        raise ValueError(f"plan rank={plan.rank} but this process is rank {rank} of {where}")
