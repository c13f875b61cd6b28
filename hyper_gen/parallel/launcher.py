"""Joining the launcher's job and sharing host values between ranks, framework-free.

MindSpore on CPU has only AllGather, AllReduce and Broadcast, so host values (a chat message,
a seed) travel as int32 tensors through ``broadcast``, which every backend supports.

Collective timeout: how long a rank waits in a collective for a peer before the job fails, so a
stalled or dead rank ends the job instead of hanging it. ``timeout_s=`` where the job is joined
(``init_distributed(backend, timeout_s=)``, ``hyper-gen ... --timeout SECONDS``), else the
environment variable ``HYPER_GEN_TIMEOUT_S`` (which ``load_model(..., tp=)`` honours when it joins
the job), else each backend's default:

- torch: the process group's timeout (``init_process_group(timeout=)``), default 600 s; a gloo
  collective that waits longer raises ``TimeoutError`` naming the timeout on the waiting rank
  (NCCL's watchdog aborts the process instead). A group the program created itself keeps its own.
- MindSpore: sets ``MS_CPU_COMM_OP_TIMEOUT`` (the CPU collectives' wait, MindSpore's default
  30 s, undocumented) before communication starts. msrun's scheduler also ends the job when a
  worker stops sending heartbeats for ``MS_NODE_TIMEOUT`` seconds (default 30; a SIGSTOPped or
  dead rank), which must be set in msrun's own environment. On Ascend, HCCL's own limits apply
  instead: ``HCCL_EXEC_TIMEOUT`` (a collective's execution) and ``HCCL_CONNECT_TIMEOUT`` (building
  links); see CANN's documentation (not measurable on CPU).

A person is not a stalled rank: :func:`broadcast_text_patiently` keeps the other ranks' waits
short while rank 0 waits for stdin, so a chat user may think for as long as they like.
"""

from __future__ import annotations

import math
import os
import queue
import threading
from typing import Callable, Optional

import numpy as np

from hyper_gen import registry

TIMEOUT_ENV = "HYPER_GEN_TIMEOUT_S"
_WAITING = -2  # broadcast_text_patiently's "no text yet" word (lengths are >= 0, -1 is None)


def launched_multi_rank() -> bool:
    """True in a process started by torchrun / msrun with more than one rank."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 or int(os.environ.get("MS_WORKER_NUM", "1")) > 1


# the launchers this package joins, by the variable each sets in its workers, and the framework of each
LAUNCHERS = {"msrun": ("MS_ROLE", "mindspore"), "torchrun": ("TORCHELASTIC_RUN_ID", "torch")}


def launched_by() -> Optional[str]:
    """ "msrun" or "torchrun" in a process one of them started, else None."""
    for launcher, (variable, _) in LAUNCHERS.items():
        if os.environ.get(variable):
            return launcher
    return None


def launcher_backend(default: Optional[str] = "torch") -> Optional[str]:
    """The backend of the launcher that started this process: "mindspore" under msrun, "torch" under
    torchrun, else ``default``. One program then runs under either launcher, as the README's tensor-
    and context-parallel examples do: ``load_model(path, backend=launcher_backend(), tp=2)``."""
    launcher = launched_by()
    return default if launcher is None else LAUNCHERS[launcher][1]


def collective_timeout_s(timeout_s=None) -> Optional[float]:
    """The collective timeout asked for, in seconds: ``timeout_s``, else ``$HYPER_GEN_TIMEOUT_S``,
    else None (the backend's default). Anything but a positive finite number is a ValueError."""
    source = "timeout_s"
    if timeout_s is None:
        timeout_s = os.environ.get(TIMEOUT_ENV) or None
        source = TIMEOUT_ENV
        if timeout_s is None:
            return None
    try:
        value = float(timeout_s)
    except (TypeError, ValueError):
        value = math.nan
    if isinstance(timeout_s, bool) or not (math.isfinite(value) and value > 0):
        raise ValueError(f"{source} must be a positive number of seconds, got {timeout_s!r}")
    return value


def init_distributed(backend: str, timeout_s=None) -> bool:
    """Join the torchrun / msrun job when launched by one; False for a single process.
    ``timeout_s``: the collective timeout (module docstring; None: $HYPER_GEN_TIMEOUT_S or the default)."""
    return registry.adapter(backend).init_distributed(timeout_s=timeout_s)


def shutdown_distributed(backend: str) -> None:
    registry.adapter(backend).shutdown_distributed()


def host_ops(backend: str):
    """Ops for moving host values between ranks (the backend's adapter on its default device)."""
    return registry.adapter(backend).host_ops()


def broadcast_ints(ops, values, src: int = 0) -> np.ndarray:
    """Rank ``src``'s int array (at most int32 range) on every rank; others pass the same length."""
    return ops.to_numpy(ops.broadcast(ops.asarray(np.asarray(values, dtype=np.int32), "int32"), src=src))


def _send_text(ops, text, src: int):
    payload = None if text is None else np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
    broadcast_ints(ops, [-1 if payload is None else payload.size], src)
    if payload is not None and payload.size:
        broadcast_ints(ops, payload.astype(np.int32), src)
    return text


def _receive_text(ops, length: int, src: int):
    if length <= 0:
        return None if length < 0 else ""
    data = broadcast_ints(ops, np.zeros(length, np.int32), src)
    return bytes(data.astype(np.uint8)).decode("utf-8")


def broadcast_text(ops, text, src: int = 0):
    """Rank ``src``'s string (or None, e.g. end of input) on every rank."""
    if ops.world_size() == 1:
        return text
    if ops.rank() == src:
        return _send_text(ops, text, src)
    return _receive_text(ops, int(broadcast_ints(ops, [0], src)[0]), src)


def broadcast_text_patiently(ops, read: Callable[[], Optional[str]], src: int = 0, tick_s: float = 1.0):
    """Rank ``src``'s ``read()`` (a string, or None) on every rank, however long ``read`` takes.

    ``read`` runs on rank ``src`` only, in a helper thread; until it returns, ``src`` broadcasts a
    "still waiting" word every ``tick_s`` seconds, so no rank ever sits in one collective longer
    than that (a person thinking at a chat prompt is not a stalled rank, whatever the collective
    timeout). An exception from ``read`` ends the input on every rank (None), then is raised on src.
    """
    if ops.world_size() == 1:
        return read()
    if ops.rank() != src:
        while True:
            word = int(broadcast_ints(ops, [0], src)[0])
            if word != _WAITING:
                return _receive_text(ops, word, src)
    done: "queue.Queue" = queue.Queue(maxsize=1)

    def run():
        try:
            done.put((read(), None))
        except BaseException as error:  # handed to the main thread, raised there
            done.put((None, error))

    threading.Thread(target=run, name="hyper_gen-read", daemon=True).start()
    while True:
        try:
            text, error = done.get(timeout=tick_s)
            break
        except queue.Empty:
            broadcast_ints(ops, [_WAITING], src)
    _send_text(ops, None if error is not None else text, src)
    if error is not None:
        raise error
    return text


def heartbeat_s(timeout_s: Optional[float]) -> float:
    """How often a waiting rank 0 tells the others it is still there: well inside the timeout."""
    return 1.0 if timeout_s is None else max(0.05, min(1.0, timeout_s / 4))
