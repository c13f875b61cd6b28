"""EngineCore: the scheduler, the model runner, the live requests and one input queue, driven by one step.

Everything that changes the engine comes in as a message (``messages.py``) on the one queue, from
any thread, and is applied at a step boundary by ``step``, the only function that runs the engine:
the background thread calls it in a loop, an engine stepped by its caller calls it from there, and
the other ranks of a tensor-parallel engine call it in ``follow``. Each step, on rank 0:

1. take the queued messages, in order (``_take``): adds join the waiting queue, aborts and pauses
   pick the requests they end (an abort of one choice, from a stop string, ends it), resume clears
   the hold; an update, a sleep, a wake-up or the shutdown ends the batch, since it needs a plan of
   its own;
2. plan (``_plan``): the rows to drop (ended, aborted, cancelled, failed), the hold, the update or
   pool change, or else the scheduler's output and the requests new to the runners (``plan.py``);
3. settle: the aborted requests end, the messages get their answers;
4. share the plan with the other ranks (world size > 1), then ``execute`` it: the same function on
   every rank applies the drops, the weight update (``weight_sync.py``), a trainer's weight-update
   group call (``weight_groups.py``) or the pool change, and
   runs the scheduler's output on the runner, recording the drawn token ids.

Rank 0 ends the choices it can tell from the ids (EOS, a stop token id, max_tokens) and puts what
each step drew, and every end, in order into its ``OutputProcessor`` (output_processor.py), which
makes the text, the chunks and the outputs on a thread of its own, or right after the step of an
engine stepped by its caller: the tokenizer never runs in the step loop, and a long output costs
the step nothing. The answers of the controls that return outputs (abort, pause, sleep) come from
there too, after the last chunks of the requests they end.

A step that updates weights or changes the pool computes nothing: the prefix cache is reset before
any later allocation. A world of one runs exactly this path with no collective, so every control
has one meaning whatever the world size.

Failure stays with whom it belongs to: a forward that raises fails its requests (``runner.py``),
and the engine goes on; an error in the engine itself kills it: every open stream, every waiting
message and every later call gets ``EngineDeadError``, and the other ranks are told to stop. An
error in the output processor is the engine's too: the engine dies of it at its next step boundary.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from concurrent.futures import wait as wait_for
from typing import List, Optional

from ..parallel.launcher import collective_timeout_s, heartbeat_s
from ..parallel.model_group import exclusive, parallel_group
from .messages import (
    ALL,
    Abort,
    AddRequest,
    EngineDeadError,
    FlushCache,
    Message,
    Pause,
    ReceiveWeights,
    Resume,
    Shutdown,
    Sleep,
    UpdateWeights,
    WakeUp,
    WeightGroupCall,
    resolve,
)
from .output_processor import Aborted, Answer, Dead, EngineCoreOutput, Failed, StepOutputs, Stopped
from .plan import Admission, StepPlan, share_plan
from .request import Choice, Request
from .runner import build
from .weight_groups import WeightGroups
from .weight_sync import WeightSync, version_key

_POLL_S = 0.25  # how often a follower's update_weights call looks at its deadline


class RecentIds:
    """The request ids of the last ``size`` requests that ended, so an abort can tell an id that
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


def _busy(requests) -> RuntimeError:
    return RuntimeError(
        f"engine.sleep(): {len(requests)} request(s) are running or queued; let them finish, or call "
        "sleep(abort=True) to end them"
    )


class EngineCore:
    """See the module docstring. ``state``: new -> running -> stopping -> stopped, or dead."""

    def __init__(self, model, ops, config, *, max_model_len, admit_batch, vocab_size, eos_token_ids):
        self.model, self.ops = model, ops
        self.eos_token_ids = eos_token_ids
        group, size = parallel_group(ops, model)
        self.world_size = size
        self.rank = ops.rank(group) if size > 1 else 0
        self._heartbeat_s = heartbeat_s(collective_timeout_s())
        self.weights = WeightSync(ops, self.rank, size, self._heartbeat_s, collective_timeout_s() or 600.0)
        self.groups = WeightGroups(model, self.weights, self._heartbeat_s)  # a trainer's weight-update groups
        with exclusive(ops, model), ops.no_grad():
            self.scheduler, self.runner, self.cache_memory_bytes = build(
                model,
                ops,
                ops.param_dtype(model),
                config,
                max_model_len=max_model_len,
                admit_batch=admit_batch,
                vocab_size=vocab_size,
                logprobs=self.rank == 0,
            )
        self.runner.request_of = lambda serial: self.live[serial]
        self._cond = threading.Condition()  # guards the queue and the state other threads read
        self._queue: deque = deque()  # the one input queue: messages in the order they came
        self._queued_adds = 0
        self._serials = itertools.count()
        self.waiting: deque = deque()  # rank 0: added, not yet handed to the scheduler (held while paused)
        self.live: dict = {}  # serial -> Request in the scheduler (or, on the other ranks, the runner)
        self._drops: List[tuple] = []  # rank 0: rows that ended since the last plan
        self.paused = False
        self.asleep = False
        self._sleep_planned = False  # rank 0: a sleep is in this step's plan (submit is refused from then)
        self._sleeps_asked = 0  # rank 0: queued sleep(abort=True) calls (submit is refused from the call on)
        self.weight_version = None  # the last update's version, on every output
        self._boundary: Optional[Message] = None  # rank 0: the update / sleep / wake_up / shutdown of this plan
        self._taken: List[Message] = []  # rank 0: the messages of the step running now
        self._ended = RecentIds()
        self._step_lock = threading.RLock()  # one step at a time, whoever calls it
        self._stepping: Optional[int] = None  # the thread inside a step (it must not wait for one)
        self.inline = False  # stepped by the caller (start(background=False)): a control call steps itself
        self._thread: Optional[threading.Thread] = None  # the engine thread (rank 0, started in the background)
        # rank 0: the OutputProcessor (output_processor.py) the steps' outputs and ends go to, in order
        self.outputs = None
        self._step_outputs: List = []  # rank 0: this step's, put there once it is executed
        self._fatal: Optional[BaseException] = None  # the output processor's error: the engine dies of it
        self.state = "new"
        self.error: Optional[BaseException] = None

    # ---- the way in (any thread) -----------------------------------------------------------------
    def start(self, inline: bool, setup=None) -> None:
        """Rank 0: running; unless ``inline`` (stepped by the caller), the engine thread steps it
        (``setup()`` first, there) beside the output processor's thread."""
        with self._cond:
            if self.state != "new":
                raise RuntimeError(f"the engine was already started (it is {self.state})")
            self.state, self.inline = "running", inline  # together: a control call sees which kind it is
        if not inline:
            self.outputs.start()
            self._thread = threading.Thread(target=self.run, args=(setup,), name="hyper_gen-engine", daemon=True)
            self._thread.start()

    def join(self, timeout: Optional[float]) -> None:
        """Wait up to ``timeout`` s each for the engine thread and the output processor's to end (not
        on one of them: a done callback that shuts the engine down returns at once)."""
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        if self.outputs is not None:
            self.outputs.join(timeout)

    def check_running(self) -> None:
        if self.state == "running":
            return
        if self.state == "dead":
            raise EngineDeadError(f"the engine stopped on an error: {self.error!r}") from self.error
        raise RuntimeError(
            "the engine is not running: call engine.start() or use `with Engine(...) as engine:`"
            if self.state == "new"
            else "the engine was shut down"
        )

    def post(self, message: Message) -> None:
        """Queue ``message`` for the next step boundary. Refused (RuntimeError) when the engine does
        not run, from a thread inside a step when its caller would wait for one, and on ranks other
        than 0 for anything but an update. A cancel after the end is dropped: nothing is left to end."""
        with self._cond:
            if self.rank != 0:
                if not isinstance(message, UpdateWeights):
                    raise RuntimeError(f"rank {self.rank} follows rank 0's steps: call {message.name} on rank 0")
                if self.state in ("stopped", "dead"):
                    raise RuntimeError(
                        f"rank {self.rank}'s engine was shut down (run_follower returned): update_weights needs "
                        "a running engine"
                    )
            elif isinstance(message, Abort) and not message.reply and self.state != "running":
                return
            else:
                self.check_running()
            if message.waits and threading.get_ident() in (self._stepping, getattr(self.outputs, "thread_ident", None)):
                where = "the engine's (not from a done callback)" if self.rank == 0 else "the one running run_follower"
                raise RuntimeError(
                    f"{message.name} waits for a step boundary: call it from another thread than {where}"
                )
            if isinstance(message, AddRequest):
                if self.asleep or self._sleep_planned or self._sleeps_asked:
                    raise RuntimeError(
                        "the engine is asleep or going to sleep (engine.sleep()): call engine.wake_up() before "
                        "submitting"
                    )
                message.request.serial = next(self._serials)
                self._queued_adds += 1
            if isinstance(message, Sleep) and message.abort:  # refuse, abort, sleep: no request slips in between
                self._sleeps_asked += 1
            if isinstance(message, Shutdown):
                self.state = "stopping"
            self._queue.append(message)
            self._cond.notify_all()

    def call(self, message: Message):
        """Post ``message`` and wait for its answer: a caller-stepped engine steps here (steps that
        compute nothing) until it is applied; a follower's update waits at most ``weights.timeout_s``
        for rank 0's plan to name it."""
        self.post(message)
        if self.rank != 0:
            return self._await_staged(message)
        if self.inline:
            self.drive(message)
        return message.future.result()

    def stop(self) -> Optional[Shutdown]:
        """Post the shutdown (rank 0 of a running engine; None otherwise)."""
        with self._cond:
            if self.rank != 0 or self.state != "running":
                return None
            message = Shutdown()
            self.post(message)
        return message

    def fail(self, error: BaseException) -> None:
        """The output processor broke: the engine dies of ``error``, on the thread that steps it (at once
        when that is this one, else at its next boundary)."""
        if self._stepping == threading.get_ident():
            self._die(error)
            return
        with self._cond:
            self._fatal = self._fatal or error
            self._cond.notify_all()

    def drive(self, message: Message) -> None:
        """A caller-stepped engine: steps on this thread that compute nothing, until ``message`` is applied."""
        if self._stepping == threading.get_ident():
            return  # (inside a step: the next one applies it)
        while not message.future.done():
            self.step(compute=False)

    def pausing(self) -> bool:
        with self._cond:
            return self.paused or any(isinstance(m, Pause) for m in self._queue)

    def _await_staged(self, message: UpdateWeights):
        start = time.monotonic()
        while not wait_for([message.future], _POLL_S).done:
            with self._cond:
                if message.taken or time.monotonic() - start < self.weights.timeout_s:
                    continue
                if message in self._queue:
                    self._queue.remove(message)
            raise TimeoutError(
                f"update_weights(version={message.key}) on rank {self.rank}: rank 0 applied no update within "
                f"{self.weights.timeout_s:g} s (engine.update_timeout_s); call update_weights on every rank"
            )
        return message.future.result()

    def _take_staged(self, seconds: float) -> Optional[UpdateWeights]:
        """A follower's oldest queued update, waited for up to ``seconds`` (None: none came)."""
        until = time.monotonic() + seconds
        with self._cond:
            while True:
                for message in self._queue:
                    if isinstance(message, UpdateWeights):
                        self._queue.remove(message)
                        message.taken = True
                        return message
                left = until - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)

    # ---- the loops: all of them call step --------------------------------------------------------
    def run(self, setup=None) -> None:
        """The background thread (rank 0): steps until the engine stops."""
        try:
            if setup is not None:
                setup()
            while self.state in ("running", "stopping"):
                self.step(wait=True)
        except BaseException as error:  # a bug or a dead peer: fail everyone loudly, never hang
            self._die(error)

    def follow(self) -> None:
        """Ranks other than 0: run rank 0's steps until it shuts down."""
        if self.rank == 0:
            raise RuntimeError("rank 0 runs engine.start(); run_follower is for the other ranks")
        with self._cond:
            if self.state == "new":
                self.state = "running"
        while self.state == "running":
            self.step()

    def step(self, compute: bool = True, wait: bool = False) -> bool:
        """The step (see the module docstring). ``compute=False``: apply the messages and the drops,
        compute nothing (a control call on a caller-stepped engine); ``wait``: while idle, wait for
        a message (rank 0 of a multi-rank engine sends an empty plan every heartbeat meanwhile).
        Rank 0: whether a plan ran, or, idle, whether work is left that a later step may run."""
        with self._step_lock:
            outer, self._stepping = self._stepping, threading.get_ident()
            try:
                return self._step(compute, wait)
            except BaseException as error:
                self._die(error)
                raise
            finally:
                if self.inline and self.outputs is not None:  # no thread of its own: it runs here, after the step
                    self.outputs.drain()
                self._stepping = outer

    def _step(self, compute: bool, wait: bool) -> bool:
        if self.state in ("stopped", "dead"):  # (a caller that waited for the step lock meanwhile)
            return False
        if self.rank == 0:
            plan = self._next_plan(compute, wait)
            if plan is None:
                return bool(self.waiting or len(self.scheduler)) and not self.paused
            if self.world_size > 1:
                share_plan(self.ops, plan)
        else:
            plan = share_plan(self.ops)
        with self.ops.no_grad():  # (torch's is per thread: here, on the thread that calls the model)
            self.execute(plan)
        if plan.shutdown:
            self._end()
        self._boundary, self._taken = None, []
        return True

    # ---- rank 0: messages into a plan --------------------------------------------------------------
    def _next_plan(self, compute: bool, wait: bool) -> Optional[StepPlan]:
        while True:
            with self._cond:
                plan, aborted, taken = self._plan(compute)
            self._settle(aborted, taken)
            if not self._idle(plan):
                return plan
            if not wait:
                return None
            with self._cond:
                if not self._pending():
                    self._cond.wait(self._heartbeat_s if self.world_size > 1 else 1.0)
                if not self._pending():
                    return plan if self.world_size > 1 else None  # (the heartbeat the other ranks wait for)

    def _pending(self) -> bool:
        return bool(self._queue or self._drops or self._fatal)

    @staticmethod
    def _idle(plan: StepPlan) -> bool:
        """Whether running ``plan`` would change nothing: no row leaves, nothing is computed."""
        work = plan.scheduled is not None and not plan.scheduled.empty
        controls = plan.update or plan.group or plan.sleep is not None
        return not (plan.drops or plan.shutdown or controls or (work and not plan.hold))

    def _take(self):
        """The queued messages in order, up to the first that needs a plan of its own (lock held):
        (messages, requests they end)."""
        taken, aborted = [], []
        while self._queue and self._boundary is None:
            message = self._queue.popleft()
            taken.append(message)
            if isinstance(message, AddRequest):
                self._queued_adds -= 1
                self.waiting.append(message.request)
            elif isinstance(message, Abort) and isinstance(message.target, Choice):  # a stop string
                if message.target.finish_reason is None:
                    self._finish(message.target, "stop")
            elif isinstance(message, Abort):
                message.requests = self._targets(message.target, aborted, message)
                aborted += message.requests
            elif isinstance(message, Pause):
                self.paused = True
                if message.mode == "abort":
                    message.requests = self._targets(ALL, aborted)
                    aborted += message.requests
            elif isinstance(message, Resume):
                self.paused = False
            elif isinstance(message, Sleep):
                if message.abort:
                    self._sleeps_asked -= 1
                    message.requests = self._targets(ALL, aborted)
                    aborted += message.requests
                busy = [r for r in (*self.live.values(), *self.waiting) if not r.finished and r not in aborted]
                if self.asleep:
                    pass  # a no-op
                elif busy:
                    resolve(message, error=_busy(busy))
                else:
                    self._boundary, self._sleep_planned = message, True
            elif isinstance(message, FlushCache):
                busy = [r for r in (*self.live.values(), *self.waiting) if not r.finished and r not in aborted]
                if busy:
                    error = RuntimeError(f"flush_cache: {len(busy)} request(s) are running or queued")
                    resolve(message, error=error)
                else:  # rank 0's scheduler alone looks prefixes up: nothing to share with the other ranks
                    resolve(message, self.scheduler.kv.reset(self.scheduler.kv.prefix.extra_key))
            elif isinstance(message, WakeUp):
                if self.asleep:
                    self._boundary = message
            else:  # UpdateWeights, WeightGroupCall, Shutdown
                self._boundary = message
        for request in aborted:
            if request in self.waiting:
                self.waiting.remove(request)
        return taken, aborted

    def _targets(self, target, ending: list, abort: Optional[Abort] = None) -> list:
        """The unfinished requests ``target`` names (ALL, a request id, a ``Request``) that ``ending``
        does not hold yet, by serial; an id never submitted is ``abort``'s ValueError."""
        if isinstance(target, Request):  # a stream's cancel
            candidates = [target]
        else:
            candidates = sorted([*self.waiting, *self.live.values()], key=lambda r: r.serial)
            if target is not ALL:
                candidates = [r for r in candidates if r.request_id == target]
                if not candidates and target not in self._ended and abort is not None:
                    error = ValueError(f"abort: no request with request_id={target!r} was submitted to this engine")
                    resolve(abort, error=error)
        return [r for r in candidates if not r.finished and r not in ending]

    def _plan(self, compute: bool):
        """(plan, requests to abort, messages taken) for the next step (lock held)."""
        if self._fatal is not None:
            raise self._fatal
        taken, aborted = self._take()
        self._taken = taken
        boundary = self._boundary
        if isinstance(boundary, Shutdown):  # the last plan: every request still queued or running ends
            aborted += [r for r in (*self.waiting, *self.live.values()) if r not in aborted]
            self.waiting.clear()
            self.paused = False
            self.scheduler.clear()
            return StepPlan(drops=self._take_drops(aborted), shutdown=True), aborted, taken
        drops = self._take_drops(aborted)
        self.scheduler.drop(drops)
        update = self.weights.spec(boundary) if isinstance(boundary, UpdateWeights) else None
        sleep = isinstance(boundary, Sleep) if isinstance(boundary, (Sleep, WakeUp)) else None
        group = boundary.plan_entry() if isinstance(boundary, WeightGroupCall) else None
        if boundary is not None or self.paused or self.asleep or not compute:
            plan = StepPlan(drops=drops, hold=self.paused, update=update, sleep=sleep, group=group)
            return plan, aborted, taken
        while self.waiting:
            request = self.waiting.popleft()
            request.open_choices(self.eos_token_ids)
            self.live[request.serial] = request
            self.scheduler.add(request)
        scheduled = self.scheduler.schedule()
        admissions = []
        for serial in scheduled.new_requests:
            r = self.live[serial]
            admissions.append(Admission(r.serial, r.request_id, r.prompt, r.params, r.noise_seed))
        return StepPlan(admissions, drops, scheduled=None if scheduled.empty else scheduled), aborted, taken

    def _take_drops(self, requests) -> list:
        drops = self._drops + [c.key for r in requests for c in r.choices]
        self._drops = []
        return drops

    def _settle(self, aborted, taken) -> None:
        """End the aborted requests, then answer the messages taken (the one the plan applies answers
        once applied): those that return outputs through the output processor, after their last chunks."""
        for request in aborted:
            self._abort(request)
        named = [m for m in taken if getattr(m, "requests", None) is not None]
        for message in taken:
            if message not in named and message is not self._boundary:
                resolve(message)
        if aborted or named:
            answer = [m for m in named if m is not self._boundary and not m.future.done()]
            self.outputs.put(Aborted(aborted, named, answer, self.weight_version))

    # ---- every rank: a plan ------------------------------------------------------------------------
    def execute(self, plan: StepPlan) -> None:
        """Apply rank 0's plan on this rank: drops, the update or pool change, then the step's work."""
        with exclusive(self.ops, self.model):
            if plan.drops:
                gone = set(map(tuple, plan.drops))
                self.runner.drop(gone)
                self._forget(gone)
            if plan.update is not None:
                mine = self._boundary if self.rank == 0 else None
                self.weights.apply(plan.update, mine, self._take_staged, self._weights_changed)
            if plan.group is not None:
                mine = self._boundary if self.rank == 0 else None
                version = mine.version if isinstance(mine, ReceiveWeights) else plan.group.get("version")
                self.groups.apply(plan.group, mine, version, self._weights_changed)
            if plan.sleep is not None:
                self._switch(plan.sleep)
            if plan.shutdown:  # the pool goes now, not whenever a garbage collection finds the engine
                self.groups.close()
                self.runner.clear()
                self.runner.store.release()
                return
            if plan.hold or plan.scheduled is None:  # paused (the rows keep their cache), or nothing to run
                return
            scheduled = plan.scheduled
            for admission in plan.admissions:
                self._request_of(admission)
            self._step_outputs = []
            result = self.runner.execute(scheduled)
            for request, error in result.errors:
                self._fail(request, error)
            for choices, selection, routed in result.samples:
                self._record(choices, selection, routed)
            if self.rank == 0:
                self.scheduler.update(scheduled, result.computed)
                if self._step_outputs:
                    self.outputs.put(StepOutputs(self._step_outputs, self.weight_version))

    def _weights_changed(self, version) -> None:
        """After an update: outputs carry ``version``, and nothing the old weights computed is served
        from the prefix cache again (running rows keep their cache but are never cached)."""
        self.weight_version = version
        self.scheduler.kv.reset(version_key(version))

    def _switch(self, asleep: bool) -> None:
        """Release (``asleep``) or allocate this rank's cache pool. A failure is the caller's in one
        process (the engine keeps its state); across ranks it stops the engine (the pools may differ)."""
        message = self._boundary if self.rank == 0 else None
        try:
            if asleep != self.asleep:
                if asleep:
                    self.scheduler.clear()
                    self.scheduler.kv.reset(self.scheduler.kv.prefix.extra_key)
                    self.runner.sleep()
                else:
                    self.runner.wake_up()
                with self._cond:
                    self.asleep = asleep
        except BaseException as error:
            if message is not None:
                resolve(message, error=error)
            if self.world_size > 1:
                raise
            return
        finally:
            with self._cond:
                self._sleep_planned = False
        if isinstance(message, Sleep):
            self.outputs.put(Answer([message]))  # its aborted requests' outputs, once they are out
        elif message is not None:
            resolve(message)

    def _forget(self, gone: set) -> None:
        """Requests whose every choice has ended leave ``live`` (rank 0 once all have finished; the other
        ranks count the drops, since a preempted choice is in no runner while it waits)."""
        with self._cond:
            for serial, index in gone:
                request = self.live.get(serial)
                if request is None:
                    continue
                request.dropped.add(index)
                if len(request.dropped) == len(request.choices) and (request.finished or self.rank != 0):
                    del self.live[serial]

    def _request_of(self, admission: Admission) -> Request:
        if self.rank == 0:
            return self.live[admission.serial]
        a = admission
        request = Request(a.serial, a.request_id, a.prompt, a.params, a.noise_seed)
        request.open_choices(self.eos_token_ids)
        self.live[request.serial] = request
        return request

    # ---- the end -----------------------------------------------------------------------------------
    def _end(self) -> None:
        """The shutdown plan ran: stopped; a follower's queued update calls fail."""
        with self._cond:
            self.state = "stopped"
            left, self._queue = list(self._queue), deque()
        for message in left:  # (only a follower's: rank 0's shutdown is the last message it takes)
            why = f"rank {self.rank}'s engine stopped before {message.name} was applied (rank 0 shut it down)"
            resolve(message, error=RuntimeError(why))
        if self.outputs is not None:
            self.outputs.put(Stopped())
        if self._boundary is not None:
            resolve(self._boundary)

    def _die(self, error: BaseException) -> None:
        with self._cond:
            if self.state == "dead":
                return
            self.state, self.error = "dead", error
            pending = [*self._taken, *self._queue] + ([self._boundary] if self._boundary is not None else [])
            requests = list(self.waiting) + list(self.live.values())
            requests += [m.request for m in self._queue if isinstance(m, AddRequest)]
            self._queue.clear()
            self._queued_adds = 0
            self.waiting.clear()
            self.live.clear()
        where = "the hyper_gen engine" if self.rank == 0 else f"rank {self.rank}'s engine"
        dead = EngineDeadError(f"{where} stopped on an error: {error!r}")
        dead.__cause__ = error
        if self.outputs is not None:
            self.outputs.put(Dead(requests, dead))
        for message in pending:
            resolve(message, error=dead)
        if self.rank == 0 and self.world_size > 1:
            try:  # let the other ranks leave run_follower instead of waiting out their timeout
                share_plan(self.ops, StepPlan(shutdown=True))
            except Exception:
                pass

    # ---- results: every rank keeps the tokens; rank 0 ends choices and puts what it drew out -----------
    def _record(self, choices, selection, routed) -> None:
        for row, choice in enumerate(choices):
            request = choice.request
            if choice.finish_reason is not None:
                continue
            if selection.errors[row] is not None:
                self._fail(request, selection.errors[row])
                continue
            token = int(selection.tokens[row])
            choice.token_ids.append(token)
            if self.rank == 0:
                params = request.params
                reason = "stop" if token in request.stop_ids else "length" if choice.step >= params.max_tokens else None
                if reason is not None:
                    self._finish(choice, reason)
                route = routed[row] if routed is not None and params.return_routed_experts else None
                self._step_outputs.append(EngineCoreOutput(choice, token, selection.logprobs[row], reason, route))

    def _finish(self, choice, reason: str) -> None:
        """Rank 0: ``choice`` draws no more; its row leaves at the next plan."""
        choice.finish_reason = reason
        with self._cond:
            self._drops.append(choice.key)
        if choice.request.finished:
            self._ended.add(choice.request.request_id)  # abort(id) now finds it ended

    def _abort(self, request: Request) -> None:
        """End a request now (cancel, abort, shutdown): its open choices end with "abort" (this plan
        drops their rows; the output processor gives them their last chunk)."""
        if not request.choices:  # still queued
            request.open_choices(self.eos_token_ids)
        ending = [c for c in request.choices if c.finish_reason is None]
        for choice in ending:
            choice.finish_reason = "abort"
        if ending:
            self._ended.add(request.request_id)

    def _fail(self, request: Request, error: BaseException) -> None:
        if request.finished:
            return
        for choice in request.choices:
            if choice.finish_reason is None:
                choice.finish_reason = "error"
        with self._cond:
            self._drops.extend(c.key for c in request.choices)
        if self.rank == 0:
            self._ended.add(request.request_id)
            self._step_outputs.append(Failed(request, error))

    def stats(self) -> dict:
        queued = {seq.request.serial for seq in list(self.scheduler.waiting) if not seq.resume}
        queued -= {seq.request.serial for seq in list(self.scheduler.running)}
        waiting = self._queued_adds + len(self.waiting) + len(queued)
        stats = {"running": len(self.live) - len(queued), "waiting": waiting}
        stats.update(self.scheduler.stats())
        stats["kv_cache_usage"] = stats["blocks_used"] / max(stats["blocks_total"], 1)
        stats["cache_memory_bytes"] = self.cache_memory_bytes
        stats["block_size"] = self.scheduler.kv.block_size
        stats["bytes_per_block"] = self.runner.layout.bytes_per_token() * self.scheduler.kv.block_size
        stats["state_slot_bytes"] = self.runner.store.state_slots_nbytes()
        return stats


__all__ = ["EngineCore", "EngineDeadError", "RecentIds"]
