"""A weight update that lands on every rank or on none, at the step boundary rank 0's plan names.

Each rank of a tensor-parallel model holds its own slices of the weights, so every rank's trainer
calls ``update_weights`` with the full tensors, and each rank checks them in its calling thread
(``message``) and queues them on its own engine core. Rank 0's plan names the update (its version
and tensor names); at that boundary every rank takes its call, converts (the port's load code cuts
its part, nothing written yet), and the ranks agree through one all-gather of a status word
(waiting / converted / failed) before any writes: a write on some ranks only would leave a model
that no checkpoint describes. So all of them write, or none does and every rank's call raises the
same ValueError naming the rank that failed and why. A rank whose trainer has not called yet says
"waiting" every heartbeat, so no collective waits past the heartbeat, and gives up after
``timeout_s`` (``Engine.update_timeout_s``): every rank's call raises a ValueError naming it, it
warns (RuntimeWarning), and its trainer's late call then raises the same error. A follower's call
that rank 0 never applies raises TimeoutError.

One process is the same path with a world of one: no collective, and the update's own error (a
failed conversion) is what the caller gets, since there is no other rank to name.
"""

from __future__ import annotations

import json
import threading
import time
import warnings
from typing import Callable, List, Optional

import numpy as np

from ..parallel.launcher import broadcast_text
from .messages import UpdateWeights, resolve

_WAITING, _READY, _FAILED = 0, 1, 2  # a rank's word in the agreement
_MISSED_KEPT = 16  # a follower remembers this many updates it missed (its late call then raises)


def version_key(version) -> str:
    """``version`` as text, the same on every rank for the same value (ranks compare it)."""
    return json.dumps(version, sort_keys=True, default=repr)


def _describe(error: BaseException) -> str:
    return str(error) if isinstance(error, ValueError) else f"{type(error).__name__}: {error}"


class WeightSync:
    """This rank's side of every update: the checks in the caller's thread, the agreement at the
    boundary. ``timeout_s``: how long this rank waits for its own trainer's call (read live)."""

    def __init__(self, ops, rank: int, world_size: int, heartbeat_s: float, timeout_s: float):
        self.ops, self.rank, self.world_size = ops, rank, world_size
        self.heartbeat_s = heartbeat_s
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._missed: dict = {}  # other ranks: updates whose call never came -> the error (a late call raises)

    # ---- the caller's thread -------------------------------------------------------------------
    def message(self, model, weights, version, defer: bool = False, checked=None) -> UpdateWeights:
        """The checked call as a message. One process: a bad tensor raises here, nothing queued; on
        a multi-rank engine (or with ``defer``: tensors received at the boundary) it is kept in the
        message all the same, since the other ranks must hear of it. A model without a
        ``weight_source`` (not loaded by ``hyper_gen.load_model``) is a ValueError. ``checked``: a
        callable giving the update already checked tensor by tensor (``Checker.finish``), instead of
        checking ``weights`` here."""
        source = getattr(model, "weight_source", None)  # hyper_gen.models.weight_update.WeightSource
        if source is None:
            raise ValueError(
                f"update_weights needs a native model loaded by hyper_gen.load_model, got {type(model).__name__}"
            )
        message = UpdateWeights(version=version, key=version_key(version))
        if self.rank != 0:
            with self._lock:
                missed = self._missed.pop(message.key, None)
            if missed is not None:  # the late call of an update the ranks already gave up on
                raise ValueError(missed)
        try:
            message.update = checked() if checked is not None else source.check(model, weights)
            message.names = sorted(message.update.arrays)
        except Exception as error:
            if self.world_size == 1 and not defer:
                raise
            message.check_error = error
        return message

    @staticmethod
    def spec(message: UpdateWeights) -> dict:
        """What rank 0's plan says of the update: every rank checks its own call against it."""
        return {"version": message.key, "names": message.names}

    # ---- the boundary (every rank) -------------------------------------------------------------
    def apply(
        self,
        spec: dict,
        message: Optional[UpdateWeights],
        take: Callable[[float], Optional[UpdateWeights]],
        written: Callable[[object], None],
    ) -> None:
        """Take this rank's call (``message`` on rank 0; ``take(seconds)`` waits for a follower's),
        convert, agree, then all write or none does; ``written(version)`` after a write, then the
        caller's future gets the count. An error past the agreement stops a multi-rank engine (the
        ranks' weights may now differ); one process reports it to the caller and goes on."""
        word, text, write, missed = _WAITING, "", None, False
        start = time.monotonic()
        try:
            while True:
                if word == _WAITING:
                    message = message or take(self.heartbeat_s)
                    if message is not None:
                        word, text, write = self._convert(message, spec)
                    elif time.monotonic() - start >= self.timeout_s:
                        word, missed = _FAILED, True
                        text = (
                            f"update_weights was not called on rank {self.rank} within {self.timeout_s:g} s "
                            "(engine.update_timeout_s) of the step boundary rank 0 chose for it"
                        )
                words = self.gather(word)
                if _WAITING not in words:
                    break
            failed = [r for r, w in enumerate(words) if w == _FAILED]
            if failed:
                self._refuse(spec, message, failed, text, missed)
                return
            count = write()
            written(message.version)
            resolve(message, count)
        except BaseException as error:
            if message is not None:
                resolve(message, error=error)
            if self.world_size > 1:
                raise

    def _refuse(self, spec, message, failed: List[int], text: str, missed: bool) -> None:
        """Every rank learns each failed rank's reason (the failure path only) and raises it."""
        if self.world_size == 1 and message is not None and message.check_error is not None:
            resolve(message, error=message.check_error)
            return
        reasons = "; ".join(f"rank {r}: {m}" for r, m in zip(failed, self.told(failed, text)))
        error = ValueError(
            f"update_weights(version={spec['version']}) failed on {reasons}; no rank wrote its weights "
            "(the model is unchanged)"
        )
        if message is not None:
            error.__cause__ = message.check_error
            resolve(message, error=error)
        if missed:
            self._miss(spec["version"], str(error))

    def _convert(self, message: UpdateWeights, spec: dict):
        """(word, reason, write): this rank's conversion, nothing written."""
        if message.check_error is not None:
            return _FAILED, _describe(message.check_error), None
        if message.key != spec["version"]:
            return _FAILED, f"version={message.key} differs from rank 0's version={spec['version']}", None
        if spec["names"] is not None and message.names != spec["names"]:
            mine, theirs = set(message.names), set(spec["names"])
            parts = [f"{label}: {sorted(names)[:3]}" for label, names in (
                ("rank 0 sends, this rank does not", theirs - mine),
                ("this rank sends, rank 0 does not", mine - theirs),
            ) if names]  # fmt: skip
            return _FAILED, f"its tensor names differ from rank 0's ({'; '.join(parts)})", None
        try:
            return _READY, "", message.update.prepare()
        except Exception as error:
            message.check_error = error
            return _FAILED, _describe(error), None

    def told(self, failed: List[int], text: str) -> List[str]:
        """Each failed rank's ``text``, on every rank (one broadcast per failed rank: the failure path only)."""
        if self.world_size == 1:
            return [text]
        return [broadcast_text(self.ops, text if r == self.rank else None, src=r) for r in failed]

    def gather(self, word: int) -> List[int]:
        """Every rank's ``word`` (a small int), in rank order."""
        if self.world_size == 1:
            return [word]
        gathered = self.ops.all_gather(self.ops.asarray(np.asarray([word], np.int32), "int32"), 0)
        return [int(w) for w in self.ops.to_numpy(gathered).reshape(-1)]

    def _miss(self, key: str, text: str) -> None:
        """A follower whose trainer never called: remember it (its late call raises) and say so now."""
        with self._lock:
            self._missed[key] = text
            while len(self._missed) > _MISSED_KEPT:
                self._missed.pop(next(iter(self._missed)))
        warnings.warn(f"rank {self.rank}: {text}", RuntimeWarning, stacklevel=3)


__all__ = ["WeightSync", "version_key"]
