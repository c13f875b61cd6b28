"""What every endpoint shares: the engine, the tokenizer, the served model's name and limits,
submitting a request's prompts (a prompt the engine rejects is a 400, nothing queued; an engine
asleep a 503), the engine's sleep and wake-up (``POST /sleep``, ``POST /wake_up``), and the
requests still open when the server stops (``interrupt_all``: each ends with a 503 / a last
error event, see ``launch``)."""

from __future__ import annotations

import asyncio
import time
import uuid
import weakref
from typing import List, Optional

from hyper_gen.inputs import ModelLimits

from .errors import APIError, bad_value, draining, engine_sleeping, not_supported, shutting_down, unknown_model
from .logprobs import TokenStrings
from .params import field_named
from .streams import Requests, ServerClosing

DEFAULT_CHAT_MAX_TOKENS = 256  # a chat request without max_tokens on a model that declares no context


class ServerState:
    def __init__(self, engine, tokenizer, model_name: str, max_model_len: Optional[int] = None):
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        model = getattr(engine, "model", None)
        limits = ModelLimits.of(model) if model is not None else None
        self.max_model_len = max_model_len or getattr(engine, "max_model_len", None) or (limits and limits.context)
        self.vocab_size = limits.vocab_size if limits is not None else None
        self.tokens = TokenStrings(tokenizer)
        self.created = int(time.time())
        self.tool_call_parser = "hermes"  # --tool-call-parser (tools.py): how tool calls are read from the output
        self.reasoning_parser = None  # --reasoning-parser: None keeps <think> in the content
        self.closing = False  # the server stopped and the grace period of its open requests is over
        self.draining = False  # SIGTERM / SIGINT came: no new requests, the open ones finish
        self.model_path: Optional[str] = None  # the checkpoint folder (GET /server_info, /model_info)
        self.tp_size, self.backend = 1, None
        self._open: "weakref.WeakSet[Requests]" = weakref.WeakSet()  # responses not yet done

    def load(self) -> dict:
        """How busy the engine is: requests admitted and not yet closed, requests queued (the rest
        of ``engine.stats()``, the KV cache's numbers, is ``GET /metrics``'s)."""
        stats = self.engine.stats()
        return {key: stats[key] for key in ("running", "waiting") if key in stats}

    def health(self) -> str:
        """ "ok" while the server takes requests, else why not: "engine stopped", "draining" (stopping
        after a signal), "asleep" (KV cache freed), "paused" (``/pause_generation``): a router
        sends its requests elsewhere on the 503 that goes with it."""
        if not getattr(self.engine, "alive", True):
            return "engine stopped"
        if self.draining or self.closing:
            return "draining"
        if self.sleeping:
            return "asleep"
        if bool(getattr(self.engine, "paused", False)):
            return "paused"
        return "ok"

    @property
    def sleeping(self) -> bool:
        return bool(getattr(self.engine, "is_sleeping", False))

    def is_sleeping(self) -> bool:
        """``engine.is_sleeping``; a 501 for an engine that cannot sleep."""
        if not hasattr(self.engine, "is_sleeping"):
            raise not_supported("GET /is_sleeping", "is_sleeping", self.engine)
        return self.sleeping

    async def sleep(self, abort: bool) -> None:
        """``engine.sleep(abort)`` off the event loop (it waits for a step boundary). Busy
        (requests running or waiting, ``abort`` false) is a 409; asleep already, nothing to do."""
        method = getattr(self.engine, "sleep", None)
        if method is None:
            raise not_supported("POST /sleep", "sleep()", self.engine)
        if self.sleeping:
            return
        try:
            await asyncio.to_thread(method, abort=abort)
        except RuntimeError as exc:
            if self.sleeping:  # another caller put it to sleep meanwhile
                return
            load = self.load()
            hint = ""
            if not abort and load.get("running", 0) + load.get("waiting", 0) > 0:
                hint = "; POST /sleep?abort=true aborts the running and waiting requests first"
            raise APIError(f"the engine cannot sleep now: {exc}{hint}", status=409, code="engine_busy") from None

    async def wake_up(self) -> None:
        """``engine.wake_up()`` off the event loop; awake already, nothing to do. A failure (the
        KV cache cannot be allocated again) is a 500 naming it."""
        method = getattr(self.engine, "wake_up", None)
        if method is None:
            raise not_supported("POST /wake_up", "wake_up()", self.engine)
        if not self.sleeping:
            return
        try:
            await asyncio.to_thread(method)
        except Exception as exc:
            raise APIError(f"the engine could not wake up: {type(exc).__name__}: {exc}", status=500) from None

    def check_model(self, name: Optional[str]) -> None:
        if name is not None and name != self.model_name:
            raise unknown_model(name, self.model_name)

    def check_max_tokens(self, max_tokens: Optional[int], param: str) -> None:
        """A ``max_tokens`` no prompt could go with is the client's ``max_tokens``, named as such
        (checked before the prompt is tokenized)."""
        if max_tokens is not None and self.max_model_len is not None and max_tokens >= self.max_model_len:
            raise bad_value(
                param,
                f"{param} must be at most {self.max_model_len - 1} (the context is max_model_len={self.max_model_len} "
                f"positions, prompt included), got {max_tokens}",
            )

    def interrupt_all(self) -> None:
        """End every open response now (on the event loop): the server is stopping and their grace is over."""
        self.closing = True
        for requests in list(self._open):
            requests.interrupt()

    def default_max_tokens(self, prompts: List[List[int]]) -> int:
        """Chat without max_tokens: up to the context, as vLLM does."""
        if self.max_model_len is None:
            return DEFAULT_CHAT_MAX_TOKENS
        room = self.max_model_len - max(len(p) for p in prompts)
        if room < 1:
            raise bad_value("messages", f"the prompt fills the model's context ({self.max_model_len} tokens)")
        return room

    def submit(self, prompts: List[List[int]], params, param: str) -> Requests:
        """Every prompt queued, or none: the engine's rejection (a prompt too long for the
        context, ...) cancels what was already queued and becomes a 400 naming ``param``."""
        return self.submit_each([(ids, params, uuid.uuid4().hex) for ids in prompts], param)

    def submit_each(self, items, param: str) -> Requests:
        """``submit`` for ``[(prompt ids, params, request id), ...]``, each with its own params and id."""
        if self.closing:
            raise shutting_down()
        if self.draining:
            raise draining()
        if self.sleeping:
            raise engine_sleeping()
        streams = []
        try:
            for ids, params, request_id in items:
                streams.append(self.engine.submit(ids, params, request_id=request_id))
        except (ValueError, TypeError) as exc:
            for stream in streams:
                stream.cancel()
            field = field_named(
                str(exc),
                ("prompt", "prompt_token_ids", "n", "stop", "stop_token_ids", "max_tokens", "return_routed_experts"),
            )
            raise bad_value(param if field.startswith("prompt") or not field else field, str(exc)) from None
        except RuntimeError as exc:  # the engine is shutting down, has stopped, or fell asleep meanwhile
            for stream in streams:
                stream.cancel()
            if self.sleeping:
                raise engine_sleeping() from None
            raise APIError(f"the engine cannot take requests: {exc}", status=503) from None
        requests = Requests(streams)
        self._open.add(requests)
        return requests


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


async def watch_disconnect(http_request, requests: Requests, every_s: float = 0.1) -> None:
    """Cancel ``requests`` when the client of a non-streaming request goes away."""
    while True:
        await asyncio.sleep(every_s)
        if await http_request.is_disconnected():
            requests.cancel()
            return


async def collected_chunks(http_request, requests: Requests):
    """``(prompt index, chunk)`` of every stream of a non-streamed answer, cancelling them if the
    client goes away: the server closing is a 503, the engine failing a request a 500."""
    watcher = asyncio.ensure_future(watch_disconnect(http_request, requests))
    try:
        async for item in requests.chunks():
            yield item
    except ServerClosing:
        raise shutting_down() from None
    except Exception as exc:
        requests.cancel()
        raise APIError(f"generation failed: {exc}", status=500) from exc
    finally:
        watcher.cancel()
