"""Which torch device a model or a rank uses, and the collective library that goes with it."""

from __future__ import annotations

import os

import torch


def npu_available() -> bool:
    """True when torch_npu imports (CANN present) and an NPU is visible."""
    try:
        import torch_npu  # noqa: F401
    except (ImportError, OSError, RuntimeError):
        return False
    return hasattr(torch, "npu") and torch.npu.is_available()


def default_device() -> str:
    if torch.cuda.is_available():
        return "cuda"
    return "npu" if npu_available() else "cpu"


def rank_device() -> str:
    """This rank's device in a multi-rank job: the accelerator numbered by LOCAL_RANK, else CPU."""
    kind = default_device()
    return kind if kind == "cpu" else f"{kind}:{int(os.environ.get('LOCAL_RANK', '0'))}"


def distributed_backend(device: str) -> str:
    """The collective library for ``device``: HCCL on Ascend, NCCL on CUDA, gloo on CPU."""
    kind = str(device).split(":")[0]  # by name: torch.device("npu") needs torch_npu imported
    return {"npu": "hccl", "cuda": "nccl"}.get(kind, "gloo")


def resolve_device(device, dtype: str, tp: int = 1):
    """The torch device ``load_model`` puts weights on: ``device``, or CPU (a TP rank: its own
    accelerator, so the model and HCCL/NCCL agree); a dtype the device cannot compute is a ValueError."""
    if device is None and tp > 1:
        device = rank_device()
    kind = (device or "cpu").split(":")[0].lower()
    if dtype == "float64" and kind in ("mps", "npu"):
        raise ValueError(f"dtype 'float64' is not supported on torch device {device!r}")
    if kind == "npu" and not npu_available():
        raise ValueError(f"device {device!r} needs torch_npu and CANN, which are not available here")
    try:
        return torch.device(device or "cpu")
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"device {device!r} is not a torch device: {error}") from None
