"""The OpenAI API's request and response bodies, with OpenAI's field names (and vLLM's extras).

Requests forbid unknown fields, so a misspelt parameter is a 400 naming it rather than a silent
default, and take JSON's types strictly (``true`` is not an integer, ``"2"`` is not a number).
Value checks that pydantic can state (``max_tokens >= 1``, ``temperature >= 0``) live on the
fields, so their 400s name the parameter too; ``params.check_sizes`` bounds what a request can
make the server allocate, and the engine's ``SamplingParams`` checks the rest.
"""

from __future__ import annotations

from typing import Any, Dict, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from .dialects import ChatDialect, CompletionDialect


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(_Request):
    """What completions and chat share: OpenAI's sampling parameters and vLLM's extras."""

    model: Optional[str] = None
    temperature: Optional[float] = Field(None, ge=0)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1, le=128)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    stop: Optional[Union[str, List[str]]] = None
    seed: Optional[int] = None
    presence_penalty: Optional[float] = None  # accepted at 0 only (OpenAI's default)
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[Dict[str, float]] = None  # accepted empty only
    user: Optional[str] = None
    # vLLM's extras
    top_k: Optional[int] = None
    min_p: Optional[float] = Field(None, ge=0, le=1)
    repetition_penalty: Optional[float] = Field(None, gt=0)
    ignore_eos: bool = False
    stop_token_ids: Optional[List[int]] = None
    min_tokens: int = Field(0, ge=0)
    return_token_ids: bool = False  # vLLM's: prompt_token_ids and each choice's token_ids in the answer
    # vLLM's structured outputs (structured.py): one of these, or chat's response_format
    structured_outputs: Optional[Dict[str, Any]] = None
    guided_json: Optional[Union[str, Dict[str, Any]]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[List[str]] = None
    guided_grammar: Optional[str] = None


class CompletionRequest(_SamplingFields, CompletionDialect):  # + the routers' fields (dialects.py)
    prompt: Union[str, List[str], List[int], List[List[int]]]
    max_tokens: Optional[int] = Field(16, ge=0)  # 0: only with echo (the prompt scored, nothing generated)
    logprobs: Optional[int] = Field(None, ge=0, le=20)
    prompt_logprobs: Optional[int] = Field(None, ge=0, le=20)  # vLLM's extra (not with stream)
    echo: bool = False
    suffix: Optional[str] = None
    best_of: Optional[int] = None


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)  # tool_calls, refusal, ...: not for the template
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, List[ContentPart]]] = None
    name: Optional[str] = None
    tool_calls: Optional[List[Dict[str, Any]]] = None  # an assistant's calls, kept for the template
    tool_call_id: Optional[str] = None  # a tool message's answer to that call
    reasoning_content: Optional[str] = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_SamplingFields, ChatDialect):  # + the routers' fields (dialects.py)
    messages: List[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[int] = Field(None, ge=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)
    prompt_logprobs: Optional[int] = Field(None, ge=0, le=20)  # vLLM's extra, of the templated prompt (not with stream)
    response_format: Optional[Dict[str, Any]] = None
    # agent turns (tools.py): OpenAI's tools, and vLLM's template controls
    tools: Optional[List[Dict[str, Any]]] = None
    tool_choice: Optional[Union[str, Dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = None
    chat_template_kwargs: Optional[Dict[str, Any]] = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False


# -- responses ---------------------------------------------------------------------------------


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogprobs(BaseModel):
    """The legacy completions format: parallel lists, one entry per generated token (with ``echo``,
    the prompt's tokens first: the first one's logprob and top logprobs None)."""

    tokens: List[str] = []
    token_logprobs: List[Optional[float]] = []
    top_logprobs: List[Optional[Dict[str, float]]] = []
    text_offset: List[int] = []


class PromptLogprob(BaseModel):
    """vLLM's ``Logprob``: one token of a prompt position, ``rank`` 1 for the likeliest."""

    logprob: float
    rank: int
    decoded_token: str


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = None
    # vLLM's: None for the first prompt token, then {token id as a string: PromptLogprob} (the prompt token, top k)
    prompt_logprobs: Optional[List[Optional[Dict[str, PromptLogprob]]]] = None
    # vLLM's return_token_ids: the prompt's ids as the engine took them, the ids generated (an EOS that ended it too)
    prompt_token_ids: Optional[List[int]] = None
    token_ids: Optional[List[int]] = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: List[CompletionChoice]
    usage: Optional[Usage] = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: Optional[List[int]] = None


class TokenLogprob(TopLogprob):
    top_logprobs: List[TopLogprob] = []


class ChatLogprobs(BaseModel):
    content: Optional[List[TokenLogprob]] = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: Optional[str] = None
    reasoning_content: Optional[str] = None
    tool_calls: Optional[List[Dict[str, Any]]] = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None
    token_ids: Optional[List[int]] = None  # vLLM's return_token_ids


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: List[ChatChoice]
    usage: Optional[Usage] = None
    # vLLM's, at the top level (one prompt per request): as CompletionChoice.prompt_logprobs, of the templated prompt
    prompt_logprobs: Optional[List[Optional[Dict[str, PromptLogprob]]]] = None
    prompt_token_ids: Optional[List[int]] = None  # vLLM's return_token_ids: the templated prompt's ids


class DeltaMessage(BaseModel):
    role: Optional[Literal["assistant"]] = None
    content: Optional[str] = None
    reasoning_content: Optional[str] = None
    tool_calls: Optional[List[Dict[str, Any]]] = None  # OpenAI's deltas: index, id, type, function name / arguments


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None
    token_ids: Optional[List[int]] = None  # vLLM's return_token_ids: this chunk's new ids


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: List[ChatChunkChoice]
    usage: Optional[Usage] = None
    prompt_token_ids: Optional[List[int]] = None  # vLLM's return_token_ids: on the first chunk


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "hyper_gen"
    max_model_len: Optional[int] = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: List[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[Any] = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
