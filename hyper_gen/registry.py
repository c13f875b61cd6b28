"""The one backend registry: backend name -> the adapter package that implements it.

Every layer asks this module (the generate core to find the ops of a model or tensor, the model
loader to build a native model, the CLI and the launchers to join a job). An adapter is a package
``hyper_gen.backends.<name>`` that provides, at module level:

- ``ops_for(obj) -> Ops | None``: ops bound to the device of a model or tensor it recognises;
- ``host_ops() -> Ops``: ops on the default device, for moving host values between ranks;
- ``init_distributed(timeout_s=None) -> bool`` / ``shutdown_distributed()``: join / leave the
  launcher's job (``timeout_s``: how long a collective may wait, see ``parallel.launcher``);
- ``launcher(n) -> str``: the command that starts n ranks (for error messages);
- ``limit_threads(n) -> str``: cap intra-op threads where the framework allows (benchmarks of
  ranks sharing a host), returning what it did;
- ``resolve_device(device, dtype, tp) -> device``: where ``load_model`` puts the weights, raising
  ``ValueError`` for a dtype the device cannot compute in;
- ``models``: a package with one module per model family (``models.qwen3_5.load(...)``);
- ``collective_forward(model) -> bool``: whether the model's forwards run collectives across
  data-parallel ranks (FSDP, DTensor parameters), so generate keeps ranks stepping together;
- ``find_parallelism(model) -> (group, vocab_parallel) | None``: tensor parallelism found in the
  model's parameters (torch ``parallelize_module``), for models without ``parallel_group``;
- ``parameters_unsharded(model)``: a context holding sharded parameters gathered (FSDP2 unshard);
- ``thread_initializer() -> callable``: read on the calling thread, run first on a new thread that
  will call the model, so it computes with the caller's settings (torch's intra-op thread count is
  per thread: a new thread's default team was measured 2.7x slower on 2 cores).

and, for the benchmarks (which ask the adapter for a capability, never compare backend names):

- ``intra_op_threads() -> int | None``: the threads its CPU kernels compute with, where it reports them;
- ``bind_local_rank_cores() -> str | None``: bind this rank's threads to its share of the host's
  cores where its runtime needs that (busy helper threads), saying what it did; None: nothing to do;
- ``fixed_logits_model(logits)``: a model of the framework whose forward only returns ``logits``
  (the generate loop's own cost, ``bench loop``).

Optional, asked for with ``getattr`` (a server answers what an adapter lacks with a 400):

- ``join_weight_group(model, master_address, master_port, rank, world_size, group_name, backend,
  timeout_s)``: join a trainer's weight-update group (SGLang's ``/init_weights_update_group``),
  returning a group with ``receive(specs, timeout_s, flattened, arrived)`` (``arrived(item)`` as
  each tensor is in) and ``destroy()``; ``weight_dtype_is_floating(text)``
  (a ValueError for a dtype it does not know); ``WEIGHT_GROUP_BACKENDS``.
- ``group_timeout_s() -> float | None``: the collective timeout of the job's default group as the
  program created it (a chat's heartbeat stays well inside it).

The torch adapter also offers ``cpu_products(x, w)``, the float32 CPU products its kernels run
(``bench models`` times the host's anchors with torch), and ``load_sharded(path, dtype, sharder)``:
an HF model sharded over the job's ranks by one of its ``Backend.sharders`` (``--shard``).

Adapters are imported on first use, and :func:`backend_for` only asks adapters whose framework is
already imported, so ``import hyper_gen`` never imports torch or mindspore. A new backend is one
entry in ``BACKENDS`` plus its package.
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass
from typing import Any, List, Optional


@dataclass(frozen=True)
class Backend:
    name: str  # what users type: load_model(backend=...), --backend
    framework: str  # the top-level module whose presence in sys.modules makes the adapter eligible
    package: str  # the adapter package
    sharders: tuple = ()  # what its load_sharded shards an HF model with (--shard), known without importing it


BACKENDS = {
    "torch": Backend("torch", "torch", "hyper_gen.backends.torch", ("fsdp2", "hyperparallel")),
    "mindspore": Backend("mindspore", "mindspore", "hyper_gen.backends.mindspore"),
}


def names() -> tuple:
    return tuple(BACKENDS)


def check_name(name: Any) -> str:
    """``name`` if it is a registered backend, else a ValueError naming the choices."""
    if not isinstance(name, str) or name not in BACKENDS:
        raise ValueError(f"backend must be one of {names()}, got {name!r}")
    return name


def adapter(name: str):
    """The adapter package of backend ``name`` (imports its framework)."""
    return importlib.import_module(BACKENDS[check_name(name)].package)


def imported_adapters() -> List[Any]:
    """Adapters of every framework already imported (the only ones a foreign object can belong to)."""
    return [importlib.import_module(b.package) for b in BACKENDS.values() if b.framework in sys.modules]


def adapter_of(obj: Any):
    """The adapter of the first imported framework that claims ``obj`` (a model or a tensor), or None."""
    for adapter_module in imported_adapters():
        if obj is not None and adapter_module.ops_for(obj) is not None:
            return adapter_module
    return None


def backend_for(*objects: Any):
    """The ops of the first imported framework that claims one of ``objects`` (a model or a tensor)."""
    for adapter_module in imported_adapters():
        for obj in objects:
            if obj is None:
                continue
            ops = adapter_module.ops_for(obj)
            if ops is not None:
                return ops
    kinds = ", ".join(type(o).__name__ for o in objects if o is not None)
    raise TypeError(
        f"no backend recognises {kinds or 'nothing'}: pass a torch.nn.Module / mindspore.nn.Cell model "
        "(or a callable whose parameters or inputs are torch / mindspore tensors)"
    )


def thread_initializer(name: Optional[str] = None):
    """The callable a new thread about to run backend ``name``'s models (None: every imported
    framework's) calls first (see above)."""
    steps = [adapter(name).thread_initializer()] if name else [a.thread_initializer() for a in imported_adapters()]

    def initialize():
        for step in steps:
            step()

    return initialize


def to_host(value: Any) -> Any:
    """A framework tensor as a numpy array; anything else unchanged."""
    for adapter_module in imported_adapters():
        ops = adapter_module.ops_for(value)
        if ops is not None and ops.is_tensor(value):
            return ops.to_numpy(value)
    return value
