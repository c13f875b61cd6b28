"""Batch-invariant products: ``x @ w`` whose every row is the same bits however many rows share it.

A BLAS picks its kernel (and on several threads, how it splits the sum) from the product's shape:
on an AVX2 EPYC with torch 2.13 a float32 row computed among 1, 2, 3, 5-7 or 9-11 rows differs in
its last bits from the same row computed among 64, while 4, 8 and any count >= 12 agree. So in
batch-invariant mode every product runs the plain product with its row count padded up to a
*row quantum* ``q`` (zero rows, dropped after): the smallest of ``QUANTA`` that a probe at load
shows gives every row the bits it has among 64 rows, at every multiple of ``q`` up to 64, at
two offsets, and among 192 rows. The quantum is a recorded choice of the model's ``KernelPlan``
(backend ``torch-invariant``, a host file of its own; key ``invariant <in>x<out> <dtype> <layout>
<device>``, kernel ``rows:<q>``), recorded under ``kernels="auto"`` and pinnable like any other;
a shape no quantum passes runs ``sum``: the products and a sum over ``in`` in a fixed order
(small weights only; a large one is a ValueError at load). The oneDNN-packed and column-blocked
products are never used in this mode.
"""

from __future__ import annotations

import re
import threading
from typing import Dict, Tuple

import torch

from hyper_gen.kernel_plan import KernelPlan

QUANTA = (4, 8, 16, 32, 64)
PROBE_ROWS = 64
PROBE_COLUMNS = 4096  # a wider weight (the LM head) is probed on this many of its columns
SUM_MAX_ELEMENTS = 1 << 16  # the largest weight allowed to fall back to the fixed-order sum
_KERNEL = re.compile(r"rows:(4|8|16|32|64)|sum")


def allowed(kernel: str) -> bool:
    """A kernel name this module runs (``KernelPlan.check``)."""
    return _KERNEL.fullmatch(kernel) is not None


def _layout(w: torch.Tensor) -> str:
    return "in-out" if w.stride(-1) == 1 else "out-in"


def plan_key(w: torch.Tensor) -> str:
    inner, out = w.shape[-2:]
    return f"invariant {inner}x{out} {str(w.dtype).replace('torch.', '')} {_layout(w)} {w.device.type}"


def fixed_sum_product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w`` as elementwise products summed over ``in`` (a reduction whose order is the row's own)."""
    return (x.unsqueeze(-1) * w).sum(dim=-2)


def _padded(rows: torch.Tensor, quantum: int) -> torch.Tensor:
    extra = -rows.shape[0] % quantum
    return rows if extra == 0 else torch.cat([rows, rows.new_zeros(extra, rows.shape[1])])


def probe(w: torch.Tensor) -> str:
    """The kernel for an (in, out) weight: ``rows:<q>`` for the smallest quantum that keeps every row's
    bits (see the module doc), else ``sum``."""
    w = w.detach()[..., :PROBE_COLUMNS]
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3 * PROBE_ROWS, w.shape[0], generator=generator).to(device=w.device, dtype=w.dtype)
    with torch.no_grad():
        reference = x[:PROBE_ROWS] @ w
        big = x @ w
        if not torch.equal(big[:PROBE_ROWS], reference):
            return "sum"
        for quantum in QUANTA:
            counts = range(quantum, PROBE_ROWS + 1, quantum)
            if all(
                torch.equal((_padded(x[start : start + m], quantum) @ w)[:m], reference[start : start + m])
                for m in sorted({*counts, *(c - 1 for c in counts if c > 1), 1})
                for start in {0, PROBE_ROWS - m}
            ):
                return f"rows:{quantum}"
    return "sum"


class InvariantKernels:
    """One model's batch-invariant products (``project``), the quantum of each weight shape held in
    the model's ``KernelPlan`` (``used_plan``). Same interface as ``TorchKernels``."""

    invariant = True

    def __init__(self, plan: KernelPlan):
        plan.check(allowed)
        self.plan = plan
        self.keys: Dict[Tuple, str] = {}
        self.plan_keys: set = set()
        self.lock = threading.RLock()

    def _key(self, w: torch.Tensor) -> Tuple:
        return (tuple(w.shape[-2:]), w.dtype, _layout(w), w.device.type)

    def kernel_for(self, w: torch.Tensor) -> str:
        """The plan's kernel for an (in, out) weight (a stack of them: its first), probed once."""
        key = self._key(w)
        kernel = self.keys.get(key)
        if kernel is not None:
            return kernel
        with self.lock:
            w2 = w if w.dim() == 2 else w.reshape(-1, *w.shape[-2:])[0]
            kernel = self.plan.choose(plan_key(w2), lambda: probe(w2), plain=None)
            if kernel == "sum" and w2.numel() > SUM_MAX_ELEMENTS:
                raise ValueError(
                    f"batch_invariant: no row quantum in {QUANTA} keeps the rows of a {tuple(w2.shape)} "
                    f"{w2.dtype} product identical on this host ({plan_key(w2)!r}); this device is not supported"
                )
            self.keys[key] = kernel
            self.plan_keys.add(plan_key(w2))
            return kernel

    def layout(self, w_t: torch.Tensor) -> torch.Tensor:
        """(in, out)-contiguous (float64: HF's (out, in) memory, whose sums HF's ``F.linear`` makes),
        its quantum probed now, at load."""
        stored = w_t if w_t.dtype == torch.float64 else w_t.contiguous()
        self.kernel_for(stored)
        return stored

    def used_plan(self) -> KernelPlan:
        return self.plan.used(self.plan_keys)

    def quantum(self, w: torch.Tensor) -> int:
        kernel = self.kernel_for(w)
        return 0 if kernel == "sum" else int(kernel.split(":")[1])

    def project(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """``x @ w`` for an (in, out) ``w``, any leading shape of ``x``, rows padded to the quantum."""
        quantum = self.quantum(w)
        rows = x.reshape(-1, x.shape[-1])
        if quantum == 0:
            out = fixed_sum_product(rows, w)
        else:
            out = (_padded(rows, quantum) @ w)[: rows.shape[0]]
        return out.reshape(*x.shape[:-1], w.shape[-1])
