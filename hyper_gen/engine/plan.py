"""A step plan: what rank 0 decided for a step, run by every rank.

A multi-rank model (tensor parallel: every rank holds a slice of every layer) needs every rank to
run the same forwards on the same rows. Rank 0 owns the request queue and the scheduler, so each
step it writes down what only it knows: the requests new to the runners (prompt, settings, the
noise seed of a ``seed=None`` request), the choices it ended on its own (a stop string found in
the text, a cancel, an abort), the scheduler's output (``scheduled``: the step's decodes and
prefill chunks with the blocks they write, and what the runner applies before them), whether the
engine is paused (``hold``: no forward this step, the rows keep their cache), a weight update to
apply (``update``: its version and tensor names, which every rank checks against its own
``update_weights`` call; weight_sync.py), a trainer's weight-update group to join, receive from
or leave (``group``: the call's spec; weight_groups.py), a pool to release or allocate
(``sleep``) and whether to shut down. The tokens follow from the gathered logits, which are the same on every rank. The
plan travels as UTF-8 JSON through ``broadcast_text`` (int32 broadcasts, which every backend has);
an empty plan is one 4-byte broadcast, so a decode step adds one small collective. While rank 0
has nothing to do it sends an empty plan every heartbeat, so the others never wait in one
collective past the timeout.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

from ..parallel.launcher import broadcast_text
from .params import SamplingParams
from .scheduler import SchedulerOutput


@dataclass
class Admission:
    serial: int
    request_id: str
    prompt: List[int]
    params: SamplingParams
    noise_seed: int


@dataclass
class StepPlan:
    admissions: List[Admission] = field(default_factory=list)
    drops: List[Tuple[int, int]] = field(default_factory=list)  # (request serial, choice index)
    shutdown: bool = False
    hold: bool = False  # paused: drop what ``drops`` names, then run nothing
    update: Optional[dict] = None  # {"version": key, "names": [...] or None}: apply update_weights here
    sleep: Optional[bool] = None  # True: release the cache pool here (sleep), False: allocate it (wake_up)
    scheduled: Optional[SchedulerOutput] = None  # the step's work (none: a step that only drops or controls)
    group: Optional[dict] = None  # a weight-update group call's spec (weight_groups.py): every rank runs it here

    @property
    def empty(self) -> bool:
        work = self.scheduled is not None and not self.scheduled.empty
        busy = self.admissions or self.drops or self.shutdown or self.hold or self.update or self.group or work
        return not busy and self.sleep is None

    def encode(self) -> str:
        if self.empty:
            return ""
        return json.dumps(
            {
                "admit": [
                    [a.serial, a.request_id, a.prompt, a.params.to_dict(), str(a.noise_seed)] for a in self.admissions
                ],
                "drop": [list(d) for d in self.drops],
                "shutdown": self.shutdown,
                "hold": self.hold,
                "update": self.update,
                "sleep": self.sleep,
                "scheduled": None if self.scheduled is None else self.scheduled.encode(),
                "group": self.group,
            }
        )

    @classmethod
    def decode(cls, text) -> "StepPlan":
        if text is None:  # rank 0 is gone without a word: end like a shutdown
            return cls(shutdown=True)
        if not text:
            return cls()
        data = json.loads(text)
        admissions = [
            Admission(serial, request_id, prompt, SamplingParams(**params), int(seed))
            for serial, request_id, prompt, params, seed in data["admit"]
        ]
        drops = [tuple(d) for d in data["drop"]]
        scheduled = None if data["scheduled"] is None else SchedulerOutput.decode(data["scheduled"])
        return cls(
            admissions,
            drops,
            bool(data["shutdown"]),
            bool(data["hold"]),
            data["update"],
            data["sleep"],
            scheduled,
            data.get("group"),
        )


def share_plan(ops, plan: StepPlan = None) -> StepPlan:
    """Rank 0's plan on every rank (rank 0 passes it, the others None)."""
    return StepPlan.decode(broadcast_text(ops, None if plan is None else plan.encode()))


__all__ = ["Admission", "StepPlan", "share_plan"]
