"""A request's sampling parameters as the engine's ``SamplingParams``, or a 400 naming the field.

OpenAI's parameters the engine has no equivalent for are accepted at their defaults only
(``presence_penalty`` / ``frequency_penalty`` 0, an empty ``logit_bias``, no ``suffix``,
``best_of`` equal to ``n``), so a client is told instead of silently ignored.
``check_sizes`` bounds every list a request can make the server hold (prompts, stop strings,
stop token ids) before anything is tokenized or queued; ``n``, ``logprobs`` and
``top_logprobs`` are bounded on their fields (``protocol``), ``max_tokens`` by the context
(``ServerState.check_max_tokens``).
"""

from __future__ import annotations

import re

from hyper_gen.engine import SamplingParams

from . import dialects
from .errors import bad_value
from .protocol import ChatCompletionRequest, CompletionRequest

# SamplingParams field -> the request parameter that sets it (chat overrides a few)
_PARAM_OF_FIELD = {
    "n": "n",
    "max_tokens": "max_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "seed": "seed",
    "stop_token_ids": "stop_token_ids",
    "stop": "stop",
    "ignore_eos": "ignore_eos",
    "logprobs": "logprobs",
    "prompt_logprobs": "prompt_logprobs",
    "min_tokens": "min_tokens",
}


MAX_PROMPTS = 2048  # prompts in one completions request (OpenAI's limit on an array input)
MAX_STOPS = 32  # stop strings in one request (OpenAI allows 4)
MAX_STOP_CHARS = 1024  # characters of one stop string (a streamed choice holds back that many - 1)
MAX_STOP_TOKEN_IDS = 1024


def check_sizes(request) -> None:
    """A 400 naming the parameter for a list longer than this server takes, before any work."""
    stop = request.stop
    if isinstance(stop, list):
        if len(stop) > MAX_STOPS:
            raise bad_value("stop", f"stop has {len(stop)} strings, more than the {MAX_STOPS} a request may have")
    for text in [stop] if isinstance(stop, str) else stop or ():
        if len(text) > MAX_STOP_CHARS:
            raise bad_value("stop", f"a stop string has {len(text)} characters, more than {MAX_STOP_CHARS}")
    ids = request.stop_token_ids
    if ids is not None and len(ids) > MAX_STOP_TOKEN_IDS:
        raise bad_value(
            "stop_token_ids",
            f"stop_token_ids has {len(ids)} ids, more than the {MAX_STOP_TOKEN_IDS} a request may have",
        )
    prompt = getattr(request, "prompt", None)
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) and len(prompt) > MAX_PROMPTS:
        raise bad_value(
            "prompt", f"prompt is a batch of {len(prompt)} prompts, more than the {MAX_PROMPTS} a request may have"
        )


def check_dialect(request, endpoint: str) -> None:
    """A 400 naming the first router / SGLang field (``dialects``) set to a value this server cannot honour."""
    found = dialects.unhonoured(request, endpoint)
    if found is not None:
        raise bad_value(*found)


def _check_unsupported(request) -> None:
    check_dialect(request, dialects.COMPLETIONS if isinstance(request, CompletionRequest) else dialects.CHAT)
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(request, name)
        if value not in (None, 0, 0.0):
            raise bad_value(name, f"{name} is not supported (only 0), got {value!r}; use repetition_penalty")
    if request.logit_bias:
        raise bad_value("logit_bias", "logit_bias is not supported")
    if request.stream_options is not None and not request.stream:
        raise bad_value("stream_options", "stream_options is only allowed when stream is true")
    if isinstance(request, CompletionRequest):
        if request.echo and request.stream:
            raise bad_value("echo", "echo is not available with stream: true (send stream: false to score a prompt)")
        if request.max_tokens == 0 and not request.echo:
            raise bad_value("max_tokens", "max_tokens: 0 needs echo: true (the prompt scored, nothing generated)")
        if request.max_tokens == 0 and request.min_tokens:
            raise bad_value("min_tokens", f"min_tokens must be 0 with max_tokens: 0, got {request.min_tokens}")
        if request.suffix:
            raise bad_value("suffix", "suffix is not supported")
        if request.best_of not in (None, request.n):
            raise bad_value("best_of", f"best_of must equal n ({request.n}) when given, got {request.best_of}")
    if request.prompt_logprobs is not None and request.stream:
        raise bad_value("prompt_logprobs", "prompt_logprobs is not available with stream: true (as in vLLM)")


def field_named(message: str, fields) -> str:
    """The first SamplingParams field the engine's error message names."""
    found = [(m.start(), name) for name in fields for m in [re.search(rf"\b{re.escape(name)}\b", message)] if m]
    return min(found)[1] if found else ""


def sampling_params(request, max_tokens: int, context=None, structured_outputs=None) -> SamplingParams:
    """SamplingParams for ``request`` (completions or chat) generating at most ``max_tokens``
    (``structured_outputs``: the grammar ``structured.build`` made of it, or None)."""
    _check_unsupported(request)
    params = {"n": request.n, "max_tokens": max_tokens, "ignore_eos": request.ignore_eos}
    if structured_outputs is not None:
        params["structured_outputs"] = structured_outputs
    params["min_tokens"] = request.min_tokens
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed", "stop_token_ids"):
        value = getattr(request, name)
        if value is not None:
            params[name] = value
    if request.stop is not None:  # "" and [""] alike are 400s (SamplingParams), never silently dropped
        params["stop"] = request.stop if isinstance(request.stop, str) else list(request.stop)
    names = dict(_PARAM_OF_FIELD)
    if isinstance(request, ChatCompletionRequest):
        if request.top_logprobs is not None and not request.logprobs:
            raise bad_value("top_logprobs", "top_logprobs needs logprobs: true")
        if request.logprobs:
            params["logprobs"] = request.top_logprobs or 0
        names["logprobs"] = "top_logprobs"
        names["max_tokens"] = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
    elif request.logprobs is not None:
        params["logprobs"] = request.logprobs
    if request.prompt_logprobs is not None:
        params["prompt_logprobs"] = request.prompt_logprobs
    if isinstance(request, CompletionRequest) and request.echo and request.logprobs is not None:
        # echo's prompt entries are the engine's prompt logprobs (its prefill forward), top logprobs of them
        params["prompt_logprobs"] = max(request.logprobs, request.prompt_logprobs or 0)
    try:
        return SamplingParams(**params)
    except (TypeError, ValueError) as exc:
        field = field_named(str(exc), names)
        raise bad_value(names.get(field, field) or None, str(exc)) from None
