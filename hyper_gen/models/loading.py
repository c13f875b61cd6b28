"""``load_model``: an HF checkpoint folder -> a native torch or MindSpore model.

Backend- and family-neutral: the checkpoint's architecture picks the model family
(``hyper_gen.models.FAMILIES``), the backend registry picks the adapter, and the adapter's
``models.<family>.load(checkpoint, dtype, device, plan, group[, cp_plan])`` builds the model.
With ``tp > 1`` or ``cp > 1`` the launcher's process group is joined here and each rank loads
only its tensor-parallel shard (all of it under context parallelism alone).
"""

from __future__ import annotations

import importlib
from typing import Optional

from hyper_gen import kernel_plan, registry
from hyper_gen.models import FAMILIES
from hyper_gen.models.checkpoint import Checkpoint, generation_defaults
from hyper_gen.models.weight_update import WeightSource
from hyper_gen.parallel.cp_plan import CPPlan, Mesh, check_strategy, check_ulysses_heads
from hyper_gen.parallel.launcher import launched_by, launcher_backend
from hyper_gen.parallel.tp_plan import TPPlan

DTYPES = ("float32", "float64", "float16", "bfloat16")


def family_for(checkpoint: Checkpoint):
    """The model-family description module (``hyper_gen.models.<family>``) for the checkpoint."""
    family = FAMILIES.get(checkpoint.architecture)
    if family is None:
        raise ValueError(
            f"checkpoint {checkpoint.path!r} has architecture {checkpoint.architecture or None!r}; "
            f"supported: {', '.join(FAMILIES)}"
        )
    return importlib.import_module(f"hyper_gen.models.{family}")


def load_model(
    path,
    backend: str = "torch",
    dtype: str = "float32",
    device: Optional[str] = None,
    tp: int = 1,
    cp: int = 1,
    cp_strategy: str = "allgather",
    kernels=None,
    batch_invariant: bool = False,
):
    """Load a checkpoint folder as a native ``backend`` model in ``dtype``.

    ``device``: a torch device string for ``backend="torch"`` (default CPU; with ``tp > 1`` the
    rank's own accelerator, ``npu:<LOCAL_RANK>`` / ``cuda:<LOCAL_RANK>``, where one exists); for
    ``backend="mindspore"`` the MindSpore device target ("CPU", "Ascend"), which must be the one
    already selected with ``mindspore.set_device`` (default: whatever is selected).
    The model carries ``generation_defaults`` (eos/pad/bos ids from generation_config.json).

    ``tp``: tensor-parallel ranks. With ``tp > 1`` every process of a ``torchrun`` (torch) or
    ``msrun`` (MindSpore) job of exactly ``tp`` ranks calls this; the job's process group is
    joined if not yet, the config is checked against ``TPPlan(tp, rank)`` before any weight is
    read, and each rank reads only its slices. The tp ranks are the whole job (world == tp).
    Pass the model to ``hyper_gen.generate`` on every rank with the same inputs.

    ``cp``: context-parallel ranks (``hyper_gen.parallel.cp_plan``; contract in
    docs/model_contract.md): each rank prefills its slice of the prompt and caches only that slice
    of the attention K/V. The job is then a ``tp x cp`` mesh of exactly ``tp * cp`` ranks, tensor
    parallelism innermost (global rank = cp_rank * tp + tp_rank).

    ``cp_strategy``: how full-attention layers exchange the prefill, one of
    ``hyper_gen.parallel.cp_plan.STRATEGIES``: ``"allgather"`` (default; every backend) all-gathers
    K|V; ``"ulysses"`` (torch only) runs two all-to-alls, each rank attending over the whole
    sequence for ``1/cp`` of the heads (attention and KV heads per tp rank divisible by ``cp``).
    Both give the same tokens; the cache and decode are the same.

    ``kernels``: which kernel each projection runs through (``hyper_gen.kernel_plan``): "auto"
    (default, or ``$HYPER_GEN_KERNELS``) times each shape once per host and caches the choice on
    disk, so every process on the host runs the same kernels; "plain" runs the framework's plain
    products; a ``.json`` path pins a plan recorded with ``model.kernel_plan.save(path)``.

    ``batch_invariant``: True loads the model in batch-invariant mode (torch native ports, tp = cp =
    1, for now): a row's logits are the same bits alone or among any other rows, padded or not, in
    one prefill, in chunks or one token at a time, so ``generate(..., output_logprobs=True)``'s raw
    logprobs equal ``score()``'s and the model's own full-sequence forward's bit for bit; its
    parameters require grad (the trainer trains this object). Slower (docs/performance.md).
    """
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp must be an int >= 1, got {tp!r}")
    if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1:
        raise ValueError(f"cp must be an int >= 1, got {cp!r}")
    check_strategy(cp_strategy)
    if not isinstance(batch_invariant, bool):
        raise TypeError(f"batch_invariant must be a bool, got {type(batch_invariant).__name__} {batch_invariant!r}")
    kernels = kernel_plan.check_spec(kernels)
    registry.check_name(backend)
    adapter = registry.adapter(backend)
    if cp_strategy not in adapter.CP_STRATEGIES:
        raise ValueError(f"cp_strategy={cp_strategy!r} {adapter.CP_STRATEGIES_WHY}; use one of {adapter.CP_STRATEGIES}")
    if not isinstance(dtype, str):
        raise TypeError(f"dtype must be a str, one of {DTYPES}, got {type(dtype).__name__} {dtype!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if device is not None and not isinstance(device, str):
        raise TypeError(f"device must be a str or None, got {type(device).__name__} {device!r}")
    device = adapter.resolve_device(device, dtype, tp * cp)

    checkpoint = Checkpoint(path)
    family = family_for(checkpoint)
    config = family.config_from_checkpoint(checkpoint)
    port = importlib.import_module(f"{adapter.models.__name__}.{family.NAME}")
    extra = {}
    if batch_invariant:
        _check_batch_invariant(adapter, port, family, tp, cp)
        extra["batch_invariant"] = True
    if cp_strategy == "ulysses":
        _check_ulysses(tp, cp, family, config)
    if cp > 1:
        plan, cp_plan = _join_mesh_job(adapter, tp, cp, family, config, cp_strategy)
        model = port.load(
            checkpoint, dtype, device=device, plan=plan, group=None, cp_plan=cp_plan, kernels=kernels, **extra
        )
    else:
        plan = _join_tp_job(adapter, tp, family, config) if tp > 1 else None
        model = port.load(checkpoint, dtype, device=device, plan=plan, group=None, kernels=kernels, **extra)
    model.generation_defaults = generation_defaults(checkpoint)
    model.weight_source = WeightSource(checkpoint, family)  # for update_weights
    return model


def _check_batch_invariant(adapter, port, family, tp: int, cp: int) -> None:
    """batch_invariant=True where a port declares ``BATCH_INVARIANT`` (one device for now), else a
    ValueError naming what does not support it, before any weight is read."""
    if not getattr(port, "BATCH_INVARIANT", False):
        raise ValueError(
            f"batch_invariant=True is not supported by backend={adapter.NAME!r} for {family.NAME} models yet; "
            "use backend='torch' (native Qwen3.5 dense and MoE) or batch_invariant=False"
        )
    if tp > 1 or cp > 1:
        raise ValueError(f"batch_invariant=True runs on one device for now (tp=1, cp=1), got tp={tp}, cp={cp}")


def _check_launcher_backend(adapter, ranks: int) -> None:
    """A ValueError naming the launcher when this process was started by the other framework's (a
    torch model under msrun, a MindSpore one under torchrun): it cannot join that job, and "a single
    process with no process group" would send the user looking in the wrong place."""
    launcher, backend = launched_by(), launcher_backend(default=None)
    if backend is not None and backend != adapter.NAME:
        raise ValueError(
            f"backend={adapter.NAME!r} cannot join this job: it was started by {launcher}, which launches "
            f"{backend} jobs; use backend={backend!r} (hyper_gen.parallel.launcher.launcher_backend() gives the "
            f"launcher's), or launch it with {adapter.launcher(ranks)}"
        )


def _join_tp_job(adapter, tp: int, family, config) -> TPPlan:
    """This rank's ``TPPlan`` in the launcher's job of ``tp`` ranks, the config checked against it.

    The divisibility checks do not depend on the rank, so a tp that does not divide the heads
    fails (on every rank alike) before the process group is touched."""
    family.check_tp(TPPlan(tp, 0), config)
    if not adapter.init_distributed():
        _check_launcher_backend(adapter, tp)
        raise ValueError(
            f"tp={tp} needs {tp} processes launched together ({adapter.launcher(tp)} ...), but this is a single "
            "process with no process group; use tp=1 here"
        )
    ops = adapter.host_ops()
    world, rank = ops.world_size(), ops.rank()
    if world != tp:
        raise ValueError(
            f"tp={tp} but the job has {world} ranks: tensor parallelism spans the whole job, "
            f"launch it with {adapter.launcher(tp)}"
        )
    plan = TPPlan(tp, rank)
    family.check_tp(plan, config)
    return plan


def _check_ulysses(tp: int, cp: int, family, config) -> None:
    """Ulysses' head split, checked before the process group is touched (the kernels check their
    shard again): the attention and KV heads of one tensor-parallel rank must divide by ``cp``."""
    heads, kv_heads = getattr(config, "num_attention_heads", None), getattr(config, "num_key_value_heads", None)
    if heads is None or kv_heads is None:
        return
    family.check_tp(TPPlan(tp, 0), config)
    start, stop = TPPlan(tp, 0).kv_heads(kv_heads, heads) if tp > 1 else (0, kv_heads)
    check_ulysses_heads(cp, heads // tp, stop - start)


def _join_mesh_job(adapter, tp: int, cp: int, family, config, strategy: str = "allgather"):
    """(TPPlan, CPPlan) of this rank in the launcher's job of ``tp * cp`` ranks (``Mesh``: tp
    innermost), the config checked against the tp split first (on every rank alike)."""
    mesh = Mesh(tp, cp)
    family.check_tp(TPPlan(tp, 0), config)
    if not adapter.init_distributed():
        _check_launcher_backend(adapter, mesh.size)
        raise ValueError(
            f"cp={cp} needs {mesh.size} processes launched together ({adapter.launcher(mesh.size)} ...), but this "
            f"is a single process with no process group; use cp=1{' and tp=1' if tp > 1 else ''} here"
        )
    ops = adapter.host_ops()
    world, rank = ops.world_size(), ops.rank()
    if world != mesh.size:
        raise ValueError(
            f"tp={tp} x cp={cp} needs {mesh.size} ranks but the job has {world}: the tp x cp mesh spans the whole "
            f"job, launch it with {adapter.launcher(mesh.size)}"
        )
    tp_rank, cp_rank = mesh.coordinates(rank)
    plan = TPPlan(tp, tp_rank)
    family.check_tp(plan, config)
    return plan, CPPlan(cp, cp_rank, strategy=strategy)
