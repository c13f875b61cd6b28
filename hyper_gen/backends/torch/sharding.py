"""What generate() needs to know about a model its trainer sharded with torch's own APIs.

- FSDP2 (``fully_shard``: modules become ``FSDPModule``) and FSDP1 (``FullyShardedDataParallel``)
  all-gather parameters inside every forward, as do DTensor parameters of any kind: ranks must
  step together (``collective_forward``).
- ``parallelize_module`` tensor parallelism leaves DTensor weights on a device mesh; an output
  layer sharded by rows (``ColwiseParallel``: ``Shard(0)`` of (V, H)) gives each rank its slice of
  the vocabulary (``find_parallelism``: that mesh's group, vocab-parallel).
- ``parameters_unsharded``: FSDP2's ``unshard()`` on every FSDP module for the whole call, then
  ``reshard()``, so decode does not all-gather every layer every token.
"""

from __future__ import annotations

import contextlib

import torch
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
from torch.distributed.tensor import DTensor, Shard

_FSDP = (FSDPModule, FullyShardedDataParallel)


def _modules(model):
    return list(model.modules()) if isinstance(model, torch.nn.Module) else []


def _is_fsdp(model) -> bool:
    return any(isinstance(m, _FSDP) for m in _modules(model))


def collective_forward(model) -> bool:
    """True when a forward of ``model`` runs collectives: FSDP modules or DTensor parameters."""
    if _is_fsdp(model):
        return True
    return isinstance(model, torch.nn.Module) and any(isinstance(p, DTensor) for p in model.parameters())


def _output_layer(model):
    get = getattr(model, "get_output_embeddings", None)
    layer = get() if callable(get) else None
    return layer if layer is not None else getattr(model, "lm_head", None)


def find_parallelism(model):
    """(process group, vocab_parallel) of a ``parallelize_module`` model whose output layer is a
    row-sharded DTensor (each rank's logits its vocabulary slice), else None. FSDP's DTensors
    (parameters sharded on the data-parallel mesh) are not tensor parallelism and are not reported."""
    if not isinstance(model, torch.nn.Module) or _is_fsdp(model):
        return None
    weight = getattr(_output_layer(model), "weight", None)
    if not isinstance(weight, DTensor) or weight.device_mesh.ndim != 1:
        return None
    (placement,) = weight.placements
    if not (isinstance(placement, Shard) and placement.dim == 0):
        return None
    return weight.device_mesh.get_group(), True


@contextlib.contextmanager
def parameters_unsharded(model):
    """FSDP2 modules' parameters all-gathered once for the block (nothing to do for others)."""
    fsdp = [m for m in _modules(model) if isinstance(m, FSDPModule)]
    for module in fsdp:
        module.unshard()
    try:
        yield
    finally:
        for module in fsdp:
            module.reshard()
