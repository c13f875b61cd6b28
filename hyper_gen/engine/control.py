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

A weight update on a multi-rank engine is a collective: every rank holds its own slices of the
weights, so every rank's trainer calls ``update_weights`` with the full tensors, and each rank
checks them in its calling thread and stages them (rank 0 as a queued ticket, the others in
``_staged``). Rank 0 names the update in one step plan (its version and tensor names); at that
boundary every rank takes its staged call, converts (the port's load code slices its part), and
the ranks agree through one all-gather of a status word (waiting / converted / failed) before any
writes: all of them write, or none does and every rank's call raises the same ValueError naming
the rank that failed and why. A rank whose trainer has not called yet reports "waiting" every
heartbeat, so no collective waits past the heartbeat, and gives up after ``update_timeout_s``.
"""

from __future__ import annotations

import json
import threading
import time
import warnings
from collections import deque
from typing import List, Optional

import numpy as np

from ..parallel.launcher import broadcast_text
from .plan import StepPlan, share_plan

ALL = object()  # a Control's target: every unfinished request
PAUSE_MODES = ("abort", "keep")
_SETTLE_POLL_S = 0.25
_WAITING, _READY, _FAILED = 0, 1, 2  # a rank's word in a multi-rank update's agreement
_MISSED_KEPT = 16  # a follower remembers this many updates it missed (its late call then raises)


class Control:
    """One abort / pause / resume, settled by the engine at a step boundary.

    ``target``: ALL, a request id, or None (abort nothing); ``pause``: True / False to set the
    engine's paused state, None to leave it; ``update``: a checked ``WeightUpdate`` to apply, and
    ``version`` the ``weight_version`` outputs carry from then on. The engine fills ``requests``
    (those it aborted, in submission order) and ``outputs`` (their ``RequestOutput``s), or
    ``error``, then sets ``done``.

    A multi-rank update (``collective``) also carries what this rank's check found (``update``, or
    ``check_error``: the other ranks must still hear of it), the version as text and the sorted
    tensor names, which every rank compares with rank 0's; ``taken`` once a step boundary holds it."""

    def __init__(self, target=None, pause: Optional[bool] = None, update=None, version=None, sleep=None):
        self.target = target
        self.pause = pause
        self.sleep = sleep  # True: free the cache pool (sleep), False: allocate it again (wake_up)
        self.planned = False  # a multi-rank sleep / wake_up: named in a step plan
        self.update, self.version = update, version
        self.requests: list = []
        self.outputs: list = []
        self.error: Optional[BaseException] = None
        self.done = threading.Event()
        self.collective = False
        self.check_error: Optional[BaseException] = None
        self.version_key: str = ""
        self.names: Optional[list] = None
        self.taken = False


def version_key(version) -> str:
    """``version`` as text, the same on every rank for the same value (ranks compare it)."""
    return json.dumps(version, sort_keys=True, default=repr)


def _busy(requests) -> RuntimeError:
    return RuntimeError(
        f"engine.sleep(): {len(requests)} request(s) are running or queued; let them finish, or call "
        "sleep(abort=True) to end them"
    )


def _describe(error: BaseException) -> str:
    return str(error) if isinstance(error, ValueError) else f"{type(error).__name__}: {error}"


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
        written between two steps; an error there raises here and changes nothing.

        On a multi-rank (tensor-parallel) engine this is a collective, like a torch.distributed call:
        call it on every rank, in the same order, with the same ``version`` and the same tensor names
        (the full HF-named tensors on each rank; a DTensor is made whole), on rank 0 from another
        thread than the engine's, elsewhere from another thread than the one in ``run_follower``.
        Each rank holds only its own slices, so each checks its tensors here and, at the step
        boundary rank 0's plan names, cuts its part with the port's load code; the ranks then agree
        (one small all-gather) that every one of them converted before any writes, because a write
        on some ranks only would leave a model that no checkpoint describes. So the update lands on
        every rank or on none: a bad tensor, a failed conversion, or a version or set of names that
        differs from rank 0's, on any rank, is a ValueError on every rank naming the rank and its
        error (a check error too: the other ranks must hear of it), and the model keeps its weights.
        No wait is unbounded: a rank waits ``engine.update_timeout_s`` seconds (the collective
        timeout, ``$HYPER_GEN_TIMEOUT_S``, else 600) for its peers' calls, heartbeating meanwhile so
        no collective waits past the heartbeat. If a follower's trainer never calls, every rank's
        call raises a ValueError naming that rank and the follower warns (RuntimeWarning; its late
        call with that version raises the same error); a follower's call that rank 0 never applies
        raises TimeoutError."""
        source = getattr(self.model, "weight_source", None)  # hyper_gen.models.weight_update.WeightSource
        if source is None:
            raise ValueError(
                f"update_weights needs a native model loaded by hyper_gen.load_model, got {type(self.model).__name__}"
            )
        if self.world_size > 1:
            return self._collective_update(source, weights, version)
        update = source.check(self.model, weights)
        return self._control(Control(update=update, version=version)).outputs

    def _collective_update(self, source, weights, version) -> int:
        ticket = Control(version=version)
        ticket.collective, ticket.version_key = True, version_key(version)
        if self.rank != 0:
            with self._cond:
                missed = self._missed.pop(ticket.version_key, None)
            if missed is not None:  # the late call of an update the ranks already gave up on
                raise ValueError(missed)
        try:
            ticket.update = source.check(self.model, weights)
            ticket.names = sorted(ticket.update.arrays)
        except Exception as error:  # staged all the same: every rank raises it at the boundary
            ticket.check_error = error
        if self.rank == 0:
            return self._control(ticket).outputs
        return self._stage(ticket).outputs

    def sleep(self, abort: bool = False) -> list:
        """Free the KV cache pool and the prefix cache, at the next step boundary (between a rollout
        and a training step: vLLM's sleep mode, SGLang's ``release_memory_occupation``). The engine
        must be idle: with requests running or queued it raises RuntimeError, unless ``abort=True``,
        which ends them first as ``abort_all`` does (their outputs are returned). While asleep
        ``submit`` raises RuntimeError; ``wake_up()`` allocates the pool again (the prefix cache
        starts empty). A no-op when already asleep."""
        if not isinstance(abort, bool):
            raise TypeError(f"abort must be a bool, got {abort!r}")
        return self._control(Control(ALL if abort else None, sleep=True)).outputs

    def wake_up(self) -> None:
        """Allocate the KV cache pool again after ``sleep()`` (a no-op when awake)."""
        self._control(Control(sleep=False))

    @property
    def is_sleeping(self) -> bool:
        """Whether the engine's cache pool is released (``sleep()``)."""
        return self._asleep

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
                while not ticket.done.is_set():
                    with self._cond:
                        aborted, tickets = self._take_controls()
                    self._settle(aborted, tickets)
                    if not self._share_update_plan():  # (multi-rank: an update travels in a plan)
                        break
        while not ticket.done.wait(_SETTLE_POLL_S):
            if self._state in ("dead", "stopped"):
                with self._cond:
                    if not ticket.done.is_set():
                        self._check_running()
        if ticket.error is not None:
            raise ticket.error
        return ticket

    def _stage(self, ticket: Control) -> Control:
        """A follower's update_weights: staged for the step boundary rank 0's plan names, then waited for."""
        with self._cond:
            if self._following == "stopped":
                raise RuntimeError(
                    f"rank {self.rank}'s engine was shut down (run_follower returned): update_weights needs a "
                    "running engine"
                )
            if self._loop_ident == threading.get_ident():
                raise RuntimeError(
                    "update_weights waits for a step boundary: call it from another thread than the one "
                    "running run_follower"
                )
            self._staged.append(ticket)
            self._cond.notify_all()
        start = time.monotonic()
        while not ticket.done.wait(_SETTLE_POLL_S):
            with self._cond:
                if ticket.taken or time.monotonic() - start < self.update_timeout_s:
                    continue
                self._staged.remove(ticket)
            raise TimeoutError(
                f"update_weights(version={ticket.version_key}) on rank {self.rank}: rank 0 applied no update "
                f"within {self.update_timeout_s:g} s (engine.update_timeout_s); call update_weights on every rank"
            )
        if ticket.error is not None:
            raise ticket.error
        return ticket

    # ---- settling (the engine thread, or the caller holding the step lock) ----------------------
    def _take_controls(self):
        """(requests to abort, tickets) from the queued tickets, in the order they came; sets the
        paused state and takes the queued requests it aborts out of the queue (lock held). The
        aborted requests' rows are the caller's to drop. A multi-rank update is taken alone, for
        the next plan (``_update_spec``); later ones wait in the queue for the plans after."""
        queued, self._controls = self._controls, []
        tickets = []
        for ticket in queued:
            if ticket.collective:
                if self._state != "running":
                    ticket.error = RuntimeError("the engine was shut down before update_weights was applied")
                elif self._update_ticket is None:
                    self._update_ticket = ticket
                    continue
                else:
                    self._controls.append(ticket)
                    continue
            tickets.append(ticket)
        aborted: List = []
        for ticket in tickets:
            if ticket.sleep is not None and self.world_size > 1:  # every rank's pool: in a plan (_plan_sleep)
                if self._sleep_ticket is not None:
                    self._controls.append(ticket)  # after the one already waiting for its plan
                    ticket.planned = None  # (not settled with this step's tickets)
                    continue
                self._sleep_ticket = ticket
            if ticket.target is not None:
                ticket.requests = self._targets(ticket)
                for request in ticket.requests:
                    if request in self._waiting:
                        self._waiting.remove(request)
                aborted += ticket.requests
            if ticket.pause is not None:
                self._paused = ticket.pause
        deferred = [t for t in tickets if t.planned is None]
        for ticket in deferred:
            ticket.planned = False
        return aborted, [t for t in tickets if t not in deferred]

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
            if ticket is self._sleep_ticket:  # a multi-rank sleep: done once its plan ran (_apply_sleep)
                continue
            if ticket.collective:  # refused before any plan named it (shutdown): the error is set
                ticket.done.set()
                continue
            if ticket.update is not None:
                try:  # all or nothing: conversion errors come before any write
                    ticket.outputs = ticket.update.apply()
                    self._weights_changed(ticket.version)
                except Exception as error:
                    ticket.error = error
                ticket.done.set()
                continue
            if ticket.sleep is not None:
                try:
                    self._set_sleep(ticket.sleep)
                except Exception as error:
                    ticket.error = error
            ticket.outputs = [self._output(r) for r in ticket.requests]
            ticket.done.set()

    def _fail_controls(self, error: BaseException) -> None:
        with self._cond:
            tickets, self._controls = self._controls, []
            if self._update_ticket is not None:
                tickets.append(self._update_ticket)
                self._update_ticket = None
        for ticket in tickets:
            if not ticket.done.is_set():
                ticket.error = error
                ticket.done.set()

    # ---- a multi-rank update (every rank, at the boundary a plan names) -------------------------
    def _update_spec(self) -> Optional[dict]:
        """What the next plan says of the update taken for it, once (rank 0, lock held)."""
        ticket = self._update_ticket
        if ticket is None or ticket.taken:
            return None
        ticket.taken = True
        return {"version": ticket.version_key, "names": ticket.names}

    def _share_update_plan(self) -> bool:
        """A caller-stepped multi-rank engine: the taken update in a plan of its own (a held step:
        nothing decodes), shared and run here; False when there is none."""
        if self.world_size == 1:
            return False
        with self._cond:
            spec = self._update_spec()
            if spec is None:
                return False
            plan = StepPlan(drops=self._take_drops([]), hold=True, update=spec)
        try:
            share_plan(self.ops, plan)
            with self.ops.no_grad():
                self._execute(plan)
        except BaseException as error:
            self._die(error)
            raise
        return True

    def _apply_update(self, spec: dict) -> None:
        """Every rank, at the boundary the plan names: take this rank's call (a follower waits for it,
        telling the others every heartbeat), convert, agree, then all write or none does."""
        ticket = self._update_ticket if self.rank == 0 else None
        word, message, commit, missed = _WAITING, "", None, False
        start = time.monotonic()
        try:
            while True:
                if word == _WAITING:
                    ticket = ticket or self._take_staged()
                    if ticket is not None:
                        word, message, commit = self._convert(ticket, spec)
                    elif time.monotonic() - start >= self.update_timeout_s:
                        word, missed = _FAILED, True
                        message = (
                            f"update_weights was not called on rank {self.rank} within {self.update_timeout_s:g} s "
                            "(engine.update_timeout_s) of the step boundary rank 0 chose for it"
                        )
                words = self._gather_words(word)
                if _WAITING not in words:
                    break
            failed = [r for r, w in enumerate(words) if w == _FAILED]
            if failed:  # every rank learns each failed rank's message (the failure path only)
                told = [broadcast_text(self.ops, message if r == self.rank else None, src=r) for r in failed]
                reasons = "; ".join(f"rank {r}: {m}" for r, m in zip(failed, told))
                error = ValueError(
                    f"update_weights(version={spec['version']}) failed on {reasons}; no rank wrote its weights "
                    "(the model is unchanged)"
                )
                if ticket is not None:
                    error.__cause__ = ticket.check_error
                    ticket.error = error
                if missed:
                    self._miss(spec["version"], str(error))
                return
            count = commit()
            self._weights_changed(ticket.version)
            ticket.outputs = count
        except BaseException as error:
            if ticket is not None and ticket.error is None:
                ticket.error = error
            raise
        finally:
            if ticket is not None:
                ticket.done.set()
            if self.rank == 0:
                with self._cond:
                    self._update_ticket = None

    def _weights_changed(self, version) -> None:
        """After an update: outputs carry ``version``, and nothing the old weights computed is served
        from the prefix cache again (running rows keep their cache but are never cached)."""
        self._weight_version = version
        self._scheduler.kv.reset(version_key(version))

    def _plan_sleep(self, ending) -> Optional[bool]:
        """A multi-rank sleep / wake_up for the next plan (lock held): None when there is none, or it
        is refused because requests other than ``ending`` still run or wait."""
        ticket = self._sleep_ticket
        if ticket is None or ticket.planned:
            return None
        busy = [r for r in [*self._live.values(), *self._waiting] if not r.closed and r not in ending]
        if ticket.sleep and busy:
            ticket.error = _busy(busy)
            self._sleep_ticket = None
            ticket.done.set()
            return None
        ticket.planned = True
        return ticket.sleep

    def _apply_sleep(self, asleep: bool) -> None:
        """Every rank, at the boundary rank 0's plan names: release or allocate this rank's pool."""
        ticket = self._sleep_ticket if self.rank == 0 else None
        try:
            if asleep != self._asleep:
                self._switch_pool(asleep)
        except BaseException as error:
            if ticket is not None:
                ticket.error = error
            raise
        finally:
            if ticket is not None:
                ticket.outputs = [self._output(r) for r in ticket.requests]
                self._sleep_ticket = None
                ticket.done.set()

    def _set_sleep(self, asleep: bool) -> None:
        """A single-process sleep / wake_up, settled at the step boundary its ticket was taken at."""
        if asleep == self._asleep:
            return
        if asleep:
            with self._cond:
                busy = [r for r in self._live.values() if not r.closed] + list(self._waiting)
                if busy:
                    raise _busy(busy)
                self._asleep = True  # (under the lock: a submit from now on is refused)
        self._switch_pool(asleep)

    def _switch_pool(self, asleep: bool) -> None:
        """Release (``asleep``) or allocate this rank's cache pool."""
        if asleep:
            self._scheduler.clear()
            self._scheduler.kv.reset(self._scheduler.kv.prefix.extra_key)
            self._runner.sleep()
        else:
            self._runner.wake_up()
        with self._cond:
            self._asleep = asleep

    def _take_staged(self) -> Optional[Control]:
        """A follower's oldest staged call, waited for up to one heartbeat (None: none came)."""
        until = time.monotonic() + self._heartbeat_s
        with self._cond:
            while not self._staged:
                left = until - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)
            ticket = self._staged.pop(0)
            ticket.taken = True
            return ticket

    def _convert(self, ticket: Control, spec: dict):
        """(word, message, write): this rank's conversion, nothing written."""
        if ticket.check_error is not None:
            return _FAILED, _describe(ticket.check_error), None
        if ticket.version_key != spec["version"]:
            return _FAILED, f"version={ticket.version_key} differs from rank 0's version={spec['version']}", None
        if spec["names"] is not None and ticket.names != spec["names"]:
            mine, theirs = set(ticket.names), set(spec["names"])
            parts = [f"{label}: {sorted(names)[:3]}" for label, names in (
                ("rank 0 sends, this rank does not", theirs - mine),
                ("this rank sends, rank 0 does not", mine - theirs),
            ) if names]  # fmt: skip
            return _FAILED, f"its tensor names differ from rank 0's ({'; '.join(parts)})", None
        try:
            return _READY, "", ticket.update.prepare()
        except Exception as error:
            ticket.check_error = error
            return _FAILED, _describe(error), None

    def _gather_words(self, word: int) -> List[int]:
        gathered = self.ops.all_gather(self.ops.asarray(np.asarray([word], np.int32), "int32"), 0)
        return [int(w) for w in self.ops.to_numpy(gathered).reshape(-1)]

    def _miss(self, key: str, message: str) -> None:
        """A follower whose trainer never called: remember it (its late call raises) and say so now."""
        with self._cond:
            self._missed[key] = message
            while len(self._missed) > _MISSED_KEPT:
                self._missed.pop(next(iter(self._missed)))
        warnings.warn(f"rank {self.rank}: {message}", RuntimeWarning, stacklevel=2)

    def _end_following(self, error: Optional[BaseException] = None) -> None:
        """run_follower returned (rank 0 shut down, or a collective failed): staged calls fail."""
        with self._cond:
            self._following = "stopped"
            staged, self._staged = self._staged, []
        for ticket in staged:
            ticket.error = RuntimeError(
                f"rank {self.rank}'s engine stopped before update_weights was applied"
                + (f": {error!r}" if error is not None else " (rank 0 shut it down)")
            )
            ticket.done.set()


__all__ = ["ALL", "Control", "EngineControl", "PAUSE_MODES", "RecentIds"]
