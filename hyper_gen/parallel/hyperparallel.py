"""HyperParallel's sharding, recognised and gathered once for both frameworks. Its torch
``fully_shard`` modules (``HSDP<Class>``) and its MindSpore ``hsdp`` cells (``HSDPCell``) keep a
``hsdp_scheduler``; its DTensor is ``hyper_parallel.core.dtensor.DTensor`` (on torch a
torch.Tensor subclass that is not torch's DTensor). Everything is read by attribute and class name:
hyper_parallel is never imported here (it is not one of our dependencies)."""

from __future__ import annotations

import contextlib


def is_sharded_module(module) -> bool:
    """A module / cell HyperParallel shards. Between forwards its gathered parameters are plain
    parameters, so a model is recognised by its modules, not only by its parameters' types."""
    return getattr(module, "hsdp_scheduler", None) is not None


def is_dtensor(x) -> bool:
    """A HyperParallel DTensor (its dispatcher refuses ops without a layout rule, e.g. torch's
    ``is_floating_point()``: callers read attributes such as ``dtype`` instead)."""
    return any(c.__name__ == "DTensor" and c.__module__.startswith("hyper_parallel.") for c in type(x).__mro__)


@contextlib.contextmanager
def gathered(modules):
    """``modules``' parameters gathered once for the block through HyperParallel's own ``unshard()``,
    resharding after each forward switched off meanwhile, then every scheduler's setting put back as
    it was (also when the block raises) and ``reshard()``. Its MindSpore ``hsdp`` cells reshard in
    every post-forward hook with no switch to turn that off, so they are left to gather per forward."""
    modules = [m for m in modules if callable(getattr(m.hsdp_scheduler, "set_reshard_after_forward", None))]
    saved = [(m.hsdp_scheduler, m.hsdp_scheduler.reshard_after_forward) for m in modules]
    try:
        for scheduler, _ in saved:
            scheduler.set_reshard_after_forward(False)
        for module in modules:
            module.unshard()
        yield
    finally:
        for scheduler, setting in saved:
            scheduler.reshard_after_forward = scheduler.config.reshard_after_forward = setting
        for module in modules:
            module.reshard()
