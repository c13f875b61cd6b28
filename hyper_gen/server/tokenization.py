"""vLLM's tokenizer endpoints: ``POST /tokenize``, ``POST /detokenize``, ``GET /tokenizer_info``.

Clients that count or build token ids against the served tokenizer (lm-evaluation-harness probes
``/tokenizer_info`` and ``/tokenize`` and then tokenizes through them) get vLLM's field names:
``/tokenize`` takes a ``prompt`` (with ``add_special_tokens``, default true, as completions
encode) or chat ``messages`` (through the chat template, as chat encodes: ``add_special_tokens``
default false) and answers ``{"count", "max_model_len", "tokens"}`` (``"token_strs"`` with
``return_token_strs``); ``/detokenize`` takes ``tokens`` and answers ``{"prompt"}``.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from pydantic import Field

from .errors import bad_value
from .prompts import _check_ids, _encode, chat_text
from .protocol import ChatMessage, _Request


class TokenizeCompletionRequest(_Request):
    model: Optional[str] = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_Request):
    model: Optional[str] = None
    messages: List[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool = False
    tools: Optional[List[Dict[str, Any]]] = None
    chat_template_kwargs: Optional[Dict[str, Any]] = None


class DetokenizeRequest(_Request):
    model: Optional[str] = None
    tokens: List[int]


class TokenizeRequest:
    """Either form, as vLLM tells them apart: a body with ``messages`` is the chat form, any other
    the prompt form (``body.read_json`` validates with ``model_validate``)."""

    @staticmethod
    def model_validate(body: dict):
        form = TokenizeChatRequest if "messages" in body else TokenizeCompletionRequest
        return form.model_validate(body)


def _tokenizer(state, param: str):
    if state.tokenizer is None:
        raise bad_value(param, "this server has no tokenizer")
    return state.tokenizer


def tokenize(state, request) -> dict:
    state.check_model(request.model)
    if isinstance(request, TokenizeChatRequest):
        tokenizer = _tokenizer(state, "messages")
        text, param = chat_text(request, tokenizer), "messages"
    else:
        tokenizer, text, param = _tokenizer(state, "prompt"), request.prompt, "prompt"
    ids = _encode(tokenizer, text, param, request.add_special_tokens)
    out = {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids}
    if request.return_token_strs:
        out["token_strs"] = tokenizer.convert_ids_to_tokens(ids)
    return out


def detokenize(state, request: DetokenizeRequest) -> dict:
    state.check_model(request.model)
    tokenizer = _tokenizer(state, "tokens")
    if request.tokens:
        _check_ids(request.tokens, state.vocab_size, "tokens")
    return {"prompt": tokenizer.decode(request.tokens)}


def tokenizer_info(state) -> dict:
    """The tokenizer's class, special tokens and chat template (what a client needs to build prompts)."""
    tokenizer = _tokenizer(state, "tokenizer")
    info = {"tokenizer_class": type(tokenizer).__name__}
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        value = getattr(tokenizer, name, None)
        info[name] = value if value is None or isinstance(value, str) else str(value)
    info["chat_template"] = getattr(tokenizer, "chat_template", None)
    info["model_max_length"] = state.max_model_len
    return info
