"""Process-group setup for torch launched by torchrun (gloo on CPU, NCCL on CUDA, HCCL on Ascend).

The group's timeout (how long a collective waits for a stalled or dead peer) is ``timeout_s``,
else ``$HYPER_GEN_TIMEOUT_S``, else 600 s (``hyper_gen.parallel.launcher``).
"""

from __future__ import annotations

import atexit
import os
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

from hyper_gen.parallel.launcher import TIMEOUT_ENV, collective_timeout_s

from .devices import default_device, distributed_backend

DEFAULT_TIMEOUT_S = 600.0
_joined_timeout_s: Optional[float] = None  # the timeout of the group init_from_env created


def init_from_env(device: str = None, timeout_s: float = None) -> bool:
    """Join the torchrun job described by the environment; False when not launched by torchrun.
    A process group that already exists is joined as it is (its own timeout)."""
    global _joined_timeout_s
    if dist.is_initialized():
        return True
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    timeout = collective_timeout_s(timeout_s) or DEFAULT_TIMEOUT_S
    dist.init_process_group(backend=distributed_backend(device or default_device()), timeout=timedelta(seconds=timeout))
    _joined_timeout_s = timeout
    # a group left open at interpreter exit aborts gloo ("terminate called without an active
    # exception", SIGABRT): leave it cleanly when the user's script just ends
    atexit.register(shutdown)
    return True


def group_timeout_s() -> Optional[float]:
    """The default process group's own collective timeout in seconds (the program may have created
    the group with any ``init_process_group(timeout=)``), None without a group or where torch hides it."""
    if not dist.is_initialized():
        return None
    try:
        group = dist.distributed_c10d._get_default_group()
        return float(group._get_backend(default_device_of(group)).options._timeout.total_seconds())
    except Exception:  # private attributes: absent or changed in another torch
        return None


def default_device_of(group):
    """The device a group's collectives run on (CPU for gloo)."""
    import torch

    return torch.device("cpu") if dist.get_backend(group) == "gloo" else torch.device(default_device())


def timeout_description() -> str:
    """What the waiting rank's error says about the timeout it ran into."""
    if _joined_timeout_s is None:
        return "the process group's timeout"
    return f"{_joined_timeout_s:g} s (timeout_s= / --timeout / ${TIMEOUT_ENV}; default {DEFAULT_TIMEOUT_S:g} s)"


def shutdown() -> None:
    global _joined_timeout_s
    if dist.is_initialized():
        dist.destroy_process_group()
    _joined_timeout_s = None
