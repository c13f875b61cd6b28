"""What generate() needs to know about a model its trainer sharded: torch's FSDP2 / FSDP1 / DTensor
parameters and HyperParallel's torch ``fully_shard`` (ranks step together), ``parallelize_module``'s
vocab-parallel output layer on a 1-D or 2-D mesh, and ``parameters_unsharded`` (docs/architecture.md,
"Trainer-sharded torch models"); ``load_sharded`` for ``hyper-gen chat --shard``."""

from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
from torch.distributed.tensor import DTensor, Shard

from hyper_gen.parallel import hyperparallel

from .devices import rank_device
from .ops import torch_dtype

_FSDP = (FSDPModule, FullyShardedDataParallel)


def load_sharded(path: str, dtype: str, sharder: str):
    """The HF causal LM in ``path`` (``dtype``: its name) with every decoder layer and the root
    sharded over a 1-D mesh of all ranks, by torch's FSDP2 ``fully_shard`` or HyperParallel's. The
    latter splits dim 0 evenly only: a root with a parameter that does not split (the demo's 99-row
    embedding) stays whole, its decoder layers sharded."""
    from transformers import AutoModelForCausalLM

    device = rank_device()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype(dtype)).to(device).eval()
    world = dist.get_world_size()
    if sharder == "hyperparallel":
        os.environ.setdefault("HYPER_PARALLEL_PLATFORM", "torch")  # it picks MindSpore whenever MindSpore imports
        from hyper_parallel import init_device_mesh
        from hyper_parallel.core.fully_shard import fully_shard
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
    even = all(p.dim() and p.shape[0] % world == 0 for p in model.parameters())
    mesh = init_device_mesh(device.split(":")[0], (world,), mesh_dim_names=("dp",))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    if even or sharder == "fsdp2":
        fully_shard(model, mesh=mesh)
    return model


def _modules(model):
    return list(model.modules()) if isinstance(model, torch.nn.Module) else []


def _is_fsdp(model) -> bool:
    return any(isinstance(m, _FSDP) for m in _modules(model))


def collective_forward(model) -> bool:
    """True when a forward of ``model`` runs collectives: FSDP or HyperParallel modules, or DTensor
    parameters of torch or HyperParallel."""
    if _is_fsdp(model) or any(hyperparallel.is_sharded_module(m) for m in _modules(model)):
        return True
    params = model.parameters() if isinstance(model, torch.nn.Module) else ()
    return any(isinstance(p, DTensor) or hyperparallel.is_dtensor(p) for p in params)


def _output_layer(model):
    get = getattr(model, "get_output_embeddings", None)
    layer = get() if callable(get) else None
    return layer if layer is not None else getattr(model, "lm_head", None)


def find_parallelism(model):
    """(process group, vocab_parallel) of a ``parallelize_module`` model whose output layer is a
    row-sharded DTensor (each rank's logits its vocabulary slice), else None. FSDP's DTensors
    (parameters sharded on the data-parallel mesh) are not tensor parallelism and are not reported;
    FSDP2 applied over such a model (``fully_shard(..., mesh=mesh["dp"])``) leaves the weight on the
    2-D (dp, tp) mesh, FSDP's ``_StridedShard`` first and TP's ``Shard(0)`` last: the last mesh
    dimension's group is the tensor-parallel one.

    A vocabulary that does not split evenly over the mesh is a ``ValueError``: torch gives the
    ranks blocks of different sizes, and the logits gather takes equal blocks."""
    if not isinstance(model, torch.nn.Module):
        return None
    weight = getattr(_output_layer(model), "weight", None)
    if not isinstance(weight, DTensor):
        return None
    mesh, placements = weight.device_mesh, weight.placements
    if _is_fsdp(model):
        # FSDP2 over TP: a (dp..., tp) mesh, FSDP's dims first; FSDP alone: a 1-D dp mesh (not TP)
        if mesh.ndim < 2:
            return None
    elif mesh.ndim != 1:
        return None
    placement = placements[-1]
    if not (type(placement) is Shard and placement.dim == 0):  # not FSDP's _StridedShard
        return None
    vocab, ranks = int(weight.shape[0]), mesh.size(mesh.ndim - 1)
    if vocab % ranks:
        raise ValueError(
            f"the output layer's vocabulary of {vocab} rows is sharded over {ranks} ranks, which does not "
            f"divide it: pad the vocabulary (embedding and LM head) to a multiple of {ranks}, or keep the "
            "logits distributed (ColwiseParallel(use_local_output=False)), which generate gathers whole"
        )
    return mesh.get_group(mesh.ndim - 1), True


def _keep_unsharded(module) -> tuple:
    """Switch off ``module``'s reshard-after-forward; returns what puts it back. FSDP2 keeps that
    setting per parameter group (``post_forward_mesh_info``) with an 'auto' flag for the root: both
    are saved as they are and restored, so an int ``reshard_after_forward`` comes back exactly."""
    state = module._get_fsdp_state()
    saved = (state._auto_reshard_after_forward, [g.post_forward_mesh_info for g in state._fsdp_param_groups])
    module.set_reshard_after_forward(False, recurse=False)
    return state, saved


def _restore(state, saved) -> None:
    auto, infos = saved
    state._auto_reshard_after_forward = auto
    for group, info in zip(state._fsdp_param_groups, infos):
        group.post_forward_mesh_info = info


def _outermost_fsdp(module) -> list:
    """The FSDP2 modules of ``module`` with no FSDP2 module above them (the roots of their trees)."""
    if isinstance(module, FSDPModule) or not isinstance(module, torch.nn.Module):
        return [module] if isinstance(module, FSDPModule) else []
    return [m for child in module.children() for m in _outermost_fsdp(child)]


@contextlib.contextmanager
def parameters_unsharded(model):
    """FSDP2 or HyperParallel modules' parameters all-gathered once for the block (nothing to do for others)."""
    hsdp = [m for m in _modules(model) if hyperparallel.is_sharded_module(m)]
    if hsdp:
        with hyperparallel.gathered(hsdp):
            yield
        return
    fsdp = [m for m in _modules(model) if isinstance(m, FSDPModule)]
    for root in _outermost_fsdp(model):  # what the first forward does: decide the root (its reshard is 'auto')
        root._get_fsdp_state()._lazy_init()
    restore = []
    try:
        for module in fsdp:
            restore.append(_keep_unsharded(module))
            module.unshard()
        yield
    finally:
        for state, saved in restore:
            _restore(state, saved)
        for module in fsdp:
            module.reshard()
