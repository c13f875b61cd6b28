"""The C++ CPU kernel that attends over a paged K/V cache in place (``csrc/paged_attention.cpp``).

The plain-ops path gathers every row's K/V history out of the engine's pool each step (a copy as
large as what attention then reads); this kernel reads each row's slots where they lie. It is built
on first use with torch's C++ extension loader (the host's compiler, ``-O3 -march=native``: it is
compiled on and for the host it runs on) into torch's extension cache, and loaded from there by
every later process.

Each query's sums run in an order fixed by the query and the K/V it attends alone: its columns in
chunks of 32 from its first, an online softmax across them. So a row's output does not depend on the
rows beside it, the padding, or the thread count, and a position computed in a prefill chunk gets
the bits it gets decoded one token at a time.

Where no compiler can build it (or ``$HYPER_GEN_PAGED_KERNEL=0``), ``available()`` is False and the
engine keeps the plain-ops path; ``describe()`` says which one runs and why.
"""

from __future__ import annotations

import os
import threading
from typing import Optional

import torch

from hyper_gen import switches

_NAME = "hyper_gen_paged_attention"
_SOURCE = os.path.join(os.path.dirname(__file__), "csrc", "paged_attention.cpp")
_lock = threading.Lock()
_state: dict = {}  # "ok": bool once tried; "why": the reason it is off


def available() -> bool:
    """Whether ``torch.ops.hyper_gen.paged_attention`` runs here (built and loaded once a process)."""
    with _lock:
        if "ok" not in _state:
            _state["ok"], _state["why"] = _load()
        return _state["ok"]


def describe() -> str:
    available()
    return "paged_attention (C++, in place)" if _state["ok"] else f"gathered pieces ({_state['why']})"


def enabled() -> bool:
    """``$HYPER_GEN_PAGED_KERNEL`` (0 / 1, default 1; another value is a ValueError naming it)."""
    return switches.flag("HYPER_GEN_PAGED_KERNEL")


def _load():
    if not enabled():
        return False, "HYPER_GEN_PAGED_KERNEL=0"
    if hasattr(torch.ops, "hyper_gen") and hasattr(torch.ops.hyper_gen, "paged_attention"):
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


def paged_attention(query, cache_k, cache_v, slots, lengths, scale: float):
    """Attention of ``query`` (B, H, S, D) over the cache slots ``slots`` (B, T) int64 names per row,
    in order; query s of row b attends the first ``lengths[b, s]`` of them (0: a zero output).
    ``cache_k`` / ``cache_v``: (N, block, H_kv, D) with any strides but a contiguous last dim (slot =
    n * block + offset), or (slots, H_kv, D). Returns (B, H, S, D_v) in the query's dtype."""
    if not _state.get("ok") and not available():
        raise RuntimeError(f"hyper_gen's paged-attention kernel is not available: {_state['why']}")
    if cache_k.dim() == 3:
        cache_k, cache_v = cache_k.unsqueeze(1), cache_v.unsqueeze(1)
    return torch.ops.hyper_gen.paged_attention(query, cache_k, cache_v, slots, lengths, float(scale))


def reference(query, cache_k, cache_v, slots, lengths, scale: float, dtype: Optional[torch.dtype] = None):
    """The same attention in plain ops (gather, softmax), for tests: in ``dtype`` (default the query's)."""
    dtype = dtype or query.dtype
    if cache_k.dim() == 4:
        cache_k, cache_v = cache_k.flatten(0, 1), cache_v.flatten(0, 1)
    b, h, s, _ = query.shape
    out = query.new_zeros((b, h, s, cache_v.shape[-1]), dtype=dtype)
    for row in range(b):
        for step in range(s):
            picked = slots[row, : int(lengths[row, step])]
            if not len(picked):
                continue
            k = cache_k.index_select(0, picked).to(dtype).transpose(0, 1)  # (H_kv, T, D)
            v = cache_v.index_select(0, picked).to(dtype).transpose(0, 1)
            k = k.repeat_interleave(h // k.shape[0], dim=0)
            v = v.repeat_interleave(h // v.shape[0], dim=0)
            q = query[row, :, step].to(dtype)  # (H, D)
            weights = torch.softmax((q[:, None] @ k.transpose(-1, -2))[:, 0] * scale, dim=-1)
            out[row, :, step] = (weights[:, None] @ v)[:, 0]
    return out
