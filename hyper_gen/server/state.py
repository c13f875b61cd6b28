"""What every endpoint shares: the engine, the tokenizer, the served model's name and limits,
submitting a request's prompts (a prompt the engine rejects is a 400, nothing queued), and the
requests still open when the server stops (``interrupt_all``: each ends with a 503 / a last
error event, see ``launch``)."""

from __future__ import annotations

import asyncio
import time
import uuid
import weakref
from typing import List, Optional

from hyper_gen.inputs import ModelLimits

from .errors import APIError, bad_value, shutting_down, unknown_model
from .logprobs import TokenStrings
from .params import field_named
from .streams import Requests

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
        self.closing = False  # the server stopped and the grace period of its open requests is over
        self._open: "weakref.WeakSet[Requests]" = weakref.WeakSet()  # responses not yet done

    def load(self) -> dict:
        """How busy the engine is: requests admitted and not yet closed, requests queued."""
        return self.engine.stats()

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
        if self.closing:
            raise shutting_down()
        streams = []
        try:
            for ids in prompts:
                streams.append(self.engine.submit(ids, params, request_id=f"{uuid.uuid4().hex}"))
        except (ValueError, TypeError) as exc:
            for stream in streams:
                stream.cancel()
            field = field_named(str(exc), ("prompt", "prompt_token_ids", "n", "stop", "stop_token_ids", "max_tokens"))
            raise bad_value(param if field.startswith("prompt") or not field else field, str(exc)) from None
        except RuntimeError as exc:  # the engine is shutting down or has stopped
            for stream in streams:
                stream.cancel()
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
