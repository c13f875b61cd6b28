"""Joining the launcher's job and sharing host values between ranks, framework-free.

MindSpore on CPU has only AllGather, AllReduce and Broadcast, so host values (a chat message,
a seed) travel as int32 tensors through ``broadcast``, which every backend supports.
"""

from __future__ import annotations

import os

import numpy as np

from hyper_gen import registry


def launched_multi_rank() -> bool:
    """True in a process started by torchrun / msrun with more than one rank."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 or int(os.environ.get("MS_WORKER_NUM", "1")) > 1


def init_distributed(backend: str) -> bool:
    """Join the torchrun / msrun job when launched by one; False for a single process."""
    return registry.adapter(backend).init_distributed()


def shutdown_distributed(backend: str) -> None:
    registry.adapter(backend).shutdown_distributed()


def host_ops(backend: str):
    """Ops for moving host values between ranks (the backend's adapter on its default device)."""
    return registry.adapter(backend).host_ops()


def broadcast_ints(ops, values, src: int = 0) -> np.ndarray:
    """Rank ``src``'s int array (at most int32 range) on every rank; others pass the same length."""
    return ops.to_numpy(ops.broadcast(ops.asarray(np.asarray(values, dtype=np.int32), "int32"), src=src))


def broadcast_text(ops, text, src: int = 0):
    """Rank ``src``'s string (or None, e.g. end of input) on every rank."""
    if ops.world_size() == 1:
        return text
    is_src = ops.rank() == src
    payload = np.frombuffer(text.encode("utf-8"), dtype=np.uint8) if (is_src and text is not None) else None
    length = int(broadcast_ints(ops, [-1 if payload is None else payload.size] if is_src else [0], src)[0])
    if length <= 0:
        return None if length < 0 else ""
    data = broadcast_ints(ops, payload.astype(np.int32) if is_src else np.zeros(length, np.int32), src)
    return bytes(data.astype(np.uint8)).decode("utf-8")
