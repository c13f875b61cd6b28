"""The request fields SGLang's and vLLM's routers (and SGLang's own clients) add to what a client
sent, in one list: every field here is accepted on the endpoints it names, with the client version
it was seen from.

sglang-router and vllm-router parse each request into SGLang's request types and forward them with
SGLang's extension fields written out at their defaults, so a server that forbids unknown fields
(``protocol``: a misspelt parameter is a 400, not a silent default) refuses every routed request
unless it knows them. A field here is either **honoured** (the server acts on it: ``no_stop_trim``
keeps the stop string in the text, ``skip_special_tokens`` false decodes special tokens,
``separate_reasoning`` / ``include_reasoning`` / ``stream_reasoning`` steer the reasoning split,
``model`` on ``/generate`` is checked as on the OpenAI routes), or accepted at its **neutral** value
only: a value the server cannot honour (``return_hidden_states: true``, ``background: true``) is a
400 naming the field rather than silently ignored. Fields outside this list and the protocol
models stay 400s, so typos are still caught.

Fields the routers also send that OpenAI's or vLLM's protocol already has (``stream``, ``echo``,
``ignore_eos``, ``logprobs``, chat's ``continue_final_message`` and ``max_completion_tokens``,
``/generate``'s ``return_logprob`` and ``return_text_in_logprobs``) are declared by the protocol
models; ``ROUTED`` lists them too, so a test can check every field a router sends is accepted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

from pydantic import BaseModel, ConfigDict, create_model

COMPLETIONS, CHAT, GENERATE = "completions", "chat", "generate"
SGLANG_ROUTER = "sglang-router 0.3.2"
VLLM_ROUTER = "vllm-router 0.1.17"
BOTH = f"{SGLANG_ROUTER}, {VLLM_ROUTER}"


@dataclass(frozen=True)
class Extension:
    """One field of the dialect: its JSON type and default, the endpoints it comes on, the clients
    seen sending it, and whether the server acts on it (``honoured``) or takes ``default`` only."""

    name: str
    type: Any
    default: Any
    endpoints: Tuple[str, ...]
    clients: str
    honoured: bool
    meaning: str


EXTENSIONS: Tuple[Extension, ...] = (
    Extension(
        "no_stop_trim",
        bool,
        False,
        (COMPLETIONS, CHAT),
        BOTH,
        True,
        "true: the stop string (or stop token's text) that ended a choice stays in its text (SGLang's)",
    ),
    Extension(
        "skip_special_tokens",
        bool,
        True,
        (COMPLETIONS, CHAT),
        BOTH,
        True,
        "false: special tokens are decoded into the text (an EOS that ended the choice stays out)",
    ),
    Extension(
        "separate_reasoning",
        bool,
        True,
        (CHAT,),
        BOTH,
        True,
        "false: with --reasoning-parser, the <think> block stays in content instead of reasoning_content",
    ),
    Extension(
        "stream_reasoning",
        bool,
        True,
        (CHAT,),
        BOTH,
        True,
        "false: a stream hands out reasoning_content in one delta once the reasoning ends",
    ),
    Extension(
        "include_reasoning",
        bool,
        True,
        (CHAT,),
        VLLM_ROUTER,
        True,
        "false: with --reasoning-parser, the reasoning is split off and dropped (vLLM's)",
    ),
    Extension(
        "return_hidden_states",
        bool,
        False,
        (COMPLETIONS, CHAT, GENERATE),
        BOTH,
        False,
        "the last layer's hidden states in the answer: not returned by this server",
    ),
    Extension(
        "model", Optional[str], None, (GENERATE,), SGLANG_ROUTER, True, "a name other than the served model's is a 404"
    ),
    Extension(
        "log_metrics", bool, True, (GENERATE,), SGLANG_ROUTER, False, "false would leave the request out of /metrics"
    ),
    Extension(
        "background", bool, False, (GENERATE,), SGLANG_ROUTER, False, "a request answered later, by id: not served"
    ),
    Extension(
        "no_logs",
        bool,
        False,
        (GENERATE,),
        SGLANG_ROUTER,
        True,
        "true: the request is not logged; this server never logs request contents, so either value holds",
    ),
    Extension("return_bytes", bool, False, (GENERATE,), SGLANG_ROUTER, False, "output text as bytes: not returned"),
    Extension("return_entropy", bool, False, (GENERATE,), SGLANG_ROUTER, False, "per-token entropy: not returned"),
)

# every field each router adds to a request (what it was seen sending), the protocol's own included
ROUTED: Dict[str, Dict[str, Dict[str, Any]]] = {
    SGLANG_ROUTER: {
        COMPLETIONS: {
            "stream": False,
            "echo": False,
            "no_stop_trim": False,
            "ignore_eos": False,
            "skip_special_tokens": True,
            "return_hidden_states": False,
        },
        CHAT: {
            "logprobs": False,
            "stream": False,
            "no_stop_trim": False,
            "ignore_eos": False,
            "continue_final_message": False,
            "skip_special_tokens": True,
            "separate_reasoning": True,
            "stream_reasoning": True,
            "return_hidden_states": False,
        },
        GENERATE: {
            "model": None,
            "return_text_in_logprobs": False,
            "stream": False,
            "log_metrics": True,
            "return_hidden_states": False,
            "background": False,
            "no_logs": False,
            "return_bytes": False,
            "return_entropy": False,
        },
    },
    VLLM_ROUTER: {
        COMPLETIONS: {
            "stream": False,
            "echo": False,
            "no_stop_trim": False,
            "ignore_eos": False,
            "skip_special_tokens": True,
            "return_hidden_states": False,
        },
        CHAT: {
            "stream": False,
            "logprobs": False,
            "no_stop_trim": False,
            "ignore_eos": False,
            "continue_final_message": False,
            "skip_special_tokens": True,
            "separate_reasoning": True,
            "stream_reasoning": True,
            "return_hidden_states": False,
            "include_reasoning": True,
        },
        GENERATE: {"stream": False, "return_logprob": False, "return_hidden_states": False},
    },
}


def _fields(endpoint: str) -> dict:
    return {e.name: (e.type, e.default) for e in EXTENSIONS if endpoint in e.endpoints}


def _mixin(name: str, endpoint: str):
    config = ConfigDict(extra="forbid", strict=True)
    return create_model(name, __config__=config, **_fields(endpoint))


# the protocol models inherit these: the dialect's fields, declared here only
CompletionDialect = _mixin("CompletionDialect", COMPLETIONS)
ChatDialect = _mixin("ChatDialect", CHAT)
GenerateDialect = _mixin("GenerateDialect", GENERATE)


def unhonoured(request: BaseModel, endpoint: str) -> Optional[Tuple[str, str]]:
    """(field, message) of the first dialect field ``request`` sets to a value this server cannot
    honour, else None (the caller makes it a 400 naming the field)."""
    for e in EXTENSIONS:
        if e.honoured or endpoint not in e.endpoints:
            continue
        value = getattr(request, e.name)
        if value != e.default:
            shown = "null" if e.default is None else str(e.default).lower()
            return e.name, f"{e.name}={str(value).lower()} is not supported ({e.meaning}); send {shown} or leave it out"
    return None


__all__ = ["EXTENSIONS", "ROUTED", "CompletionDialect", "ChatDialect", "GenerateDialect", "unhonoured"]
