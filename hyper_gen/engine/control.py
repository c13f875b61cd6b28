"""Abort, pause and resume: the control surface an RL trainer drives between rollouts (verl, SGLang and
vLLM use these names).

A control call comes from any thread but changes the batch only at a step boundary, the one place
where no forward is running and every choice's tokens are final. The caller queues a ``Control``
ticket under the engine's lock and waits for it: the engine thread takes the queued tickets when it
plans its next step (``Engine._plan_step``), together with the cancels, so an abort is a cancel
whose output comes back to the caller. An engine stepped by the caller (``start(background=False)``)
has no thread to wait for: the calling thread settles the tickets itself, holding the step lock, so
it never runs inside a step. Either way the rows that end leave at the next plan, and a pause is the
plan's ``hold`` flag: both travel in the plan rank 0 shares, so every rank of a tensor-parallel
engine drops and holds the same rows.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import List, Optional

ALL = object()  # a Control's target: every unfinished request
PAUSE_MODES = ("abort", "keep")
_SETTLE_POLL_S = 0.25


class Control:
    """One abort / pause / resume, settled by the engine at a step boundary.

    ``target``: ALL, a request id, or None (abort nothing); ``pause``: True / False to set the
    engine's paused state, None to leave it; ``update``: a checked ``WeightUpdate`` to apply, and
    ``version`` the ``weight_version`` outputs carry from then on. The engine fills ``requests``
    (those it aborted, in submission order) and ``outputs`` (their ``RequestOutput``s), or
    ``error``, then sets ``done``."""

    def __init__(self, target=None, pause: Optional[bool] = None, update=None, version=None):
        self.target = target
        self.pause = pause
        self.update, self.version = update, version
        self.requests: list = []
        self.outputs: list = []
        self.error: Optional[BaseException] = None
        self.done = threading.Event()


class RecentIds:
    """The request ids of the last ``size`` requests that ended, so ``abort`` can tell an id that
    finished (a no-op) from one never submitted (a ValueError) without keeping every id forever."""

    def __init__(self, size: int = 100_000):
        self._lock = threading.Lock()
        self._order: deque = deque()
        self._counts: dict = {}
        self._size = size

    def add(self, request_id: str) -> None:
        with self._lock:
            self._order.append(request_id)
            self._counts[request_id] = self._counts.get(request_id, 0) + 1
            if len(self._order) > self._size:
                old = self._order.popleft()
                self._counts[old] -= 1
                if not self._counts[old]:
                    del self._counts[old]

    def __contains__(self, request_id) -> bool:
        with self._lock:
            return request_id in self._counts


class EngineControl:
    """``Engine``'s abort / pause / resume (a mixin: the engine's state lives in engine.py)."""

    # ---- public API ---------------------------------------------------------------------------
    def abort_all(self) -> list:
        """End every unfinished request at the next step boundary and return their ``RequestOutput``s
        (submission order): the tokens and logprobs decoded so far, finish_reason "abort" on each
        choice still running (a choice that had ended keeps its reason). Queued requests end too,
        with no tokens. Their streams end cleanly: a last chunk, then the output (no exception)."""
        return self._control(Control(ALL)).outputs

    def abort(self, request_id: str):
        """``abort_all`` for one request: its ``RequestOutput``, or None when it had already finished
        (a no-op; an id counts as finished for the last 100,000 requests that ended). An id never
        submitted is a ValueError. Request ids are the caller's: every unfinished request with this
        id ends, and the first submitted one's output is returned."""
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {request_id!r}")
        ticket = self._control(Control(request_id))
        return ticket.outputs[0] if ticket.outputs else None

    def pause(self, mode: str = "abort") -> list:
        """Stop scheduling at the next step boundary; returns once no step runs (weights may then
        change under the model). ``mode="abort"``: every unfinished request ends as with
        ``abort_all`` (their outputs are returned); ``"keep"``: running requests keep their rows and
        cache, and continue on ``resume()`` with exactly the tokens of an uninterrupted run
        (returns []). While paused ``submit`` queues (admitted after ``resume``), ``abort`` and
        ``cancel`` still end requests, and an engine stepped by the caller runs no forward: its
        ``step()`` returns False."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode must be one of {PAUSE_MODES}, got mode={mode!r}")
        return self._control(Control(ALL if mode == "abort" else None, pause=True)).outputs

    def resume(self) -> None:
        """Continue scheduling after ``pause``: kept rows decode on, queued requests are admitted.
        A no-op when the engine is not paused."""
        with self._cond:
            if not self._paused and not any(t.pause for t in self._controls):
                return
        self._control(Control(pause=False))

    def update_weights(self, weights, version=None) -> int:
        """``hyper_gen.update_weights`` on the engine's model at the next step boundary; returns the
        number of tensors applied. Every ``RequestOutput`` made after it carries ``weight_version =
        version``. Running requests continue on the new weights from their next token (vLLM's
        semantics: the cache they built keeps the old weights' keys and values); ``pause(mode="keep")``
        first and ``resume()`` after to apply it between rollouts instead. The tensors are checked in
        the calling thread (a ValueError / TypeError naming the tensor, nothing queued), converted and
        written between two steps; an error there raises here and changes nothing."""
        if self.world_size > 1:
            raise NotImplementedError(
                "update_weights on a multi-rank engine: update the model on every rank while paused"
            )
        source = getattr(self.model, "weight_source", None)  # hyper_gen.models.weight_update.WeightSource
        if source is None:
            raise ValueError(
                f"update_weights needs a native model loaded by hyper_gen.load_model, got {type(self.model).__name__}"
            )
        update = source.check(self.model, weights)
        return self._control(Control(update=update, version=version)).outputs

    @property
    def weight_version(self):
        """The ``version`` of the last ``update_weights`` applied (None before any)."""
        return self._weight_version

    @property
    def paused(self) -> bool:
        """Whether the engine is paused (a snapshot, read without the engine's lock)."""
        return self._paused

    # ---- queueing and waiting (the calling thread) ----------------------------------------------
    def _control(self, ticket: Control) -> Control:
        if self.rank != 0:
            raise RuntimeError(f"rank {self.rank} follows rank 0's steps: abort / pause / resume on rank 0")
        with self._cond:
            self._check_running()
            if self._loop_ident == threading.get_ident():
                raise RuntimeError(
                    "abort / pause / resume waits for a step boundary: call it from another thread than the "
                    "engine's (not from a done callback)"
                )
            self._controls.append(ticket)
            self._cond.notify_all()
        if self._thread is None:  # stepped by the caller: settle here, between two steps
            with self._step_lock:
                with self._cond:
                    aborted, tickets = self._take_controls()
                self._settle(aborted, tickets)
        while not ticket.done.wait(_SETTLE_POLL_S):
            if self._state in ("dead", "stopped"):
                with self._cond:
                    if not ticket.done.is_set():
                        self._check_running()
        if ticket.error is not None:
            raise ticket.error
        return ticket

    # ---- settling (the engine thread, or the caller holding the step lock) ----------------------
    def _take_controls(self):
        """(requests to abort, tickets) from the queued tickets, in the order they came; sets the
        paused state and takes the queued requests it aborts out of the queue (lock held). The
        aborted requests' rows are the caller's to drop."""
        tickets, self._controls = self._controls, []
        aborted: List = []
        for ticket in tickets:
            if ticket.target is not None:
                ticket.requests = self._targets(ticket)
                for request in ticket.requests:
                    if request in self._waiting:
                        self._waiting.remove(request)
                aborted += ticket.requests
            if ticket.pause is not None:
                self._paused = ticket.pause
        return aborted, tickets

    def _targets(self, ticket: Control) -> list:
        candidates = sorted([*self._waiting, *self._live.values()], key=lambda r: r.serial)
        if ticket.target is not ALL:
            candidates = [r for r in candidates if r.request_id == ticket.target]
            if not candidates and ticket.target not in self._ended:
                ticket.error = ValueError(
                    f"abort: no request with request_id={ticket.target!r} was submitted to this engine"
                )
        return [r for r in candidates if not r.closed]

    def _settle(self, aborted, tickets) -> None:
        """End the aborted requests (a last "abort" chunk, the stream closed with its output) and hand
        each ticket its outputs."""
        for request in aborted:
            self._abort(request)
        for ticket in tickets:
            if ticket.update is not None:
                try:  # all or nothing: conversion errors come before any write
                    ticket.outputs = ticket.update.apply()
                    self._weight_version = ticket.version
                except Exception as error:
                    ticket.error = error
                ticket.done.set()
                continue
            ticket.outputs = [self._output(r) for r in ticket.requests]
            ticket.done.set()

    def _fail_controls(self, error: BaseException) -> None:
        with self._cond:
            tickets, self._controls = self._controls, []
        for ticket in tickets:
            ticket.error = error
            ticket.done.set()


__all__ = ["ALL", "Control", "EngineControl", "PAUSE_MODES", "RecentIds"]
