"""``POST /v1/chat/completions``: the messages through the checkpoint's chat template, n replies,
whole or streamed (each choice's first chunk carries ``role: "assistant"``, as OpenAI's do).

vLLM's ``prompt_logprobs=k`` (not with ``stream``): the templated prompt's logprobs, once per
response at its top level (completions puts them on every choice), in the same format. vLLM's
``return_token_ids``: the templated prompt's ids at the top level (``prompt_token_ids``; streamed,
on the first chunk), each choice's generated ids on it (``token_ids``; streamed, each chunk's new ids)."""

from __future__ import annotations

import asyncio
import time

from .errors import APIError, shutting_down
from .params import check_sizes, sampling_params
from .prompts import chat_prompt
from .protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    DeltaMessage,
    Usage,
)
from .state import ServerState, new_id, watch_disconnect
from .streams import DONE, EventStream, ServerClosing, sse


def _usage(prompt_tokens: int, completion_tokens: int) -> Usage:
    return Usage(
        prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, total_tokens=prompt_tokens + completion_tokens
    )


async def create_chat_completion(state: ServerState, request: ChatCompletionRequest, http_request):
    state.check_model(request.model)
    check_sizes(request)
    for param in ("max_completion_tokens", "max_tokens"):
        state.check_max_tokens(getattr(request, param), param)
    ids = chat_prompt(request, state.tokenizer, state.vocab_size, state.max_model_len)
    max_tokens = request.max_completion_tokens or request.max_tokens or state.default_max_tokens([ids])
    params = sampling_params(request, max_tokens)
    requests = state.submit([ids], params, "messages")
    head = dict(id=new_id("chatcmpl"), created=int(time.time()), model=state.model_name)
    if request.stream:
        return EventStream(_events(state, request, requests, head, ids), requests)

    watcher = asyncio.ensure_future(watch_disconnect(http_request, requests))
    texts, reasons, logprobs, aligners, generated = {}, {}, {}, {}, 0
    token_ids = {i: [] for i in range(request.n)}
    try:
        async for _, chunk in requests.chunks():
            texts[chunk.index] = texts.get(chunk.index, "") + (chunk.text or "")
            token_ids[chunk.index] += [int(t) for t in chunk.token_ids]
            generated += len(chunk.token_ids)
            if request.logprobs:
                entries = aligners.setdefault(chunk.index, state.tokens.choice()).add(chunk)
                logprobs.setdefault(chunk.index, ChatLogprobs(content=[])).content += state.tokens.chat(entries).content
            if chunk.finished:
                reasons[chunk.index] = chunk.finish_reason
    except ServerClosing:
        raise shutting_down() from None
    except Exception as exc:
        requests.cancel()
        raise APIError(f"generation failed: {exc}", status=500) from exc
    finally:
        watcher.cancel()
    choices = [
        ChatChoice(
            index=i,
            message=AssistantMessage(content=texts.get(i, "")),
            logprobs=logprobs.get(i, ChatLogprobs(content=[])) if request.logprobs else None,
            finish_reason=reasons.get(i),
            token_ids=token_ids[i] if request.return_token_ids else None,
        )
        for i in range(request.n)
    ]
    prompt_logprobs = None
    if request.prompt_logprobs is not None:
        found = requests.streams[0].result(timeout=5).prompt_logprobs  # the stream has ended: no wait
        prompt_logprobs = None if found is None else state.tokens.prompt(found)
    return ChatCompletionResponse(
        **head,
        choices=choices,
        usage=_usage(len(ids), generated),
        prompt_logprobs=prompt_logprobs,
        prompt_token_ids=list(ids) if request.return_token_ids else None,
    )


async def _events(state, request, requests, head, prompt_ids):
    prompt_tokens = len(prompt_ids)
    want_ids = request.return_token_ids
    options = request.stream_options
    usage_each = bool(options and options.continuous_usage_stats)
    aligners, generated = {}, 0
    try:
        for i in range(request.n):
            first = ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
            if want_ids:
                first.token_ids = []
            usage = _usage(prompt_tokens, 0) if usage_each else None
            prompt = list(prompt_ids) if want_ids and i == 0 else None
            yield sse(ChatCompletionChunk(**head, choices=[first], usage=usage, prompt_token_ids=prompt))
        async for _, chunk in requests.chunks():
            generated += len(chunk.token_ids)
            logprobs = None
            if request.logprobs:
                entries = aligners.setdefault(chunk.index, state.tokens.choice()).add(chunk)
                logprobs = state.tokens.chat(entries) if entries else None
            if not (chunk.text or chunk.finished or logprobs or (want_ids and chunk.token_ids)):
                continue
            choice = ChatChunkChoice(
                index=chunk.index,
                delta=DeltaMessage(content=chunk.text or None),
                logprobs=logprobs,
                finish_reason=chunk.finish_reason if chunk.finished else None,
                token_ids=[int(t) for t in chunk.token_ids] if want_ids else None,
            )
            usage = _usage(prompt_tokens, generated) if usage_each else None
            yield sse(ChatCompletionChunk(**head, choices=[choice], usage=usage))
        if options and options.include_usage:
            yield sse(ChatCompletionChunk(**head, choices=[], usage=_usage(prompt_tokens, generated)))
    except ServerClosing:  # the response has started: the error goes in the stream
        yield sse(shutting_down().response_body())
    except Exception as exc:
        yield sse(APIError(f"generation failed: {exc}", status=500).response_body())
    yield DONE
