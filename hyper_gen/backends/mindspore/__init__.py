"""MindSpore adapter (CPU here; Ascend where present); importing it selects the device.

Device choice: Ascend when MindSpore was built with it and a device is visible, else CPU.
Asynchronous PyNative launching is very slow for the small ops of a decode loop on CPU, so the
adapter switches to blocking launches there (``mindspore.runtime.launch_blocking()``).

The adapter interface every backend provides is described in ``hyper_gen.registry``.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Optional

import mindspore as ms
import numpy as np

from hyper_gen.models import fixed_logits
from hyper_gen.parallel import hyperparallel

from .launch import bind_local_rank_cores
from .ops import MindSporeOps, ms_dtype

NAME = "mindspore"
# context-parallel prefill strategies load_model may use here: no all-to-all for Ulysses
CP_STRATEGIES = ("allgather",)
CP_STRATEGIES_WHY = (
    "needs an all-to-all, which MindSpore's CPU collectives do not have (AllGather, AllReduce and Broadcast only)"
)
_CONFIGURED = False


@contextlib.contextmanager
def _quiet_device_probe():
    """Asked whether Ascend is there, MindSpore logs "Backend Ascend is not available" and its
    plugin's load error as warnings: on a machine without Ascend that is the expected answer, not
    news, and it would land on every library user's stderr at ``import``. Only warnings during the
    probe are dropped (a filter on MindSpore's Python logger, ``ME.mindspore.log.<pid>``, which it
    creates by that name on first use), and only when the user has not set ``GLOG_v``."""
    if "GLOG_v" in os.environ:
        yield
        return
    logger = logging.getLogger(f"ME.mindspore.log.{os.getpid()}")

    def errors_only(record):
        return record.levelno >= logging.ERROR

    logger.addFilter(errors_only)
    try:
        yield
    finally:
        logger.removeFilter(errors_only)


def default_device() -> str:
    """ "Ascend" when an Ascend device is usable, else "CPU"."""
    try:
        with _quiet_device_probe():
            if ms.hal.is_available("Ascend") and ms.hal.device_count("Ascend") > 0:
                return "Ascend"
    except (AttributeError, RuntimeError, ValueError):
        pass
    return "CPU"


def configure(device: str = None) -> str:
    """Pick the device once per process (``set_device`` may only be called before first use)."""
    global _CONFIGURED
    if not _CONFIGURED:
        device = device or default_device()
        try:
            ms.set_device(device)
        except RuntimeError:
            pass  # the user already chose a device
        if ms.get_context("device_target") == "CPU":
            ms.runtime.launch_blocking()
        _CONFIGURED = True
    return ms.get_context("device_target")


# Configure on import: tensors created before launch_blocking() stay on the slow asynchronous
# path (a model built first decodes far slower; docs/performance.md).
configure()

from . import models  # noqa: E402  (after configure: nothing may create a tensor first)
from .launch import init_from_env  # noqa: E402
from .launch import shutdown as shutdown_distributed  # noqa: E402
from .weights import check_dtype  # noqa: E402


def init_distributed(device: str = None, timeout_s: float = None) -> bool:
    """Join the msrun job (``launch.init_from_env``) on this package's device: the device is chosen
    here, communication in ``launch``."""
    configure(device)
    return init_from_env(timeout_s=timeout_s)


def limit_threads(threads: int) -> str:
    """MindSpore fixes its CPU thread pool when the context is created: nothing to set later."""
    return "MindSpore's default CPU threads"


def launcher(ranks: int) -> str:
    return f"msrun --worker_num {ranks}"


def intra_op_threads() -> Optional[int]:
    """None: MindSpore's CPU kernels report no thread count to print with the host."""
    return None


def fixed_logits_model(logits: np.ndarray) -> ms.nn.Cell:
    """``hyper_gen.models.fixed_logits`` as a MindSpore Cell (``bench loop``)."""
    return fixed_logits.fixed_logits_model(ms.nn.Cell, ms.Parameter(ms.Tensor(logits), requires_grad=False))


def resolve_device(device, dtype: str, tp: int = 1) -> str:
    """The selected MindSpore device target; ``device`` must name it (``mindspore.set_device``
    chooses, once per process), and bfloat16 cannot compute on CPU."""
    target = ms.get_context("device_target")
    if device is not None and str(device).lower() != str(target).lower():
        raise ValueError(
            f"device {device!r} is not the selected MindSpore device target {target!r}: call "
            f"mindspore.set_device({device!r}) before load_model"
        )
    check_dtype(dtype)
    return target


def _hsdp_cells(model) -> list:
    cells = [cell for _, cell in model.cells_and_names()] if isinstance(model, ms.nn.Cell) else []
    return [cell for cell in cells if hyperparallel.is_sharded_module(cell)]


def collective_forward(model) -> bool:
    """HyperParallel's ``hsdp`` cells gather their parameter shards in every forward; another Cell
    that does (ZeRO-3 style) says so with ``collective_forward = True``, read by the core before this."""
    return bool(_hsdp_cells(model))


def find_parallelism(model):
    """None: a MindSpore tensor-parallel Cell declares ``parallel_group`` / ``vocab_parallel``."""
    return None


@contextlib.contextmanager
def parameters_unsharded(model):
    """A Cell that can gather its parameter shards once offers ``unshard()`` / ``reshard()``;
    HyperParallel's ``hsdp`` cells go through ``hyper_gen.parallel.hyperparallel.gathered``."""
    unshard, reshard = getattr(model, "unshard", None), getattr(model, "reshard", None)
    if callable(unshard) and callable(reshard) and not _hsdp_cells(model):
        unshard()
        try:
            yield
        finally:
            reshard()
    else:
        with hyperparallel.gathered(_hsdp_cells(model)):
            yield


def thread_initializer():
    """Nothing to carry over: MindSpore's CPU thread settings are process-wide."""
    return lambda: None


def ops_for(obj):
    """MindSporeOps for a Cell or Tensor, else None."""
    if isinstance(obj, (ms.Tensor, ms.nn.Cell)):
        configure()
        return MindSporeOps()
    return None


def host_ops() -> MindSporeOps:
    """Ops for moving host values between ranks."""
    configure()
    return MindSporeOps()
