"""The C++ CPU kernel that attends over the engine's paged K/V pool in place (``csrc/paged_attention.cpp``).

The plain-ops path gathers every row's K/V history out of the pool each decode step (a copy as large
as what attention then reads); this kernel reads each row's slots where they lie. It is built on
first use with torch's C++ extension loader (the host's compiler, ``-O3 -march=native``: it is
compiled on and for the host it runs on) into torch's extension cache, and loaded from there by
every later process. Its sums run in a fixed order per (row, kv head) task, so a row's output does
not depend on the rows beside it or on the thread count, and the same inputs give the same bits.

Where no compiler can build it (or ``$HYPER_GEN_PAGED_KERNEL=0``), ``available()`` is False and the
engine keeps the plain-ops path; ``describe()`` says which one runs and why.
"""

from __future__ import annotations

import os
import threading
from typing import Optional

import torch

_NAME = "hyper_gen_paged_attention"
_SOURCE = os.path.join(os.path.dirname(__file__), "csrc", "paged_attention.cpp")
_lock = threading.Lock()
_state: dict = {}  # "ok": bool once tried; "why": the reason it is off


def available() -> bool:
    """Whether ``torch.ops.hyper_gen.paged_decode`` runs here (built and loaded once a process)."""
    with _lock:
        if "ok" not in _state:
            _state["ok"], _state["why"] = _load()
        return _state["ok"]


def describe() -> str:
    available()
    return "paged_decode (C++, in place)" if _state["ok"] else f"gathered pieces ({_state['why']})"


def _load():
    if os.environ.get("HYPER_GEN_PAGED_KERNEL", "1") == "0":
        return False, "HYPER_GEN_PAGED_KERNEL=0"
    if hasattr(torch.ops, "hyper_gen") and hasattr(torch.ops.hyper_gen, "paged_decode"):
        return True, ""
    try:
        from torch.utils import cpp_extension

        cpp_extension.load(
            name=_NAME,
            sources=[_SOURCE],
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
            verbose=False,
        )
    except Exception as error:  # no compiler, headers or ninja: the plain path serves
        return False, f"the C++ kernel could not be built: {str(error).splitlines()[0][:200]}"
    return True, ""


def paged_decode(query: torch.Tensor, pool_k: torch.Tensor, pool_v: torch.Tensor, slots: torch.Tensor, scale: float):
    """Attention of ``query`` (B, H, 1, D) over the pool slots ``slots`` (B, T) int64 names per row,
    in order (a negative slot is a column the row does not attend); ``pool_k`` / ``pool_v`` are
    (slots, H_kv, D). Returns (B, H, 1, D_v) in the query's dtype."""
    if not _state.get("ok") and not available():
        raise RuntimeError(f"hyper_gen's paged-attention kernel is not available: {_state['why']}")
    return torch.ops.hyper_gen.paged_decode(query, pool_k, pool_v, slots, float(scale))


def reference(query, pool_k, pool_v, slots, scale: float, dtype: Optional[torch.dtype] = None):
    """The same attention in plain ops (gather, softmax), for tests: in ``dtype`` (default the query's)."""
    dtype = dtype or query.dtype
    b, h, _, d = query.shape
    out = []
    for row in range(b):
        picked = slots[row][slots[row] >= 0]
        k = pool_k.index_select(0, picked).to(dtype).transpose(0, 1)  # (H_kv, T, D)
        v = pool_v.index_select(0, picked).to(dtype).transpose(0, 1)
        k = k.repeat_interleave(h // k.shape[0], dim=0)
        v = v.repeat_interleave(h // v.shape[0], dim=0)
        q = query[row, :, 0].to(dtype)  # (H, D)
        weights = torch.softmax((q[:, None] @ k.transpose(-1, -2))[:, 0] * scale, dim=-1)
        out.append((weights[:, None] @ v)[:, 0])
    return torch.stack(out)[:, :, None]
