"""``POST /v1/chat/completions``: the messages through the checkpoint's chat template, n replies,
whole or streamed (each choice's first chunk carries ``role: "assistant"``, as OpenAI's do).

vLLM's ``prompt_logprobs=k`` (not with ``stream``): the templated prompt's logprobs, once per
response at its top level (completions puts them on every choice), in the same format. vLLM's
``return_token_ids``: the templated prompt's ids at the top level (``prompt_token_ids``; streamed,
on the first chunk), each choice's generated ids on it (``token_ids``; streamed, each chunk's new ids)."""

from __future__ import annotations

import time
from types import SimpleNamespace

from . import structured, texts
from .errors import APIError, bad_value, shutting_down
from .params import sampling_params
from .prompts import checked_chat
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
from .state import ServerState, collected_chunks, new_id
from .streams import DONE, EventStream, Frames, ServerClosing, sse
from .tools import AgentOutput, check_tools, finish_reason, tool_grammar


def _usage(prompt_tokens: int, completion_tokens: int) -> Usage:
    return Usage(
        prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, total_tokens=prompt_tokens + completion_tokens
    )


async def create_chat_completion(state: ServerState, request: ChatCompletionRequest, http_request):
    text, ids, max_tokens = checked_chat(state, request)
    outputs, parsers = _constraints(state, request, text)
    params = sampling_params(request, max_tokens, structured_outputs=outputs)
    requests = state.submit([ids], params, "messages")
    head = dict(id=new_id("chatcmpl"), created=int(time.time()), model=state.model_name)
    make = texts.texter(state, params, request.skip_special_tokens, request.no_stop_trim)
    own = {}

    def text_of(chunk) -> str:  # the engine's text, or decoded here (texts.py)
        if make is None:
            return chunk.text or ""
        return own.setdefault(chunk.index, make()).add(chunk.token_ids, chunk.finished, chunk.finish_reason)

    if request.stream:
        return EventStream(_events(state, request, requests, head, ids, parsers, text_of), requests)

    answers, reasons, logprobs, aligners, generated = {}, {}, {}, {}, 0
    token_ids = {i: [] for i in range(request.n)}
    async for _, chunk in collected_chunks(http_request, requests):
        answers[chunk.index] = answers.get(chunk.index, "") + text_of(chunk)
        token_ids[chunk.index] += [int(t) for t in chunk.token_ids]
        generated += len(chunk.token_ids)
        if request.logprobs:
            entries = aligners.setdefault(chunk.index, state.tokens.choice()).add(chunk)
            logprobs.setdefault(chunk.index, ChatLogprobs(content=[])).content += state.tokens.chat(entries).content
        if chunk.finished:
            reasons[chunk.index] = chunk.finish_reason
    messages, calls = {}, {}
    for i in range(request.n):
        reasoning, content, calls[i] = AgentOutput(*parsers).feed(answers.get(i, ""), final=True)
        messages[i] = AssistantMessage(
            content=content if content or not calls[i] else None,
            reasoning_content=reasoning if reasoning and request.include_reasoning else None,
            tool_calls=calls[i] or None,
        )
    choices = [
        ChatChoice(
            index=i,
            message=messages[i],
            logprobs=logprobs.get(i, ChatLogprobs(content=[])) if request.logprobs else None,
            finish_reason=finish_reason(reasons.get(i), calls[i]),
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


def _constraints(state, request, text: str):
    """(the request's StructuredOutputs or None, (reasoning parser, tool-call parser, prompt text))."""
    functions = check_tools(request)
    spec = structured.requested(request)
    outputs = None
    if functions:
        grammar = tool_grammar(request, functions, state.tool_call_parser)
        if grammar is not None:
            if spec:
                raise bad_value(spec[1], f"{spec[1]} cannot be combined with tool_choice {request.tool_choice!r}")
            outputs = structured.build(state, grammar, "tool_choice")
        else:  # the tool schemas must compile even when the output is free
            check = SimpleNamespace(tool_choice="required", parallel_tool_calls=None)
            structured.build(state, tool_grammar(check, functions, state.tool_call_parser), "tools")
    if spec and outputs is None:
        outputs = structured.build(state, *spec)
    tool_parser = state.tool_call_parser if functions and request.tool_choice != "none" else None
    reasoning_parser = state.reasoning_parser if request.separate_reasoning else None  # SGLang's: else all content
    return outputs, (reasoning_parser, tool_parser, text)


def _tool_deltas(index: int, call: dict) -> list:
    """OpenAI's tool-call deltas for one call: its id and name first, then its arguments."""
    fn = call["function"]
    return [
        {"index": index, "id": call["id"], "type": "function", "function": {"name": fn["name"], "arguments": ""}},
        {"index": index, "function": {"arguments": fn["arguments"]}},
    ]


async def _events(state, request, requests, head, prompt_ids, parsers, text_of):
    prompt_tokens = len(prompt_ids)
    want_ids = request.return_token_ids
    options = request.stream_options
    usage_each = bool(options and options.continuous_usage_stats)
    aligners, agents, generated, held = {}, {}, 0, {}
    frames = Frames(ChatCompletionChunk, ChatChunkChoice, head)
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
            agent = agents.setdefault(chunk.index, AgentOutput(*parsers))
            reasoning, content, calls = agent.feed(text_of(chunk), final=chunk.finished)
            if not request.include_reasoning:
                reasoning = ""
            elif not request.stream_reasoning:  # SGLang's: the reasoning in one delta, once it ends
                held[chunk.index] = held.get(chunk.index, "") + reasoning
                ended = chunk.finished or content or calls or not (agent.reasoning and agent.reasoning.inside)
                reasoning = held.pop(chunk.index) if ended else ""
            if not (reasoning or content or calls or chunk.finished or logprobs or (want_ids and chunk.token_ids)):
                continue
            made = agent.tools.calls if agent.tools else []
            values = dict(
                index=chunk.index,
                finish_reason=None if calls else finish_reason(chunk.finish_reason, made) if chunk.finished else None,
                token_ids=[int(t) for t in chunk.token_ids] if want_ids else None,
            )
            if logprobs is None and not usage_each:  # the usual chunk: only its choice is encoded (Frames)
                delta = {"content": content or None, "reasoning_content": reasoning or None}
                yield frames.event(frames.choice(**values, delta={k: v for k, v in delta.items() if v is not None}))
            else:
                delta = DeltaMessage(content=content or None, reasoning_content=reasoning or None)
                choice = ChatChunkChoice(**values, delta=delta, logprobs=logprobs)
                usage = _usage(prompt_tokens, generated) if usage_each else None
                yield sse(ChatCompletionChunk(**head, choices=[choice], usage=usage))
            first = len(made) - len(calls)
            for k, call in enumerate(calls):
                for delta in _tool_deltas(first + k, call):
                    part = ChatChunkChoice(index=chunk.index, delta=DeltaMessage(tool_calls=[delta]))
                    yield sse(ChatCompletionChunk(**head, choices=[part]))
            if calls and chunk.finished:
                end = ChatChunkChoice(
                    index=chunk.index, delta=DeltaMessage(), finish_reason=finish_reason(chunk.finish_reason, made)
                )
                yield sse(ChatCompletionChunk(**head, choices=[end]))
        if options and options.include_usage:
            yield sse(ChatCompletionChunk(**head, choices=[], usage=_usage(prompt_tokens, generated)))
    except ServerClosing:  # the response has started: the error goes in the stream
        yield sse(shutting_down().response_body())
    except Exception as exc:
        yield sse(APIError(f"generation failed: {exc}", status=500).response_body())
    yield DONE
