"""RequestStream: one request's chunks, handed from the engine thread to any thread or event loop.

The engine thread pushes; a consumer pulls with ``for chunk in stream`` (a condition variable)
or ``async for chunk in stream`` from any asyncio loop (the engine wakes the awaiting loop with
``loop.call_soon_threadsafe``, never touching the loop's objects from its own thread; inside
``one_wake_per_loop()``, as the output processor handles a step, once per loop for every stream
it fed, not once per stream: a wake-up is a write to the loop's self-pipe and a turn of the loop,
and at 16 streams one per step serves all). Chunks are
consumed once, by whoever pulls them; ``result()`` waits for the whole output and needs no
iteration. Every wait ends: the engine closes each stream exactly once, with its output, with
the error that failed it, or with a ``RuntimeError`` when the engine itself stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import deque
from typing import Callable, List, Optional

_gathering = threading.local()  # .wakes: {loop: [futures]} while one_wake_per_loop() runs on this thread


def _wake(future) -> None:
    if not future.done():
        future.set_result(None)


def _wake_all(futures) -> None:
    for future in futures:
        _wake(future)


def _call_soon(loop, callback, argument) -> None:
    try:
        loop.call_soon_threadsafe(callback, argument)
    except RuntimeError:  # that loop is closed: nobody is waiting there any more
        pass


@contextlib.contextmanager
def one_wake_per_loop():
    """The async consumers that streams pushed to within the block are woken at its end, with one
    ``call_soon_threadsafe`` per event loop (on this thread; nested blocks join the outer one)."""
    if getattr(_gathering, "wakes", None) is not None:
        yield
        return
    _gathering.wakes = wakes = {}
    try:
        yield
    finally:
        _gathering.wakes = None
        for loop, futures in wakes.items():
            _call_soon(loop, _wake_all, futures)


class RequestStream:
    """Iterate it (sync or async) for ``CompletionChunk``s; ``result()`` for the ``RequestOutput``;
    ``cancel()`` to end it early (finish_reason "abort"; the slot is freed at the next step)."""

    def __init__(self, request_id: str, cancel: Callable[[], None]):
        self.request_id = request_id
        self._cancel = cancel
        self._cond = threading.Condition()
        self._chunks: deque = deque()
        self._closed = False
        self._error: Optional[BaseException] = None
        self._output = None
        self._waiters: List[tuple] = []  # (loop, future) of async consumers waiting for a chunk
        self._callbacks: List[Callable] = []

    # ---- engine side ----------------------------------------------------------------------
    def _push(self, chunk) -> None:
        with self._cond:
            self._chunks.append(chunk)
            self._notify()

    def _close(self, output=None, error: Optional[BaseException] = None) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed, self._output, self._error = True, output, error
            self._notify()
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback(self)

    def _notify(self) -> None:  # with self._cond held
        self._cond.notify_all()
        if not self._waiters:
            return
        waiters, self._waiters = self._waiters, []
        wakes = getattr(_gathering, "wakes", None)
        for loop, future in waiters:
            if wakes is None:
                _call_soon(loop, _wake, future)
            else:
                wakes.setdefault(loop, []).append(future)

    def interrupt_waiters(self, error: BaseException) -> None:
        """Raise ``error`` in the ``async for`` consumers waiting for a chunk on the running event loop
        (call it there): a response that must end now, whatever the engine does."""
        loop = asyncio.get_running_loop()
        with self._cond:
            mine = [future for owner, future in self._waiters if owner is loop]
            self._waiters = [(owner, future) for owner, future in self._waiters if owner is not loop]
        for future in mine:
            if not future.done():
                future.set_exception(error)

    # ---- consumer side --------------------------------------------------------------------
    @property
    def finished(self) -> bool:
        return self._closed

    def cancel(self) -> None:
        """Abort the request (idempotent; a no-op once it finished)."""
        if not self._closed:
            self._cancel()

    def add_done_callback(self, callback: Callable[["RequestStream"], None]) -> None:
        """``callback(stream)`` once the request is done or failed (on the engine thread; keep it short)."""
        with self._cond:
            if not self._closed:
                self._callbacks.append(callback)
                return
        callback(self)

    def result(self, timeout: Optional[float] = None):
        """The ``RequestOutput``, waiting at most ``timeout`` seconds (``TimeoutError``); the
        request's error if it failed."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._closed, timeout):
                raise TimeoutError(f"request {self.request_id!r} did not finish within {timeout} s")
            if self._error is not None:
                raise self._error
            return self._output

    def __iter__(self):
        return self

    def __next__(self):
        with self._cond:
            self._cond.wait_for(lambda: self._chunks or self._closed)
            return self._pop(StopIteration)

    def _pop(self, end):
        if self._chunks:
            return self._chunks.popleft()
        if self._error is not None:
            raise self._error
        raise end

    def __aiter__(self):
        return self

    async def __anext__(self):
        loop = asyncio.get_running_loop()
        while True:
            with self._cond:
                if self._chunks or self._closed:
                    return self._pop(StopAsyncIteration)
                future = loop.create_future()
                self._waiters.append((loop, future))
            await future


__all__ = ["RequestStream", "one_wake_per_loop"]
