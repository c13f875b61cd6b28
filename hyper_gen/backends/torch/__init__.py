"""torch adapter (CPU / CUDA, and Ascend NPU where torch_npu and CANN are installed).

torch_npu is imported lazily: it fails to import without CANN (``libhccl.so``), so plain torch
is the fallback. On Ascend: ``load_model(..., device="npu")`` and the HCCL process group
(``torchrun`` sets it up through ``init_process_group(backend="hccl")``).

The adapter interface every backend provides is described in ``hyper_gen.registry``.
"""

from __future__ import annotations

from typing import Callable, List, Optional

import numpy as np
import torch

from hyper_gen.models import fixed_logits

from . import kernels, models
from .devices import default_device, distributed_backend, npu_available, rank_device, resolve_device
from .launch import group_timeout_s
from .launch import init_from_env as init_distributed
from .launch import shutdown as shutdown_distributed
from .ops import TorchOps, torch_dtype
from .sharding import collective_forward, find_parallelism, load_sharded, parameters_unsharded

NAME = "torch"
CP_STRATEGIES = ("allgather", "ulysses")  # gloo / NCCL / HCCL all have the all-to-all Ulysses needs
CP_STRATEGIES_WHY = ""


def limit_threads(threads: int) -> str:
    """Cap this process's intra-op threads (ranks sharing one host); says what was set."""
    torch.set_num_threads(threads)
    return f"{threads} torch thread{'s' if threads > 1 else ''} per rank"


def thread_initializer():
    """The caller's intra-op thread count, applied on the new thread (torch keeps it per thread)."""
    threads = torch.get_num_threads()
    return lambda: torch.set_num_threads(threads)


def launcher(ranks: int) -> str:
    return f"torchrun --nproc_per_node {ranks}"


def intra_op_threads() -> Optional[int]:
    """The threads torch's CPU kernels compute with (benchmarks print them with the host)."""
    return torch.get_num_threads()


def bind_local_rank_cores() -> Optional[str]:
    """None: ranks sharing a host need only ``limit_threads`` (torch has no busy runtime threads)."""
    return None


def cpu_products(x: torch.Tensor, w: torch.Tensor) -> List[Callable[[], torch.Tensor]]:
    """The float32 CPU products this build can run for ``x @ w``: MKL's, and oneDNN's packed one
    where the build has it (``bench models`` times the fastest as the host's rate)."""
    products = [lambda: x @ w]
    if kernels.onednn_available():
        packed = kernels.pack(w.t())
        products.append(lambda: kernels.packed_product(x, packed))
    return products


def fixed_logits_model(logits: np.ndarray) -> torch.nn.Module:
    """``hyper_gen.models.fixed_logits`` as a torch Module (``bench loop``)."""
    return fixed_logits.fixed_logits_model(
        torch.nn.Module, torch.nn.Parameter(torch.from_numpy(logits), requires_grad=False)
    )


WEIGHT_GROUP_BACKENDS = ("gloo", "nccl", "hccl")


def join_weight_group(model, master_address, master_port, rank, world_size, group_name, backend, timeout_s):
    """This server's rank joining a trainer's weight-update group (``weight_group.join``): gloo
    receives on the host, NCCL / HCCL on the model's device. torch.distributed is loaded here, not
    when the adapter is."""
    from . import weight_group

    device = None if backend == "gloo" else ops_for(model).device
    return weight_group.join(master_address, master_port, rank, world_size, group_name, backend, timeout_s, device)


def weight_dtype_is_floating(text: str) -> bool:
    """Whether the dtype named ``text`` (``bfloat16``, ``torch.float32``) is a floating one; ValueError if unknown."""
    from . import weight_group

    return weight_group.is_floating(text)


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


def host_ops() -> TorchOps:
    """Ops on the default device, for moving host values between ranks."""
    return TorchOps(default_device())
