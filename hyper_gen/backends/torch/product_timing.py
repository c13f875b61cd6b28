"""What the load-time kernel choices of the torch CPU projections share (``blocked_gemm``,
``onednn_gemm``, ``packed_gemm``): timing a product the way a prefill and a decode step see it, and
which weights may carry a packed copy.

A one-row product cycles over copies of its weight past the last-level cache, as a batch-1 decode
step streams its weights from memory; more rows reuse one copy, as a prefill (or a batched decode
step, whose weights the rows share) does. The median of a few samples, each repeated for a couple
of milliseconds, keeps one noisy sample from deciding a layout.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

REPEATS = 5
SAMPLE_SECONDS = 2e-3  # each timed sample repeats the product for about this long
STREAM_BYTES = 64 << 20  # one-row products cycle over this much weight memory (past the cache)


def copies_for(rows: int, inner: int, out: int) -> int:
    """How many copies of an (inner, out) float32 weight a timed ``rows``-row product cycles over."""
    return max(1, -(-STREAM_BYTES // (inner * out * 4))) if rows == 1 else 1


def median_seconds(product: Callable[[int], object], copies: int) -> float:
    """Median per-call seconds of ``product(k)`` for k cycling over ``copies``, after a warm-up."""
    start = time.perf_counter()
    for k in range(copies):
        product(k)
    calls = max(1, int(SAMPLE_SECONDS * copies / max(time.perf_counter() - start, 1e-6)))
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        for call in range(calls):
            product(call % copies)
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


def packable(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``x @ w`` may run through a packed copy of ``w``: float32 on the CPU, a matrix not
    being trained (grad mode on a weight that requires grad), and not an inference tensor (one made
    under ``torch.inference_mode`` has no version counter, so an in-place change could not be seen)."""
    return (
        w.dtype == torch.float32
        and x.dtype == torch.float32
        and w.device.type == "cpu"
        and w.dim() == 2
        and not (w.requires_grad and torch.is_grad_enabled())
        and not w.is_inference()
    )
