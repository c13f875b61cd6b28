"""The ops the MindSpore model ports are written in, made once, for the fewest and cheapest CPU
kernels (docs/architecture.md, "MindSpore on CPU"); each choice's reason is at its definition."""

from __future__ import annotations

from collections import OrderedDict

import mindspore as ms
import numpy as np
from mindspore import Tensor, mint, ops


def on_cpu() -> bool:
    """Whether MindSpore runs on the host's CPU (no Ascend / GPU device)."""
    return ms.get_context("device_target") == "CPU"


def numpy_dtype(dtype):
    """numpy dtype of a MindSpore float dtype (``mindspore.dtype_to_nptype`` is deprecated)."""
    return {ms.float16: np.float16, ms.float32: np.float32, ms.float64: np.float64}[dtype]


def scalar(value: float, dtype) -> Tensor:
    """A 0-d tensor constant: scales and epsilons are tensors of the dtype they meet (``x * 8 **
    -0.5`` with a Python float is off at float32 precision in a float64 model)."""
    return Tensor(value, dtype)


def cast(x: Tensor, dtype) -> Tensor:
    return x if x.dtype == dtype else x.astype(dtype)


# MindSpore 2.10's PyNative CPU kernels keep some host memory of most calls with a scalar or tuple
# argument (docs/performance.md, "Issue 27"). mint.bmm takes none but is several times slower for
# a decode step's 2-D products, so projections stay MatMul; batched products, reductions and zeros
# below avoid the leaking forms.
matmul = ops.MatMul()


def bmm(a: Tensor, b: Tensor, ta: bool = False, tb: bool = False) -> Tensor:
    """``a @ b`` (``a^T`` / ``b^T`` with ``ta`` / ``tb``: transposed views) over the last two axes, the
    leading axes equal: mint.bmm, which takes no scalar argument (so leaks nothing; BatchMatMul's
    transpose flags do, for the same bits) and is as fast as BatchMatMul for these batched products."""
    a, b = (mint.transpose(a, -1, -2) if ta else a), (mint.transpose(b, -1, -2) if tb else b)
    out = mint.bmm(a.reshape((-1,) + a.shape[-2:]), b.reshape((-1,) + b.shape[-2:]))
    return out.reshape(a.shape[:-2] + out.shape[-2:])


add = ops.Add()
sub = ops.Sub()
mul = ops.MulNoNan()  # x * y, except that inf/nan * 0 gives 0
div = ops.RealDiv()
square = ops.Square()
sqrt = ops.Sqrt()
sigmoid = ops.Sigmoid()
exp = ops.Exp()
# the reductions' primitives leak one scalar a call where mint.mean / mint.sum leak two or three
mean_last = ops.ReduceMean(keep_dims=True)  # (x, axis): bitwise mint.mean(x, axis, True)
sum_last = ops.ReduceSum(keep_dims=True)
softplus = mint.nn.functional.softplus  # torch's (threshold 20, exact in float64); ops.softplus is less exact
softmax = mint.nn.functional.softmax
glu = mint.nn.functional.glu
# In a graph ops.Transpose writes a contiguous copy, mint.transpose returns a view
transpose_copy = ops.Transpose()

mul_kernel = ops.Mul()
# From here on MulNoNan's CPU kernel is slower than Mul's (4-10x over 100K elements in a graph, a
# batch's recurrent state); below, Mul costs more to launch (docs/performance.md)
LARGE_PRODUCT = 65536


def product(x: Tensor, y: Tensor) -> Tensor:
    """``x * y`` (``y`` broadcast to x's shape) by the faster kernel for x's size: the same
    values (no operand is inf or nan). A large product's factor is broadcast first (a
    broadcasting kernel is slower still)."""
    if x.size < LARGE_PRODUCT:
        return mul(x, y)
    return mul_kernel(x, y if y.shape == x.shape else ops.broadcast_to(y, x.shape))


def mul_tiled(x: Tensor, y: Tensor) -> Tensor:
    """``x * y`` with ``y`` broadcast to x's shape by ``ops.tile`` first: MindSpore CPU's
    broadcasting MulNoNan is 2-3x slower than tiling a per-channel or per-row factor and
    multiplying same-shape tensors (the same products, bitwise). For the large prefill operands.
    (Tile leaks a little, but a ``broadcast_to`` view is 4-12x slower: the product copies it.)"""
    y = y.reshape((1,) * (x.ndim - y.ndim) + tuple(y.shape))
    if tuple(y.shape) != tuple(x.shape):
        y = ops.tile(y, tuple(a // c for a, c in zip(x.shape, y.shape)))
    return product(x, y)


def silu(x: Tensor) -> Tensor:
    return product(x, sigmoid(x))


def normalize(x: Tensor, eps: Tensor) -> Tensor:
    """``x / sqrt(mean(x^2) + eps)`` over the last axis: RMSNorm without its weight."""
    return div(x, sqrt(add(mean_last(square(x), -1), eps)))


def l2_normalize(x: Tensor, eps: Tensor) -> Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last axis."""
    return div(x, sqrt(add(sum_last(square(x), -1), eps)))


def rms_norm(x: Tensor, eps: Tensor) -> Tensor:
    """A zero-centred RMSNorm whose ``1 + w`` was folded into the next projection: normalised in
    the compute dtype of ``eps``, returned in x's dtype."""
    return cast(normalize(cast(x, eps.dtype), eps), x.dtype)


# keys can hold a prompt's length, so a server's would grow without end: the least recent are dropped
MAX_CONSTANTS = 512
_CONSTANTS: "OrderedDict[tuple, object]" = OrderedDict()


def cached(key: tuple, make):
    """``make()``'s constant, once per ``key`` among the ``MAX_CONSTANTS`` most recently used."""
    value = _CONSTANTS.get(key)
    if value is None:
        value = _CONSTANTS[key] = make()
        if len(_CONSTANTS) > MAX_CONSTANTS:
            _CONSTANTS.popitem(last=False)
    else:
        _CONSTANTS.move_to_end(key)
    return value


def ones(shape: tuple, dtype) -> Tensor:
    """A cached all-ones tensor."""
    return cached(("ones", tuple(shape), dtype), lambda: Tensor(np.ones(shape, numpy_dtype(dtype))))


def zeros(shape: tuple, dtype) -> Tensor:
    """A cached all-zeros tensor (never written: every use concatenates it), from numpy (ops.zeros leaks)."""
    floats = (ms.float16, ms.float32, ms.float64)
    make = (lambda: Tensor(np.zeros(shape, numpy_dtype(dtype)))) if dtype in floats else lambda: ops.zeros(shape, dtype)
    return cached(("zeros", tuple(shape), dtype), make)


def pad_axis(x: Tensor, axis: int, pad: int) -> Tensor:
    """``x`` with ``pad`` zeros appended along ``axis``."""
    shape = list(x.shape)
    shape[axis] = pad
    return ops.concat([x, zeros(tuple(shape), x.dtype)], axis)


def gather_rows(rows: Tensor, index: np.ndarray, shape: tuple) -> Tensor:
    """``rows[index]`` as ``shape``: the head-major copy of token-major rows (or back) by one
    Gather. MindSpore CPU copies a transposed view several times slower, and every kernel given
    such a view makes that copy first; a Gather is an exact copy."""
    return ops.gather(rows, Tensor(index.reshape(-1).astype(np.int32)), 0).reshape(shape)


def take(x: Tensor, axis: int, start: int, stop: int = None) -> Tensor:
    """``x``'s positions ``start:stop`` along ``axis`` (with ``stop`` None the one position
    ``start``, the axis dropped) as a new contiguous tensor, by one Gather: a kernel given a
    strided view (a slice, a split part) first copies it several times slower than a Gather
    copies. For the PyNative prefill; graphs take views for free."""
    index = cached(
        ("take", start, stop),
        lambda: Tensor(np.int32(start) if stop is None else np.arange(start, stop, dtype=np.int32)),
    )
    return ops.gather(x, index, axis % x.ndim)


def take_split(x: Tensor, sizes: tuple) -> list:
    """``mint.split(x, sizes, -1)`` as contiguous tensors (``take``)."""
    starts = np.cumsum((0,) + tuple(sizes))
    return [take(x, -1, int(a), int(b)) for a, b in zip(starts[:-1], starts[1:])]


def split_whole(x: Tensor, sizes: tuple) -> tuple:
    """``mint.split`` of ``x``'s last axis into ``sizes`` (views), dropping what is left after them:
    the zero columns of a padded projection."""
    rest = x.shape[-1] - sum(sizes)
    return mint.split(x, sizes + (rest,) if rest else sizes, -1)[: len(sizes)]
