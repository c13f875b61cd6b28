"""Communication setup for MindSpore launched by msrun (CPU collectives here, HCCL on Ascend).

Timeouts (``hyper_gen.parallel.launcher``): ``timeout_s`` / ``$HYPER_GEN_TIMEOUT_S`` becomes
``MS_CPU_COMM_OP_TIMEOUT``, how long a CPU collective waits for its peers (MindSpore's default:
30 s), before communication starts; msrun's scheduler separately ends the job when a worker sends
no heartbeat for ``MS_NODE_TIMEOUT`` s (default 30, set in msrun's environment). On Ascend,
``HCCL_EXEC_TIMEOUT`` / ``HCCL_CONNECT_TIMEOUT`` govern HCCL.
"""

from __future__ import annotations

import math
import os

from hyper_gen import host
from hyper_gen.parallel.launcher import TIMEOUT_ENV, collective_timeout_s

CPU_TIMEOUT_ENV = "MS_CPU_COMM_OP_TIMEOUT"
DEFAULT_CPU_TIMEOUT_S = 30  # MindSpore 2.10's CPU collectives, measured (it is not documented)


def launched_by_msrun() -> bool:
    return int(os.environ.get("MS_WORKER_NUM", "1")) > 1 and "MS_ROLE" in os.environ


def init_from_env(timeout_s: float = None) -> bool:
    """Join the msrun job described by the environment; False when not launched by msrun. The
    device is already chosen: the package configures it (``init_distributed``) before this runs."""
    from mindspore.communication import GlobalComm, init

    if GlobalComm.INITED:
        return True
    if not launched_by_msrun():
        return False
    timeout = collective_timeout_s(timeout_s)
    if timeout is not None:
        os.environ[CPU_TIMEOUT_ENV] = str(max(1, math.ceil(timeout)))
    init()
    return True


def timeout_description() -> str:
    """What a failed collective's error says about the wait it ran into."""
    value = os.environ.get(CPU_TIMEOUT_ENV)
    if value is None:
        return f"MindSpore's default {DEFAULT_CPU_TIMEOUT_S} s (set timeout_s= / --timeout / ${TIMEOUT_ENV})"
    return f"{CPU_TIMEOUT_ENV}={value} s (from timeout_s= / --timeout / ${TIMEOUT_ENV})"


def shutdown() -> None:
    from mindspore.communication import GlobalComm, release

    if GlobalComm.INITED:
        release()


def bind_local_rank_cores() -> str:
    """Each local rank's threads on its own cores (``hyper_gen.host.bind_threads_to_share``) when
    distributed: MindSpore's CPU runtime keeps busy helper threads in every process (the kernel
    pool's threads spin on ``sched_yield`` between kernels), so ranks sharing a host's cores stall
    each other, and ranks that meet in a collective per layer wait on every stall (docs/performance.md)."""
    from mindspore.communication import GlobalComm, get_local_rank, get_local_rank_size

    if not GlobalComm.INITED:
        return "MindSpore's default CPU threads (not distributed: not bound)"
    return "MindSpore's default CPU threads, " + host.bind_threads_to_share(get_local_rank(), get_local_rank_size())
