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

from .params import sampling_params
from .prompts import checked_chat, checked_completion
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
    prompts, max_tokens = checked_completion(state, request)
    params = _params(request, max_tokens)
    return [_generate_request(state, request, ids, "cmpl", params) for ids in prompts]


def chat(state: ServerState, request: ChatCompletionRequest) -> dict:
    _, ids, max_tokens = checked_chat(state, request)
    return _generate_request(state, request, ids, "chatcmpl", _params(request, max_tokens))
