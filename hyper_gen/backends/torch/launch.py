"""Process-group setup for torch launched by torchrun (gloo on CPU, NCCL on CUDA, HCCL on Ascend)."""

from __future__ import annotations

import atexit
import os
from datetime import timedelta

import torch.distributed as dist

from .devices import default_device, distributed_backend


def init_from_env(device: str = None, timeout_s: float = 600.0) -> bool:
    """Join the torchrun job described by the environment; False when not launched by torchrun."""
    if dist.is_initialized():
        return True
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    dist.init_process_group(
        backend=distributed_backend(device or default_device()), timeout=timedelta(seconds=timeout_s)
    )
    # a group left open at interpreter exit aborts gloo ("terminate called without an active
    # exception", SIGABRT): leave it cleanly when the user's script just ends
    atexit.register(shutdown)
    return True


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
