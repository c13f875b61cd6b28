"""Engine: in-flight batching behind a thread-safe request API (the server and offline jobs stand on it).

One background thread owns every model call (MindSpore's runtime is not thread-safe, and one
owner makes the batch a plain data structure). Requests arrive from any thread through
``submit``; each step the thread

1. takes the plan (``plan.py``): rows to drop (finished, cancelled, aborted, failed), requests to
   admit (FIFO, while the batch has slots and the step's prefill budget lasts), whether to hold
   (paused: nothing below runs), shutdown; abort / pause / resume (``control.py``) come in here;
2. drops those rows (``batch.py`` trims the columns nobody uses any more);
3. decodes one token for every running row (one (B, 1) forward), picks each row's token with
   its own settings (``selector.py``) and streams it;
4. prefills the admitted requests (one left-padded forward for all of them; n choices share one
   prefill), picks their first tokens and splices their rows into the batch.

A request therefore joins at the next step and leaves the step after it finishes: the batch
is never drained to let anyone in. Rows leave only at step 1, by the plan, so a multi-rank
engine (rank 0 broadcasts the plan; the other ranks run ``run_follower``) keeps the same rows on
every rank: what only rank 0 can know (text, stop strings, cancels) reaches the others there.
A weight update is the one control that every rank's own caller makes (each rank holds its own
slices of the weights): the plan names it, and every rank applies it at that step boundary,
after the drops and before the step's forwards (control.py).

Failure stays with whom it belongs to: a request the engine cannot take is a ``ValueError`` /
``TypeError`` from ``submit``, before it is queued; a prefill that raises fails the requests
admitted with it (each is retried alone first); a decode that raises fails the requests in the
batch (their streams raise the model's error) and the engine goes on with an empty batch. An
error in the engine itself stops it: every open stream raises ``EngineDeadError`` and so does
every later ``submit``. No wait is unbounded by design: streams are always closed.
"""

from __future__ import annotations

import itertools
import threading
import uuid
from collections import deque
from typing import List, Optional

import numpy as np

from ..config import model_defaults
from ..inputs import ModelLimits
from ..parallel.launcher import collective_timeout_s, heartbeat_s
from ..parallel.model_group import exclusive, parallel_group
from ..registry import backend_for, thread_initializer
from .checks import check_engine_model, check_prompt_ids, check_request
from .config import EngineConfig, resolve_engine_config
from .control import Control, EngineControl, RecentIds
from .outputs import ChoiceOutput, CompletionChunk, RequestOutput
from .params import SamplingParams
from .plan import Admission, StepPlan, share_plan
from .request import Request
from .routes import keep_route, routed_experts
from .runner import build
from .stream import RequestStream


class EngineDeadError(RuntimeError):
    """The engine thread stopped on an error of its own; the cause is chained (``__cause__``)."""


class Engine(EngineControl):
    """In-flight batching engine over one model (see the module docstring); ``abort_all``, ``abort``,
    ``pause`` and ``resume`` (control.py) end or hold requests at a step boundary, and
    ``update_weights`` writes new weights at one (on a multi-rank engine a collective: every rank
    calls it, since every rank holds its own slices; ``update_timeout_s`` bounds the wait for them).

    ``tokenizer``: any HF tokenizer, for chunk text and stop strings (None: ids only).
    The settings below come as an ``EngineConfig`` (``config``, config.py: vLLM's names, so
    ``max_batch_size`` is its ``max_num_seqs`` and ``cache_memory_bytes`` its ``kv_cache_memory_bytes``)
    and/or as keywords of either name, which override ``config``'s fields; ``engine.config`` holds them.
    ``max_batch_size``: rows (choices) decoded together. ``max_model_len``: positions a request may
    use (prompt + max_tokens), default the model's ``max_position_embeddings``.
    The cache is paged (``scheduler.py``, ``runner.py``): ``block_size`` positions a block, from one pool of
    ``cache_memory_bytes`` (default: what ``max_batch_size`` rows of ``max_model_len`` positions
    could use, within a quarter of the host's available memory; ``stats()`` and the server print
    it). ``enable_prefix_caching``: requests share the blocks of a common prompt prefix (a hybrid
    model's recurrent state is snapshotted every ``state_snapshot_blocks`` blocks, where a hit may
    resume). ``max_num_batched_tokens``: the most tokens a step computes, decoding rows included; a
    longer prompt is prefilled in chunks over several steps while the running rows keep decoding.
    ``admit_batch``: admit waiting requests only once this many slots are free (or the batch is
    empty): 1 (the default) gives the lowest latency; an offline job, where only throughput
    counts, admits in groups so one prefill forward serves several requests (a prefill call
    costs about two decode steps of a small model whatever its size).
    """

    def __init__(self, model, tokenizer=None, config: Optional[EngineConfig] = None, **overrides):
        check_engine_model(model)
        # the settings: config (None: the defaults) with the keyword overrides (config.py: EngineConfig's
        # fields, or max_batch_size / cache_memory_bytes / the deprecated max_prefill_tokens)
        self.config = config = resolve_engine_config(config, overrides, stacklevel=3)
        self.model = model
        self.tokenizer = tokenizer
        self.max_batch_size = config.max_num_seqs
        self.admit_batch = min(config.admit_batch, self.max_batch_size)
        self.ops = backend_for(model)
        limits = ModelLimits.of(model)
        self.vocab_size = limits.vocab_size
        max_model_len = config.max_model_len
        if max_model_len is not None:
            if limits.context is not None and max_model_len > limits.context:
                raise ValueError(
                    f"max_model_len={max_model_len} is more than the model's context of {limits.context} positions "
                    "(max_position_embeddings)"
                )
        self.max_model_len = max_model_len if max_model_len is not None else limits.context
        eos = model_defaults(model).get("eos_token_id")
        self.eos_token_ids = [] if eos is None else list(eos) if isinstance(eos, (list, tuple)) else [int(eos)]
        group, size = parallel_group(self.ops, model)
        self.world_size = size
        self.rank = self.ops.rank(group) if size > 1 else 0
        self._heartbeat_s = heartbeat_s(collective_timeout_s())
        # multi-rank update_weights: how long a rank waits for its peers' calls (control.py)
        self.update_timeout_s = collective_timeout_s() or 600.0
        with exclusive(self.ops, model), self.ops.no_grad():
            self._scheduler, self._runner, self.cache_memory_bytes = build(
                model,
                self.ops,
                self.ops.param_dtype(model),
                config,
                max_model_len=self.max_model_len,
                admit_batch=self.admit_batch,
                vocab_size=self.vocab_size,
                logprobs=self.rank == 0,
            )
        self._runner.request_of = lambda serial: self._live[serial]
        self._asleep = False
        self._sleep_ticket: Optional[Control] = None  # rank 0 of a multi-rank engine: the sleep / wake_up to plan
        self._cond = threading.Condition()  # guards everything below that other threads touch
        self._waiting: deque = deque()  # rank 0: submitted, not yet handed to the scheduler
        self._cancels: set = set()  # rank 0: serials whose streams asked to cancel
        self._live: dict = {}  # serial -> Request in the scheduler (or, on the other ranks, the runner)
        self._drops: List[tuple] = []  # rank 0: rows to drop at the next plan
        self._controls: List[Control] = []  # rank 0: abort / pause / resume tickets for the next plan
        self._paused = False  # rank 0: plans hold the batch (no forward, no admission)
        self._weight_version = None  # the last update_weights' version (control.py), on every output
        self._update_ticket: Optional[Control] = None  # rank 0: the multi-rank update of the next plan
        self._staged: List[Control] = []  # other ranks: update_weights calls waiting for a plan's boundary
        self._missed: dict = {}  # other ranks: updates whose call never came -> the error (a late call raises)
        self._following: Optional[str] = None  # other ranks: "running" in run_follower, then "stopped"
        self._ended = RecentIds()  # rank 0: ids of requests that ended, for abort(id)
        self._step_lock = threading.RLock()  # held by step(): a caller-driven engine's step boundary
        self._loop_ident: Optional[int] = None  # the thread running steps (control calls must not wait on it)
        self._serials = itertools.count()
        self._state = "new"  # new -> running -> stopping -> stopped | dead
        self._error: Optional[BaseException] = None
        self._thread: Optional[threading.Thread] = None

    # ---- lifecycle -----------------------------------------------------------------------
    def start(self, background: bool = True) -> "Engine":
        """Start the engine thread (rank 0 of a multi-rank model; the other ranks run ``run_follower``).

        ``background=False``: no thread; the caller drives the engine with :meth:`step` (offline jobs:
        no handoff between threads, whose two framework thread pools were measured to slow each
        other down on a 2-core host)."""
        if self.rank != 0:
            raise RuntimeError(f"rank {self.rank} of a multi-rank engine runs engine.run_follower(), not start()")
        thread = None
        if background:
            setup = thread_initializer(self.ops.name)  # the caller's settings (torch threads) on the engine thread
            thread = threading.Thread(target=self._run, args=(setup,), name="hyper_gen-engine", daemon=True)
        with self._cond:
            if self._state != "new":
                raise RuntimeError(f"the engine was already started (it is {self._state})")
            self._state, self._thread = "running", thread  # together: a control call sees which kind it is
        if thread is not None:
            thread.start()
        return self

    def step(self) -> bool:
        """One step on the calling thread, for an engine started with ``start(background=False)``:
        admissions, one decode for every running row, drops. False when nothing is queued or running,
        or while the engine is paused (no forward runs then)."""
        if self._thread is not None:
            raise RuntimeError("this engine runs its own thread: step() is for start(background=False)")
        self._check_running()
        with self._step_lock:
            self._loop_ident = threading.get_ident()
            try:
                with self._cond:
                    plan, aborted, tickets = self._plan_step()
                self._settle(aborted, tickets)
                if self._idle(plan):
                    return bool(self._waiting or len(self._scheduler)) and not self._paused
                try:
                    if self.world_size > 1:
                        share_plan(self.ops, plan)
                    with self.ops.no_grad():
                        self._execute(plan)
                except BaseException as error:
                    self._die(error)
                    raise
            finally:
                self._loop_ident = None
        return True

    def _stop_inline(self) -> None:
        """shutdown() of an engine without a thread: what the thread's last plan would do."""
        with self._step_lock:
            with self._cond:
                plan, aborted, tickets = self._shutdown_plan()
            self._settle(aborted, tickets)
            if self.world_size > 1:
                share_plan(self.ops, plan)
            self._execute(plan)
            with self._cond:
                self._state = "stopped"

    def shutdown(self, timeout: Optional[float] = 60.0) -> None:
        """Stop: requests still queued or running end with finish_reason "abort"; the other ranks'
        ``run_follower`` returns. Waits up to ``timeout`` s for the engine thread."""
        with self._cond:
            inline = self._thread is None and self._state == "running"
            if self._state == "running":
                self._state = "stopping"
            self._cond.notify_all()
        if inline:
            self._stop_inline()
            return
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def __enter__(self) -> "Engine":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.shutdown()

    @property
    def alive(self) -> bool:
        return self._state == "running"

    def stats(self) -> dict:
        """How busy the engine is and what its cache holds (a snapshot, read without the engine's
        lock): ``running`` requests admitted and not yet closed, ``waiting`` requests queued for a
        slot; ``blocks_total`` / ``blocks_used`` / ``blocks_cached`` / ``blocks_free`` of the pool,
        ``kv_cache_usage`` (used / total), ``prefix_cache_queries`` and ``prefix_cache_hits``
        (prompt tokens looked up / found cached, cumulative, as vLLM counts them),
        ``preemptions``, ``cache_memory_bytes``, ``block_size`` and ``bytes_per_block`` (K and V of
        every attention layer for one block: a budget of N blocks is N times that)."""
        queued = {seq.request.serial for seq in list(self._scheduler.waiting) if not seq.resume}
        queued -= {seq.request.serial for seq in list(self._scheduler.running)}
        stats = {"running": len(self._live) - len(queued), "waiting": len(self._waiting) + len(queued)}
        stats.update(self._scheduler.stats())
        stats["kv_cache_usage"] = stats["blocks_used"] / max(stats["blocks_total"], 1)
        stats["cache_memory_bytes"] = self.cache_memory_bytes
        stats["block_size"] = self._scheduler.kv.block_size
        stats["bytes_per_block"] = self._runner.layout.bytes_per_token() * self._scheduler.kv.block_size
        return stats

    # ---- requests ------------------------------------------------------------------------
    def submit(self, prompt_token_ids, params: Optional[SamplingParams] = None, request_id: Optional[str] = None):
        """Queue a request; returns its ``RequestStream``. Thread-safe. Raises ``ValueError`` /
        ``TypeError`` for a request the engine cannot take, before it is queued."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        prompt = self._check_prompt(prompt_token_ids, params)
        if request_id is None:
            request_id = f"req-{uuid.uuid4().hex}"
        elif not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str or None, got {request_id!r}")
        noise_seed = params.seed if params.seed is not None else int(np.random.default_rng().integers(0, 2**63))
        with self._cond:
            self._check_running()
            if self._asleep or (self._sleep_ticket is not None and self._sleep_ticket.sleep):
                raise RuntimeError("the engine is asleep (engine.sleep()): call engine.wake_up() before submitting")
            request = Request(next(self._serials), request_id, prompt, params, noise_seed)
            request.stream = RequestStream(request_id, lambda: self._cancel(request.serial))
            self._waiting.append(request)
            self._cond.notify_all()
        return request.stream

    async def generate(self, prompt_token_ids, params: Optional[SamplingParams] = None, request_id=None):
        """``async for chunk in engine.generate(ids, params)``; leaving the loop early cancels the request."""
        stream = self.submit(prompt_token_ids, params, request_id)
        try:
            async for chunk in stream:
                yield chunk
        finally:
            stream.cancel()

    def run_batch(self, requests, return_exceptions: bool = False) -> list:
        """``[(prompt_token_ids, params), ...]`` through the in-flight queue at once; ``RequestOutput``s
        in input order. ``return_exceptions``: a request that fails (or is refused) gives its
        exception in its place instead of raising. Starts (and then stops) the engine if needed."""
        started_here = self._state == "new" and self.rank == 0
        if started_here:
            self.start()
        try:
            streams = []
            for prompt, params in requests:
                try:
                    streams.append(self.submit(prompt, params))
                except (TypeError, ValueError) as error:
                    if not return_exceptions:
                        for stream in streams:
                            stream.cancel()
                        raise
                    streams.append(error)
            results = []
            for stream in streams:
                if isinstance(stream, BaseException):
                    results.append(stream)
                    continue
                try:
                    results.append(stream.result())
                except Exception as error:
                    if not return_exceptions:
                        raise
                    results.append(error)
            return results
        finally:
            if started_here:
                self.shutdown()

    def _check_running(self) -> None:
        if self._state == "running":
            return
        if self._state == "dead":
            raise EngineDeadError(f"the engine stopped on an error: {self._error!r}") from self._error
        raise RuntimeError(
            "the engine is not running: call engine.start() or use `with Engine(...) as engine:`"
            if self._state == "new"
            else "the engine was shut down"
        )

    def _check_prompt(self, prompt_token_ids, params: SamplingParams) -> List[int]:
        ids = check_prompt_ids(prompt_token_ids, self.vocab_size)
        check_request(self, ids.size, params)
        return [int(t) for t in ids]

    def _cancel(self, serial: int) -> None:
        with self._cond:
            self._cancels.add(serial)
            self._cond.notify_all()

    # ---- the engine thread (rank 0) ------------------------------------------------------
    def _run(self, setup=None) -> None:
        self._loop_ident = threading.get_ident()
        try:
            if setup is not None:
                setup()
            with self.ops.no_grad():  # torch's no_grad is per thread: here, on the thread that calls the model
                while True:
                    plan = self._next_plan()
                    if self.world_size > 1:
                        share_plan(self.ops, plan)
                    self._execute(plan)
                    if plan.shutdown:
                        break
            with self._cond:
                self._state = "stopped"
        except BaseException as error:  # a bug or a dead peer: fail everyone loudly, never hang
            self._die(error)

    def _next_plan(self) -> StepPlan:
        """Rank 0: the next step's plan; waits while there is nothing to do (heartbeats when multi-rank)."""
        while True:
            with self._cond:
                if self._state != "running":
                    plan, aborted, tickets = self._shutdown_plan()
                else:
                    plan, aborted, tickets = self._plan_step()
                    if self._idle(plan) and not aborted and not tickets:  # idle, or paused
                        self._cond.wait(self._heartbeat_s if self.world_size > 1 else 1.0)
                        if self.world_size > 1 and self._state == "running" and not self._pending():
                            return plan  # nothing to run: the heartbeat the other ranks wait for
                        continue
            self._settle(aborted, tickets)
            if not self._idle(plan):
                return plan

    def _pending(self) -> bool:
        """Whether something waits for the next plan (lock held)."""
        return bool(self._cancels or self._controls or (self._waiting and not self._paused))

    def _idle(self, plan: StepPlan) -> bool:
        """Whether running ``plan`` would change nothing: no row leaves, nothing is computed."""
        work = plan.scheduled is not None and not plan.scheduled.empty
        return not (plan.drops or plan.shutdown or plan.update or plan.sleep is not None or (work and not plan.hold))

    def _shutdown_plan(self):
        """The last plan: every request still queued or running ends (lock held)."""
        aborted, tickets = self._take_controls()
        aborted += list(self._waiting) + list(self._live.values())
        self._waiting.clear()
        self._paused = False
        self._scheduler.clear()
        return StepPlan(drops=self._take_drops(aborted), shutdown=True), aborted, tickets

    def _take_drops(self, requests) -> list:
        drops = self._drops + [c.key for r in requests for c in r.choices]
        self._drops = []
        return drops

    def _plan_step(self):
        """(plan, requests to abort, control tickets) from the queue, the cancels, the abort / pause
        tickets and the rows that ended (lock held), then the scheduler's step. A paused engine's
        plan holds the batch; a step that updates weights or sleeps computes nothing."""
        cancelled = []
        for serial in self._cancels:
            queued = [r for r in self._waiting if r.serial == serial]
            for request in queued:
                self._waiting.remove(request)
            cancelled += queued
            if serial in self._live:
                cancelled.append(self._live[serial])
        self._cancels.clear()
        aborted, tickets = self._take_controls()
        cancelled += aborted
        drops = self._take_drops([r for r in cancelled if r.choices])
        self._scheduler.drop(drops)
        sleep = self._plan_sleep(cancelled)
        update = self._update_spec()
        control = any(t.update is not None or t.sleep is not None for t in tickets)  # (settled before the step)
        if self._paused or self._asleep or sleep is not None or update is not None or control:
            return StepPlan(drops=drops, hold=self._paused, update=update, sleep=sleep), cancelled, tickets
        while self._waiting:
            request = self._waiting.popleft()
            request.open_choices(self.eos_token_ids, self.tokenizer)
            self._live[request.serial] = request
            self._scheduler.add(request)
        scheduled = self._scheduler.schedule()
        admissions = []
        for serial in scheduled.new_requests:
            request = self._live[serial]
            admissions.append(
                Admission(request.serial, request.request_id, request.prompt, request.params, request.noise_seed)
            )
        plan = StepPlan(admissions, drops, scheduled=None if scheduled.empty else scheduled)
        return plan, cancelled, tickets

    def _die(self, error: BaseException) -> None:
        with self._cond:
            self._state, self._error = "dead", error
            requests = list(self._waiting) + list(self._live.values())
            self._waiting.clear()
            self._live.clear()
        dead = EngineDeadError(f"the hyper_gen engine stopped on an error: {error!r}")
        dead.__cause__ = error
        for request in requests:
            self._close(request, error=dead)
        self._fail_controls(dead)
        if self.world_size > 1:
            try:  # let the other ranks leave run_follower instead of waiting out their timeout
                share_plan(self.ops, StepPlan(shutdown=True))
            except Exception:
                pass

    # ---- followers ----------------------------------------------------------------------
    def run_follower(self) -> None:
        """Ranks other than 0 of a multi-rank model: run rank 0's steps until it shuts down."""
        if self.rank == 0:
            raise RuntimeError("rank 0 runs engine.start(); run_follower is for the other ranks")
        with self._cond:
            self._following, self._loop_ident = "running", threading.get_ident()
        try:
            with self.ops.no_grad():
                while True:
                    plan = share_plan(self.ops)
                    self._execute(plan)
                    if plan.shutdown:
                        break
        except BaseException as error:
            self._end_following(error)
            raise
        self._end_following()

    # ---- one step (every rank) -----------------------------------------------------------
    def _execute(self, plan: StepPlan) -> None:
        with exclusive(self.ops, self.model):
            if plan.drops:
                gone = set(map(tuple, plan.drops))
                self._runner.drop(gone)
                self._forget(gone)
            if plan.update is not None:  # a multi-rank update_weights: every rank, here
                self._apply_update(plan.update)
            if plan.sleep is not None:  # a multi-rank sleep / wake_up: every rank, here
                self._apply_sleep(plan.sleep)
            if plan.shutdown:  # the pool goes now, not whenever a garbage collection finds the engine
                self._runner.clear()
                self._runner.store.release()
                return
            if plan.hold or plan.scheduled is None:  # paused (the rows keep their cache), or nothing to run
                return
            scheduled = plan.scheduled
            for admission in plan.admissions:
                self._request_of(admission)
            result = self._runner.execute(scheduled)
            for request, error in result.errors:
                self._fail(request, error)
            for choices, selection, routed in result.samples:
                self._record(choices, selection, routed)
            if self.rank == 0:
                self._scheduler.update(scheduled, result.computed)

    def _forget(self, gone: set) -> None:
        """Requests whose every choice has ended leave ``_live`` (rank 0 once closed too; the other
        ranks count the drops, since a preempted choice is in no runner while it waits)."""
        with self._cond:
            for serial, index in gone:
                request = self._live.get(serial)
                if request is None:
                    continue
                request.dropped.add(index)
                if len(request.dropped) == len(request.choices) and (request.closed or self.rank != 0):
                    del self._live[serial]

    def _request_of(self, admission: Admission) -> Request:
        if self.rank == 0:
            return self._live[admission.serial]
        a = admission
        request = Request(a.serial, a.request_id, a.prompt, a.params, a.noise_seed)
        request.open_choices(self.eos_token_ids, None)
        self._live[request.serial] = request
        return request

    # ---- results (rank 0 streams them; every rank keeps the token counts) ----------------
    def _record(self, choices, selection, routed) -> None:
        for row, choice in enumerate(choices):
            request = choice.request
            if request.closed or choice.finish_reason is not None:
                continue
            if selection.errors[row] is not None:
                self._fail(request, selection.errors[row])
                continue
            token = int(selection.tokens[row])
            choice.token_ids.append(token)
            keep_route(choice, routed, row)
            if self.rank != 0:
                continue
            self._emit(choice, token, selection.logprobs[row])

    def _emit(self, choice, token: int, logprob) -> None:
        request, params = choice.request, choice.request.params
        if choice.logprobs is not None:
            choice.logprobs.append(logprob)
        reason = "stop" if token in request.stop_ids else "length" if choice.step >= params.max_tokens else None
        text, stopped = choice.text.update(choice.token_ids)
        if stopped:
            reason = "stop"
        if reason is not None:
            text += choice.text.finish()
        self._chunk(choice, [token], text, reason, None if logprob is None else [logprob])

    def _chunk(self, choice, tokens, text, reason, logprobs) -> None:
        request = choice.request
        if reason is not None:
            choice.finish_reason = reason
            with self._cond:
                self._drops.append(choice.key)
        request.stream._push(
            CompletionChunk(
                request_id=request.request_id,
                index=choice.index,
                token_ids=tokens,
                text=text,
                finished=reason is not None,
                finish_reason=reason,
                logprobs=logprobs if request.params.logprobs is not None else None,
                prompt_tokens=len(request.prompt),
                completion_tokens=len(choice.token_ids),
            )
        )
        if request.finished:
            self._close(request, output=self._output(request))

    def _abort(self, request: Request) -> None:
        """End a request now (cancel, abort, shutdown): its open choices get a final "abort" chunk."""
        if request.closed:
            return
        if not request.choices:  # still queued
            request.open_choices(self.eos_token_ids, self.tokenizer)
        for choice in request.choices:
            if choice.finish_reason is None:
                self._chunk(choice, [], choice.text.finish(), "abort", [] if choice.logprobs is not None else None)

    def _fail(self, request: Request, error: BaseException) -> None:
        if request.closed:
            return
        for choice in request.choices:
            if choice.finish_reason is None:
                choice.finish_reason = "error"
        with self._cond:
            self._drops.extend(c.key for c in request.choices)
        self._close(request, error=error)

    def _close(self, request: Request, output=None, error=None) -> None:
        request.closed = True
        if request.stream is not None:
            self._ended.add(request.request_id)  # before the stream ends: abort(id) then finds it ended
            request.stream._close(output, error)

    def _output(self, request: Request) -> RequestOutput:
        outputs = [
            ChoiceOutput(c.index, list(c.token_ids), c.text.text, c.finish_reason, c.logprobs, routed_experts(c))
            for c in request.choices
        ]
        return RequestOutput(
            request_id=request.request_id,
            prompt_token_ids=list(request.prompt),
            outputs=outputs,
            prompt_tokens=len(request.prompt),
            completion_tokens=sum(len(c.token_ids) for c in request.choices),
            weight_version=self._weight_version,
            prompt_logprobs=request.prompt_logprobs,
        )


__all__ = ["Engine", "EngineDeadError", "check_engine_model"]
