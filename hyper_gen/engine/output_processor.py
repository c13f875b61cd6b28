"""OutputProcessor: what the engine core's steps drew, turned into text, chunks and outputs, off the step loop.

The core (``core.py``) records each step's drawn token ids with their logprobs, routing and the
finish it can see itself (EOS, a stop token id, max_tokens) as ``EngineCoreOutput``s, and puts them
here with every other event that ends a request (an abort, a failure, the engine's death, the
shutdown), in the order they happened. This processor owns everything a caller reads: each
choice's tokens and logprobs as delivered, its text (``detokenize.IncrementalText``: a bounded
window, O(1) amortized per token), stop strings, ``CompletionChunk``s, ``RequestOutput``s, the
streams (``stream.py``) and the answers of the controls that return outputs (abort, pause, sleep).

It runs on its own thread beside a background engine (``start``), so the tokenizer never costs
the step loop a thing; an engine stepped by its caller drains it right after each step, on that
thread (``drain``). Nothing here touches the scheduler, the runner or a tensor: only ranks 0 of a
tensor-parallel engine has one.

A stop string is found here, after the core drew the token that completed it and perhaps a few
more: the choice ends at once (finish_reason "stop", the text cut before the stop string, the
token that completed it kept), the tokens the core drew for it later are dropped, and an ``Abort``
for that choice goes through the core's one input queue, so its row leaves and its blocks are
freed at the next step boundary, like any other abort.

An error here is the engine's: it stops (``EngineDeadError`` to every open stream and waiting call).
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional

import numpy as np

from .detokenize import IncrementalText
from .messages import EngineDeadError, resolve
from .outputs import ChoiceOutput, CompletionChunk, RequestOutput
from .stream import one_wake_per_loop


# ---- what the core puts here, in order ------------------------------------------------------------
@dataclass
class EngineCoreOutput:
    """One choice's token from one step: ``finish_reason`` is the core's ("stop" for EOS or a stop
    token id, "length" at max_tokens, None while it runs); ``logprob`` its entry (None when not
    asked); ``routed`` its (moe_layers, top_k) routing (None when not asked)."""

    choice: Any
    token_id: int
    logprob: Optional[dict]
    finish_reason: Optional[str]
    routed: Optional[np.ndarray] = None


@dataclass
class Failed:
    """A request whose forward or draw failed: its stream ends with ``error``."""

    request: Any
    error: BaseException


@dataclass
class StepOutputs:
    """A step's tokens and failures, in the order the core recorded them; ``weight_version`` as the step ran."""

    outputs: List[Any]
    weight_version: Any = None
    messages: List = field(default_factory=list)


@dataclass
class Aborted:
    """Requests the core ended at a step boundary (abort, cancel, pause or sleep with abort, shutdown),
    and the messages that named them: each message's ``requests`` keeps those that were still open
    here (one a stop string or the core had already finished is no longer the abort's), and those in
    ``answer`` get their outputs now (a sleep's answer waits for the pool: an ``Answer`` later)."""

    requests: List
    messages: List
    answer: List
    weight_version: Any = None


@dataclass
class Answer:
    """Answer ``messages[0]`` with the outputs of its requests (a sleep, once the pool is released)."""

    messages: List


@dataclass
class Dead:
    """The engine died: every open stream ends with ``error``, ``requests`` (those it had queued) included."""

    requests: List
    error: BaseException
    messages: List = field(default_factory=list)


class Stopped:
    """The shutdown ran: nothing more comes."""

    messages: List = []


# ---- what this processor keeps per request (vLLM's RequestState) ------------------------------------
class ChoiceState:
    """One choice as delivered: its tokens, logprobs, routing, text and finish."""

    def __init__(self, request, index: int, tokenizer):
        self.request = request
        self.index = index
        self.token_ids: List[int] = []
        self.logprobs: Optional[List[dict]] = [] if request.params.logprobs is not None else None
        self.routes: List = []
        self.text = IncrementalText(tokenizer, request.params.stop_strings)
        self.finish_reason: Optional[str] = None

    def routed_experts(self) -> Optional[np.ndarray]:
        """(T, moe_layers, top_k) int64, token t's from the forward that chose it (None if not asked)."""
        if not self.request.params.return_routed_experts:
            return None
        return np.stack(self.routes) if self.routes else np.zeros((0, 0, 0), dtype=np.int64)


class RequestState:
    """A request's choices as delivered; ``output`` once its stream is closed (None after an error)."""

    def __init__(self, request, tokenizer):
        self.request = request
        self.choices = [ChoiceState(request, i, tokenizer) for i in range(request.params.n)]
        self.closed = False
        self.output: Optional[RequestOutput] = None

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices)


class OutputProcessor:
    """See the module docstring. ``abort(choice)``: end a choice in the core (a stop string);
    ``fail(error)``: stop the engine (an error here)."""

    def __init__(self, tokenizer, abort: Callable, fail: Callable):
        self.tokenizer = tokenizer
        self._abort_choice, self._fail_engine = abort, fail
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._states: dict = {}  # serial -> RequestState of the requests not closed yet
        self._lock = threading.Lock()  # one drain at a time
        self._thread: Optional[threading.Thread] = None
        self.thread_ident: Optional[int] = None  # the thread processing now (a control call there would wait on itself)
        self._done = False

    # ---- the way in (the core's thread) ------------------------------------------------------------
    def put(self, event) -> None:
        self._events.put(event)

    # ---- the loops -------------------------------------------------------------------------------
    def start(self, setup=None) -> None:
        """Process on a thread of its own until the engine stops or dies."""
        self._thread = threading.Thread(target=self._run, args=(setup,), name="hyper_gen-output", daemon=True)
        self._thread.start()

    def join(self, timeout: Optional[float]) -> None:
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def _run(self, setup) -> None:
        self.thread_ident = threading.get_ident()
        if setup is not None:
            setup()
        while not self._done:
            event = self._events.get()
            with one_wake_per_loop():  # this event and any that came meanwhile: one wake-up a loop
                self._process(event)
                self._process_queued()

    def drain(self) -> None:
        """Everything put so far, on this thread (an engine stepped by its caller, right after a step)."""
        with self._lock:
            outer, self.thread_ident = self.thread_ident, threading.get_ident()
            try:
                with one_wake_per_loop():
                    self._process_queued()
            finally:
                self.thread_ident = outer

    def _process_queued(self) -> None:
        while not self._done:
            try:
                event = self._events.get_nowait()
            except queue.Empty:
                return
            self._process(event)

    def _process(self, event) -> None:
        try:
            if isinstance(event, StepOutputs):
                self._step_outputs(event)
            elif isinstance(event, Aborted):
                self._aborted(event)
            elif isinstance(event, Answer):
                message = event.messages[0]
                resolve(message, [r.state.output for r in message.requests])
            elif isinstance(event, Dead):
                self._dead(event)
            elif isinstance(event, Stopped):
                self._done = True
        except BaseException as error:  # a bug here (a tokenizer that raises, ...): the engine stops
            dead = EngineDeadError(f"the hyper_gen engine's output processing stopped on an error: {error!r}")
            dead.__cause__ = error
            for message in event.messages:
                resolve(message, error=dead)
            self._fail_engine(error)  # (a Dead event follows)

    # ---- events ----------------------------------------------------------------------------------
    def _state(self, request) -> RequestState:
        state = request.state
        if state is None:
            state = request.state = RequestState(request, self.tokenizer)
            self._states[request.serial] = state
        return state

    def _step_outputs(self, event: StepOutputs) -> None:
        for out in event.outputs:
            if isinstance(out, Failed):
                self._fail(self._state(out.request), out.error)
                continue
            state = self._state(out.choice.request)
            choice = state.choices[out.choice.index]
            if state.closed or choice.finish_reason is not None:
                continue  # ended here (a stop string, a failure): what the core drew for it since is dropped
            choice.token_ids.append(out.token_id)
            if choice.logprobs is not None:
                choice.logprobs.append(out.logprob)
            if out.routed is not None:
                choice.routes.append(out.routed)
            reason = out.finish_reason
            text, stopped = choice.text.update(choice.token_ids)
            if stopped:
                if reason is None:  # the core draws on until this abort reaches it
                    self._abort_choice(out.choice)
                reason = "stop"
            if reason is not None:
                text += choice.text.finish()
            logprobs = None if out.logprob is None else [out.logprob]
            self._chunk(state, choice, [out.token_id], text, reason, logprobs, event.weight_version)

    def _aborted(self, event: Aborted) -> None:
        ended = set()
        for request in event.requests:
            state = self._state(request)
            if state.closed:
                continue
            ended.add(id(request))
            for choice in state.choices:
                if choice.finish_reason is None:
                    logprobs = [] if choice.logprobs is not None else None
                    self._chunk(state, choice, [], choice.text.finish(), "abort", logprobs, event.weight_version)
        for message in event.messages:
            message.requests = [r for r in message.requests if id(r) in ended]
        for message in event.answer:
            resolve(message, [r.state.output for r in message.requests])

    def _dead(self, event: Dead) -> None:
        self._done = True
        for request in event.requests:
            if request.stream is not None and request.state is None:  # (queued: never seen here)
                request.stream._close(None, event.error)
        for state in list(self._states.values()):
            self._fail(state, event.error)

    # ---- a choice's chunks, a request's end ------------------------------------------------------------
    def _chunk(self, state: RequestState, choice: ChoiceState, tokens, text, reason, logprobs, version) -> None:
        request = state.request
        choice.finish_reason = reason
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
        if state.finished:
            state.output = self._output(state, version)
            self._close(state, state.output)

    def _fail(self, state: RequestState, error: BaseException) -> None:
        if state.closed:
            return
        for choice in state.choices:
            if choice.finish_reason is None:
                choice.finish_reason = "error"
        self._close(state, None, error)

    def _close(self, state: RequestState, output, error=None) -> None:
        state.closed = True
        self._states.pop(state.request.serial, None)
        if state.request.stream is not None:
            state.request.stream._close(output, error)

    @staticmethod
    def _output(state: RequestState, version) -> RequestOutput:
        request = state.request
        outputs = [
            ChoiceOutput(c.index, list(c.token_ids), c.text.text, c.finish_reason, c.logprobs, c.routed_experts())
            for c in state.choices
        ]
        return RequestOutput(
            request_id=request.request_id,
            prompt_token_ids=list(request.prompt),
            outputs=outputs,
            prompt_tokens=len(request.prompt),
            completion_tokens=sum(len(c.token_ids) for c in state.choices),
            weight_version=version,
            prompt_logprobs=request.prompt_logprobs,
            cached_tokens=int(getattr(request, "cached_tokens", 0)),
        )


__all__ = [
    "Aborted",
    "Answer",
    "Dead",
    "EngineCoreOutput",
    "Failed",
    "OutputProcessor",
    "RequestState",
    "StepOutputs",
    "Stopped",
]
