"""vLLM's tokenize-only endpoints: ``POST /v1/completions/render`` and ``POST /v1/chat/completions/render``.

vllm-router posts a request here first (its ``kv_aware`` policy routes on the prompt's token ids)
and then sends the same body to the generating endpoint. The answer is vLLM's token-in request:
completions a list with one object per prompt, chat one object, each with ``token_ids`` (the
prompt's ids exactly as the generating endpoint would take them: text encoded with the special
tokens for completions, the chat template's text without for chat), ``sampling_params``,
``model``, ``request_id``, ``stream`` and ``stream_options``. The request is checked as the
generating endpoint checks it (a 400 names the field); nothing is generated.
"""

from __future__ import annotations

from .params import check_sizes, sampling_params
from .prompts import chat_prompt, chat_text, completion_prompts
from .protocol import ChatCompletionRequest, CompletionRequest
from .state import ServerState, new_id


def _params(request, max_tokens: int) -> dict:
    params = sampling_params(request, max_tokens).to_dict()
    params.pop("structured_outputs", None)  # the grammar is compiled where the request is served
    params["skip_special_tokens"] = request.skip_special_tokens
    return params


def _generate_request(state: ServerState, request, ids, prefix: str, params: dict) -> dict:
    options = request.stream_options.model_dump() if request.stream_options is not None else None
    return {
        "request_id": new_id(prefix),
        "token_ids": list(ids),
        "sampling_params": params,
        "model": state.model_name,
        "stream": request.stream,
        "stream_options": options,
    }


def completions(state: ServerState, request: CompletionRequest) -> list:
    state.check_model(request.model)
    check_sizes(request)
    state.check_max_tokens(request.max_tokens, "max_tokens")
    prompts = completion_prompts(request, state.tokenizer, state.vocab_size, state.max_model_len)
    max_tokens = request.max_tokens if request.max_tokens is not None else state.default_max_tokens(prompts)
    params = _params(request, max_tokens)
    return [_generate_request(state, request, ids, "cmpl", params) for ids in prompts]


def chat(state: ServerState, request: ChatCompletionRequest) -> dict:
    state.check_model(request.model)
    check_sizes(request)
    for param in ("max_completion_tokens", "max_tokens"):
        state.check_max_tokens(getattr(request, param), param)
    text = chat_text(request, state.tokenizer)
    ids = chat_prompt(request, state.tokenizer, state.vocab_size, state.max_model_len, text=text)
    max_tokens = request.max_completion_tokens or request.max_tokens or state.default_max_tokens([ids])
    return _generate_request(state, request, ids, "chatcmpl", _params(request, max_tokens))
