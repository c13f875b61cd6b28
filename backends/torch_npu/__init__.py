"""torch adapter (CPU / CUDA, and Ascend NPU where torch_npu and CANN are installed).

torch_npu is imported lazily: it fails to import without CANN (``libhccl.so``), so plain torch
is the fallback. On Ascend: ``load_model(..., device="npu")`` and the HCCL process group
(``torchrun`` sets it up through ``init_process_group(backend="hccl")``).
"""

from __future__ import annotations

import torch

from .ops import TorchOps, torch_dtype


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
    import os

    kind = default_device()
    return kind if kind == "cpu" else f"{kind}:{int(os.environ.get('LOCAL_RANK', '0'))}"


def distributed_backend(device: str) -> str:
    """The collective library for ``device``: HCCL on Ascend, NCCL on CUDA, gloo on CPU."""
    kind = str(device).split(":")[0]  # by name: torch.device("npu") needs torch_npu imported
    return {"npu": "hccl", "cuda": "nccl"}.get(kind, "gloo")


def ops_for(obj):
    """TorchOps for a torch Module (its parameters' device) or Tensor, else None."""
    if isinstance(obj, torch.Tensor):
        return TorchOps(obj.device)
    if isinstance(obj, torch.nn.Module):
        for tensor in obj.parameters():
            return TorchOps(tensor.device)
        for tensor in obj.buffers():
            return TorchOps(tensor.device)
        return TorchOps("cpu")
    return None


__all__ = ["TorchOps", "ops_for", "torch_dtype", "default_device", "rank_device", "distributed_backend", "npu_available"]
