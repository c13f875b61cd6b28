"""What a caller asks of the engine core: one typed message per operation, each with a future.

Every change to the engine's state (a request added, aborted or cancelled, a pause, a weight update,
sleep, shutdown) is a message on the core's one input queue (``core.py``). The core applies the
queued messages in order at a step boundary, the one place where no forward runs and every choice's
tokens are final, and answers each through its future: the caller's thread only checks its
arguments, queues and waits. So there is one way in, one order (a resume queued after a pause is
applied after it, an abort after the add it names), and no state that two threads write.

The messages that must happen on every rank of a tensor-parallel engine at the same boundary (an
``UpdateWeights``, a ``Sleep`` or ``WakeUp`` that changes the pool, a trainer's weight-update group
joined, received from or left: ``WeightGroupCall``) end the batch of messages a
step takes: the step applies them through its plan and computes nothing, and what was queued after
them waits for the next step. On ranks other than 0 the queue holds only ``UpdateWeights`` (each
rank's trainer calls it with the full tensors; rank 0's plan says when every rank applies it).
"""

from __future__ import annotations

from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any, ClassVar, List, Optional


class _All:
    def __repr__(self) -> str:
        return "ALL"


ALL = _All()  # an Abort's target: every unfinished request
PAUSE_MODES = ("abort", "keep")


class EngineDeadError(RuntimeError):
    """The engine stopped on an error of its own; the cause is chained (``__cause__``)."""


@dataclass(eq=False)
class Message:
    """``future``: the message's result (or error), set by the core once it is applied.
    ``waits``: the caller waits on it, so it must not come from the engine's own thread."""

    name: ClassVar[str] = ""
    future: Future = field(default_factory=Future, init=False, repr=False)

    @property
    def waits(self) -> bool:
        return True


@dataclass(eq=False)
class AddRequest(Message):
    """A checked request to queue; its stream is already in the caller's hands."""

    name: ClassVar[str] = "submit"
    request: Any = None

    @property
    def waits(self) -> bool:
        return False


@dataclass(eq=False)
class Abort(Message):
    """End ``target`` (ALL, a request id, a ``Request`` its stream cancels, or one ``Choice`` the
    output processor found a stop string in); the result is the ended requests' ``RequestOutput``s
    in submission order. ``reply=False``: a cancel or a stop, which nobody waits for (allowed from
    any thread, silently dropped once the engine stopped)."""

    name: ClassVar[str] = "abort"
    target: Any = ALL
    reply: bool = True
    requests: List = field(default_factory=list, init=False, repr=False)

    @property
    def waits(self) -> bool:
        return self.reply


@dataclass(eq=False)
class Pause(Message):
    """Hold the batch; ``mode="abort"`` ends every unfinished request first (their outputs are the result)."""

    name: ClassVar[str] = "pause"
    mode: str = "abort"
    requests: List = field(default_factory=list, init=False, repr=False)


@dataclass(eq=False)
class Resume(Message):
    name: ClassVar[str] = "resume"


@dataclass(eq=False)
class UpdateWeights(Message):
    """One rank's ``update_weights`` call: the checked ``update`` (or the ``check_error`` the other
    ranks must still hear of), ``version`` and its text ``key`` and the sorted tensor ``names``,
    which every rank compares with rank 0's; ``taken`` once a step boundary holds it. The result
    is the number of tensors written."""

    name: ClassVar[str] = "update_weights"
    version: Any = None
    key: str = ""
    update: Any = None
    names: Optional[List[str]] = None
    check_error: Optional[BaseException] = None
    taken: bool = False


@dataclass(eq=False)
class WeightGroupCall(Message):
    """A trainer's weight-update group, on every rank at one boundary (``weight_groups.py``): ``spec``
    is what rank 0's plan carries (JSON), the same for every rank. One typed message per SGLang call."""

    spec: dict = field(default_factory=dict)

    def plan_entry(self) -> dict:
        return {"call": self.name, **self.spec}


@dataclass(eq=False)
class JoinWeightGroup(WeightGroupCall):
    """Join the group ``spec["group_name"]`` (every rank at ``rank_offset + rank``); the result is None."""

    name: ClassVar[str] = "init_weights_update_group"


@dataclass(eq=False)
class ReceiveWeights(WeightGroupCall):
    """Receive the tensors ``spec`` announces from the group's rank 0 on every rank, then apply them
    as one update (all or nothing, ``version``), or drop them (``spec["drop"]``); the result is the
    number of tensors written."""

    name: ClassVar[str] = "update_weights_from_distributed"
    version: Any = None


@dataclass(eq=False)
class LeaveWeightGroup(WeightGroupCall):
    """Leave the group ``spec["group_name"]`` on every rank; the result is None."""

    name: ClassVar[str] = "destroy_weights_update_group"


@dataclass(eq=False)
class Sleep(Message):
    """Release the cache pool; refused while requests run or wait unless ``abort`` (their outputs are the result)."""

    name: ClassVar[str] = "sleep"
    abort: bool = False
    requests: List = field(default_factory=list, init=False, repr=False)


@dataclass(eq=False)
class WakeUp(Message):
    name: ClassVar[str] = "wake_up"


@dataclass(eq=False)
class FlushCache(Message):
    """Drop the prefix cache (SGLang's ``flush_cache``); refused while requests run or wait. The
    result is the number of cached blocks dropped."""

    name: ClassVar[str] = "flush_cache"


@dataclass(eq=False)
class Shutdown(Message):
    """End every request still queued or running (finish_reason "abort") and stop."""

    name: ClassVar[str] = "shutdown"

    @property
    def waits(self) -> bool:
        return False


def resolve(message: Message, result=None, error: Optional[BaseException] = None) -> None:
    """Answer ``message`` once (a later answer is ignored: the first one is what its caller saw)."""
    try:
        if error is not None:
            message.future.set_exception(error)
        else:
            message.future.set_result(result)
    except InvalidStateError:
        pass


__all__ = [
    "ALL",
    "PAUSE_MODES",
    "Abort",
    "AddRequest",
    "EngineDeadError",
    "FlushCache",
    "JoinWeightGroup",
    "LeaveWeightGroup",
    "Message",
    "Pause",
    "ReceiveWeights",
    "Resume",
    "Shutdown",
    "Sleep",
    "UpdateWeights",
    "WakeUp",
    "WeightGroupCall",
    "resolve",
]
