"""``POST /v1/completions``: one or more prompts, n choices each, whole or streamed.

Choice ``i * n + j`` is prompt ``i``'s ``j``-th sample (as vLLM numbers them). Usage counts each
prompt once and every generated token. vLLM's ``return_token_ids``: each choice carries its
prompt's ids (``prompt_token_ids``, as the engine took them: ids sent are never re-tokenized) and
the ids it generated (``token_ids``, an EOS or stop token that ended it included); streamed, each
chunk carries its new ids and a choice's first chunk its prompt's ids. ``echo`` puts each
choice's prompt (text, and logprobs with ``logprobs``) in front of it (``echo.py``).
"""

from __future__ import annotations

import time

from . import echo, structured, texts
from .errors import APIError, shutting_down
from .logprobs import merge_completion
from .params import sampling_params
from .prompts import checked_completion
from .protocol import CompletionChoice, CompletionRequest, CompletionResponse, Usage
from .state import ServerState, collected_chunks, new_id
from .streams import DONE, EventStream, Frames, ServerClosing, sse


def _usage(prompt_tokens: int, completion_tokens: int) -> Usage:
    return Usage(
        prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, total_tokens=prompt_tokens + completion_tokens
    )


async def create_completion(state: ServerState, request: CompletionRequest, http_request):
    prompts, max_tokens = checked_completion(state, request)
    max_tokens = max_tokens or 1  # max_tokens: 0 (echo only): the engine draws one token, left out (echo.py)
    spec = structured.requested(request)
    outputs = structured.build(state, *spec) if spec else None
    params = sampling_params(request, max_tokens, structured_outputs=outputs)
    requests = state.submit(prompts, params, "prompt")
    head = dict(id=new_id("cmpl"), created=int(time.time()), model=state.model_name)
    prompt_tokens = sum(len(p) for p in prompts)
    want_logprobs = request.logprobs is not None
    text_of = _texts(state, request, params)
    if request.stream:
        return EventStream(_events(state, request, requests, head, prompts, want_logprobs, text_of), requests)

    choices, aligners, generated = {}, {}, 0
    async for i, chunk in collected_chunks(http_request, requests):
        index = i * request.n + chunk.index
        choice = choices.setdefault(index, CompletionChoice(index=index, text=""))
        choice.text += text_of(index, chunk)
        if request.return_token_ids:
            if choice.token_ids is None:
                choice.prompt_token_ids, choice.token_ids = list(prompts[i]), []
            choice.token_ids += [int(t) for t in chunk.token_ids]
        generated += len(chunk.token_ids) if request.max_tokens != 0 else 0
        if want_logprobs:
            aligner = aligners.setdefault(index, state.tokens.choice())
            more = state.tokens.completion(aligner.add(chunk))
            if choice.logprobs is None:
                choice.logprobs = more
            else:
                merge_completion(choice.logprobs, more)
        if chunk.finished:
            choice.finish_reason = chunk.finish_reason
    if request.prompt_logprobs is not None or request.echo:  # vLLM's: each choice of a prompt carries that prompt's
        echoed = echo.prompt_texts(request, prompts, state.tokenizer) if request.echo else None
        for i, stream in enumerate(requests.streams):
            found = stream.result(timeout=5).prompt_logprobs  # the stream has ended: no wait
            prompt_logprobs = None
            if found is not None and request.prompt_logprobs is not None:
                prompt_logprobs = state.tokens.prompt(found, request.prompt_logprobs)
            for j in range(request.n):
                choice = choices.get(i * request.n + j)
                if choice is not None:
                    choice.prompt_logprobs = prompt_logprobs
                    if echoed is not None:
                        echo.prepend(choice, state, request, prompts[i], echoed[i], found)
    ordered = [choices[k] for k in sorted(choices)]
    return CompletionResponse(**head, choices=ordered, usage=_usage(prompt_tokens, generated))


def _texts(state, request, params):
    """``(choice index, chunk) -> its new text``: the engine's, or decoded here for SGLang's
    ``skip_special_tokens`` false / ``no_stop_trim`` true (``texts``)."""
    make = texts.texter(state, params, request.skip_special_tokens, request.no_stop_trim)
    if make is None:
        return lambda index, chunk: chunk.text or ""
    each = {}
    return lambda index, chunk: each.setdefault(index, make()).add(chunk.token_ids, chunk.finished, chunk.finish_reason)


async def _events(state, request, requests, head, prompts, want_logprobs, text_of):
    options = request.stream_options
    usage_each = bool(options and options.continuous_usage_stats)
    prompt_tokens = sum(len(p) for p in prompts)
    aligners, generated, started = {}, 0, set()
    ids = request.return_token_ids
    frames = Frames(CompletionResponse, CompletionChoice, head)
    try:
        async for i, chunk in requests.chunks():
            index = i * request.n + chunk.index
            generated += len(chunk.token_ids)
            text = text_of(index, chunk)
            logprobs = None
            if want_logprobs:
                entries = aligners.setdefault(index, state.tokens.choice()).add(chunk)
                logprobs = state.tokens.completion(entries) if entries else None
            if not (text or chunk.finished or logprobs or (ids and chunk.token_ids)):
                continue
            if want_logprobs and logprobs is None:
                logprobs = state.tokens.completion([])
            values = dict(index=index, text=text, finish_reason=chunk.finish_reason if chunk.finished else None)
            if ids:
                values["token_ids"] = [int(t) for t in chunk.token_ids]
                if index not in started:
                    started.add(index)
                    values["prompt_token_ids"] = list(prompts[i])
            if want_logprobs or usage_each:
                usage = _usage(prompt_tokens, generated) if usage_each else None
                choice = CompletionChoice(**values, logprobs=logprobs)
                yield sse(CompletionResponse(**head, choices=[choice], usage=usage))
            else:  # the usual chunk: only its choice is encoded (Frames)
                yield frames.event(frames.choice(**values))
        if options and options.include_usage:
            yield sse(CompletionResponse(**head, choices=[], usage=_usage(prompt_tokens, generated)))
    except ServerClosing:  # the response has started: the error goes in the stream
        yield sse(shutting_down().response_body())
    except Exception as exc:
        yield sse(APIError(f"generation failed: {exc}", status=500).response_body())
    yield DONE
