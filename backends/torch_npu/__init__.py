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


def distributed_backend(device: str) -> str:
    """The collective library for ``device``: HCCL on Ascend, NCCL on CUDA, gloo on CPU."""
    kind = torch.device(device).type
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


__all__ = ["TorchOps", "ops_for", "torch_dtype", "default_device", "distributed_backend", "npu_available"]
