"""Communication setup for MindSpore launched by msrun (CPU collectives here, HCCL on Ascend)."""

from __future__ import annotations

import os

from . import configure


def launched_by_msrun() -> bool:
    return int(os.environ.get("MS_WORKER_NUM", "1")) > 1 and "MS_ROLE" in os.environ


def init_from_env(device: str = None) -> bool:
    """Join the msrun job described by the environment; False when not launched by msrun."""
    from mindspore.communication import GlobalComm, init

    if GlobalComm.INITED:
        return True
    if not launched_by_msrun():
        return False
    configure(device)
    init()
    return True


def shutdown() -> None:
    from mindspore.communication import GlobalComm, release

    if GlobalComm.INITED:
        release()
