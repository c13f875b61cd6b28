"""Projections through oneDNN's packed weights on CPU, where this host multiplies them faster.

torch's ``x @ w`` on CPU is MKL's sgemm. Where MKL takes a generic path (an AMD EPYC with
AVX-512: MKL does not use AVX-512 kernels there) it runs small-row products, a batched decode
step's, several times below what the cores can do, and the column blocks of ``blocked_gemm`` or
MKL's packed GEMM recover only part of it. oneDNN's inner-product primitive on a weight reordered
once into its blocked layout (``torch.ops.mkldnn._reorder_linear_weight`` and
``_linear_pointwise``, what TorchInductor's CPU weight prepacking runs) uses the host's full ISA
whatever the vendor. Whether it is faster depends on the host, so it is decided per (in, out)
shape at load by timing it against the product that would run otherwise (whole or blocked), at
prefill rows, at a batched decode step's rows and for one row streaming the weight from memory
(``use_packed``; a large vocabulary's head on a slice of its columns). Numbers: docs/performance.md.

The packed copy lives beside the weight (the checkpoint's tensor stays for the tied embedding,
state dicts, float64 and other devices), keyed by the weight and its version counter: a weight
changed in place (an optimizer step between rollouts) is packed again, never read stale. Copies
stop where they would pass ``HYPER_GEN_TORCH_ONEDNN_GEMM_MB`` (default 4096; 0 turns this off).
The products are oneDNN's sums, float32 rounding away from ``F.linear``'s, and a row's result
does not depend on the other rows of the product. Only float32 CPU weights not being trained
(no grad mode on a weight that requires grad) and not made under ``torch.inference_mode`` (no
version counter) are packed.
"""

from __future__ import annotations

import threading
import weakref
from typing import Callable, Dict, Optional, Tuple

import torch

from hyper_gen import switches
from hyper_gen.backends.torch import blocked_gemm, product_timing

PREFILL_ROWS = 64  # rows of the timed prefill-sized product
DECODE_ROWS = 16  # rows of the timed batched-decode product
MARGIN = 0.9  # packed is kept only if it takes at most this share of the other's time at those rows
DECODE_SLACK = 1.1  # ... and at most this many times its time for one row
MIN_ELEMENTS = 1 << 18  # smaller weights: too small for the kernel to matter (no timing)
MAX_OUT = 1 << 16  # a wider weight (a large vocabulary's head) is timed on a slice of its columns:
SLICE_OUT = 1 << 14  # this many (64 MB at 1024 inputs: past the cache for the one-row product)

_CHOSEN: Dict[Tuple[int, int], bool] = {}


def _budget_bytes() -> int:
    return switches.megabytes("HYPER_GEN_TORCH_ONEDNN_GEMM_MB", 4096)


def available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def pack(weight: torch.Tensor) -> torch.Tensor:
    """The oneDNN-packed copy of an (out, in) float32 CPU matrix."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)


def packed_product(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """``x @ weight.t()`` for the (out, in) ``weight`` that ``packed`` was made from; any leading shape."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def _seconds(rows: int, inner: int, out: int, kind: str) -> float:
    """Median per-product seconds of (rows, inner) by an (inner, out) weight: ``kind`` "packed"
    (oneDNN), "whole" (``x @ w``) or "current" (the product ``blocked_gemm`` chose for the shape)
    (``product_timing``: one row streams copies, more rows reuse one)."""
    copies = product_timing.copies_for(rows, inner, out)
    if kind != "packed":
        width = blocked_gemm.block_width(inner, out) if kind == "current" else 0
        return blocked_gemm._seconds(rows, inner, out, width)
    x = torch.full((rows, inner), 0.5)
    weights = [pack(torch.full((out, inner), 0.25)) for _ in range(copies)]
    return product_timing.median_seconds(lambda k: packed_product(x, weights[k]), copies)


def use_packed(inner: int, out: int, timer: Callable[[int, int, int, str], float] = None) -> bool:
    """Whether an (inner, out) float32 CPU weight is multiplied through its oneDNN-packed copy here:
    timed once per shape in a process. ``timer(rows, inner, out, kind)`` returns seconds for
    ``kind`` "packed", "current" or "whole" (``_seconds``; default: torch on this process's
    threads)."""
    key = (inner, out)
    if key in _CHOSEN:
        return _CHOSEN[key]
    if _budget_bytes() == 0 or not available() or inner * out < MIN_ELEMENTS:
        return False
    timer = timer or _seconds
    # a head of 248k columns costs GBs and seconds to time whole: SLICE_OUT of its columns stand for
    # it (a wide product's time is its columns' times added up), against the whole product it runs
    timed, current = (out, "current") if out <= MAX_OUT else (SLICE_OUT, "whole")
    chosen = True
    for rows, bound in ((PREFILL_ROWS, MARGIN), (DECODE_ROWS, MARGIN), (1, DECODE_SLACK)):
        if timer(rows, inner, timed, "packed") > bound * timer(rows, inner, timed, current):
            chosen = False
            break
    _CHOSEN[key] = chosen
    return chosen


class PackedWeights:
    """oneDNN-packed copies of weights, within a byte budget. Held by id with a finaliser, so a
    freed model's copies go with it, and stamped with the weight's version counter."""

    def __init__(self, budget: int = None):
        self.packed: Dict[int, tuple] = {}  # id(w) -> (w._version, packed)
        self.refused: set = set()  # id(w) that did not fit the budget
        self.bytes = 0
        self.budget = _budget_bytes() if budget is None else budget
        # the engine's thread and the caller's may both project; a finaliser may run inside a pack
        self.lock = threading.RLock()

    def project(self, x: torch.Tensor, w: torch.Tensor) -> Optional[torch.Tensor]:
        """``x @ w`` for an (in, out) ``w`` through its packed copy; None where it does not apply
        (another dtype or device, a weight being trained, an unchosen shape, the budget spent)."""
        if not _CHOSEN.get(tuple(w.shape), False) or not product_timing.packable(x, w):
            return None
        key = id(w)
        entry = self.packed.get(key)
        if entry is None or entry[0] != w._version:
            entry = self._pack(w)
            if entry is None:
                return None
        return packed_product(x, entry[1])

    def _pack(self, w: torch.Tensor):
        key = id(w)
        with self.lock:
            if key in self.refused:
                return None
            if key not in self.packed:  # first seen: its copy (or refusal) goes when it does
                weakref.finalize(w, self._forget, key)
            self._drop(key)
            size = _matrix_bytes(w)
            if self.bytes + size > self.budget:
                self.refused.add(key)
                return None
            self.bytes += size
            self.packed[key] = entry = (w._version, pack(w.t()))
        return entry

    def _drop(self, key: int) -> None:
        entry = self.packed.pop(key, None)
        if entry is not None:
            self.bytes -= _matrix_bytes(entry[1])

    def _forget(self, key: int) -> None:
        with self.lock:
            self._drop(key)
            self.refused.discard(key)


def _matrix_bytes(matrix: torch.Tensor) -> int:
    """Bytes of a float32 matrix, a packed copy or its weight (a packed tensor has no storage size)."""
    return int(torch.Size(matrix.shape).numel()) * 4


_SHARED = None


def project(x: torch.Tensor, w: torch.Tensor) -> Optional[torch.Tensor]:
    """``x @ w`` (``w`` (in, out)) through the process's packed copy where this shape was chosen,
    else None."""
    global _SHARED
    if not _CHOSEN:
        return None
    if _SHARED is None:
        _SHARED = PackedWeights()
    return _SHARED.project(x, w)
