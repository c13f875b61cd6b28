"""Batched decode projections through MKL's packed GEMM on CPU.

A decode step of B rows multiplies (B, 1, in) activations by each (in, out) weight. For 8-64 rows
MKL's plain sgemm repacks the weight on every call and streams it at well under the memory
bandwidth; ``cblas_sgemm_pack`` once per weight and row count (``torch.ops.mkl``, what
TorchInductor's CPU weight prepacking uses) removes that, and the product is what ``F.linear``
gives on the checkpoint's (out, in) weight, i.e. HF's arithmetic: bitwise on the Intel hosts
measured, to float32 rounding where MKL takes its generic path (an AMD EPYC)
(docs/performance.md). A packed copy is kept per weight for one row count: the batch being
decoded, once it has held for ``STEADY_CALLS`` calls (a new row count repacks, and so does a
weight changed in place, seen by its version counter). A copy takes
about 2.3 times the weight's memory, so packing stops where the copies would pass
``HYPER_GEN_TORCH_PACKED_GEMM_MB`` (default 2048 MB; 0 turns it off). Other row counts, float64
(bitwise HF's own layout), devices other than the CPU and builds without MKL use ``x @ w``.
"""

from __future__ import annotations

import weakref
from typing import Dict

import torch

from hyper_gen import switches
from hyper_gen.backends.torch import product_timing

MIN_ROWS = 8  # below this the plain product streams as fast (matrix-vector paths)
MAX_ROWS = 64  # a larger batch streams its weights well enough unpacked
STEADY_CALLS = 4  # a weight is packed for a row count once this many calls in a row had it


def _budget_bytes() -> int:
    return switches.megabytes("HYPER_GEN_TORCH_PACKED_GEMM_MB", 2048)


def available() -> bool:
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight")


class PackedWeights:
    """Packed copies of weights, one row count each, within a byte budget. Held by id with a
    finaliser, so a freed model's copies go with it."""

    def __init__(self, budget: int = None):
        self.packed: Dict[int, tuple] = {}  # id(w) -> (rows, packed, w._version)
        self.streak: Dict[int, tuple] = {}  # id(w) -> (rows, consecutive calls with them)
        self.refused: set = set()  # (id(w), rows) that did not fit the budget
        self.bytes = 0
        self.budget = _budget_bytes() if budget is None else budget
        self.enabled = self.budget > 0 and available()

    def project(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """``x @ w`` for an (in, out) weight ``w``; packed for a decode step's (B, 1, in) ``x``
        (a prompt's rows vary with its length: each new length would repack)."""
        rows = x.shape[0]
        if not (self.enabled and x.dim() == 3 and x.shape[1] == 1 and MIN_ROWS <= rows <= MAX_ROWS):
            return x @ w
        if not product_timing.packable(x, w):
            return x @ w
        entry = self.packed.get(id(w))
        if entry is not None and entry[2] != w._version:  # changed in place (an optimizer step): stale
            entry = None  # (repacked below; _pack replaces the stale copy)
        if entry is None or entry[0] != rows:
            # a batch size that keeps changing (an in-flight engine) would repack every step
            last, calls = self.streak.get(id(w), (rows, 0))
            calls = calls + 1 if last == rows else 1
            self.streak[id(w)] = (rows, calls)
            if calls < STEADY_CALLS:
                return x @ w
            entry = self._pack(w, rows)
            if entry is None:
                return x @ w
        return torch.ops.mkl._mkl_linear(x, entry[1], w.t(), None, rows)

    def _pack(self, w: torch.Tensor, rows: int):
        if (id(w), rows) in self.refused:
            return None
        first = id(w) not in self.packed
        self._drop(id(w))
        packed = torch.ops.mkl._mkl_reorder_linear_weight(w.detach().t(), rows)
        size = packed.numel() * packed.element_size()
        if self.bytes + size > self.budget:
            self.refused.add((id(w), rows))
            return None
        self.bytes += size
        self.packed[id(w)] = entry = (rows, packed, w._version)
        if first:
            weakref.finalize(w, self._forget, id(w))
        return entry

    def _drop(self, key: int) -> None:
        entry = self.packed.pop(key, None)
        if entry is not None:
            self.bytes -= entry[1].numel() * entry[1].element_size()

    def _forget(self, key: int) -> None:
        self._drop(key)
        self.streak.pop(key, None)
        self.refused = {k for k in self.refused if k[0] != key}


_SHARED = None


def project(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w`` (``w`` (in, out)), through the process's packed copies where they pay."""
    global _SHARED
    if _SHARED is None:
        _SHARED = PackedWeights()
    return _SHARED.project(x, w)
