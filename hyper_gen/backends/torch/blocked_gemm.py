"""Projections as one batched product over contiguous column blocks, where that is faster here.

On some hosts (an AMD EPYC with AVX2, where MKL takes its generic path) a float32 product with
a wide weight, (M, 512) @ (512, 3072) or (M, 1024) @ (1024, 7168), runs at half the rate of the
same product split into output blocks of a few hundred columns, each block contiguous, for every
row count from a prefill's down to a batched decode step's; on others (the Intel hosts MKL was
tuned on) the whole (in, out)-contiguous product is as fast. The checkpoint's (out, in) layout
makes every block of output columns a contiguous run of rows, so the blocked product needs no
copy of the weight: ``W.view(nb, bw, in)`` under one ``bmm``. Which layout a weight is stored
in is therefore decided at load time, per (in, out) shape, by timing both on this host
(``block_width``): a width is kept only if it is faster at prefill rows by ``MARGIN`` and not
much slower for one row (a batch-1 decode step). Numbers: docs/performance.md.

Only float32 CPU weights are blocked: float64 stays bit for bit HF's ``F.linear``, and other
devices have their own GEMM libraries. ``HYPER_GEN_TORCH_BLOCKED_GEMM=0`` turns it off.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

import torch

from hyper_gen import switches
from hyper_gen.backends.torch import product_timing

WIDTHS = (256, 512, 1024)  # block widths tried (a width must divide the output size)
PREFILL_ROWS = 64  # rows of the timed prefill-sized product
MARGIN = 0.85  # a blocked width is kept only if it takes at most this share of the whole's time
DECODE_SLACK = 1.1  # ... and at most this many times the whole's time for one row
MIN_ELEMENTS = 1 << 18  # smaller weights: too small for the layout to matter (no timing)
MAX_OUT = 1 << 16  # wider weights (a large vocabulary's head) stay whole (timing one costs GBs)

_CHOSEN: Dict[Tuple[int, int], int] = {}


def enabled() -> bool:
    return switches.flag("HYPER_GEN_TORCH_BLOCKED_GEMM")


def candidates(out: int) -> Tuple[int, ...]:
    """The block widths tried for ``out`` output columns: those of ``WIDTHS`` dividing it, below it."""
    return tuple(w for w in WIDTHS if w < out and out % w == 0)


def blocked(x: torch.Tensor, weight: torch.Tensor, width: int) -> torch.Tensor:
    """``x @ weight.t()`` for an (out, in)-contiguous ``weight``, as one bmm over its
    ``out // width`` contiguous row blocks (each block's output columns are a contiguous
    slice of the result)."""
    out, inner = weight.shape
    rows = x.reshape(-1, inner)
    parts = torch.matmul(rows, weight.view(out // width, width, inner).transpose(1, 2))  # (nb, rows, width)
    return parts.permute(1, 0, 2).reshape(*x.shape[:-1], out)


def _seconds(rows: int, inner: int, out: int, width: int) -> float:
    """Median per-product seconds of (rows, inner) by an (inner, out) weight: whole and
    (in, out)-contiguous for ``width`` 0, else blocked (``blocked``) over the (out, in) layout
    (``product_timing``: one row streams copies, more rows reuse one)."""
    copies = product_timing.copies_for(rows, inner, out)
    x = torch.full((rows, inner), 0.5)
    if width:
        weights = torch.full((copies, out, inner), 0.25)
        return product_timing.median_seconds(lambda k: blocked(x, weights[k], width), copies)
    weights = torch.full((copies, inner, out), 0.25)
    return product_timing.median_seconds(lambda k: x @ weights[k], copies)


def block_width(inner: int, out: int, timer: Callable[[int, int, int, int], float] = None) -> int:
    """The block width an (inner, out) float32 CPU weight is multiplied with here, 0 for the whole
    (in, out)-contiguous product: timed once per shape in a process. ``timer(rows, inner, out,
    width)`` returns seconds (default: torch on this process's threads)."""
    if not enabled():
        return 0
    key = (inner, out)
    if key in _CHOSEN:
        return _CHOSEN[key]
    if inner * out < MIN_ELEMENTS or out > MAX_OUT:
        return 0
    timer = timer or _seconds
    chosen = 0
    prefill = {width: timer(PREFILL_ROWS, inner, out, width) for width in candidates(out)}
    if prefill:
        best = min(prefill, key=prefill.get)
        if prefill[best] <= MARGIN * timer(PREFILL_ROWS, inner, out, 0) and timer(
            1, inner, out, best
        ) <= DECODE_SLACK * timer(1, inner, out, 0):
            chosen = best
    _CHOSEN[key] = chosen
    return chosen


def stored(w_t: torch.Tensor) -> torch.Tensor:
    """The (in, out) view ``w_t`` of an (out, in) float32 CPU matrix as it is kept: the view itself
    (the (out, in) memory the blocks are cut from) where ``block_width`` chose blocks, else
    (in, out)-contiguous."""
    inner, out = w_t.shape
    if block_width(inner, out):
        return w_t
    return w_t.contiguous()


def project(x: torch.Tensor, w: torch.Tensor) -> Optional[torch.Tensor]:
    """``x @ w`` blocked, for an (in, out) ``w`` that ``stored`` kept in (out, in) memory; None
    where the whole product applies (another layout, dtype or device, or an unchosen shape)."""
    if w.dtype != torch.float32 or w.dim() != 2 or w.device.type != "cpu" or x.dtype != torch.float32:
        return None
    width = _CHOSEN.get(tuple(w.shape), 0)
    if not width or not w.t().is_contiguous() or (w.requires_grad and torch.is_grad_enabled()):
        return None
    return blocked(x, w.t(), width)
