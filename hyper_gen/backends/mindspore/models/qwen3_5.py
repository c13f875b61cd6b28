"""Qwen3.5 (dense and MoE) written natively in MindSpore for the cache-object contract.

Semantics follow transformers 5.23 ``modeling_qwen3_5`` / ``modeling_qwen3_5_moe`` (text part):
3 Gated DeltaNet layers to 1 gated full-attention layer, zero-centred RMSNorm, partial rotary.
Layout choices are for MindSpore on CPU (the measurements behind them: docs/performance.md):

* every projection is stored transposed, (in, out), and applied as ``x @ W`` on 2-D (tokens,
  features) activations: much faster on MindSpore CPU than ``linear`` with the checkpoint's
  (out, in) layout, and 2-D matmuls beat 3-D ones for one decode row;
* projections that read the same input are concatenated into one matrix (q|k|v|gate, the DeltaNet
  qkv|z|b|a, the MLP gate|up, the MoE router|shared-expert gate): fewer, larger ops; on CPU each
  of the first three is stored at the faster of its width and a zero-padded one, as the model's
  kernel plan records (``hyper_gen.backends.mindspore.matmul_widths``: some widths run MindSpore's
  MatMul 2-3x slower; timed once per host and shape);
* every RMSNorm weight that feeds a projection is folded into that projection's rows at load time
  (``(1 + w)`` of the zero-centred norms, the gated norm's ``w`` into out_proj), so a norm is
  ``x / sqrt(mean(x^2) + eps)``: five small ops;
* heads, experts and the vocabulary stay contiguous along the ``out`` axis, so a tensor-parallel
  rank's pieces (``hyper_gen.models.qwen3_5.shards``) are contiguous blocks of them;
* mint ops without CPU kernels are avoided; nothing relies on in-place ops (they silently do
  nothing on CPU): caches are written by ``cache.update`` (slice assignment) or by rebinding.

Decode speed on CPU is per-op overhead (a fixed cost per op, whatever its size) plus the weight
reads, so the one-token paths are written for the fewest and cheapest kernels: cached primitives
instead of Tensor operators (a primitive call costs less than an operator); a small product is
``MulNoNan`` (identical but for ``inf * 0``; in PyNative it launches faster than ``Mul``) and one
of 64K+ elements ``Mul`` (MulNoNan's kernel is 4-10x slower there: ``_product``); the state
decays as HF's ``S * exp(g)`` by ``Mul`` with the per-head factor broadcast to the (B, H, Dk, Dv)
state first (a broadcasting kernel over a batched state is several times slower);
``BatchMatMul`` with transpose flags instead of transposed copies; rotary as one matmul with a
+-1 rotation matrix; ``mint.nn.functional.softplus`` (exact in float64, unlike
``ops.softplus``); sub-cells are called through ``construct`` (``Cell.__call__``
adds a per-call overhead). A one-token forward goes further: its fixed-shape blocks (a whole
Gated DeltaNet layer, an attention layer before and after its cache, the final norm and LM head)
are compiled once per batch size with ``mindspore.jit`` ("compiled decode blocks" below; bitwise
the PyNative results) and launched together: with a static cache (generate's default) a decode
step is one graph, its cache writes and attention included, instead of ~450 PyNative ops on the
mid shape; with a dynamic cache one graph per stretch between attention cores.

Precision: float32 and float64 models compute everything in their own dtype; float16 models keep
what HF upcasts (norms, softmax, rotary tables, the delta rule and its state) in float32. The
linear-attention recurrent state is float32, or float64 in a float64 model.

Tensor parallelism (``load(checkpoint, dtype, plan=TPPlan(tp, rank), group=None)``, under msrun):
each rank reads only its pieces, as ``hyper_gen.models.qwen3_5.shards.describe`` lists them (its
splits are checked before any weight is read, so a tp that does not divide the heads fails at
once); this module only lays the arrays ``Checkpoint.read`` returns out for its kernels. Attention
query(+gate)/K/V heads, Gated DeltaNet key heads with their value heads, MLP / expert /
shared-expert intermediate dims and the vocabulary are split; the router, the shared-expert gate
and every norm weight are replicated.
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
to float64 rounding); float32 / float16 use the native AllReduce.

Context parallelism (``load(..., plan=TPPlan(tp, tp_rank), cp_plan=CPPlan(cp, cp_rank))``; contract:
docs/model_contract.md) is the torch port's, step for step, on AllGather alone: each rank prefills
its run of 64-position chunks, attention all-gathers K|V, Gated DeltaNet all-gathers the conv halo
and relays the recurrent state in rank order, each rank's cache holds its K/V slice (the last rank
appends the decode tokens) and decode merges the per-rank partial attention by log-sum-exp in rank
order. With tp = 1 the CP group is the world. With tp > 1 the world is a ``tp x cp`` mesh
(``hyper_gen.parallel.cp_plan.Mesh``, tensor parallelism innermost: global rank = cp_rank * tp +
tp_rank) and ``load`` makes this rank's two subgroups, ``hyper_gen_tp<T>xcp<C>_tp<i>`` (the tp
ranks of cp rank i: the row-parallel sums and the LM head's vocabulary gather, so every rank's
logits hold the whole vocabulary) and ``hyper_gen_tp<T>xcp<C>_cp<j>`` (the cp ranks of tp rank j:
everything of context parallelism above); generate() checks inputs and agrees on tokens over the
world. MindSpore's CPU AllReduce runs on a subgroup but its AllGather does not, so there a
subgroup's all-gather is one world AllGather of which the group's part is kept
(``hyper_gen.backends.mindspore.ops``): tp times the CP traffic, and the tp x cp model's every
rank must run the same collectives in the same order, which an SPMD forward does.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Dict, List

import mindspore as ms
import numpy as np
from mindspore import Parameter, ParameterTuple, Tensor, mint, nn, ops

from hyper_gen import switches
from hyper_gen.backends.mindspore import matmul_widths
from hyper_gen.backends.mindspore.ops import MindSporeOps, new_group
from hyper_gen.cache import DynamicCache
from hyper_gen.kernel_plan import KernelPlan
from hyper_gen.models.checkpoint import Piece
from hyper_gen.models.qwen3_5 import ARCHITECTURES, Qwen3_5Config, describe
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
from hyper_gen.parallel.cp_plan import CPLayout, CPPlan, Mesh
from hyper_gen.parallel.tp_plan import TPPlan

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
    """Reads this rank's pieces of a checkpoint (``hyper_gen.models.qwen3_5.shards``) into
    MindSpore parameters of the model's layout and dtype."""

    def __init__(self, checkpoint, dtype: str, kernel_plan: KernelPlan):
        self.checkpoint = checkpoint
        self.dtype = dtype
        self.kernel_plan = kernel_plan
        self.kernel_keys = set()  # the plan's keys this model's shapes use (model.kernel_plan)
        self.on_cpu = ms.get_context("device_target") == "CPU"
        self.ms_dtype = DTYPES[dtype]
        self.acc = ms.float64 if dtype == "float64" else ms.float32
        self.np_read = "float64" if dtype == "float64" else "float32"

    def read(self, piece: Piece) -> np.ndarray:
        """``Checkpoint.read`` in the read dtype; a piece that is all of its tensor (a KV head
        every rank keeps, any piece at tp 1) is read as the whole tensor."""
        if piece.ranges is not None and piece.ranges == ((0, piece.shape[piece.axis]),):
            piece = Piece(piece.name, piece.shape)
        return self.checkpoint.read(piece, self.np_read)

    def vocab_rows(self, shard: ModelShard, name: str) -> np.ndarray:
        return vocab_rows(self.checkpoint, shard, name, self.np_read)

    def param(self, array: np.ndarray, name: str = "Parameter") -> Parameter:
        """A checkpoint weight in the model dtype (every Parameter of the model is in it)."""
        if self.ms_dtype == ms.bfloat16:
            tensor = Tensor(np.ascontiguousarray(array, dtype=np.float32), dtype=ms.bfloat16)
        else:
            tensor = Tensor(np.ascontiguousarray(array, dtype=_numpy_dtype(self.ms_dtype)))
        return Parameter(tensor, name=name, requires_grad=False)

    def constant(self, array: np.ndarray) -> Tensor:
        """A derived compute-dtype tensor (not a Parameter), after model-dtype rounding: what HF
        computes with for the weights it upcasts (norm scales, decay rates, conv taps)."""
        return Tensor(np.ascontiguousarray(_round_to(array, self.dtype), dtype=_numpy_dtype(self.acc)))

    def projection(self, blocks: List[np.ndarray], in_scale: np.ndarray = None, pad: bool = False) -> Parameter:
        """(out, in) matrices concatenated along out, stored (in, out); ``in_scale`` (in,) multiplies
        the rows: the weight of the RMSNorm that feeds the projection, folded in once (the product
        is taken in float64 and rounded to the model dtype once). ``pad``: zero columns appended up
        to ``fast_width``."""
        matrix = np.concatenate(blocks, axis=0).T
        width = self.fast_width(*matrix.shape) if pad else matrix.shape[1]
        if width > matrix.shape[1]:
            matrix = np.concatenate([matrix, np.zeros((matrix.shape[0], width - matrix.shape[1]), matrix.dtype)], 1)
        if in_scale is not None:
            matrix = matrix.astype(np.float64) * in_scale.astype(np.float64)[:, None]
        return self.param(matrix)

    def linear_t(self, pieces: List[Piece], in_scale: np.ndarray = None, pad: bool = False) -> Parameter:
        """``projection`` of the (out, in) checkpoint pieces, in order."""
        return self.projection([self.read(piece) for piece in pieces], in_scale, pad)

    def fast_width(self, inner: int, width: int) -> int:
        """The width an (inner, width) fused projection is stored with: on CPU the kernel plan's
        (``hyper_gen.backends.mindspore.matmul_widths``), else the checkpoint's."""
        if not self.on_cpu:
            return width
        self.kernel_keys.add(matmul_widths.matmul_key(inner, width, self.dtype))
        return matmul_widths.projection_width(self.kernel_plan, inner, width, self.dtype, self.ms_dtype)

    def head_columns(self, head_t: np.ndarray) -> int:
        """Most columns per LM head block: on CPU the kernel plan's (narrow blocks for a head larger
        than the last-level cache), else ``HEAD_COLUMNS``."""
        if not self.on_cpu:
            return matmul_widths.HEAD_COLUMNS
        hidden, vocab = head_t.shape
        self.kernel_keys.add(matmul_widths.head_key(hidden, vocab, self.dtype))
        return matmul_widths.head_columns(self.kernel_plan, hidden, vocab, self.dtype, head_t.nbytes)

    def norm_scale(self, piece: Piece) -> np.ndarray:
        """``1 + w`` of a zero-centred RMSNorm, as HF computes it (model-dtype ``w`` plus one in
        the compute dtype), in numpy: to fold into a projection or to make a constant of."""
        acc = _numpy_dtype(self.acc)
        return (1.0 + _round_to(self.read(piece), self.dtype).astype(acc)).astype(acc)


# ----------------------------------------------------------------------------------------------
# compute helpers (MindSpore)


def _scalar(value: float, dtype) -> Tensor:
    """A 0-d tensor constant. MindSpore turns a Python float operand into float32 even next to a
    float64 tensor (``x * 8 ** -0.5`` is then off at float32 precision), so scales and epsilons are
    tensors of the dtype they meet."""
    return Tensor(value, dtype)


def _cast(x: Tensor, dtype) -> Tensor:
    return x if x.dtype == dtype else x.astype(dtype)


# Primitive instances made once: on CPU a call costs less than a Tensor operator, and MulNoNan /
# RealDiv are cheaper kernels than Mul / Div (module docstring). Measured against the functional
# ops.add / ops.mul / ops.div in the whole decode step: no faster.
# MindSpore 2.10's CPU kernels never free the memory of a scalar argument (a transpose flag, an
# axis): ~1.3 KB a MatMul call. mint.bmm takes none but is several times slower for the 2-D
# products of a decode step (docs/performance.md), so the products stay MatMul / BatchMatMul and
# the leak is cut where it is free to: the reductions below.
_matmul = ops.MatMul()
_bmm_tb = ops.BatchMatMul(transpose_b=True)
_bmm_ta_flag = ops.BatchMatMul(transpose_a=True)  # a^T @ b without a transposed copy of a


def _bmm(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` over the last two axes, the leading axes equal: mint.bmm, which takes no scalar
    argument (so leaks nothing) and is as fast as BatchMatMul for these small batched products."""
    out = mint.bmm(a.reshape((-1,) + a.shape[-2:]), b.reshape((-1,) + b.shape[-2:]))
    return out.reshape(a.shape[:-2] + out.shape[-2:])


def _bmm_ta(a: Tensor, b: Tensor) -> Tensor:
    """``a^T @ b`` over the last two axes; a row's transpose is a reshape (no transpose kernel)."""
    a_t = a.reshape(a.shape[:-2] + (a.shape[-1], 1)) if a.shape[-2] == 1 else a.swapaxes(-1, -2)
    return _bmm(a_t, b)


_add = ops.Add()
_sub = ops.Sub()
_mul = ops.MulNoNan()  # x * y, except that inf/nan * 0 gives 0
_div = ops.RealDiv()
_square = ops.Square()
_sqrt = ops.Sqrt()
_sigmoid = ops.Sigmoid()
_exp = ops.Exp()
# the reductions' primitives leak one scalar a call where mint.mean / mint.sum leak two or three
_mean_last = ops.ReduceMean(keep_dims=True)  # (x, axis): bitwise mint.mean(x, axis, True)
_sum_last = ops.ReduceSum(keep_dims=True)
_softplus = mint.nn.functional.softplus  # torch's (threshold 20); ops.softplus is less exact
_softmax = mint.nn.functional.softmax
_glu = mint.nn.functional.glu

_mul_kernel = ops.Mul()
# From here on MulNoNan's CPU kernel is slower than Mul's in a graph (4-10x over 100K elements, a
# batch's recurrent state); below, Mul costs more to launch (docs/performance.md)
_LARGE_PRODUCT = 65536


def _product(x: Tensor, y: Tensor) -> Tensor:
    """``x * y`` (``y`` broadcast to x's shape) by the faster kernel for x's size: the same
    values (no operand is inf or nan). A large product's factor is broadcast first (a
    broadcasting kernel is slower still)."""
    if x.size < _LARGE_PRODUCT:
        return _mul(x, y)
    return _mul_kernel(x, y if y.shape == x.shape else ops.broadcast_to(y, x.shape))


def _mul_tiled(x: Tensor, y: Tensor) -> Tensor:
    """``x * y`` with ``y`` broadcast to x's shape by ``ops.tile`` first: MindSpore CPU's
    broadcasting MulNoNan is 2-3x slower than tiling a per-channel or per-row factor and
    multiplying same-shape tensors (the same products, bitwise). For the large prefill operands."""
    y = y.reshape((1,) * (x.ndim - y.ndim) + tuple(y.shape))
    if tuple(y.shape) != tuple(x.shape):
        y = ops.tile(y, tuple(a // c for a, c in zip(x.shape, y.shape)))
    return _product(x, y)


def _silu(x: Tensor) -> Tensor:
    return _product(x, _sigmoid(x))


def _normalize(x: Tensor, eps: Tensor) -> Tensor:
    """``x / sqrt(mean(x^2) + eps)`` over the last axis: RMSNorm without its weight."""
    return _div(x, _sqrt(_add(_mean_last(_square(x), -1), eps)))


def _rms_norm(x: Tensor, eps: Tensor) -> Tensor:
    """A zero-centred RMSNorm whose ``1 + w`` was folded into the next projection: normalised in
    the compute dtype of ``eps``, returned in x's dtype."""
    return _cast(_normalize(_cast(x, eps.dtype), eps), x.dtype)


class _PartialSum:
    """Sums row-parallel partial outputs over the tensor-parallel group (the identity at tp 1).

    float32 / float16 use AllReduce. MindSpore's CPU AllReduce has no float64 kernel and its
    float64 AllGather rounds to float32, so float64 bits travel as int32 words through AllGather
    (exact) and every rank adds the parts in rank order: the same float64 sum on every rank (a tp
    subgroup of a tp x cp mesh: that AllGather runs over the world on CPU, ``MindSporeOps``)."""

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


_CONSTANTS: Dict[tuple, object] = {}


def _numpy_dtype(dtype):
    """numpy dtype of a MindSpore float dtype (``mindspore.dtype_to_nptype`` is deprecated)."""
    return {ms.float16: np.float16, ms.float32: np.float32, ms.float64: np.float64}[dtype]


def _ones(shape: tuple, dtype) -> Tensor:
    """A cached all-ones tensor."""
    key = ("ones", shape, dtype)
    if key not in _CONSTANTS:
        _CONSTANTS[key] = Tensor(np.ones(shape, _numpy_dtype(dtype)))
    return _CONSTANTS[key]


def _zeros(shape: tuple, dtype) -> Tensor:
    """A cached all-zeros tensor (never written: every use concatenates it). Padding by
    concatenation: ``ops.pad`` takes ~40x longer than ``concat`` with zeros on MindSpore CPU."""
    key = ("zeros", tuple(shape), dtype)
    if key not in _CONSTANTS:
        _CONSTANTS[key] = ops.zeros(tuple(shape), dtype)
    return _CONSTANTS[key]


def _pad_axis(x: Tensor, axis: int, pad: int) -> Tensor:
    """``x`` with ``pad`` zeros appended along ``axis``."""
    shape = list(x.shape)
    shape[axis] = pad
    return ops.concat([x, _zeros(tuple(shape), x.dtype)], axis)


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


def _chunked_delta_rule(q, k, v, g, beta, state, chunk: int = 0):
    """Gated delta rule over a whole sequence, chunk by chunk (HF ``torch_chunk_gated_delta_rule``).

    q, k (B, H, S, Dk) l2-normalised, v (B, H, S, Dv), g (log decay) and
    beta (B, H, S), state (B, H, Dk, Dv) or None; all in the compute dtype. Inside a chunk the
    delta updates are a unit lower-triangular system solved at once (the UT transform); chunks
    are scanned in order. Sequences shorter than a chunk use a chunk of their own length (the
    zero padding HF adds changes nothing but the cost) unless ``chunk`` fixes the size. Two
    phases: the per-chunk terms (``_chunk_terms``) and the scan carrying the state (``_chunk_scan``),
    which a context-parallel rank runs once the previous rank's final state has arrived.
    """
    return _chunk_scan(_chunk_terms(q, k, v, g, beta, chunk), state)


def _chunk_terms(q, k, v, g, beta, chunk: int = 0) -> dict:
    """Everything of the chunked delta rule that does not depend on the incoming state."""
    b, h, s, dk = k.shape
    dv = v.shape[-1]
    size = chunk or min(_CHUNK, s)
    n = -(-s // size)
    pad = n * size - s
    if pad:
        q, k, v = (_pad_axis(t, 2, pad) for t in (q, k, v))
        g, beta = (_pad_axis(t, 2, pad) for t in (g, beta))
    q = q.reshape(b, h, n, size, dk)
    k = k.reshape(b, h, n, size, dk)
    v = v.reshape(b, h, n, size, dv)
    beta = beta.reshape(b, h, n, size, 1)
    cum = ops.cumsum(g.reshape(b, h, n, size), -1)  # log decay from the chunk start
    upper, strict_lower, eye = _chunk_constants(size, cum.dtype)
    # (.., i, j): decay j -> i, 0 for j > i. Products are MulNoNan and sums Add / Sub, as in decode
    # (module docstring: the Tensor operators dispatch the slower Mul); no operand is inf or nan
    decay = _exp(_add(_sub(cum[..., :, None], cum[..., None, :]), upper))
    k_beta = _mul_tiled(k, beta)
    system = _add(eye, _mul_tiled(_product(_bmm_tb(k_beta, k), decay), strict_lower))
    exp_cum = _exp(cum)[..., None]
    solved = _solve_lower(system, ops.concat([_mul_tiled(v, beta), _mul_tiled(k_beta, exp_cum)], -1))
    return {
        "length": s,
        "padded": bool(pad),
        "shape": (b, h, dk, dv),
        "values": _take(solved, -1, 0, dv),
        "k_cumdecay": _take(solved, -1, dv, solved.shape[-1]),
        "intra": _product(_bmm_tb(q, k), decay),
        "q": _mul_tiled(q, exp_cum),
        "k_decayed": _mul_tiled(k, _exp(_sub(cum[..., -1:], cum))[..., None]),  # k^T of the state update
        "chunk_decay": _exp(cum[..., -1])[..., None, None],
        "dtype": cum.dtype,
    }


def _chunk_scan(terms: dict, state, trim: bool = True):
    """The chunks in order, carrying the recurrent state: (output (B, H, S, Dv), final state);
    ``trim=False`` keeps the padded chunk positions (contiguous, for ``_gather_rows``)."""
    values, k_cumdecay, intra = terms["values"], terms["k_cumdecay"], terms["intra"]
    q, k_decayed, chunk_decay = terms["q"], terms["k_decayed"], terms["chunk_decay"]
    if state is None:
        state = ops.zeros(terms["shape"], terms["dtype"])
    outputs = []
    for i in range(values.shape[2]):  # chunk i of each term by _take: a [:, :, i] view copies slowly
        v_new = _sub(_take(values, 2, i), _bmm(_take(k_cumdecay, 2, i), state))
        outputs.append(_add(_bmm(_take(q, 2, i), state), _bmm(_take(intra, 2, i), v_new)))
        state = _add(_product(state, _take(chunk_decay, 2, i)), _bmm_ta_flag(_take(k_decayed, 2, i), v_new))
    out = outputs[0] if len(outputs) == 1 else ops.concat(outputs, 2)
    return (out[:, :, : terms["length"]] if terms["padded"] and trim else out), state


def _gather_rows(rows: Tensor, index: np.ndarray, shape: tuple) -> Tensor:
    """``rows[index]`` as ``shape``: the head-major copy of token-major rows (or back) by one
    Gather. MindSpore CPU copies a transposed view ~7x slower (1M floats: 5.4 ms vs 0.7 ms), and
    every kernel given such a view makes that copy first; a Gather is an exact copy."""
    return ops.gather(rows, Tensor(index.reshape(-1).astype(np.int32)), 0).reshape(shape)


def _take(x: Tensor, axis: int, start: int, stop: int = None) -> Tensor:
    """``x``'s positions ``start:stop`` along ``axis`` (with ``stop`` None the one position
    ``start``, the axis dropped) as a new contiguous tensor, by one Gather: a kernel given a
    strided view (a slice, a split part) first copies it ~4-8x slower than a Gather copies
    (docs/performance.md). For the PyNative prefill; graphs take views for free."""
    key = ("take", start, stop)
    if key not in _CONSTANTS:
        index = np.int32(start) if stop is None else np.arange(start, stop, dtype=np.int32)
        _CONSTANTS[key] = Tensor(index)
    return ops.gather(x, _CONSTANTS[key], axis % x.ndim)


def _take_split(x: Tensor, sizes: tuple) -> list:
    """``mint.split(x, sizes, -1)`` as contiguous tensors (``_take``)."""
    starts = np.cumsum((0,) + tuple(sizes))
    return [_take(x, -1, int(a), int(b)) for a, b in zip(starts[:-1], starts[1:])]


class TokenPacking:
    """The real tokens of a left-padded prefill, packed (the torch port's ``TokenPacking``): the
    row-wise work of every layer (norms, projections, MLP / experts, residual adds) runs on the N
    real rows only, and just the sequence mixers' cores (rotary + attention, conv + delta rule) see
    the B * S padded rows, with zeros at the padding: what HF's masked Gated DeltaNet input projects
    to, and keys the attention mask hides. Both directions are one Gather (exact copies)."""

    def __init__(self, mask: np.ndarray):
        flat = mask.reshape(-1) != 0
        self.rows = int(flat.size)
        index = np.flatnonzero(flat)
        self.count = int(index.size)
        self.pack_index = Tensor(index.astype(np.int32))
        # padded row -> its packed row, or the zero row appended after the N packed ones
        unpack = np.full(self.rows, self.count, np.int32)
        unpack[index] = np.arange(self.count, dtype=np.int32)
        self.unpack_index = Tensor(unpack)

    @classmethod
    def of(cls, cache, seq: int):
        """The packing of this forward: a prefill of a left-padded batch; None otherwise."""
        if seq == 1 or cache.seq_length != 0 or cache.prompt_mask is None:
            return None
        mask = cache.prompt_mask.asnumpy()
        return None if mask.all() else cls(mask)

    def pack(self, x: Tensor) -> Tensor:
        """(B * S, C) -> (N, C)."""
        return ops.gather(x, self.pack_index, 0)

    def unpack(self, x: Tensor) -> Tensor:
        """(N, C) -> (B * S, C), zeros at the padding."""
        return ops.gather(ops.concat([x, _zeros((1, x.shape[1]), x.dtype)], 0), self.unpack_index, 0)


def _recurrent_step(q, k, v, g, beta, state):
    """One decode step of the gated delta rule: q, k (B, H, 1, Dk), v (B, H, 1, Dv), ``g`` (the
    log decay) and beta (B, H, 1, 1), state (B, H, Dk, Dv); all in the compute dtype. The decay
    is HF's ``S * exp(g)``, with the factor broadcast to the state's shape first: a broadcasting
    product or quotient over a batched state is several times slower, and so is MulNoNan's
    kernel than Mul's on a state of any batch (2.6x at batch 1, 6x at 16; docs/performance.md)."""
    state = _mul_kernel(state, ops.broadcast_to(_exp(g), state.shape))
    delta = _mul(_sub(v, _bmm(k, state)), beta)
    state = _add(state, _bmm_ta(k, delta))  # + k^T delta
    return _bmm(q, state), state


# ----------------------------------------------------------------------------------------------
# context parallelism (hyper_gen.parallel.cp_plan; the torch port does the same, step for step)


class ContextParallel:
    """The context-parallel group of a model: its plan, its communication group (None: the world
    group) and the one collective everything here uses, AllGather (float64 travels as raw bits:
    ``MindSporeOps.all_gather``)."""

    def __init__(self, plan: CPPlan, group=None):
        self.plan = plan
        self.group = group
        self.ops = MindSporeOps()

    def gather(self, x: Tensor) -> list:
        """Every rank's ``x`` (same shape everywhere), in rank order."""
        stacked = self.gather_stacked(x)
        return [stacked[r] for r in range(self.plan.cp)]

    def gather_stacked(self, x: Tensor) -> Tensor:
        """Every rank's ``x`` (same shape everywhere) stacked along a new leading axis, in rank order."""
        return self.ops.all_gather(x.reshape((1,) + tuple(x.shape)), axis=0, group=self.group)

    def gather_sequence(self, x: Tensor, layout: CPLayout, axis: int) -> Tensor:
        """The whole sequence along ``axis`` from every rank's slice of it (padded to the longest
        for the all-gather, the real positions concatenated in rank order)."""
        pad = layout.longest - x.shape[axis]
        if pad:
            shape = list(x.shape)
            shape[axis] = pad
            x = ops.concat([x, ops.zeros(tuple(shape), x.dtype)], axis)
        parts = [
            mint.narrow(p, axis, 0, layout.length_of(r)) for r, p in enumerate(self.gather(x)) if layout.length_of(r)
        ]
        return parts[0] if len(parts) == 1 else ops.concat(parts, axis)


class CPStep:
    """One forward of a context-parallel model: the prompt's layout, and whether this forward is
    the sharded prefill (this rank computes only its slice), a replicated one (a prompt of fewer
    chunks than ranks, a cacheless one-token call) or a decode step."""

    def __init__(self, cp: ContextParallel, layout: CPLayout, decode: bool):
        self.cp = cp
        self.layout = layout
        self.rank = cp.plan.rank
        self.decode = decode
        self.sharded = layout.sharded and not decode
        self.start, self.stop = layout.slice_of(self.rank)

    def store_prefill(self, cache, layer_idx: int, key: Tensor, value: Tensor) -> None:
        """This rank's slice of the prompt's K/V (B, H, S, D) into the cache (static: a buffer with
        room for the decode tokens on the owner); nothing for an empty slice of a dynamic cache."""
        (b, h, _, d), dtype = key.shape, key.dtype
        if not self.sharded:  # replicated prefill: K/V of every position, keep this rank's
            key, value = (t[:, :, self.start : self.stop] if self.stop > self.start else None for t in (key, value))
        if cache.is_static:
            capacity = self.layout.static_capacity(self.rank, cache.max_length)
            if capacity == 0:
                return
            keys, values = ops.zeros((b, h, capacity, d), dtype), ops.zeros((b, h, capacity, d), dtype)
            if key is not None:
                self.cp.ops.write_slice(keys, 2, 0, key)
                self.cp.ops.write_slice(values, 2, 0, value)
            cache.keys[layer_idx], cache.values[layer_idx] = keys, values
        elif key is not None:
            cache.keys[layer_idx], cache.values[layer_idx] = key, value

    def decode_keys(self, cache, layer_idx: int, key: Tensor, value: Tensor, mask: Tensor):
        """The new token's K/V appended on the owner; (keys, values, mask columns) this rank attends
        over, or (None, None, None) when it holds none."""
        if self.rank == self.layout.owner:
            if cache.is_static:
                self.cp.ops.write_slice(cache.keys[layer_idx], 2, cache.seq_length - self.start, key)
                self.cp.ops.write_slice(cache.values[layer_idx], 2, cache.seq_length - self.start, value)
            elif layer_idx in cache.keys:
                cache.keys[layer_idx] = ops.concat([cache.keys[layer_idx], key], 2)
                cache.values[layer_idx] = ops.concat([cache.values[layer_idx], value], 2)
            else:
                cache.keys[layer_idx], cache.values[layer_idx] = key, value
        if layer_idx not in cache.keys:
            return None, None, None
        keys, values = cache.keys[layer_idx], cache.values[layer_idx]
        return keys, values, mask[..., self.start : self.start + keys.shape[2]]

    def merge_attention(self, out: Tensor, lse: Tensor) -> Tensor:
        """Every rank's partial attention (output over its keys, log-sum-exp of its scores) merged:
        the same ops on the same gathered (cp, ...) tensor on every rank, so the same bits. Over
        the stacked ranks at once: a handful of small kernels per decode layer, not ~6 per rank."""
        parts = self.cp.gather_stacked(ops.concat([out, lse], -1))  # (cp, ..., D + 1)
        d = out.shape[-1]
        lses = parts[..., d:]
        weights = ops.exp(lses - ops.amax(lses, 0, True))
        return (_sum_last(weights * parts[..., :d], 0) / _sum_last(weights, 0)).reshape(out.shape)

    def gather_rows(self, x: Tensor, b: int, logits_to_keep: int):
        """After a sharded prefill: (rows (B * kept, H), kept) whose logits are returned, the same
        on every rank (the last one comes from the rank holding the last position)."""
        x = x.reshape(b, -1, x.shape[-1])
        if logits_to_keep == 1:
            return self.cp.gather(x[:, -1:])[self.layout.last_rank].reshape(b, -1), 1
        x = self.cp.gather_sequence(x, self.layout, axis=1)
        if logits_to_keep and logits_to_keep < x.shape[1]:
            x = x[:, -logits_to_keep:]
        return x.reshape(-1, x.shape[-1]), x.shape[1]


# ----------------------------------------------------------------------------------------------
# layers
#
# Layers take and return 2-D (B * S, hidden) activations; ``b, s`` give the batch and length.


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
        self, cfg: Qwen3_5Config, weights: _Weights, shard: AttentionShard, layer_idx: int, in_scale: np.ndarray
    ):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = shard.num_heads
        self.num_kv_heads = shard.num_kv_heads
        self.head_dim = d = cfg.head_dim
        self.acc = weights.acc
        self.eps = _scalar(cfg.rms_norm_eps, weights.acc)
        h = cfg.hidden_size
        query_gate = weights.read(shard.query_gate).reshape(self.num_heads, 2, d, h)  # per head: [query | gate]
        self.qkv_t = weights.projection(
            [
                query_gate[:, 0].reshape(-1, h),
                weights.read(shard.key),
                weights.read(shard.value),
                query_gate[:, 1].reshape(-1, h),
            ],
            in_scale,
            pad=True,
        )
        self.split_sizes = ((self.num_heads + self.num_kv_heads) * d, self.num_kv_heads * d, self.num_heads * d)
        self.o_t = weights.linear_t([shard.o_proj])
        # q_norm and k_norm weights (1 + w), one row per local head; queries carry the score scale
        acc = _numpy_dtype(weights.acc)
        q_norm = weights.norm_scale(shard.q_norm) * acc(d**-0.5)
        k_norm = weights.norm_scale(shard.k_norm)
        self.qk_norm = Tensor(
            np.concatenate(
                [np.tile(q_norm, (1, self.num_heads, 1)), np.tile(k_norm, (1, self.num_kv_heads, 1))], 1
            ).astype(acc)
        )
        rot, half = cfg.rotary_dim, cfg.rotary_dim // 2
        rotate = np.zeros((d, d))  # x @ rotate = rotate_half(x) = [-x2, x1] on the rotary dims, 0 elsewhere
        rotate[np.arange(half, rot), np.arange(half)] = -1.0
        rotate[np.arange(half), np.arange(half, rot)] = 1.0
        self.rotate = Tensor(rotate, weights.ms_dtype)

    def construct(self, x, b, s, cos, sin, attention_mask, cache, cp_step=None, packing=None):
        n = b * s
        nh, nkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        heads = nh + nkv
        projected = _matmul(x, self.qkv_t)
        if packing is not None:
            projected = packing.unpack(projected)
        qk, v, gate = _take_split(projected, self.split_sizes)
        qk = _cast(_product(_normalize(_cast(qk.reshape(n, heads, d), self.acc), self.eps), self.qk_norm), x.dtype)
        rotated = _matmul(qk.reshape(n * heads, d), self.rotate).reshape(n, heads, d)
        qk = _add(_product(qk, cos), _product(rotated, sin))
        group = nh // nkv
        if s == 1:
            q, k = mint.split(qk, (nh, nkv), 1)
            k, v = k.reshape(b, nkv, 1, d), v.reshape(b, nkv, 1, d)
            q = q.reshape(b, nkv, group, d)  # GQA without repeating K/V: a kv head's queries are rows
        else:  # head-major (B, heads, S, D) copies of the token-major rows by Gather (_gather_rows)
            tokens = np.arange(b)[:, None, None] * s + np.arange(s)[None, None, :]  # (B, 1, S)
            rows = qk.reshape(n * heads, d)
            q = _gather_rows(rows, tokens * heads + np.arange(nh)[None, :, None], (b, nkv, group * s, d))
            k = _gather_rows(rows, tokens * heads + nh + np.arange(nkv)[None, :, None], (b, nkv, s, d))
            v = _gather_rows(v.reshape(n * nkv, d), tokens * nkv + np.arange(nkv)[None, :, None], (b, nkv, s, d))
        if cp_step is None:
            keys, values = cache.update(k, v, self.layer_idx)
        elif cp_step.decode:
            out = _cast(self._attend_partial(q, k, v, attention_mask, cache, cp_step), x.dtype)
            return _matmul(_product(out.reshape(n, nh * d), _sigmoid(gate)), self.o_t)
        else:  # context-parallel prefill: this rank's queries over the prompt's K/V (all-gathered when sharded)
            cp_step.store_prefill(cache, self.layer_idx, k, v)
            keys, values = k, v
            if cp_step.sharded:
                gathered = cp_step.cp.gather_sequence(ops.concat([k, v], -1), cp_step.layout, 2)
                keys, values = gathered[..., :d], gathered[..., d:]
                attention_mask = attention_mask[:, :, cp_step.start : cp_step.stop]
            attention_mask = attention_mask[..., : cp_step.layout.width]
        t = keys.shape[2]
        scores = _bmm_tb(q, keys)  # (B, nkv, group * S, T)
        if s == 1:
            scores = _add(scores, attention_mask)  # (B, 1, 1, T) over (B, nkv, group, T)
        else:
            scores = _add(scores.reshape(b, nkv, group, s, t), attention_mask[:, :, None])
        probs = _cast(_softmax(_cast(scores, self.acc), -1), x.dtype)
        out = _bmm(probs.reshape(b, nkv, group * s, t), values)
        if s == 1:
            out = out.reshape(n, nh * d)
        else:  # token-major again: row (b, head, position) of the (B, nh, S, D) output
            out_rows = (np.arange(b)[:, None, None] * nh + np.arange(nh)[None, None, :]) * s
            out = _gather_rows(out.reshape(b * nh * s, d), out_rows + np.arange(s)[None, :, None], (n, nh * d))
        out = _product(out, _sigmoid(gate))
        if packing is not None:
            out = packing.pack(out)
        return _matmul(out, self.o_t)

    def attend_one(self, q, k, v, attention_mask, cache, cp_step, dtype):
        """One decode token's attention over the cache (after ``_attention_pre_rows``): q
        (B, nkv, group, D), k, v (B, nkv, 1, D) -> (B, nh * D) in ``dtype``; ``construct`` op for op."""
        b = q.shape[0]
        if cp_step is not None:
            out = self._attend_partial(q, k, v, attention_mask, cache, cp_step)
        else:
            keys, values = cache.update(k, v, self.layer_idx)
            return _attend_rows(q, keys, values, attention_mask, self.acc, dtype)
        return _cast(out, dtype).reshape(b, self.num_heads * self.head_dim)

    def _attend_partial(self, q, k, v, mask, cache, step: CPStep):
        """One decode token under context parallelism: this rank's (output, log-sum-exp) over its
        cached slice, merged over the ranks (``CPStep.merge_attention``); (B, nkv, group, D)."""
        keys, values, mask = step.decode_keys(cache, self.layer_idx, k, v, mask)
        q = _cast(q, self.acc)
        if keys is None:  # an empty slice: a zero output of zero weight
            out = ops.zeros(q.shape, self.acc)
            lse = Tensor(np.full(q.shape[:-1] + (1,), np.finfo(_numpy_dtype(self.acc)).min), self.acc)
        else:
            scores = _add(_bmm_tb(q, _cast(keys, self.acc)), _cast(mask, self.acc))  # (B, nkv, group, T)
            top = ops.amax(scores, -1, True)
            weights = _exp(_sub(scores, top))
            total = _sum_last(weights, -1)
            out = _div(_bmm(weights, _cast(values, self.acc)), total)
            lse = _add(top, ops.log(total))
        return step.merge_attention(out, lse)


class GatedDeltaNet(nn.Cell):
    """Linear attention: causal depthwise conv, then the gated delta rule, then a gated RMSNorm.

    A one-token step with a state (decode) runs the conv as one (B, kernel, channels) window
    times the taps and the delta rule as ``_recurrent_step``; longer inputs use the shifted-sum
    conv and ``_chunked_delta_rule``. q and k are l2-normalised together and the query scale
    Dk ** -0.5 is never applied: the gated norm's epsilon absorbs it exactly (see
    ``gated_norm_eps``). The gated norm's weight lives in out_proj's rows.

    Under tensor parallelism this rank holds a block of key heads and the value heads they serve
    (value head j uses key head j // (num_v_heads / num_k_heads)): their q | k | v channels,
    z / b / a rows, decay parameters and out_proj columns; the head counts are local."""

    def __init__(
        self, cfg: Qwen3_5Config, weights: _Weights, shard: GatedDeltaNetShard, layer_idx: int, in_scale: np.ndarray
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
        self.l2_eps = _scalar(1e-6, weights.acc)
        # The queries stay unscaled: their output o = q @ S is then Dk ** 0.5 times HF's, and
        # o / sqrt(mean(o^2) + eps * Dk) is exactly HF's gated norm of it (o only feeds that norm).
        self.gated_norm_eps = _scalar(cfg.rms_norm_eps * dk, weights.acc)
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
        norm_weight = _round_to(weights.read(shard.norm), weights.dtype)
        self.out_t = weights.linear_t([shard.out_proj], np.tile(norm_weight, self.num_v_heads))

    def _conv_step(self, mixed, state, cache):
        """One token through the causal depthwise conv + SiLU: mixed (B, channels). The state is
        the last kernel-1 inputs, (B, channels, kernel-1) as HF and the torch port keep it, held
        as a transposed view of channels-last memory (so the window is a contiguous concat)."""
        b, c = mixed.shape
        window = ops.concat([mint.transpose(state, 1, 2), mixed.reshape(b, 1, c)], 1)  # (B, kernel, channels)
        cache.conv_states[self.layer_idx] = mint.transpose(window[:, 1:], 1, 2)
        taps = _mul(_cast(window, self.conv_t.dtype), self.conv_t)
        out = _bmm(_ones((b, 1, self.kernel), taps.dtype), taps).reshape(b, c)  # faster than a sum over axis 1
        return _silu(_cast(out, mixed.dtype))

    def _conv_sequence(self, mixed, state, cache):
        """The conv over (B, S, channels) as a sum of shifted multiplies (no float64 conv1d kernel
        on CPU), continuing from ``state`` when there is one. The rows are shifted as one flat
        (B * (S + kernel - 1), channels) sequence, whose shifted slices are contiguous (a strided
        slice per row copies ~10x slower on MindSpore CPU); the outputs that straddle two rows
        are dropped once at the end."""
        b, s, c = mixed.shape
        keep = self.kernel - 1
        if state is None:
            padded = ops.concat([_zeros((b, keep, c), mixed.dtype), mixed], 1)
        else:
            padded = ops.concat([mint.transpose(state, 1, 2), mixed], 1)
        cache.conv_states[self.layer_idx] = mint.transpose(padded[:, s:], 1, 2)
        width = s + keep
        flat = _cast(padded, self.conv_t.dtype).reshape(b * width, c)
        rows = b * width - keep
        out = _mul_tiled(flat[:rows], self.conv_taps[0])
        for j in range(1, self.kernel):
            out = _add(out, _mul_tiled(flat[j : j + rows], self.conv_taps[j]))
        if b > 1:
            out = _take(ops.concat([out, _zeros((keep, c), out.dtype)], 0).reshape(b, width, c), 1, 0, s)
        return _silu(_cast(out, mixed.dtype)).reshape(b * s, c)

    def _conv_context_parallel(self, mixed, cp_step: CPStep, cache):
        """The conv over this rank's slice (B, s, channels) of a sharded prefill: the previous
        slice's last kernel-1 pre-conv positions (the halo) come with one all-gather of every
        rank's last kernel-1, which also gives every rank the whole prompt's conv state."""
        keep, s = self.kernel - 1, mixed.shape[1]
        tail = mixed[:, -keep:] if s >= keep else ops.pad(mixed, (0, 0, keep - s, 0))
        tails = cp_step.cp.gather(tail)
        layout = cp_step.layout
        real = [t[:, keep - min(keep, layout.length_of(r)) :] for r, t in enumerate(tails) if layout.length_of(r)]
        history = ops.concat(real, 1)[:, -keep:]  # a sharded prompt has >= 2 chunks, so >= kernel-1 positions
        # the slices before the last are whole chunks (>= kernel-1 positions): the halo is the previous one's
        halo = None if cp_step.rank == 0 else mint.transpose(tails[cp_step.rank - 1], 1, 2)
        out = self._conv_sequence(mixed, halo, cache)
        cache.conv_states[self.layer_idx] = mint.transpose(history, 1, 2)
        return out

    def _relayed_chunks(self, q, k, v, g, beta, cp_step: CPStep):
        """The chunked delta rule of a sharded prefill, its state relayed in rank order: rank r
        scans its chunks from rank r-1's final state; after each rank's scan one all-gather hands
        its final state on (the last one gives every rank the whole prompt's state). Every slice
        starts on a chunk boundary and uses one device's 64-position chunks."""
        terms = _chunk_terms(q, k, v, g, beta, _CHUNK)
        placeholder = ops.zeros(terms["shape"], terms["dtype"])
        state = out = None
        for turn in range(cp_step.cp.plan.cp):
            if turn == cp_step.rank:
                out, state = _chunk_scan(terms, state)
            state = cp_step.cp.gather(state if turn == cp_step.rank else placeholder)[turn]
        return out, state

    def construct(self, x, b, s, cache, cp_step=None, packing=None):
        n = b * s
        sharded = cp_step is not None and cp_step.sharded
        if packing is None and cache.seq_length == 0 and cache.prompt_mask is not None:
            prompt_mask = cache.prompt_mask
            if sharded:
                prompt_mask = prompt_mask[:, cp_step.start : cp_step.stop]
            x = x * prompt_mask.reshape(n, 1)  # left padding must not enter conv or state
        projected = _matmul(x, self.in_proj_t)
        if packing is not None:  # padding rows: the zeros HF's masked input projects to
            z = _take(projected, -1, self.conv_dim, self.conv_dim + self.value_dim)
            projected = packing.unpack(projected)
        mixed, z_rows, beta, a = _take_split(projected, self.split_sizes)
        if packing is None:
            z = z_rows
        conv_state = cache.conv_states.get(self.layer_idx)
        state = cache.recurrent_states.get(self.layer_idx)
        step = s == 1 and state is not None
        if step:
            mixed = self._conv_step(mixed, conv_state, cache)
        elif sharded:
            mixed = self._conv_context_parallel(mixed.reshape(b, s, self.conv_dim), cp_step, cache)
        else:
            mixed = self._conv_sequence(mixed.reshape(b, s, self.conv_dim), conv_state, cache)
        acc = self.acc
        nk, nv, dk, dv = self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim
        mixed = _cast(mixed, acc)
        v = mint.split(mixed, (2 * self.key_dim, self.value_dim), -1)[1]
        qk = _take(mixed, -1, 0, 2 * self.key_dim).reshape(n, 2 * nk, dk)
        qk = _div(qk, _sqrt(_add(_sum_last(_square(qk), -1), self.l2_eps)))  # l2 norm
        q, k = mint.split(qk, (nk, nk), 1)
        if nk != nv:  # value head j reads key head j // (nv / nk)
            q, k = (ops.broadcast_to(t.reshape(n, nk, 1, dk), (n, nk, nv // nk, dk)) for t in (q, k))
        beta = _sigmoid(_cast(beta, acc))
        g = _mul(_softplus(_add(_cast(a, acc), self.dt_bias)), self.a)  # the log decay
        if step:
            q, k = q.reshape(b, nv, 1, dk), k.reshape(b, nv, 1, dk)
            out, state = _recurrent_step(
                q, k, v.reshape(b, nv, 1, dv), g.reshape(b, nv, 1, 1), beta.reshape(b, nv, 1, 1), state
            )
        else:
            # (B, heads, S, D) copies of the token-major q / k / v by Gather (``_gather_rows``): row
            # (token, head) of qk is token * 2nk + head (k after the nk q heads), of mixed
            # token * (conv_dim / dv) + 2 key_dim / dv + head; value head j reads key head j // (nv / nk)
            tokens = np.arange(b)[:, None, None] * s + np.arange(s)[None, None, :]  # (B, 1, S)
            key_head = (np.arange(nv) // (nv // nk))[None, :, None]
            rows = qk.reshape(n * 2 * nk, dk)
            q = _gather_rows(rows, tokens * (2 * nk) + key_head, (b, nv, s, dk))
            k = _gather_rows(rows, tokens * (2 * nk) + nk + key_head, (b, nv, s, dk))
            if mixed.is_contiguous() and self.conv_dim % dv == 0 and (2 * self.key_dim) % dv == 0:
                per_token = self.conv_dim // dv
                value_rows = tokens * per_token + 2 * self.key_dim // dv + np.arange(nv)[None, :, None]
                v = _gather_rows(mixed.reshape(n * per_token, dv), value_rows, (b, nv, s, dv))
            else:
                v = v.reshape(b, s, nv, dv).transpose(0, 2, 1, 3)
            g = g.reshape(b, s, nv).transpose(0, 2, 1)
            beta = beta.reshape(b, s, nv).transpose(0, 2, 1)
            if sharded:
                out, state = self._relayed_chunks(q, k, v, g, beta, cp_step)
                out = out.transpose(0, 2, 1, 3)
            else:
                out, state = _chunk_scan(_chunk_terms(q, k, v, g, beta), state, trim=False)
                length = out.shape[2]  # padded to whole chunks: row (b, head, position)
                out_rows = (np.arange(b)[:, None, None] * nv + np.arange(nv)[None, None, :]) * length
                out_rows = out_rows + np.arange(s)[None, :, None]  # (B, S, nv)
                out = _gather_rows(out.reshape(-1, dv), out_rows, (n, nv, dv))
        cache.recurrent_states[self.layer_idx] = state
        if packing is not None:  # the gated norm and out_proj on the real rows
            out = packing.pack(out.reshape(n, nv * dv))
            n = packing.count
        # gated RMSNorm over each value head, with HF's casts (exact no-ops in float32/float64);
        # its weight is in out_t
        out = _cast(_cast(out, x.dtype), acc).reshape(n, nv, dv)
        out = _cast(_cast(_normalize(out, self.gated_norm_eps), x.dtype), acc)
        out = _product(out.reshape(n, self.value_dim), _silu(_cast(z, acc)))
        return _matmul(_cast(out, x.dtype), self.out_t)


class MLP(nn.Cell):
    """SwiGLU feed-forward: ``down(silu(x @ gate) * (x @ up))``, with up|gate as one matrix:
    ``glu`` of the two halves is ``up * sigmoid(gate)``, times gate is the SwiGLU (two kernels
    instead of a split, a sigmoid and two products)."""

    def __init__(
        self, weights: _Weights, gate: np.ndarray, up: np.ndarray, down: np.ndarray, in_scale: np.ndarray = None
    ):
        super().__init__()
        # up | gate, each half zero-padded to fast_width / 2 (down gets as many zero rows):
        # glu of the padded halves is 0 on the padding
        inter, hidden = gate.shape
        self.inter = weights.fast_width(hidden, 2 * inter) // 2
        pad = np.zeros((self.inter - inter, hidden), gate.dtype)
        self.up_gate_t = weights.projection([up, pad, gate, pad], in_scale)
        self.down_t = weights.param(np.concatenate([down.T, np.zeros((self.inter - inter, down.shape[0]), down.dtype)]))

    def construct(self, x):
        up_gate = _matmul(x, self.up_gate_t)
        hidden = _product(_glu(up_gate, -1), _take(up_gate, -1, self.inter, 2 * self.inter))
        return _matmul(hidden, self.down_t)


def _dense_mlp(weights: _Weights, shard: MLPShard, in_scale: np.ndarray) -> MLP:
    """An MLP with this rank's block of the intermediate dims: gate/up rows, down columns (a
    partial output under tensor parallelism)."""
    return MLP(weights, weights.read(shard.gate), weights.read(shard.up), weights.read(shard.down), in_scale)


class SparseMoE(nn.Cell):
    """Softmax top-k router over experts plus a sigmoid-gated shared expert (HF semantics).

    Routing reads the chosen expert ids on the host once per layer and runs each hit expert on
    its tokens only; experts are separate parameters (no weight copies per step), laid out so
    expert or tensor parallelism can take a subset / slice. Under tensor parallelism every
    expert and the shared expert hold this rank's block of their intermediate dims and the
    router is replicated, so every rank routes identically and returns a partial sum."""

    def __init__(self, weights: _Weights, shard: MoEShard, in_scale: np.ndarray):
        super().__init__()
        self.num_experts = shard.num_experts
        self.top_k = shard.top_k
        # router logits | shared expert gate logit, one matmul
        self.route_t = weights.linear_t([shard.router, shard.shared_expert_gate], in_scale)
        self.shared_expert = _dense_mlp(weights, shard.shared_expert, in_scale)
        self.acc = weights.acc
        if isinstance(shard.experts, FusedExperts):  # this rank's rows of every expert at once
            gates, ups, downs = (weights.read(p) for p in (shard.experts.gate, shard.experts.up, shard.experts.down))
            experts = [MLP(weights, gates[e], ups[e], downs[e], in_scale) for e in range(self.num_experts)]
        else:  # per-expert layout (what transformers 5.23 save_pretrained writes)
            experts = [_dense_mlp(weights, expert, in_scale) for expert in shard.experts]
        self.experts = nn.CellList(experts)

    def construct(self, x):
        route = _matmul(x, self.route_t)
        probs = ops.softmax(_cast(route[:, : self.num_experts], self.acc), -1)
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
            outputs.append(self.experts[int(e)].construct(tokens[start:end]))
            start = end
        routed = outputs[0] if len(outputs) == 1 else ops.concat(outputs, 0)
        routed = ops.gather(routed, Tensor(np.argsort(order).astype(np.int32)), 0).reshape(-1, self.top_k, x.shape[1])
        routed = (routed * _cast(weights, x.dtype)[..., None]).sum(1)
        shared = _mul(self.shared_expert.construct(x), _sigmoid(route[:, self.num_experts :]))
        return _add(routed, shared)


# ----------------------------------------------------------------------------------------------
# compiled decode blocks (mindspore.jit)
#
# A one-token step runs hundreds of small kernels; launched one by one from Python (PyNative)
# each pays the dispatch cost again. The fixed-shape parts of a decode step are therefore
# compiled once (``mindspore.jit``, graph mode, the same kernels, bitwise the same results):
# a whole Gated DeltaNet layer (norm, projections, conv, delta rule, gated norm, MLP), an attention
# layer's part before the cache (norm, q|k|v|gate, q/k norms, rotary) and after it (gate, o_proj,
# MLP), and the final norm with the LM head. Weights are arguments, not constants, so every layer
# of a kind shares one compiled graph per (shape, dtype); the sizes are closed over. A dense
# model at tp 1 runs these blocks as one graph (``_segment_kernel``): the whole step with a
# static cache, whose buffers have a fixed length; with a dynamic cache one graph per stretch
# between attention cores (3 a step on the mid shape, 7 on 0.8B), the cache writes and the
# attention over the cached keys (their length grows every step) in PyNative between them. MoE
# and tensor-parallel models launch the blocks one by one. Always PyNative: MoE routing (host),
# the tensor-parallel sums (collectives) and every prefill; and a dynamic cache's steps until
# their batch size has been decoded DYNAMIC_COMPILE_AFTER times (_CompileGate).

# True (default): one-token forwards run the compiled blocks; False ($HYPER_GEN_MINDSPORE_JIT=0): all
# PyNative. A new batch size compiles once (~1-3 s on CPU) before its first step. (Read at import;
# a value other than 0 / 1 is load()'s ValueError, _check_switches.)
COMPILED_DECODE = os.environ.get("HYPER_GEN_MINDSPORE_JIT", "1") != "0"
# A dynamic cache's one-token steps (the in-flight engine's, whose batch changes size as requests
# join and leave) run the compiled blocks only from the step at which their batch size has been
# decoded this many times: rent until the rent paid would have bought the compile. Compiling a
# batch size's graphs costs ~2.3 s on the mid shape, where a compiled dynamic-cache step saves
# ~10 ms over PyNative (whose attention cores run PyNative between the graphs anyway): ~230
# steps. Counted over the model's life, so the PyNative steps are bounded (sizes x this) and every
# size in steady use ends up compiled. A static cache's steps (generate's default: one batch size
# a call) compile at once. Per model: ``decode_compile_after``.
DYNAMIC_COMPILE_AFTER = 256


class _CompileGate:
    """Which one-token steps run compiled (``DYNAMIC_COMPILE_AFTER``): every static-cache step;
    a dynamic-cache step once its batch size has been decoded ``after`` times. Every rank of a
    model sees the same sizes, so every rank decides the same."""

    def __init__(self):
        self.seen: Dict[int, int] = {}

    def allows(self, batch: int, static: bool, after: int) -> bool:
        if static:
            return True
        self.seen[batch] = self.seen.get(batch, 0) + 1
        return self.seen[batch] >= after


# Positions a static cache's length is rounded up to when the decode step is one graph (compiled
# for the buffers' shape): every prompt + max_new_tokens in a bucket shares the graph; the extra
# positions cost a few masked attention columns a step
STATIC_CACHE_MULTIPLE = 256


def _check_switches() -> None:
    """This port's environment switches read once, at load: a bad value is a ValueError naming
    it before any work (``hyper_gen.switches``)."""
    switches.flag("HYPER_GEN_MINDSPORE_JIT")


_COMPILED: Dict[tuple, object] = {}


def _compiled(key: tuple, make):
    """The jitted function ``make()`` builds, once per ``key`` (sizes and dtypes), called with
    contiguous tensors only. MindSpore 2.10 reuses a graph for an input of the same shape whatever
    its strides, and a view op inside it (``mint.transpose`` of the conv state) reads an input with
    the strides of an earlier call's: a contiguous tensor after a transposed view of the same shape
    is read transposed (wrong values, not rounding). The in-flight engine's join / drop hand the
    graphs contiguous caches between steps whose inputs were the graphs' own (view) outputs."""
    graph = _COMPILED.get(key)
    if graph is None:
        jitted = ms.jit(make())

        def graph(*args):
            args = [a.contiguous() if isinstance(a, Tensor) and not a.is_contiguous() else a for a in args]
            if threading.current_thread() is not threading.main_thread():
                return jitted(*args)
            return _keeping_ctrl_c(jitted, args)

        _COMPILED[key] = graph
    return graph


def _keeping_ctrl_c(jitted, args):
    """Run a graph so that Ctrl-C stays a KeyboardInterrupt. Each run of a MindSpore 2.10 graph
    installs MindSpore's own SIGINT handler, which answers Ctrl-C by sending the process SIGTERM: a
    JSONL job would die (exit -15) instead of stopping cleanly (exit 130, every finished row kept).
    During the run a default SIGTERM becomes a KeyboardInterrupt; afterwards Python's SIGINT
    handler is put back and SIGTERM's default restored (a few us a call)."""
    interrupt, terminate = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    converting = terminate is signal.SIG_DFL
    if converting:
        signal.signal(signal.SIGTERM, _sigterm_as_keyboard_interrupt)
    try:
        out = jitted(*args)
        _handle_pending_signals()  # a SIGTERM sent during the run raises here, before the restore
        return out
    finally:
        if interrupt is not None:
            signal.signal(signal.SIGINT, interrupt)
        if converting:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _sigterm_as_keyboard_interrupt(signum, frame):
    raise KeyboardInterrupt


def _handle_pending_signals():
    """Nothing: calling a Python function lets the interpreter run pending signal handlers."""


# In a graph ops.Transpose writes a contiguous copy, mint.transpose returns a view (a view output
# would be copied by _compiled at the next call). (Concatenating conv_state[:, :, 1:] with the new
# column instead rounds float64 to float32 precision in a graph, ~1e-7, when the split-off row also
# feeds the window's concat.)
_transpose_copy = ops.Transpose()


def _mlp_rows(x, eps, up_gate_t, down_t, inter):
    """The dense MLP residual branch of (N, hidden) rows: its post-attention RMSNorm included."""
    up_gate = _matmul(_rms_norm(x, eps), up_gate_t)
    return _matmul(_product(_glu(up_gate, -1), up_gate[:, inter:]), down_t)  # (no float64 NarrowView in graphs)


def _whole(sizes: tuple, width: int) -> tuple:
    """``sizes`` and, if they fall short of ``width``, the rest: the split of a padded projection."""
    rest = width - sum(sizes)
    return sizes + (rest,) if rest else sizes


def _delta_step_rows(x, conv_state, state, eps, in_proj_t, conv_t, ones, a, dt_bias, out_t, l2_eps, gated_eps, sizes):
    """One decode token of a Gated DeltaNet mixer on (B, hidden) rows, its input RMSNorm included:
    (partial output, new conv state, new recurrent state); ``GatedDeltaNet.construct`` op for op."""
    conv_dim, value_dim, nk, nv, dk, dv, acc = sizes
    b = x.shape[0]
    projected = _matmul(_rms_norm(x, eps), in_proj_t)
    mixed, z, beta, a_in = mint.split(projected, _whole((conv_dim, value_dim, nv, nv), projected.shape[-1]), -1)[:4]
    window = ops.concat([mint.transpose(conv_state, 1, 2), mixed.reshape(b, 1, conv_dim)], 1)  # (B, kernel, C)
    new_conv = _transpose_copy(window[:, 1:], (0, 2, 1))  # contiguous: the next step's input (_compiled)
    taps = _product(_cast(window, conv_t.dtype), conv_t)
    mixed = _silu(_cast(_bmm(ones, taps).reshape(b, conv_dim), mixed.dtype))
    qk, v = mint.split(_cast(mixed, acc), (2 * nk * dk, value_dim), -1)
    qk = qk.reshape(b, 2 * nk, dk)
    qk = _div(qk, _sqrt(_add(_sum_last(_square(qk), -1), l2_eps)))  # l2 norm
    q, k = mint.split(qk, (nk, nk), 1)
    if nk != nv:  # value head j reads key head j // (nv / nk)
        q = ops.broadcast_to(q.reshape(b, nk, 1, dk), (b, nk, nv // nk, dk))
        k = ops.broadcast_to(k.reshape(b, nk, 1, dk), (b, nk, nv // nk, dk))
    beta = _sigmoid(_cast(beta, acc))
    g = _mul(_softplus(_add(_cast(a_in, acc), dt_bias)), a)
    out, state = _recurrent_step(
        q.reshape(b, nv, 1, dk),
        k.reshape(b, nv, 1, dk),
        v.reshape(b, nv, 1, dv),
        g.reshape(b, nv, 1, 1),
        beta.reshape(b, nv, 1, 1),
        state,
    )
    out = _cast(_cast(out, x.dtype), acc).reshape(b, nv, dv)
    out = _cast(_cast(_normalize(out, gated_eps), x.dtype), acc)
    out = _product(out.reshape(b, value_dim), _silu(_cast(z, acc)))
    return _matmul(_cast(out, x.dtype), out_t), new_conv, state


def _attention_pre_rows(x, eps, qkv_t, norm_eps, qk_norm, rotate, cos, sin, sizes):
    """One decode token of gated attention up to the cache, its input RMSNorm included:
    q (B, nkv, group, D), k, v (B, nkv, 1, D) and the output gate, sigmoid(gate logits) (B, nh * D):
    a new tensor, not a view of the projection (the next graph's input: _compiled)."""
    nh, nkv, d, acc = sizes
    b, heads = x.shape[0], nh + nkv
    split = ((nh + nkv) * d, nkv * d, nh * d)
    projected = _matmul(_rms_norm(x, eps), qkv_t)
    qk, v, gate = mint.split(projected, _whole(split, projected.shape[-1]), -1)[:3]
    qk = _cast(_product(_normalize(_cast(qk.reshape(b, heads, d), acc), norm_eps), qk_norm), x.dtype)
    rotated = _matmul(qk.reshape(b * heads, d), rotate).reshape(b, heads, d)
    q, k = mint.split(_add(_product(qk, cos), _product(rotated, sin)), (nh, nkv), 1)
    return q.reshape(b, nkv, nh // nkv, d), k.reshape(b, nkv, 1, d), v.reshape(b, nkv, 1, d), _sigmoid(gate)


def _attention_out_rows(out, gate, o_t):
    """The gated attention output projection of (B, nh * D) rows (a partial sum under TP); ``gate``
    is ``_attention_pre_rows``' sigmoid(gate logits)."""
    return _matmul(_product(out, gate), o_t)


def _delta_layer_rows(x, conv_state, state, eps, *weights, sizes, inter):
    """A whole Gated DeltaNet decoder layer with a dense MLP (tp 1) on (B, hidden) rows: (x, conv
    state, state). ``weights``: ``_delta_step_rows``' in_proj_t ... gated_eps, then up, down."""
    o, conv_state, state = _delta_step_rows(x, conv_state, state, eps, *weights[:8], sizes)
    x = _add(x, o)
    return _add(x, _mlp_rows(x, eps, weights[8], weights[9], inter)), conv_state, state


def _delta_layer_kernel(sizes, inter):
    def layer(x, conv_state, state, eps, in_proj_t, conv_t, ones, a, dt_bias, out_t, l2_eps, gated_eps, up, down):
        weights = (in_proj_t, conv_t, ones, a, dt_bias, out_t, l2_eps, gated_eps, up, down)
        return _delta_layer_rows(x, conv_state, state, eps, *weights, sizes=sizes, inter=inter)

    return layer


def _delta_mixer_kernel(sizes):
    def mixer(x, conv_state, state, eps, in_proj_t, conv_t, ones, a, dt_bias, out_t, l2_eps, gated_eps):
        return _delta_step_rows(
            x, conv_state, state, eps, in_proj_t, conv_t, ones, a, dt_bias, out_t, l2_eps, gated_eps, sizes
        )

    return mixer


def _attention_pre_kernel(sizes):
    def pre(x, eps, qkv_t, norm_eps, qk_norm, rotate, cos, sin):
        return _attention_pre_rows(x, eps, qkv_t, norm_eps, qk_norm, rotate, cos, sin, sizes)

    return pre


def _attention_post_rows(x, out, gate, o_t, eps, up, down, inter):
    """After the attention core (tp 1, dense MLP): both residual branches of the layer."""
    x = _add(x, _attention_out_rows(out, gate, o_t))
    return _add(x, _mlp_rows(x, eps, up, down, inter))


def _attention_post_kernel(inter):
    def post(x, out, gate, o_t, eps, up, down):
        return _attention_post_rows(x, out, gate, o_t, eps, up, down, inter)

    return post


def _attention_out_kernel():
    return _attention_out_rows


def _segment_kernel(steps: tuple):
    """Consecutive compiled blocks of a decode step as one graph: a graph launch from Python costs
    far more than the kernels of a small block (docs/performance.md), so a step is one graph from
    each attention core to the next. ``steps`` (constant, unrolled at compile time) is a tuple of
    ``(kind, first argument, sizes, intermediate size)``; kinds, in the order they run:
    ``rope`` / ``rotary`` (the rotary tables the ``pre`` steps use: given, or computed from the
    position ids and inv_freq), ``post`` (an attention layer after its core: o_proj and MLP
    residuals; ``out``, ``gate`` are
    that core's output and ``_attention_pre_rows``' gate), ``delta`` (a whole Gated DeltaNet layer;
    its new conv and recurrent states are returned), ``pre`` (an attention layer up to its core:
    q, k, v, gate are returned), ``attend`` (the core over a static cache's whole buffers, this
    token's keys and values written at the position the (B * kv heads, 2) index ``write`` names; the new
    buffers are returned) and ``head`` (final norm and LM head: the logits are returned).
    Returns (x or logits, q, k, v, gate or None, the new states and buffers in layer order)."""

    def segment(x, out, gate, *args):
        states = ()
        q = k = v = cos = sin = None
        for kind, at, sizes, inter in steps:
            if kind == "rope":  # the rotary tables, given
                cos, sin = args[at], args[at + 1]
            elif kind == "rotary":  # the rotary tables from the position ids and inv_freq
                cos, sin = _rotary_tables(args[at], args[at + 1], x.dtype)
            elif kind == "post":
                x = _attention_post_rows(x, out, gate, *args[at : at + 4], inter)
            elif kind == "delta":
                x, conv_state, state = _delta_layer_rows(x, *args[at : at + 13], sizes=sizes, inter=inter)
                states = states + (conv_state, state)
            elif kind == "pre":
                q, k, v, gate = _attention_pre_rows(x, *args[at : at + 5], cos, sin, sizes)
            elif kind == "attend":  # a static cache: this token written at `write`, then attend_one's ops
                keys = _write_position(args[at], k, args[at + 2])
                values = _write_position(args[at + 1], v, args[at + 2])
                out = _attend_rows(q, keys, values, args[at + 3], sizes[0], x.dtype)
                states = states + (keys, values)
            else:
                x = _head_rows(x, args[at], args[at + 1], args[at + 2 : at + sizes])
        return x, q, k, v, gate, states

    return segment


def _mlp_kernel(inter):
    def mlp(x, eps, up, down):
        return _mlp_rows(x, eps, up, down, inter)

    return mlp


def _head_rows(x, eps, norm, blocks):
    """Final RMSNorm and the LM head blocks (concatenated) of (N, hidden) rows."""
    h = _cast(_product(_normalize(_cast(x, eps.dtype), eps), norm), x.dtype)
    logits = [_matmul(h, block) for block in blocks]
    return logits[0] if len(logits) == 1 else ops.concat(logits, -1)


def _head_kernel():
    def head(x, eps, norm, *blocks):
        return _head_rows(x, eps, norm, blocks)

    return head


def _attend_rows(q, keys, values, mask, acc, dtype):
    """One decode token's attention: q (B, nkv, group, D) over keys / values (B, nkv, T, D) with
    the (B, 1, 1, T) additive mask, softmax in ``acc`` -> (B, nh * D) in ``dtype``."""
    scores = _add(_bmm_tb(q, keys), mask)  # (B, 1, 1, T) over (B, nkv, group, T)
    out = _cast(_bmm(_cast(_softmax(_cast(scores, acc), -1), dtype), values), dtype)
    return out.reshape(out.shape[0], -1)


def _rotary_tables(position_ids, inv_freq, dtype):
    """cos, sin (B * S, 1, head_dim) in ``dtype``, computed in inv_freq's (compute) dtype; 1 and 0
    on the dims past rotary_dim (inv_freq 0 there)."""
    freqs = _mul(_cast(position_ids, inv_freq.dtype).reshape(-1, 1), inv_freq)
    freqs = freqs.reshape(freqs.shape[0], 1, freqs.shape[1])
    return _cast(ops.cos(freqs), dtype), _cast(ops.sin(freqs), dtype)


def _run_segment(steps: list, x, out, gate, args: list, written: list, cache):
    """Run one ``_segment_kernel`` graph and store what it wrote in the cache: ``written`` lists
    its layers in order, ("delta", layer index) (conv and recurrent state) or ("attention", layer
    index) (a static cache's key and value buffers). Returns (x or logits, q, k, v, gate)."""
    steps = tuple(steps)
    x, q, k, v, gate, states = _compiled(("segment", steps), lambda: _segment_kernel(steps))(x, out, gate, *args)
    for i, (kind, idx) in enumerate(written):
        if kind == "delta":
            cache.conv_states[idx], cache.recurrent_states[idx] = states[2 * i], states[2 * i + 1]
        else:
            cache.keys[idx], cache.values[idx] = states[2 * i], states[2 * i + 1]
    return x, q, k, v, gate


def _on_cpu() -> bool:
    """Whether MindSpore runs on the host's CPU (no Ascend / GPU device)."""
    return ms.get_context("device_target") == "CPU"


def _write_index(rows: int, position: int) -> Tensor:
    """(rows, 2) int32 pairs (row, ``position``): where a static cache's (B * kv heads, length, D)
    buffers take the token (``_write_position``)."""
    return Tensor(np.stack([np.arange(rows), np.full(rows, position)], 1).astype(np.int32))


_scatter_update = ops.TensorScatterUpdate()


def _write_position(buffer, row, index):
    """``buffer`` (B, H, T, D) with ``row`` (B, H, 1, D) written at the position ``index``
    (``_write_index``) names: one TensorScatterUpdate, which copies the buffer once. (A ``where``
    over a one-position mask reads the buffer, the row and the mask for every position: twice
    the time, ~4 ms a layer for a batch of 16 at 2048 positions; docs/performance.md.)"""
    b, h, t, d = buffer.shape
    return _scatter_update(buffer.reshape(b * h, t, d), index, row.reshape(b * h, d)).reshape(b, h, t, d)


class DecoderLayer(nn.Cell):
    """Mixer and MLP residual blocks; ``partial_sum`` adds up their row-parallel outputs. The two
    norms' ``1 + w`` live in the mixer's and the MLP's input projections."""

    def __init__(
        self, cfg: Qwen3_5Config, weights: _Weights, shard: LayerShard, layer_idx: int, partial_sum: _PartialSum
    ):
        super().__init__()
        input_scale = weights.norm_scale(shard.input_norm)
        post_attention_scale = weights.norm_scale(shard.post_attention_norm)
        self.is_attention = not shard.is_linear
        if self.is_attention:
            self.mixer = GatedAttention(cfg, weights, shard.mixer, layer_idx, input_scale)
        else:
            self.mixer = GatedDeltaNet(cfg, weights, shard.mixer, layer_idx, input_scale)
        if isinstance(shard.mlp, MoEShard):
            self.mlp = SparseMoE(weights, shard.mlp, post_attention_scale)
        else:
            self.mlp = _dense_mlp(weights, shard.mlp, post_attention_scale)
        self.eps = _scalar(cfg.rms_norm_eps, weights.acc)
        self.partial_sum = partial_sum

    def construct(self, x, b, s, cos, sin, attention_mask, cache, cp_step=None, packing=None, compiled=False):
        """``compiled``: a one-token step may run the compiled blocks (the model's ``_CompileGate``)."""
        if s == 1 and compiled and (cp_step is None or cp_step.decode):  # not a one-token CP prefill
            out = self._decode(x, b, cos, sin, attention_mask, cache, cp_step)
            if out is not None:
                return out
        h = _rms_norm(x, self.eps)
        if self.is_attention:
            x = _add(
                x, self.partial_sum(self.mixer.construct(h, b, s, cos, sin, attention_mask, cache, cp_step, packing))
            )
        else:
            x = _add(x, self.partial_sum(self.mixer.construct(h, b, s, cache, cp_step, packing)))
        return _add(x, self.partial_sum(self.mlp.construct(_rms_norm(x, self.eps))))

    def _decode(self, x, b, cos, sin, attention_mask, cache, cp_step):
        """One token per row through the compiled blocks (None: a step they do not cover, a
        Gated DeltaNet layer without a state yet)."""
        whole = self.partial_sum.tp == 1 and isinstance(self.mlp, MLP)  # one compiled call for the layer
        mlp = self.mlp
        if self.is_attention:
            att = self.mixer
            sizes = (att.num_heads, att.num_kv_heads, att.head_dim, att.acc)
            pre = _compiled(("attention_pre", sizes), lambda: _attention_pre_kernel(sizes))
            q, k, v, gate = pre(x, self.eps, att.qkv_t, att.eps, att.qk_norm, att.rotate, cos, sin)
            out = att.attend_one(q, k, v, attention_mask, cache, cp_step, x.dtype)
            if whole:
                post = _compiled(("attention_post", mlp.inter), lambda: _attention_post_kernel(mlp.inter))
                return post(x, out, gate, att.o_t, self.eps, mlp.up_gate_t, mlp.down_t)
            partial = _compiled(("attention_out",), _attention_out_kernel)(out, gate, att.o_t)
        else:
            mix, idx = self.mixer, self.mixer.layer_idx
            conv_state, state = cache.conv_states.get(idx), cache.recurrent_states.get(idx)
            if conv_state is None or state is None:
                return None
            sizes = (mix.conv_dim, mix.value_dim, mix.num_k_heads, mix.num_v_heads, mix.head_k_dim, mix.head_v_dim)
            sizes += (mix.acc,)
            args = (
                x,
                conv_state,
                state,
                self.eps,
                mix.in_proj_t,
                mix.conv_t,
                _ones((b, 1, mix.kernel), mix.conv_t.dtype),
            )
            args += (mix.a, mix.dt_bias, mix.out_t, mix.l2_eps, mix.gated_norm_eps)
            if whole:
                layer = _compiled(("delta_layer", sizes, mlp.inter), lambda: _delta_layer_kernel(sizes, mlp.inter))
                x, cache.conv_states[idx], cache.recurrent_states[idx] = layer(*args, mlp.up_gate_t, mlp.down_t)
                return x
            mixer = _compiled(("delta_mixer", sizes), lambda: _delta_mixer_kernel(sizes))
            partial, cache.conv_states[idx], cache.recurrent_states[idx] = mixer(*args)
        x = _add(x, self.partial_sum(partial))
        if isinstance(mlp, MLP):
            out = _compiled(("mlp", mlp.inter), lambda: _mlp_kernel(mlp.inter))(x, self.eps, mlp.up_gate_t, mlp.down_t)
        else:
            out = mlp.construct(_rms_norm(x, self.eps))
        return _add(x, self.partial_sum(out))


# ----------------------------------------------------------------------------------------------
# the model


class Qwen3_5ForCausalLM(nn.Cell):
    """Qwen3.5 / Qwen3.5-MoE language model implementing docs/model_contract.md (cache objects).

    Built from this rank's ``ModelShard`` (``hyper_gen.models.qwen3_5.describe``). ``config`` is
    the parsed ``hyper_gen.models.qwen3_5.Qwen3_5Config``; ``vocab_size`` the true vocabulary
    size; ``dtype`` the model dtype (every Parameter is in it; compute-dtype constants are Tensors);
    ``tp_plan`` the ``TPPlan`` it was loaded with. With ``tp_plan.tp > 1`` it also has
    ``parallel_group`` (None: the world group) and ``vocab_parallel = True``: its logits are this
    rank's block of ``plan.padded_vocab(vocab_size) // tp`` columns (generate() gathers them).
    Under context parallelism (``cp_plan.cp > 1``) ``parallel_group`` is None (the whole job,
    tp x cp ranks) and ``vocab_parallel`` False: a tp x cp model gathers its vocabulary blocks over
    its tp group ``tp_group`` itself.
    """

    supports_cache_object = True

    def __init__(self, shard: ModelShard, weights: _Weights, group=None, cp_plan: CPPlan = None, cp_group=None):
        super().__init__()
        cfg, plan = shard.config, shard.plan
        self.config = cfg
        self.vocab_size = cfg.vocab_size
        self.tp_plan = plan
        self.tp_group = group
        self.cp_plan = CPPlan.resolve(cp_plan)
        self.context_parallel = ContextParallel(self.cp_plan, cp_group) if self.cp_plan.cp > 1 else None
        self.vocab_start, self.vocab_stop = shard.vocab_start, min(shard.vocab_stop, cfg.vocab_size)  # real ids here
        # (hidden, vocab) for the fast `x @ W`, in blocks of at most head_columns columns; a tied model
        # embeds by gathering their columns
        head_t = weights.vocab_rows(shard, shard.lm_head or EMBED_TOKENS).T
        most = weights.head_columns(head_t)
        self.head_columns = width = _block_width(head_t.shape[1], most)
        self.lm_head = ParameterTuple(
            [weights.param(head_t[:, i : i + width], f"lm_head.{i // width}") for i in range(0, head_t.shape[1], width)]
        )
        del head_t
        self.embed_tokens = None if shard.lm_head is None else weights.param(weights.vocab_rows(shard, EMBED_TOKENS))
        self.partial_sum = _PartialSum(plan.tp, group)
        if self.cp_plan.cp > 1:
            # generate() checks inputs and agrees on tokens over every rank of the job (the tp x cp
            # mesh); the logits are whole on every rank (vocab blocks gathered over the tp group here)
            self.parallel_group = None
            self.vocab_parallel = False
        elif plan.tp > 1:
            self.parallel_group = group
            self.vocab_parallel = True
        self.layers = nn.CellList(
            [DecoderLayer(cfg, weights, layer, i, self.partial_sum) for i, layer in enumerate(shard.layers)]
        )
        # a dense tp-1 model's decode steps run as _segment_kernel graphs (_segmented_decode)
        self.segments_decode = plan.tp == 1 and all(isinstance(layer.mlp, MLP) for layer in self.layers)
        # its one-graph decode step is compiled for the static cache's buffer length: generate()
        # rounds that length up to a multiple of this (hyper_gen.cache.static_length), so batches
        # of other prompt lengths reuse the graph instead of compiling their own (~1-3 s each)
        whole_step = self.segments_decode and self.cp_plan.cp == 1 and COMPILED_DECODE
        self.static_cache_multiple = STATIC_CACHE_MULTIPLE if whole_step else 1
        # decode steps of a batch size with a dynamic cache before they run compiled (_CompileGate)
        self.decode_compile_after = DYNAMIC_COMPILE_AFTER
        self._compile_gate = _CompileGate()
        self.kv_heads = {layer.mixer.num_kv_heads for layer in self.layers if layer.is_attention}
        self.norm = Tensor(weights.norm_scale(shard.final_norm)[None])
        self.eps = _scalar(cfg.rms_norm_eps, weights.acc)
        # rotary frequencies over the whole head: [f, f] on the rotary dims, 0 (cos 1, sin 0) after
        rot, d = cfg.rotary_dim, cfg.head_dim
        inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, rot, 2, dtype=np.float64) / rot))
        inv_freq = np.concatenate([inv_freq, inv_freq, np.zeros(d - rot)])
        self.inv_freq = Tensor(inv_freq[None].astype(_numpy_dtype(weights.acc)))
        self.generation_defaults: dict = {}

    @property
    def dtype(self):
        return self.lm_head[0].dtype

    def _embed(self, input_ids):
        """(B * S, hidden) rows of the input ids."""
        ids = input_ids.reshape(-1)
        vocab_parallel = self.tp_plan.tp > 1
        if vocab_parallel:  # each id's row is on one rank; the others contribute zeros to the sum
            held = (ids >= self.vocab_start) & (ids < self.vocab_stop)
            ids = ops.where(held, ids - self.vocab_start, ops.zeros_like(ids))
        if self.embed_tokens is not None:
            rows = ops.gather(self.embed_tokens, ids, 0)
        else:
            rows = self._head_columns(ids).transpose(1, 0)
        if not vocab_parallel:
            return rows
        return self.partial_sum(ops.where(held[:, None], rows, ops.zeros_like(rows)))

    def _head_columns(self, ids):
        """(hidden, N): the LM head's columns ``ids`` (local ids), gathered from the blocks that
        hold them (found on the host), in the order of ``ids``."""
        host = ids.asnumpy()
        blocks = host // self.head_columns
        order = np.argsort(blocks, kind="stable")
        local = host[order] - blocks[order] * self.head_columns
        parts = [
            ops.gather(self.lm_head[int(block)], Tensor(local[blocks[order] == block]), 1)
            for block in np.unique(blocks)
        ]
        if len(parts) == 1:  # one block: the ids are in their own order (every batch-1 decode step)
            return parts[0]
        return ops.gather(ops.concat(parts, 1), Tensor(np.argsort(order)), 1)

    def _rotary(self, position_ids, dtype):
        return _rotary_tables(position_ids, self.inv_freq, dtype)

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
        cp_step = None
        if self.context_parallel is not None:
            cp_step = self._cp_step(cache, s)
            if cp_step.sharded:  # this rank's slice of the positions; the mask keeps its global columns
                input_ids = input_ids[:, cp_step.start : cp_step.stop]
                position_ids = position_ids[:, cp_step.start : cp_step.stop]
                s = cp_step.stop - cp_step.start
        packing = TokenPacking.of(cache, s) if cp_step is None else None
        compiled = s == 1 and COMPILED_DECODE
        compiled = compiled and self._compile_gate.allows(b, cache.is_static, self.decode_compile_after)
        if compiled and cp_step is None and packing is None:
            logits = self._segmented_decode(input_ids, position_ids, attention_mask, cache)
            if logits is not None:
                return {"logits": logits.reshape(b, 1, -1)}
        x = self._embed(input_ids if packing is None else packing.pack(input_ids.reshape(-1, 1)))
        cos, sin = self._rotary(position_ids, x.dtype)
        for layer in self.layers:
            x = layer.construct(x, b, s, cos, sin, attention_mask, cache, cp_step, packing, compiled)
        if packing is not None:
            x = packing.unpack(x)
        kept = s
        if cp_step is not None and cp_step.sharded:
            x, kept = cp_step.gather_rows(x, b, logits_to_keep)
        elif logits_to_keep and logits_to_keep < s:
            kept = logits_to_keep
            x = x.reshape(b, s, -1)[:, -kept:].reshape(b * kept, -1)
        if kept == 1 and compiled:  # (a prefill's last row is a view: a new graph key)
            logits = _compiled(("head",), _head_kernel)(x, self.eps, self.norm, *self.lm_head)
        else:
            logits = _head_rows(x, self.eps, self.norm, self.lm_head)
        if self.context_parallel is not None and self.tp_plan.tp > 1:  # whole vocabulary on every rank
            logits = MindSporeOps().all_gather(logits, axis=-1, group=self.tp_group)[..., : self.vocab_size]
        return {"logits": logits.reshape(b, kept, -1)}

    def _segmented_decode(self, input_ids, position_ids, attention_mask, cache):
        """One token per row through ``_segment_kernel`` graphs: with a static cache one graph for
        the whole step after the embedding (rotary tables included), else one from
        each attention core to the next with the cores' PyNative attention between them; None
        where the per-layer path runs instead (tensor parallelism, MoE, a Gated DeltaNet layer
        without a state yet)."""
        if not self.segments_decode:
            return None
        for layer in self.layers:
            if not layer.is_attention and (
                cache.conv_states.get(layer.mixer.layer_idx) is None
                or cache.recurrent_states.get(layer.mixer.layer_idx) is None
            ):
                return None
        b, dtype = input_ids.shape[0], self.dtype  # (a pending tensor's .dtype waits for MindSpore's op queue)
        # a static cache that has room for the token: its writes and attention join the graph,
        # and the whole step is one graph
        whole = cache.is_static and cache.seq_length < cache.max_length
        whole = whole and all(layer.mixer.layer_idx in cache.keys for layer in self.layers if layer.is_attention)
        write = {n: _write_index(b * n, cache.seq_length) for n in self.kv_heads} if whole else None
        # (the embedding stays PyNative: gathered in the graph, the step was ~10 ms slower)
        x, steps, args = self._embed(input_ids), [], []
        if whole:  # the rotary tables in the graph too
            steps.append(("rotary", len(args), (), 0))
            args += [position_ids, self.inv_freq]
        else:  # each segment graph is given them
            tables = self._rotary(position_ids, dtype)
            steps.append(("rope", len(args), (), 0))
            args += list(tables)
        written, out, gate = [], None, None
        for layer in self.layers:
            mlp, mix = layer.mlp, layer.mixer
            if layer.is_attention:
                idx = mix.layer_idx
                steps.append(("pre", len(args), (mix.num_heads, mix.num_kv_heads, mix.head_dim, mix.acc), 0))
                args += [layer.eps, mix.qkv_t, mix.eps, mix.qk_norm, mix.rotate]
                if whole:
                    steps.append(("attend", len(args), (mix.acc,), 0))
                    args += [cache.keys[idx], cache.values[idx], write[mix.num_kv_heads], attention_mask]
                    written.append(("attention", idx))
                else:
                    x, q, k, v, gate = _run_segment(steps, x, out, gate, args, written, cache)
                    out = mix.attend_one(q, k, v, attention_mask, cache, None, dtype)
                    steps, args, written = [("rope", 0, (), 0)], list(tables), []
                steps.append(("post", len(args), (), mlp.inter))
                args += [mix.o_t, layer.eps, mlp.up_gate_t, mlp.down_t]
            else:
                idx = mix.layer_idx
                sizes = (mix.conv_dim, mix.value_dim, mix.num_k_heads, mix.num_v_heads, mix.head_k_dim, mix.head_v_dim)
                steps.append(("delta", len(args), sizes + (mix.acc,), mlp.inter))
                args += [cache.conv_states[idx], cache.recurrent_states[idx], layer.eps, mix.in_proj_t, mix.conv_t]
                args += [_ones((b, 1, mix.kernel), mix.conv_t.dtype), mix.a, mix.dt_bias, mix.out_t, mix.l2_eps]
                args += [mix.gated_norm_eps, mlp.up_gate_t, mlp.down_t]
                written.append(("delta", idx))
        steps.append(("head", len(args), 2 + len(self.lm_head), 0))
        args += [self.eps, self.norm, *self.lm_head]
        logits = _run_segment(steps, x, out, gate, args, written, cache)[0]
        if whole and _on_cpu():
            # wait here, on the host: an op queued behind a running graph competes with its kernels
            # for the CPU cores while it waits (docs/performance.md); a device's kernels do not
            # share the host's cores, and there this would copy the logits off the device each step
            logits.asnumpy()
        return logits

    def _cp_step(self, cache, seq: int) -> CPStep:
        """The layout of this forward: a new one at the prefill (kept on the cache for decode)."""
        if cache.seq_length == 0:
            cache.cp_layout = layout = self.cp_plan.layout(seq)
            return CPStep(self.context_parallel, layout, decode=False)
        layout = getattr(cache, "cp_layout", None)
        if layout is None or seq != 1:
            raise ValueError(
                f"a context-parallel model takes a prefill (an empty cache) or one token per row after it, got "
                f"{seq} tokens after {cache.seq_length} cached positions"
                + ("" if layout is not None else " in a cache it did not prefill")
            )
        return CPStep(self.context_parallel, layout, decode=True)


def _block_width(columns: int, most: int) -> int:
    """Columns per block when ``columns`` are cut into ``ceil(columns / most)`` blocks: their even
    share, rounded up to 64 times an odd number. A row stride of a large power of two bytes cuts
    MindSpore's CPU matrix-vector bandwidth, as rows then collide in the same cache sets."""
    share = -(-columns // -(-columns // most))
    width = -(-share // 64) * 64
    return width + 64 if (width // 64) % 2 == 0 else width


_MASK_MIN = {
    ms.float16: float(np.finfo(np.float16).min),
    ms.float32: float(np.finfo(np.float32).min),
    ms.float64: float(np.finfo(np.float64).min),
    ms.bfloat16: -3.3895313892515355e38,
}


def _causal_mask(seq: int, past: int, total: int, dtype) -> Tensor:
    """(1, 1, seq, total) additive mask: query i (at position past + i) sees columns <= past + i."""
    hidden = np.arange(total)[None, :] > np.arange(past, past + seq)[:, None]
    return Tensor(np.where(hidden, _MASK_MIN[dtype], 0.0)[None, None], dtype)


def load(
    checkpoint,
    dtype: str = "float32",
    device=None,
    plan: TPPlan = None,
    group=None,
    cp_plan: CPPlan = None,
    kernels=None,
) -> Qwen3_5ForCausalLM:
    """A Qwen3.5 model from a ``hyper_gen.models.checkpoint.Checkpoint``, weights in ``dtype``.

    ``plan``: a ``TPPlan(tp, rank)`` to load this rank's tensor-parallel shard (None: the whole
    model); ``group``: the communication group of the ``tp`` ranks (None: the world group, whose
    size and this process's rank must then be ``tp`` and ``plan.rank``). ``device`` is accepted and
    ignored: MindSpore's device target is chosen for the whole process.
    ``cp_plan``: a ``CPPlan(cp, rank)`` for context parallelism. The world is then the
    ``tp x cp`` mesh (``hyper_gen.parallel.cp_plan.Mesh``, tp innermost: exactly ``tp * cp`` ranks,
    this one at ``(plan.rank, cp_plan.rank)``); with tp > 1 every rank must call this, as it makes
    the rank's tp and cp subgroups (module docstring), unless ``group`` (the tp group) is given.
    ``kernels``: the kernel plan's spec (``hyper_gen.kernel_plan``: "auto", "plain" or a plan .json);
    the model's choices are ``model.kernel_plan``."""
    _check_switches()
    plan = TPPlan.resolve(plan)
    cp_plan = CPPlan.resolve(cp_plan)
    if cp_plan.cp > 1:
        _check_mesh(plan, cp_plan)
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {dtype!r}")
    if dtype == "bfloat16" and ms.get_context("device_target") == "CPU":
        raise ValueError(
            "dtype 'bfloat16' is not supported by MindSpore on CPU (storage only); use float32, float16 or float64"
        )
    if checkpoint.architecture not in ARCHITECTURES:
        raise ValueError(
            f"checkpoint {checkpoint.path!r} has architecture {checkpoint.architecture or None!r}; "
            f"supported: {', '.join(ARCHITECTURES)}"
        )
    shard = describe(checkpoint, Qwen3_5Config.from_dict(checkpoint.config), plan)  # splits checked, nothing read
    cp_group = None
    if cp_plan.cp > 1:
        group, cp_group = _mesh_groups(plan, cp_plan, group)
    if plan.tp > 1:
        _check_group(plan, group)
    kernel_plan = KernelPlan.open(kernels, "mindspore", ms.__version__, ms.get_context("runtime_num_threads"))
    kernel_plan.check(matmul_widths.allowed)
    weights = _Weights(checkpoint, dtype, kernel_plan)
    model = Qwen3_5ForCausalLM(shard, weights, group, cp_plan, cp_group)
    model.kernel_plan = kernel_plan.used(weights.kernel_keys)
    model.set_train(False)
    return model


def _check_group(plan: TPPlan, group) -> None:
    """The group the shard will all-reduce over must be the plan's ``tp`` ranks, this one at ``plan.rank``."""
    ops_ = MindSporeOps()
    size, rank = ops_.world_size(group), ops_.rank(group)
    where = "the world group" if group is None else f"group {group!r}"
    if size != plan.tp:
        raise ValueError(
            f"plan tp={plan.tp} but {where} has {size} rank(s): launch {plan.tp} processes "
            "(msrun --worker_num) and initialise communication before loading a tensor-parallel shard"
        )
    if rank != plan.rank:
        raise ValueError(f"plan rank={plan.rank} but this process is rank {rank} of {where}")


def _mesh_groups(plan: TPPlan, cp_plan: CPPlan, group):
    """(tp group, cp group) of this rank in the world's ``tp x cp`` mesh; None is the world group
    (the one axis of a 1-D mesh). The names are the mesh's and the group's index, the same on
    every rank; each rank makes its tp group, then its cp group (MindSpore makes a group on its
    members only)."""
    mesh = _check_mesh(plan, cp_plan)
    if plan.tp == 1:
        return group, None
    rank = MindSporeOps().rank()
    tag = f"hyper_gen_tp{plan.tp}xcp{cp_plan.cp}"
    tp_index, cp_index = rank // plan.tp, rank % plan.tp  # this rank's tp group, cp group
    tp_group = new_group(f"{tag}_tp{tp_index}", mesh.tp_groups()[tp_index])
    cp_group = new_group(f"{tag}_cp{cp_index}", mesh.cp_groups()[cp_index])
    return (group if group is not None else tp_group), cp_group


def _check_mesh(plan: TPPlan, cp_plan: CPPlan) -> Mesh:
    """The world must be the ``tp x cp`` mesh, this process at the plans' coordinates."""
    mesh = Mesh(plan.tp, cp_plan.cp)
    ops_ = MindSporeOps()
    world, rank = ops_.world_size(), ops_.rank()
    launch = f"msrun --worker_num={mesh.size} --local_worker_num={mesh.size} --join=True app.py"
    if world != mesh.size:
        raise ValueError(
            f"tp={plan.tp} x cp={cp_plan.cp} needs {mesh.size} ranks (tp * cp) but this process is rank {rank} of a "
            f"{world}-rank world: launch {mesh.size} processes ({launch}) and load with "
            f"hyper_gen.load_model(..., backend='mindspore', tp={plan.tp}, cp={cp_plan.cp})"
        )
    if mesh.coordinates(rank) != (plan.rank, cp_plan.rank):
        raise ValueError(
            f"plan tp rank {plan.rank}, cp_plan cp rank {cp_plan.rank} but this process is rank {rank}, which the "
            f"mesh (tp innermost) places at tp rank, cp rank {mesh.coordinates(rank)}"
        )
    return mesh
