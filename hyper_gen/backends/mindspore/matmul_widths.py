"""The output width a MindSpore CPU projection is stored with, chosen by timing it on this host.

MindSpore's CPU MatMul runs some output widths several times slower than one 64 columns wider:
(M, 512) @ (512, 3072), (1024, 5120) and (1024, 7168), the fused MLP and attention projections
of the bench's Qwen3.5 shapes, reach a third to a half of the rate of their +64 neighbours at
prefill row counts (docs/performance.md), and which widths suffer depends on the host. So at
load time each fused projection's width is timed against one zero-padded candidate and the
faster kept; the model ignores the padding columns (and, for the MLP, multiplies them by zero
rows of the down projection). Devices other than the CPU keep the checkpoint's widths.

``HYPER_GEN_MINDSPORE_PAD_WIDTHS=0`` turns the choice off (every width as in the checkpoint).
"""

from __future__ import annotations

import time
from typing import Callable, Dict, Tuple

import numpy as np

from hyper_gen import switches

ROWS = 128  # rows of the timed product: a prefill's, where the slow widths cost the most
MARGIN = 0.8  # the padded width is kept only if it takes at most this share of the time
REPEATS = 3

_CHOSEN: Dict[Tuple[int, int, str], int] = {}


def enabled() -> bool:
    return switches.flag("HYPER_GEN_MINDSPORE_PAD_WIDTHS")


def candidate(width: int) -> int:
    """The padded width tried against ``width``: the next multiple of 64 that is 64 times an odd
    number (and more than ``width``)."""
    wider = -(-(width + 1) // 64) * 64
    return wider if (wider // 64) % 2 else wider + 64


def _seconds(rows: int, inner: int, width: int, dtype) -> float:
    """Best of REPEATS timed (rows, inner) @ (inner, width) MatMuls on MindSpore, after a warm-up."""
    import mindspore as ms
    from mindspore import Parameter, Tensor, ops

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


def fast_width(inner: int, width: int, dtype, timer: Callable[[int, int, int, object], float] = None) -> int:
    """``width`` or ``candidate(width)``, whichever (inner, width) projection runs faster here:
    timed once per (inner, width, dtype) in a process. ``timer(rows, inner, width, dtype)`` returns
    seconds (default: a MindSpore MatMul)."""
    key = (inner, width, str(dtype))
    if key not in _CHOSEN:
        timer = timer or _seconds
        wider = candidate(width)
        faster = timer(ROWS, inner, wider, dtype) <= MARGIN * timer(ROWS, inner, width, dtype)
        _CHOSEN[key] = wider if faster else width
    return _CHOSEN[key]
