"""The ``HYPER_GEN_*`` environment switches of the backends' speed paths, read one way.

A switch set to something it cannot mean (``HYPER_GEN_MINDSPORE_JIT=yes``,
``HYPER_GEN_TORCH_ONEDNN_GEMM_MB=lots``) is a ``ValueError`` naming the variable and the value,
raised when a model is loaded (each backend's ``check_switches``), before any work: read lazily
inside a forward it became a traceback mid-generation, and a lenient reading ("anything but 0 is
on") silently ignored a typo. No framework is imported here.
"""

from __future__ import annotations

import math
import os


def flag(name: str, default: bool = True) -> bool:
    """A 0 / 1 switch: ``$name`` is "0" or "1" (unset: ``default``)."""
    value = os.environ.get(name)
    if value is None:
        return default
    if value not in ("0", "1"):
        raise ValueError(f"{name} must be 0 or 1, got {value!r}")
    return value == "1"


def megabytes(name: str, default: float) -> int:
    """A memory budget in MB (a number >= 0; 0 turns its path off), returned in bytes."""
    value = os.environ.get(name)
    if value is None:
        return int(default * (1 << 20))
    try:
        mb = float(value)
    except ValueError:
        mb = math.nan
    if not (mb >= 0 and math.isfinite(mb)):
        raise ValueError(f"{name} must be a number of MB >= 0, got {value!r}")
    return int(mb * (1 << 20))
