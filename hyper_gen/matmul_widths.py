"""The output width a fused CPU projection is stored with, and the LM head's block columns, chosen
once per host through the model's ``KernelPlan`` (``hyper_gen.kernel_plan``): some CPU MatMul
widths run several times slower than one 64 columns wider, depending on the host, and a padded
width sums its columns in another order (docs/architecture.md, "Kernel plans"). Host arithmetic
over the plan's records (and, for a head kept in blocks, ``Ops`` gathers of its columns): the port
that pads (MindSpore's ``weights``) times its own MatMul.
"""

from __future__ import annotations

import re
from typing import Callable, Sequence

import numpy as np

from hyper_gen import host
from hyper_gen.ops import Ops, Tensor

ROWS = 128  # rows of the timed product: a prefill's, where the slow widths cost the most
MARGIN = 0.8  # the padded width is kept only if it takes at most this share of the time
# Most LM head columns per matmul: one very wide matrix-vector product reads slower than a few
# narrower ones on MindSpore CPU, and a head streamed from memory (larger than the last-level
# cache) fastest in blocks of ~8K columns.
HEAD_COLUMNS = 65536
STREAMED_HEAD_COLUMNS = 8192

_KERNEL = re.compile(r"(width|columns):([1-9][0-9]*)")


def allowed(kernel: str) -> bool:
    """A kernel name this module makes ("plain", "width:N", "columns:N")."""
    return kernel == "plain" or _KERNEL.fullmatch(kernel) is not None


def candidate(width: int) -> int:
    """The padded width tried against ``width``: the next multiple of 64 that is 64 times an odd
    number (and more than ``width``)."""
    wider = -(-(width + 1) // 64) * 64
    return wider if (wider // 64) % 2 else wider + 64


def faster(inner: int, width: int, dtype, timer: Callable[[int, int, int, object], float]) -> int:
    """``width`` or ``candidate(width)``, whichever (inner, width) projection runs faster here
    (the padded one by at least 1 - MARGIN). ``timer(rows, inner, width, dtype)`` returns seconds
    (the port's MatMul, ``dtype`` its own)."""
    wider = candidate(width)
    return wider if timer(ROWS, inner, wider, dtype) <= MARGIN * timer(ROWS, inner, width, dtype) else width


def _recorded(plan, key: str, kernel: str, kind: str, least: int) -> int:
    match = _KERNEL.fullmatch(kernel)
    if match is None or match.group(1) != kind or int(match.group(2)) < least:
        raise ValueError(f"kernel plan {plan.path!r}: {key!r} -> {kernel!r} is not a {kind} of at least {least}")
    return int(match.group(2))


def projection_width(plan, inner: int, width: int, dtype_name: str, dtype, timer) -> int:
    """The width an (inner, width) fused projection is stored with under ``plan`` (the key it is
    recorded under: ``matmul_key``), timed by ``timer`` (``faster``) where the plan has none."""
    key = matmul_key(inner, width, dtype_name)
    kernel = plan.choose(key, lambda: f"width:{faster(inner, width, dtype, timer)}")
    return width if kernel == "plain" else _recorded(plan, key, kernel, "width", width)


def matmul_key(inner: int, width: int, dtype_name: str) -> str:
    return f"matmul {inner}x{width} {dtype_name}"


def head_key(hidden: int, vocab: int, dtype_name: str) -> str:
    return f"lm_head {hidden}x{vocab} {dtype_name}"


def streamed_columns(head_bytes: int, cache_bytes: int) -> int:
    """Most columns per LM head block for a head of ``head_bytes`` on a CPU whose last-level cache
    holds ``cache_bytes``: a head larger than it reads faster in narrow blocks."""
    return STREAMED_HEAD_COLUMNS if head_bytes > cache_bytes else HEAD_COLUMNS


def head_columns(plan, hidden: int, vocab: int, dtype_name: str, head_bytes: int) -> int:
    """Most columns per LM head block under ``plan`` ("plain": HEAD_COLUMNS)."""
    key = head_key(hidden, vocab, dtype_name)
    kernel = plan.choose(key, lambda: f"columns:{streamed_columns(head_bytes, host.last_level_cache_bytes())}")
    return HEAD_COLUMNS if kernel == "plain" else _recorded(plan, key, kernel, "columns", 1)


def block_width(columns: int, most: int) -> int:
    """Columns per block when ``columns`` are cut into ``ceil(columns / most)`` blocks: their even
    share, rounded up to 64 times an odd number. A row stride of a large power of two bytes cuts
    MindSpore's CPU matrix-vector bandwidth, as rows then collide in the same cache sets."""
    share = -(-columns // -(-columns // most))
    width = -(-share // 64) * 64
    return width + 64 if (width // 64) % 2 == 0 else width


def block_columns(ops: Ops, blocks: Sequence[Tensor], width: int, ids: np.ndarray) -> Tensor:
    """(rows, N): the columns ``ids`` of a matrix kept as column ``blocks`` of ``width`` columns
    (``block_width``; the last one narrower), gathered from the blocks that hold them (found on the
    host), in the order of ``ids``: a tied LM head's embedding lookup."""
    block = ids // width
    order = np.argsort(block, kind="stable")
    local = ids[order] - block[order] * width
    parts = [ops.take(blocks[int(b)], local[block[order] == b], 1) for b in np.unique(block)]
    if len(parts) == 1:  # one block: the ids are in their own order (every batch-1 decode step)
        return parts[0]
    return ops.take(ops.concat(parts, 1), np.argsort(order), 1)
