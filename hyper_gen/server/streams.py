"""Engine streams as one response: several prompts' streams merged in arrival order, sent as
server-sent events, and cancelled the moment the response ends early (a client that
disconnects, a server shutting down), so their slots in the running batch are freed.
"""

from __future__ import annotations

import asyncio
import json
from typing import AsyncIterator, List, Optional, Tuple

from starlette.responses import StreamingResponse

DONE = "data: [DONE]\n\n"


def sse(payload) -> str:
    """One server-sent event holding a JSON object (a pydantic model or a dict).

    A chat delta leaves out what it does not change (``role`` after the first chunk, ``content``
    on the last), as OpenAI's chunks do."""
    body = payload.model_dump() if hasattr(payload, "model_dump") else payload
    for choice in body.get("choices") or ():
        delta = choice.get("delta")
        if delta is not None:
            choice["delta"] = {k: v for k, v in delta.items() if v is not None}
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


class Frames:
    """The server-sent events of one streamed response, its fixed fields (``id``, ``object``,
    ``created``, ``model``) JSON-encoded once instead of per chunk: ``event(choice)`` holds one
    choice, a dict with ``choice_model``'s fields in their order (``choice(**values)``), and no
    usage; the same JSON ``sse(response_model(**head, choices=[choice_model(**values)]))`` gives."""

    _CHOICES = '"choices": []'

    def __init__(self, response_model, choice_model, head: dict):
        whole = json.dumps(response_model(**head, choices=[]).model_dump(), ensure_ascii=False)
        prefix, marker, suffix = whole.rpartition(self._CHOICES)
        if not marker or self._CHOICES in prefix:
            raise ValueError(f"{response_model.__name__} does not dump its choices once as a list: {whole[:200]}")
        self._prefix, self._suffix = "data: " + prefix + '"choices": [', "]" + suffix + "\n\n"
        self._fields = dict.fromkeys(choice_model.model_fields)

    def choice(self, **values) -> dict:
        unknown = values.keys() - self._fields.keys()
        if unknown:
            raise TypeError(f"not a choice field: {sorted(unknown)}")
        return {**self._fields, **values}

    def event(self, choice: dict) -> str:
        return self._prefix + json.dumps(choice, ensure_ascii=False) + self._suffix


class ServerClosing(Exception):
    """The server is stopping and this request's grace period is over: its response ends now,
    with a 503 (or, once streaming, a last error event and ``[DONE]``)."""


_CLOSING = object()


class Requests:
    """The engine streams of one HTTP request: iterated together, cancelled together, and
    interrupted together by a server that stops (``interrupt``, on the event loop)."""

    def __init__(self, streams: list):
        self.streams = list(streams)
        self.interrupted = False
        self._queue: Optional[asyncio.Queue] = None

    def cancel(self) -> None:
        for stream in self.streams:
            stream.cancel()

    def interrupt(self) -> None:
        """End the response now, whatever the engine does: ``chunks()`` raises ``ServerClosing``
        at once (the engine streams are cancelled too, which frees their slots)."""
        self.interrupted = True
        self.cancel()
        if self._queue is not None:
            self._queue.put_nowait((None, _CLOSING))
        for stream in self.streams:
            stream.interrupt_waiters(ServerClosing())

    async def chunks(self) -> AsyncIterator[Tuple[int, object]]:
        """(prompt index, chunk) from every stream as the engine produces them: one stream's straight
        from it (no task, no queue between: the usual request), several merged by a task each."""
        if self.interrupted:
            raise ServerClosing()
        if len(self.streams) == 1:
            stream = self.streams[0]
            while not self.interrupted:
                try:
                    chunk = await stream.__anext__()
                except StopAsyncIteration:
                    return
                yield 0, chunk
            raise ServerClosing()
        queue: asyncio.Queue = asyncio.Queue()
        self._queue = queue
        end = object()

        async def pump(i, stream):
            try:
                async for chunk in stream:
                    await queue.put((i, chunk))
            except BaseException as exc:  # handed to the consumer below
                await queue.put((i, exc))
                return
            await queue.put((i, end))

        tasks: List[asyncio.Task] = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(self.streams)]
        try:
            running = len(tasks)
            while running:
                i, item = await queue.get()
                if item is _CLOSING:
                    raise ServerClosing()
                if item is end:
                    running -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield i, item
        finally:
            for task in tasks:
                task.cancel()


class EventStream(StreamingResponse):
    """An SSE response that cancels its engine requests however it ends (finished, a client
    disconnect, which Starlette turns into a cancellation, or an error)."""

    def __init__(self, events, requests: Requests):
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.requests = requests

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.requests.cancel()
