"""Batch-invariant products: ``x @ w`` whose every row is the same bits however many rows share it.

A BLAS picks its kernel (and on several threads, how it splits the sum) from the product's shape:
on an AVX2 EPYC with torch 2.13 a float32 row computed among 1, 2, 3, 5-7 or 9-11 rows differs in
its last bits from the same row computed among 64, while 4, 8 and any count >= 12 agree. So in
batch-invariant mode every product runs the plain product with its row count padded up to a
*row quantum* ``q`` (zero rows, dropped after): the smallest of ``QUANTA`` that a probe at load
shows gives every row the bits it has among 64 rows, at every multiple of ``q`` up to 64, at
two offsets, and among 192 rows. Under ``kernels="auto"`` column blocks (``kernels.blocked``)
are candidates too, probed the same way, and the fastest passing kernel is kept (MKL's plain
product of 4 rows takes a slow generic path on an AVX2 EPYC). The choice is held in the model's
``KernelPlan`` (backend ``torch-invariant``, a host file of its own; key ``invariant <in>x<out>
<dtype> <device> <kind>``, kernel ``<plain|blocked:W>+rows:<q>``), recorded under "auto" and
pinnable like any other. A shape no quantum passes runs ``sum`` (products summed over ``in`` in
a fixed order; small weights only, a large one is a ValueError at load). oneDNN's packed product
is not a candidate yet (it has no autograd, and its copy's budget could change the kernel).
"""

from __future__ import annotations

import re
import threading
from typing import Dict, Tuple

import torch

from hyper_gen.backends.torch.kernels import WIDTHS, block_width, blocked, seconds
from hyper_gen.kernel_plan import KernelPlan

QUANTA = (4, 8, 16, 32, 64)
PROBE_ROWS = 64
PROBE_COLUMNS = 4096  # a wider weight (the LM head) is probed and timed on this many of its columns
SUM_MAX_ELEMENTS = 1 << 16  # the largest weight allowed to fall back to the fixed-order sum
BLOCKED_MIN_ELEMENTS = 1 << 16  # smaller weights run plain products only
TIMED_ROWS = 16  # a candidate's time: its product at one padded row plus at this many rows
_KERNEL = re.compile(r"(plain|blocked:[1-9][0-9]*)\+rows:(4|8|16|32|64)|sum")


def allowed(kernel: str) -> bool:
    """A kernel name this module runs (``KernelPlan.check``)."""
    return _KERNEL.fullmatch(kernel) is not None


def plan_key(w: torch.Tensor, fixed: bool) -> str:
    """``fixed``: a weight whose memory is not the kernels' to lay out (Gated DeltaNet's b / a)."""
    inner, out = w.shape[-2:]
    kind = "fixed" if fixed else ("stack" if w.dim() > 2 else "matrix")
    return f"invariant {inner}x{out} {str(w.dtype).replace('torch.', '')} {w.device.type} {kind}"


def fixed_sum_product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w`` as elementwise products summed over ``in`` (a reduction whose order is the row's own)."""
    return (x.unsqueeze(-1) * w).sum(dim=-2)


def _padded(rows: torch.Tensor, quantum: int) -> torch.Tensor:
    extra = -rows.shape[0] % quantum
    return rows if extra == 0 else torch.cat([rows, rows.new_zeros(extra, rows.shape[1])])


def _product(kernel: str, rows: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """(rows, in) @ (in, out) by ``kernel`` (plain, or blocked:W over the (out, in) memory of ``w``)."""
    width = block_width(kernel)
    return blocked(rows, w.t(), width) if width else rows @ w


def stored(kernel: str, w_t: torch.Tensor) -> torch.Tensor:
    """The memory ``kernel`` reads: (in, out)-contiguous for plain (float64: HF's (out, in)), the
    (out, in) memory for column blocks."""
    if kernel.startswith("blocked:") or w_t.dtype == torch.float64:
        return w_t
    return w_t.contiguous()


def smallest_quantum(kernel: str, w: torch.Tensor) -> int:
    """The smallest row quantum keeping every row's bits under ``kernel`` (the module doc), else 0."""
    w = w.detach()[..., :PROBE_COLUMNS]
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3 * PROBE_ROWS, w.shape[0], generator=generator).to(device=w.device, dtype=w.dtype)
    with torch.no_grad():
        reference = _product(kernel, x[:PROBE_ROWS], w)
        if not torch.equal(_product(kernel, x, w)[:PROBE_ROWS], reference):
            return 0
        for quantum in QUANTA:
            counts = range(quantum, PROBE_ROWS + 1, quantum)
            if all(
                torch.equal(
                    _product(kernel, _padded(x[start : start + m], quantum), w)[:m], reference[start : start + m]
                )
                for m in sorted({*counts, *(c - 1 for c in counts if c > 1), 1})
                for start in {0, PROBE_ROWS - m}
            ):
                return quantum
    return 0


def choose(w_t: torch.Tensor, fixed: bool, timed: bool) -> str:
    """The kernel for an (in, out) weight: of plain and (float32 CPU matrices, ``timed``) column
    blocks, those a row quantum makes invariant, the fastest (timed at one padded row plus
    ``TIMED_ROWS``), as ``<kernel>+rows:<q>``; ``sum`` if none."""
    inner, out = w_t.shape
    candidates = ["plain"]
    if timed and not fixed and w_t.dtype == torch.float32 and w_t.device.type == "cpu":
        if inner * out >= BLOCKED_MIN_ELEMENTS:
            widths = [width for width in WIDTHS if width < min(out, PROBE_COLUMNS) and out % width == 0]
            candidates += [f"blocked:{width}" for width in widths]
    passing = {}
    for kernel in candidates:
        quantum = smallest_quantum(kernel, w_t if fixed else stored(kernel, w_t))
        if quantum:
            passing[kernel] = quantum
    if not passing:
        return "sum"
    if len(passing) > 1:
        columns = min(out, PROBE_COLUMNS)

        def cost(kernel):
            q = passing[kernel]
            return seconds(q, inner, columns, kernel) + seconds(max(q, TIMED_ROWS), inner, columns, kernel)

        best = min(passing, key=cost)
    else:
        best = next(iter(passing))
    return f"{best}+rows:{passing[best]}"


class InvariantKernels:
    """One model's batch-invariant products (``project``), the kernel and row quantum of each weight
    shape held in the model's ``KernelPlan`` (``used_plan``). Same interface as ``TorchKernels``."""

    invariant = True

    def __init__(self, plan: KernelPlan):
        plan.check(allowed)
        self.plan = plan
        self.keys: Dict[Tuple, Tuple[str, int]] = {}
        self.plan_keys: set = set()
        self.lock = threading.RLock()

    @staticmethod
    def _key(w: torch.Tensor) -> Tuple:
        return (tuple(w.shape[-2:]), w.dtype, w.device.type, w.stride(-1) == 1)

    def kernel_for(self, w_t: torch.Tensor, fixed: bool = True) -> str:
        """The plan's kernel for an (in, out) weight (a stack of them: its first); ``fixed``: stored
        as given (b / a), else as ``layout`` stores it. Chosen once per shape."""
        w2 = w_t if w_t.dim() == 2 else w_t.reshape(-1, *w_t.shape[-2:])[0]
        key = plan_key(w_t, fixed)
        with self.lock:
            timed = self.plan.mode != "plain" and w_t.dim() == 2
            kernel = self.plan.choose(key, lambda: choose(w2, fixed, timed), plain=None)
            if kernel == "sum" and w2.numel() > SUM_MAX_ELEMENTS:
                raise ValueError(
                    f"batch_invariant: no row quantum in {QUANTA} keeps the rows of a {tuple(w2.shape)} "
                    f"{w2.dtype} product identical on this host ({key!r}); this device is not supported"
                )
            width = block_width(kernel.split("+")[0])
            if width and (fixed or w_t.dim() > 2 or w_t.shape[-1] % width):
                raise ValueError(
                    f"kernel plan {self.plan.path!r}: {key!r} -> {kernel!r}: column blocks need a matrix "
                    "whose output size the width divides"
                )
            self.plan_keys.add(key)
            w_stored = w_t if fixed else stored(kernel, w_t)
            quantum = 0 if kernel == "sum" else int(kernel.split(":")[-1])
            self.keys[self._key(w_stored)] = (kernel.split("+")[0], quantum)
            return kernel

    def layout(self, w_t: torch.Tensor) -> torch.Tensor:
        """The weight stored as its kernel reads it, the kernel chosen now, at load."""
        return stored(self.kernel_for(w_t, fixed=False), w_t)

    def used_plan(self) -> KernelPlan:
        return self.plan.used(self.plan_keys)

    def project(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """``x @ w`` for an (in, out) ``w``, any leading shape of ``x``, rows padded to the quantum."""
        kernel, quantum = self.keys[self._key(w)]
        rows = x.reshape(-1, x.shape[-1])
        if kernel == "sum":
            out = fixed_sum_product(rows, w)
        else:
            out = _product(kernel, _padded(rows, quantum), w)[: rows.shape[0]]
        return out.reshape(*x.shape[:-1], w.shape[-1])
