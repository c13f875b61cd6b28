"""One conversation with a model, on one process or on every rank of the job that holds the model.

A model split over ranks (FSDP, expert or tensor parallel, a ZeRO-style MindSpore cell) runs
collectives in every forward, so every rank must run the same ``generate()`` on the same prompt.
Rank 0 drives the conversation (``send``, ``reset``, ``close``); every other rank runs
``follow()``, which performs the steps rank 0's calls start until rank 0 closes the session. Only
text and small ints travel (``parallel.launcher``'s broadcasts): each rank formats the same
messages into the same ids itself.

Rank 0 runs every collective on one worker thread, which also tells the other ranks "still here"
every heartbeat while no turn runs, so a person typing or a web service waiting for its next
request never trips the collective timeout, however long it takes.

Sampling is allowed: a turn samples with ``seed + turn`` (``seed=`` given) or with a seed rank 0
draws and shares; a seeded draw is portable (``noise.py``), so 1 and N ranks say the same words.
The reply rank 0 streamed is the turn's reply on every rank (sent to the others after the turn),
so every rank's history is rank 0's.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from typing import Iterator, List, Optional

import numpy as np

from . import registry
from .chat_prompt import fit_context
from .config import resolve_config
from .generation import generate
from .inputs import ModelLimits
from .parallel.launcher import broadcast_ints, broadcast_text, collective_timeout_s, heartbeat_s, host_ops
from .streaming import TextStreamer

_IDLE, _SEND, _RESET, _CLOSE = 0, 1, 2, 3  # what rank 0 announces; every announcement is [word, seed]
_END = object()  # a turn's last queue item after its pieces


class MessageTooLong(ValueError):
    """A message that, with the reply's ``max_new_tokens``, does not fit the model's context even
    alone; nothing was sent and the conversation is unchanged."""


class ChatSession:
    """A multi-turn conversation with ``model`` (any model ``generate()`` takes).

    ``config`` / ``overrides``: the generation settings of every turn (``generate``'s precedence;
    ``max_new_tokens`` is also what the context keeps room for). ``system``: a system message at
    the start of the conversation. ``timeout_s``: the job's collective timeout when it is not the
    process group's own (``parallel.launcher``); the heartbeat stays well inside it.

    Rank 0: ``send(text)`` / ``asend(text)`` stream the reply, ``history``, ``reset()``, ``close()``.
    Other ranks: ``follow()``. Also a context manager (rank 0 closes on leaving it)."""

    def __init__(self, model, tokenizer, config=None, *, system: Optional[str] = None, timeout_s=None, **overrides):
        if system is not None and not isinstance(system, str):
            raise TypeError(f"system must be a string or None, got {type(system).__name__}")
        self.model, self.tokenizer = model, tokenizer
        self.config = resolve_config(config, overrides, model)  # bad settings raise here, on every rank
        self._context = ModelLimits.of(model).context
        self._system = [] if not system else [{"role": "system", "content": system}]
        self._messages: List[dict] = list(self._system)
        self._turn = 0
        ops = registry.backend_for(model)
        self._ops = host_ops(ops.name)
        self.rank, self.world_size = self._ops.rank(), self._ops.world_size()
        self._tick = heartbeat_s(_known_timeout(ops.name, timeout_s))
        self._rng = np.random.default_rng()
        self._closed = False
        self._failure: Optional[BaseException] = None
        self._tasks: "queue.Queue" = queue.Queue()
        self._worker, self._last = None, None
        if self.rank == 0:
            setup = registry.thread_initializer(ops.name)  # the caller's framework settings on the worker
            self._worker = threading.Thread(target=self._serve, args=(setup,), name="hyper_gen-chat", daemon=True)
            self._worker.start()

    # ---- rank 0 ---------------------------------------------------------------------------------

    def send(self, text: str) -> "Reply":
        """Start a turn: ``text`` as the user's message; returns the reply, an iterator of text pieces
        as they are generated (``str(reply)`` / ``reply.text`` once done). Raises
        :class:`MessageTooLong` (nothing sent) when the message cannot fit the context."""
        self._check_driver("send")
        if self._last is not None:  # one turn at a time: the previous one ends first (its pieces are kept)
            self._last.wait()
        if not isinstance(text, str):
            raise TypeError(f"text must be a string, got {type(text).__name__}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"text is not UTF-8 text: {text[exc.start]!r} at character {exc.start}") from None
        if self._prompt(text)[1] is None:  # checked on rank 0 before anything is announced
            raise MessageTooLong(
                f"message too long: the model's context is {self._context} tokens "
                f"with {self.config.max_new_tokens} for the reply"
            )
        reply = Reply()
        seed = int(self._rng.integers(0, 2**31 - 1))

        def turn():
            self._announce(_SEND, seed)
            broadcast_text(self._ops, text)
            self._run_turn(text, seed, reply._pieces.put)

        self._submit(turn, reply._pieces)
        self._last = reply
        return reply

    def asend(self, text: str) -> "AsyncReply":
        """``send`` for asyncio: ``async for piece in session.asend(text)``."""
        return AsyncReply(self.send(text))

    def reset(self) -> None:
        """Forget the conversation (the system message stays) on every rank; turns count from 0 again."""
        self._check_driver("reset")
        self._call(lambda: (self._announce(_RESET), self._clear()))

    def close(self) -> None:
        """End the session on every rank: the other ranks' ``follow()`` returns. Idempotent; on other
        ranks a no-op (``follow`` returns when rank 0 closes)."""
        if self.rank != 0 or self._closed:
            return
        try:
            if self._failure is None:
                self._call(lambda: self._announce(_CLOSE))
        finally:
            self._closed = True
            self._tasks.put(None)
            self._worker.join()

    @property
    def history(self) -> List[dict]:
        """The conversation so far (the turns kept in the context), as ``{"role", "content"}`` dicts."""
        return [dict(m) for m in self._messages]

    # ---- the other ranks ------------------------------------------------------------------------

    def follow(self) -> List[dict]:
        """On a rank other than 0: run every step rank 0's calls start, until rank 0 closes the
        session; returns the history. A turn whose generate() raised (it raises on every rank
        together) is skipped, as on rank 0."""
        if self.rank == 0:
            raise RuntimeError("follow() runs on the ranks other than 0; rank 0 calls send() / reset() / close()")
        while True:
            word, seed = (int(v) for v in broadcast_ints(self._ops, [0, 0]))
            if word == _SEND:
                text = broadcast_text(self._ops, None)
                try:
                    self._run_turn(text, seed, None)
                except Exception:  # rank 0 raises it to its caller; the conversation goes on
                    pass
            elif word == _RESET:
                self._clear()
            elif word == _CLOSE:
                self._closed = True
                return self.history

    # ---- every rank -----------------------------------------------------------------------------

    def _prompt(self, text):
        user = {"role": "user", "content": text}
        return fit_context(self.tokenizer, self._messages + [user], self._context, self.config.max_new_tokens)

    def _run_turn(self, text, seed, sink):
        messages, ids = self._prompt(text)
        config = self.config
        if config.do_sample:
            config = config.replace(seed=(config.seed + self._turn) % 2**64 if config.seed is not None else seed)
        streamer = _TrimmedStreamer(self.tokenizer, sink)
        generate(self.model, ids, config, streamer=streamer)
        reply = streamer.text
        if self.world_size > 1:  # rank 0's words are the conversation, on every rank
            reply = broadcast_text(self._ops, reply)
        self._messages = messages + [{"role": "assistant", "content": reply}]
        self._turn += 1

    def _clear(self):
        self._messages, self._turn = list(self._system), 0

    # ---- rank 0's worker: every collective, and the heartbeat between them ----------------------

    def _announce(self, word, seed=0):
        if self.world_size > 1:
            broadcast_ints(self._ops, [word, seed])

    def _serve(self, setup):
        setup()
        while True:
            try:
                task = self._tasks.get(timeout=self._tick if self.world_size > 1 else None)
            except queue.Empty:
                try:
                    self._announce(_IDLE)  # "still here": the other ranks' wait restarts
                except BaseException as error:  # a rank is gone: every later call says so
                    self._failure = error
                    return
                continue
            if task is None:
                return
            task()

    def _submit(self, body, results: "queue.Queue"):
        """Run ``body`` on the worker; ``results`` gets ``_END`` after it, or the error it raised."""

        def task():
            try:
                body()
                results.put(_END)
            except BaseException as error:
                results.put(error)

        self._tasks.put(task)

    def _call(self, body):
        done: "queue.Queue" = queue.Queue()
        self._submit(body, done)
        result = done.get()
        if result is not _END:
            raise result

    def _check_driver(self, what):
        if self.rank != 0:
            raise RuntimeError(f"{what}() runs on rank 0; the other ranks call follow()")
        if self._closed:
            raise RuntimeError(f"{what}() on a closed chat session")
        if self._failure is not None:
            raise RuntimeError(f"the chat session lost a rank: {self._failure}") from self._failure

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()


class Reply:
    """One turn's reply on rank 0: iterate it for the text pieces as they are generated; ``text``
    (and ``str()``) once done. The pieces joined are the reply the history keeps."""

    def __init__(self):
        self._pieces: "queue.Queue" = queue.Queue()
        self._parts: List[str] = []
        self.done = False

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        if self.done:
            raise StopIteration
        item = self._pieces.get()
        return self._take(item)

    def _take(self, item):
        if item is _END:
            self.done = True
            raise StopIteration
        if isinstance(item, BaseException):
            self.done = True
            raise item
        self._parts.append(item)
        return item

    def wait(self) -> "Reply":
        """Run the rest of the turn (its pieces are kept for ``text``)."""
        for _ in self:
            pass
        return self

    @property
    def text(self) -> str:
        return "".join(self.wait()._parts)

    def __str__(self):
        return self.text


class AsyncReply:
    """A :class:`Reply` as an async iterator: waiting for a piece does not block the event loop."""

    def __init__(self, reply: Reply):
        self.reply = reply

    def __aiter__(self):
        return self

    async def __anext__(self) -> str:
        if self.reply.done:
            raise StopAsyncIteration
        item = await asyncio.to_thread(self.reply._pieces.get)
        try:
            return self.reply._take(item)
        except StopIteration:
            raise StopAsyncIteration from None


class _TrimmedStreamer(TextStreamer):
    """The reply's text as it becomes stable, without its leading and trailing whitespace (held back
    until more text follows it), to ``sink`` where given; ``text``: everything it passed on."""

    def __init__(self, tokenizer, sink):
        super().__init__(tokenizer, skip_prompt=True, skip_special_tokens=True)
        self.sink, self.parts, self._held, self._started = sink, [], "", False

    def on_text(self, text: str, stream_end: bool = False) -> None:
        if not self._started:
            text = text.lstrip()
            self._started = bool(text)
        body = text.rstrip()
        if body:
            piece, self._held = self._held + body, text[len(body) :]
            self.parts.append(piece)
            if self.sink is not None:
                self.sink(piece)
        else:
            self._held += text

    @property
    def text(self) -> str:
        return "".join(self.parts)


def _known_timeout(backend: str, timeout_s) -> Optional[float]:
    """The shortest collective timeout known: ``timeout_s`` / $HYPER_GEN_TIMEOUT_S, and the group's own."""
    known = [collective_timeout_s(timeout_s), getattr(registry.adapter(backend), "group_timeout_s", lambda: None)()]
    known = [t for t in known if t is not None]
    return min(known) if known else None
