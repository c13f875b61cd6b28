"""A step plan: what changes in the batch before a step, decided by rank 0 and run by every rank.

A multi-rank model (tensor parallel: every rank holds a slice of every layer) needs every rank to
run the same forwards on the same rows. Rank 0 owns the request queue, so each step it writes
down what only it knows: the requests admitted (prompt, settings, the noise seed of a
``seed=None`` request), the rows it ended on its own (a stop string found in the text, a cancel,
an abort), whether the engine is paused (``hold``: no forward this step, the rows keep their
cache), a weight update to apply (``update``: its version and tensor names, which every rank
checks against its own ``update_weights`` call; control.py) and whether to shut down.
Everything else (tokens, EOS, ``max_tokens``) follows from the gathered logits, which are the
same on every rank. The plan travels as UTF-8 JSON through
``broadcast_text`` (int32 broadcasts, which every backend has); an empty plan is one 4-byte
broadcast, so a decode step adds one small collective. While rank 0 has nothing to do it sends
an empty plan every heartbeat, so the others never wait in one collective past the timeout.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

from ..parallel.launcher import broadcast_text
from .params import SamplingParams


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

    @property
    def empty(self) -> bool:
        return not (self.admissions or self.drops or self.shutdown or self.hold or self.update) and self.sleep is None

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
        return cls(
            admissions, drops, bool(data["shutdown"]), bool(data.get("hold")), data.get("update"), data.get("sleep")
        )


def share_plan(ops, plan: StepPlan = None) -> StepPlan:
    """Rank 0's plan on every rank (rank 0 passes it, the others None)."""
    return StepPlan.decode(broadcast_text(ops, None if plan is None else plan.encode()))


__all__ = ["Admission", "StepPlan", "share_plan"]
