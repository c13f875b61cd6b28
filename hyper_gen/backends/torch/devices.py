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
