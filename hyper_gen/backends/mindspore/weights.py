"""How a MindSpore model's weights are laid out at load (numpy), from the arrays ``Checkpoint.read``
returns for this rank's pieces: (in, out) projections for 2-D rows, fused where they read the same
input, at the kernel plan's width, norm weights folded in (docs/architecture.md, "Weights")."""

from __future__ import annotations

import time
from typing import List

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, ops

from hyper_gen import matmul_widths
from hyper_gen.backends.mindspore.primitives import numpy_dtype, on_cpu
from hyper_gen.kernel_plan import KernelPlan
from hyper_gen.models.arrays import contiguous, round_to
from hyper_gen.models.checkpoint import Piece
from hyper_gen.models.qwen3_5.shards import EMBED_TOKENS, ModelShard, vocab_rows

DTYPES = {"float32": ms.float32, "float64": ms.float64, "float16": ms.float16, "bfloat16": ms.bfloat16}


def check_dtype(dtype: str) -> None:
    """A model dtype MindSpore computes on this device (bfloat16 is storage only on CPU)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {dtype!r}")
    if dtype == "bfloat16" and on_cpu():
        raise ValueError(
            "dtype 'bfloat16' is not supported by MindSpore on CPU (storage only); use float32, float16 or float64"
        )


REPEATS = 3  # timed MatMuls per width (the best is kept)


def matmul_seconds(rows: int, inner: int, width: int, dtype) -> float:
    """Best of REPEATS timed (rows, inner) @ (inner, width) MatMuls, after a warm-up: the timer
    ``hyper_gen.matmul_widths`` compares a projection's width and its padded candidate with."""
    np_dtype = {ms.float16: np.float16, ms.float32: np.float32, ms.float64: np.float64}.get(dtype, np.float32)
    rng = np.random.default_rng(0)
    x = Tensor(rng.standard_normal((rows, inner)).astype(np_dtype), dtype)
    w = Parameter(Tensor(rng.standard_normal((inner, width)).astype(np_dtype), dtype), requires_grad=False)
    matmul = ops.MatMul()
    matmul(x, w).asnumpy()
    best = float("inf")
    for _ in range(REPEATS):
        start = time.perf_counter()
        matmul(x, w).asnumpy()
        best = min(best, time.perf_counter() - start)
    return best


class Weights:
    """Reads this rank's pieces of a checkpoint (``hyper_gen.models.qwen3_5.shards``) into
    MindSpore parameters of the model's layout and dtype."""

    def __init__(self, checkpoint, dtype: str, kernel_plan: KernelPlan):
        self.checkpoint = checkpoint
        self.dtype = dtype
        self.kernel_plan = kernel_plan
        self.kernel_keys = set()  # the plan's keys this model's shapes use (model.kernel_plan)
        self.on_cpu = on_cpu()
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
            tensor = Tensor(contiguous(array, np.float32), dtype=ms.bfloat16)
        else:
            tensor = Tensor(contiguous(array, numpy_dtype(self.ms_dtype)))
        return Parameter(tensor, name=name, requires_grad=False)

    def constant(self, array: np.ndarray) -> Tensor:
        """A derived compute-dtype tensor (not a Parameter), after model-dtype rounding: what HF
        computes with for the weights it upcasts (norm scales, decay rates, conv taps)."""
        return Tensor(np.ascontiguousarray(round_to(array, self.dtype), dtype=numpy_dtype(self.acc)))

    def projection(self, blocks: List[np.ndarray], in_scale: np.ndarray = None, pad: bool = False) -> Parameter:
        """(out, in) matrices concatenated along out, stored (in, out); ``in_scale`` (in,) multiplies
        the rows: the weight of the RMSNorm that feeds the projection, folded in once (the product
        is taken in float64 and rounded to the model dtype once). ``pad``: zero columns appended up
        to ``fast_width``."""
        matrix = np.concatenate(blocks, axis=0)
        width = self.fast_width(*matrix.shape[::-1]) if pad else matrix.shape[0]
        if width > matrix.shape[0]:  # zero rows of the (out, in) matrix: no transposing concatenate
            matrix = np.concatenate([matrix, np.zeros((width - matrix.shape[0], matrix.shape[1]), matrix.dtype)], 0)
        matrix = matrix.T
        if in_scale is not None:
            matrix = matrix.astype(np.float64) * in_scale.astype(np.float64)[:, None]
        return self.param(matrix)

    def linear_t(self, pieces: List[Piece], in_scale: np.ndarray = None, pad: bool = False) -> Parameter:
        """``projection`` of the (out, in) checkpoint pieces, in order."""
        return self.projection([self.read(piece) for piece in pieces], in_scale, pad)

    def fast_width(self, inner: int, width: int) -> int:
        """The width an (inner, width) fused projection is stored with: on CPU the kernel plan's
        (``hyper_gen.matmul_widths``, timed by ``matmul_seconds``), else the checkpoint's."""
        if not self.on_cpu:
            return width
        self.kernel_keys.add(matmul_widths.matmul_key(inner, width, self.dtype))
        return matmul_widths.projection_width(self.kernel_plan, inner, width, self.dtype, self.ms_dtype, matmul_seconds)

    def lm_head(self, shard: ModelShard):
        """(blocks, block width): this rank's LM head as (hidden, width) blocks of vocabulary columns
        (the last one narrower), for the fast ``x @ W``; a tied model embeds by gathering their
        columns. At most ``HEAD_COLUMNS`` a block, and on CPU the kernel plan's (narrow blocks for
        a head larger than the last-level cache)."""
        head_t = self.vocab_rows(shard, shard.lm_head or EMBED_TOKENS).T
        hidden, vocab = head_t.shape
        most = matmul_widths.HEAD_COLUMNS
        if self.on_cpu:
            self.kernel_keys.add(matmul_widths.head_key(hidden, vocab, self.dtype))
            most = matmul_widths.head_columns(self.kernel_plan, hidden, vocab, self.dtype, head_t.nbytes)
        width = matmul_widths.block_width(vocab, most)
        return [self.param(head_t[:, i : i + width], f"lm_head.{i // width}") for i in range(0, vocab, width)], width

    def norm_scale(self, piece: Piece) -> np.ndarray:
        """``1 + w`` of a zero-centred RMSNorm, as HF computes it (model-dtype ``w`` plus one in
        the compute dtype), in numpy: to fold into a projection or to make a constant of."""
        acc = numpy_dtype(self.acc)
        return (1.0 + round_to(self.read(piece), self.dtype).astype(acc)).astype(acc)
