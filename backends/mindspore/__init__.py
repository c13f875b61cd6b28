"""MindSpore adapter (CPU here; Ascend where present); importing it selects the device.

Device choice: Ascend when MindSpore was built with it and a device is visible, else CPU.
Asynchronous PyNative launching is very slow for the small ops of a decode loop on CPU, so the
adapter switches to blocking launches there (``mindspore.runtime.launch_blocking()``: ~24 us/op
instead of milliseconds).
"""

from __future__ import annotations

import mindspore as ms

from .ops import MindSporeOps, ms_dtype

_CONFIGURED = False


def default_device() -> str:
    """"Ascend" when an Ascend device is usable, else "CPU"."""
    try:
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
# path (measured: a Qwen3.5 decode step 40x slower when the model was built first).
configure()


def ops_for(obj):
    """MindSporeOps for a Cell or Tensor, else None."""
    if isinstance(obj, (ms.Tensor, ms.nn.Cell)):
        configure()
        return MindSporeOps()
    return None


__all__ = ["MindSporeOps", "ops_for", "ms_dtype", "configure", "default_device"]
