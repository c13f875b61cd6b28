"""Multi-rank helpers that stay framework-free: joining the launcher's job, sharing host values.

MindSpore on CPU has only AllGather, AllReduce and Broadcast, so host values (a chat message,
a seed) travel as int32 tensors through ``broadcast``, which every backend supports.
"""

from __future__ import annotations

import importlib

import numpy as np

ADAPTER_PACKAGES = {"torch": "hyper_gen.backends.torch_npu", "mindspore": "hyper_gen.backends.mindspore"}


def _adapter(backend: str, module: str = ""):
    if backend not in ADAPTER_PACKAGES:
        raise ValueError(f"backend must be one of {sorted(ADAPTER_PACKAGES)}, got {backend!r}")
    return importlib.import_module(ADAPTER_PACKAGES[backend] + module)


def init_distributed(backend: str) -> bool:
    """Join the torchrun / msrun job when launched by one; False for a single process."""
    return _adapter(backend, ".distributed").init_from_env()


def shutdown_distributed(backend: str) -> None:
    _adapter(backend, ".distributed").shutdown()


def host_ops(backend: str):
    """Ops for moving host values between ranks (the MindSpore/torch adapter on its default device)."""
    adapter = _adapter(backend)
    if backend == "torch":
        import torch

        return adapter.ops_for(torch.zeros(1, device=adapter.default_device()))
    import mindspore

    return adapter.ops_for(mindspore.Tensor(np.zeros(1, np.float32)))


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
