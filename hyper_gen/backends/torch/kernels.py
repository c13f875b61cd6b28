"""The product each torch projection runs, fixed at load from the model's ``KernelPlan``.

Every projection is ``x @ w`` for an (in, out) weight; on CPU in float32 three products compute it
(``plain``, ``blocked:<W>`` column blocks, ``onednn`` packed), which is fastest depends on the host,
and they sum in different orders: so the choice is the plan's (``hyper_gen.kernel_plan``), made once
per host and shape by ``measure`` under ``kernels="auto"``, recorded, or pinned, and it never
changes after load. What each kernel is and when it wins: docs/architecture.md, "Kernel plans";
numbers: docs/performance.md.
"""

from __future__ import annotations

import functools
import re
import statistics
import threading
import time
import weakref
from typing import Callable, Dict, Optional, Tuple

import torch

from hyper_gen import switches
from hyper_gen.kernel_plan import KernelPlan

WIDTHS = (256, 512, 1024)  # block widths tried (a width must divide the output size)
PREFILL_ROWS = 64  # rows of the timed prefill-sized product
DECODE_ROWS = 16  # rows of the timed batched-decode product
BLOCKED_MARGIN = 0.85  # blocks are kept only if they take at most this share of the whole's time
ONEDNN_MARGIN = 0.9  # oneDNN is kept only if it takes at most this share of the other's time
DECODE_SLACK = 1.1  # ... and at most this many times the other's time for one row
MIN_ELEMENTS = 1 << 18  # smaller weights are not planned (plain)
MAX_OUT = 1 << 16  # a wider weight (a large vocabulary's head) is never blocked, and oneDNN is
SLICE_OUT = 1 << 14  # timed on this many of its columns (64 MB at 1024 inputs: past the cache)
REPEATS = 5
SAMPLE_SECONDS = 2e-3  # each timed sample repeats the product for about this long
STREAM_BYTES = 64 << 20  # one-row products cycle over this much weight memory (past the cache)

_KERNEL = re.compile(r"plain|onednn|blocked:([1-9][0-9]*)")


def allowed(kernel: str) -> bool:
    """A kernel name this module runs (``KernelPlan.check``)."""
    return _KERNEL.fullmatch(kernel) is not None


@functools.lru_cache(maxsize=None)
def block_width(kernel: str) -> int:
    """W of "blocked:W", else 0 (cached: the forward asks once per projection)."""
    return int(kernel.split(":")[1]) if kernel.startswith("blocked:") else 0


def plan_key(inner: int, out: int) -> str:
    return f"matmul {inner}x{out} float32"


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def pack(weight: torch.Tensor) -> torch.Tensor:
    """The oneDNN-packed copy of an (out, in) float32 CPU matrix."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)


def packed_product(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """``x @ weight.t()`` for the (out, in) ``weight`` that ``packed`` was made from; any leading shape."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def blocked(x: torch.Tensor, weight: torch.Tensor, width: int) -> torch.Tensor:
    """``x @ weight.t()`` for an (out, in)-contiguous ``weight``, as one bmm over its ``out // width``
    contiguous row blocks (each block's output columns are a contiguous slice of the result)."""
    out, inner = weight.shape
    rows = x.reshape(-1, inner)
    parts = torch.matmul(rows, weight.view(out // width, width, inner).transpose(1, 2))  # (nb, rows, width)
    return parts.permute(1, 0, 2).reshape(*x.shape[:-1], out)


# ------------------------------------------------------------------------------------ choosing


def _median_seconds(product: Callable[[int], object], copies: int) -> float:
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


def seconds(rows: int, inner: int, out: int, kernel: str) -> float:
    """Median seconds of a (rows, inner) @ (inner, out) product by ``kernel`` on this process's
    threads. A one-row product cycles over copies of its weight past the last-level cache, as a
    batch-1 decode step streams its weights from memory; more rows reuse one copy, as a prefill
    (or a batched decode step, whose weights the rows share) does."""
    copies = max(1, -(-STREAM_BYTES // (inner * out * 4))) if rows == 1 else 1
    x = torch.full((rows, inner), 0.5)
    if kernel == "onednn":
        weights = [pack(torch.full((out, inner), 0.25)) for _ in range(copies)]
        return _median_seconds(lambda k: packed_product(x, weights[k]), copies)
    if kernel.startswith("blocked:"):
        width = block_width(kernel)
        weights = torch.full((copies, out, inner), 0.25)
        return _median_seconds(lambda k: blocked(x, weights[k], width), copies)
    weights = torch.full((copies, inner, out), 0.25)
    return _median_seconds(lambda k: x @ weights[k], copies)


def _faster(timer, inner: int, out: int, kernel: str, than: str, margin: float, rows) -> bool:
    """``kernel`` takes at most ``margin`` of ``than``'s time at each row count of ``rows`` and at
    most DECODE_SLACK of it for one row."""
    for count, bound in [(r, margin) for r in rows] + [(1, DECODE_SLACK)]:
        if timer(count, inner, out, kernel) > bound * timer(count, inner, out, than):
            return False
    return True


def measure(inner: int, out: int, timer: Callable[[int, int, int, str], float] = seconds) -> str:
    """The fastest kernel for an (inner, out) float32 weight here: column blocks if faster than the
    whole product at prefill rows (by BLOCKED_MARGIN, not slower for one row), then oneDNN if faster
    than that at prefill and batched-decode rows. ``timer(rows, inner, out, kernel)``: seconds."""
    best = "plain"
    widths = [w for w in WIDTHS if w < out and out % w == 0] if out <= MAX_OUT else []
    if widths:
        prefill = {w: timer(PREFILL_ROWS, inner, out, f"blocked:{w}") for w in widths}
        candidate = f"blocked:{min(prefill, key=prefill.get)}"
        if _faster(timer, inner, out, candidate, "plain", BLOCKED_MARGIN, (PREFILL_ROWS,)):
            best = candidate
    if onednn_available():
        # a head of 248k columns costs GBs and seconds to time whole: SLICE_OUT of its columns stand
        # for it (a wide product's time is its columns' times added up)
        timed = out if out <= MAX_OUT else SLICE_OUT
        if _faster(timer, inner, timed, "onednn", best, ONEDNN_MARGIN, (PREFILL_ROWS, DECODE_ROWS)):
            best = "onednn"
    return best


# ------------------------------------------------------------------------------------ running


def budget_bytes() -> int:
    return switches.megabytes("HYPER_GEN_TORCH_ONEDNN_GEMM_MB", 4096)


def _packable(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Not being trained (grad mode on a weight that requires grad), and not an inference tensor
    (one made under ``torch.inference_mode`` has no version counter: an in-place change could not
    be seen)."""
    return not (w.requires_grad and torch.is_grad_enabled()) and not w.is_inference()


class TorchKernels:
    """One model's projections: the plan's kernel for each planned (in, out) shape, chosen while the
    weights load (``layout``), and the oneDNN copies within the budget. ``project(x, w)`` runs it.
    (``invariant_products.InvariantKernels`` is batch-invariant mode's, with the same interface.)"""

    invariant = False

    def __init__(self, plan: KernelPlan, budget: Optional[int] = None):
        plan.check(allowed)
        self.plan = plan
        self.by_shape: Dict[Tuple[int, int], str] = {}
        self.budget = budget_bytes() if budget is None else budget
        self.packed: Dict[int, tuple] = {}  # id(w) -> (w._version, packed)
        self.refused: set = set()  # id(w) past the budget
        self.bytes = 0
        # the engine's thread and the caller's may both project; a finaliser may run inside a pack
        self.lock = threading.RLock()

    def kernel_for(self, w_t: torch.Tensor) -> str:
        """The plan's kernel for an (in, out) weight ("plain" for one that is not planned)."""
        if w_t.dtype != torch.float32 or w_t.device.type != "cpu" or w_t.dim() != 2:
            return "plain"
        inner, out = w_t.shape
        if (inner, out) in self.by_shape:
            return self.by_shape[(inner, out)]
        if inner * out < MIN_ELEMENTS:
            return "plain"
        key = plan_key(inner, out)
        kernel = self.plan.choose(key, lambda: measure(inner, out))
        width = block_width(kernel)
        if width and out % width:
            raise ValueError(f"kernel plan {self.plan.path!r}: {key!r} -> {kernel!r}: {width} must divide {out}")
        if kernel == "onednn" and not onednn_available():
            raise ValueError(f"kernel plan {self.plan.path!r}: {key!r} -> 'onednn', which this torch build lacks")
        self.by_shape[(inner, out)] = kernel
        return kernel

    def layout(self, w_t: torch.Tensor) -> torch.Tensor:
        """The stored form of a weight given as the (in, out) view of its (out, in) matrix: that view
        (the (out, in) memory) for float64, which keeps HF's ``F.linear`` sums, for column blocks,
        which are cut from it, and for oneDNN, which packs from it (so neither its packing nor an
        ``update_weights`` of HF's (out, in) tensors transposes anything); (in, out)-contiguous for
        ``plain``, the layout MKL streams fastest."""
        if w_t.dtype == torch.float64 or self.kernel_for(w_t) != "plain":
            return w_t
        return w_t.contiguous()

    def used_plan(self) -> KernelPlan:
        """The plan narrowed to this model's shapes (``model.kernel_plan``)."""
        return self.plan.used(plan_key(inner, out) for inner, out in self.by_shape)

    def project(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """``x @ w`` for an (in, out) ``w`` through its shape's kernel."""
        kernel = self.by_shape.get(tuple(w.shape)) if w.dtype == torch.float32 and w.dim() == 2 else None
        if kernel is None or x.dtype != torch.float32 or w.device.type != "cpu":
            return x @ w
        if kernel == "onednn":
            packed = self._packed(w) if _packable(x, w) else None
            if packed is not None:
                return packed_product(x, packed)
        elif kernel != "plain" and w.t().is_contiguous():
            return blocked(x, w.t(), block_width(kernel))
        return x @ w

    def _packed(self, w: torch.Tensor):
        key = id(w)
        entry = self.packed.get(key)
        if entry is not None and entry[0] == w._version:
            return entry[1]
        with self.lock:
            if key in self.refused:
                return None
            if key not in self.packed:  # first seen: its copy (or refusal) goes when it does
                weakref.finalize(w, self._forget, key)
            self._drop(key)
            size = w.numel() * 4
            if self.bytes + size > self.budget:
                self.refused.add(key)
                return None
            self.bytes += size
            self.packed[key] = (w._version, pack(w.t()))
            return self.packed[key][1]

    def _drop(self, key: int) -> None:
        entry = self.packed.pop(key, None)
        if entry is not None:
            self.bytes -= int(torch.Size(entry[1].shape).numel()) * 4  # a packed tensor has no storage size

    def _forget(self, key: int) -> None:
        with self.lock:
            self._drop(key)
            self.refused.discard(key)


PLAIN = TorchKernels(KernelPlan("torch", "", "plain"), budget=0)  # a layer built outside ``load``
