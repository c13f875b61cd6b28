"""Prompt token ids from a request: completions' ``prompt`` (text, token ids, or a list of
either) and chat's ``messages`` through the checkpoint's chat template.

Text prompts are encoded as vLLM does: completions with the tokenizer's special tokens (a BOS
where the checkpoint wants one), chat without (the template writes its own).
"""

from __future__ import annotations

import json
from typing import List

from .errors import bad_value
from .params import check_sizes
from .protocol import ChatCompletionRequest, CompletionRequest


def _check_ids(ids, vocab_size, param: str, max_model_len=None) -> List[int]:
    if not ids:
        raise bad_value(param, f"{param} is empty: nothing to complete")
    if max_model_len is not None and len(ids) >= max_model_len:  # before any per-id work
        raise bad_value(
            param,
            f"{param} is {len(ids)} tokens, which leaves no room to generate in the context of "
            f"max_model_len={max_model_len} positions: shorten it to fewer than {max_model_len} tokens",
        )
    if vocab_size is not None:
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise bad_value(param, f"{param} has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
    return list(ids)


def _encode(tokenizer, text: str, param: str, add_special_tokens: bool) -> List[int]:
    try:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)
    except Exception as exc:  # text the tokenizer cannot take is the client's text, not a server error
        raise bad_value(param, f"the tokenizer cannot encode {param}: {type(exc).__name__}: {exc}") from None


def completion_prompts(request: CompletionRequest, tokenizer, vocab_size=None, max_model_len=None) -> List[List[int]]:
    """One list of token ids per prompt of the request."""
    prompt = request.prompt
    if isinstance(prompt, str):
        prompts = [prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        prompts = [prompt]
    else:
        prompts = list(prompt)
    if not prompts:
        raise bad_value("prompt", "prompt is empty: nothing to complete")
    out = []
    for item in prompts:
        if isinstance(item, str):
            if tokenizer is None:
                raise bad_value("prompt", "this server has no tokenizer: send token ids")
            item = _encode(tokenizer, item, "prompt", True)
        out.append(_check_ids(item, vocab_size, "prompt", max_model_len))
    return out


_RESERVED = {"conversation", "messages", "tools", "documents", "tokenize", "add_generation_prompt", "return_dict"}


def _message(m) -> dict:
    """A message as chat templates read it (vLLM's: a tool call's JSON arguments as an object)."""
    out = {"role": m.role, "content": m.text()}
    for name in ("name", "tool_call_id", "reasoning_content"):
        if getattr(m, name):
            out[name] = getattr(m, name)
    if m.tool_calls:
        calls = []
        for call in m.tool_calls:
            call = dict(call)
            fn = dict(call.get("function") or {})
            if isinstance(fn.get("arguments"), str):
                try:
                    fn["arguments"] = json.loads(fn["arguments"])
                except ValueError:
                    raise bad_value("messages", f"a tool call's arguments are not JSON: {fn['arguments']!r}") from None
            call["function"] = fn
            calls.append(call)
        out["tool_calls"] = calls
    return out


def chat_text(request: ChatCompletionRequest, tokenizer) -> str:
    """The conversation through the checkpoint's chat template, ending where the assistant speaks (or, with
    ``continue_final_message``, inside the last assistant message); ``tools`` and ``chat_template_kwargs``
    go to the template."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise bad_value("messages", "this model has no chat template: use /v1/completions")
    messages = [_message(m) for m in request.messages]
    kwargs = dict(request.chat_template_kwargs or {})
    reserved = sorted(_RESERVED & set(kwargs))
    if reserved:
        raise bad_value("chat_template_kwargs", f"chat_template_kwargs may not set {reserved}: use the request fields")
    if request.continue_final_message:
        if request.add_generation_prompt and "add_generation_prompt" in request.model_fields_set:
            message = "continue_final_message and add_generation_prompt exclude each other"
            raise bad_value("continue_final_message", message)
        if messages[-1]["role"] != "assistant":
            raise bad_value("continue_final_message", "continue_final_message needs an assistant message last")
    tools = request.tools if request.tools else None
    try:
        return tokenizer.apply_chat_template(
            messages,
            tools=tools,
            tokenize=False,
            add_generation_prompt=request.add_generation_prompt and not request.continue_final_message,
            continue_final_message=request.continue_final_message,
            **kwargs,
        )
    except Exception as exc:  # the template's own raise_exception() and jinja errors
        raise bad_value("messages", f"the chat template rejected the messages: {exc}") from None


def chat_prompt(request: ChatCompletionRequest, tokenizer, vocab_size=None, max_model_len=None, text=None) -> List[int]:
    """``chat_text``'s token ids (``text``: it, already rendered)."""
    text = chat_text(request, tokenizer) if text is None else text
    return _check_ids(_encode(tokenizer, text, "messages", False), vocab_size, "messages", max_model_len)


def checked_completion(state, request: CompletionRequest):
    """A completion request's checks before any work (model, sizes, ``max_tokens``) and its prompts:
    ``(prompts as token ids, max_tokens)``, ``max_tokens`` defaulting to what the context leaves. The
    generating endpoint and its render (``render.py``) share them, so both refuse alike."""
    state.check_model(request.model)
    check_sizes(request)
    state.check_max_tokens(request.max_tokens, "max_tokens")
    prompts = completion_prompts(request, state.tokenizer, state.vocab_size, state.max_model_len)
    max_tokens = request.max_tokens if request.max_tokens is not None else state.default_max_tokens(prompts)
    return prompts, max_tokens


def checked_chat(state, request: ChatCompletionRequest):
    """A chat request's checks and its prompt: ``(the template's text, its token ids, max_tokens)``."""
    state.check_model(request.model)
    check_sizes(request)
    for param in ("max_completion_tokens", "max_tokens"):
        state.check_max_tokens(getattr(request, param), param)
    text = chat_text(request, state.tokenizer)
    ids = chat_prompt(request, state.tokenizer, state.vocab_size, state.max_model_len, text=text)
    return text, ids, request.max_completion_tokens or request.max_tokens or state.default_max_tokens([ids])
