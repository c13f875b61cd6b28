"""SGLang's native request bodies (``GenerateReqInput`` and the control endpoints'), with SGLang's
field names, as pydantic models that forbid unknown fields and take JSON types strictly.

``native_params`` turns one prompt's ``sampling_params`` into the engine's ``SamplingParams``
(SGLang's defaults: ``max_new_tokens`` 128, temperature 1, ``top_k`` -1 = off); a value the engine
refuses is a 400 naming ``sampling_params.<field>``. Penalties SGLang has and the engine lacks are
taken at their neutral value only, so a client is told rather than silently ignored.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from hyper_gen.engine import SamplingParams

from .dialects import GenerateDialect
from .errors import bad_value, validation_error
from .params import MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS, MAX_STOPS, field_named

SGLANG_MAX_NEW_TOKENS = 128  # SGLang's SamplingParams default


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class NativeSamplingParams(_Body):
    max_new_tokens: Optional[int] = Field(None, ge=0)
    min_new_tokens: int = Field(0, ge=0)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = -1
    min_p: float = Field(0.0, ge=0, le=1)
    repetition_penalty: float = Field(1.0, gt=0)
    frequency_penalty: float = 0.0  # accepted at 0 only
    presence_penalty: float = 0.0  # accepted at 0 only
    stop: Optional[Union[str, List[str]]] = None
    stop_token_ids: Optional[List[int]] = None
    n: int = Field(1, ge=1, le=128)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False  # true: the stop string stays in the text (texts.py)
    seed: Optional[int] = None
    sampling_seed: Optional[int] = None
    # structured outputs, SGLang's names (at most one): a JSON schema as text, a regex, an EBNF grammar
    json_schema: Optional[str] = None
    regex: Optional[str] = None
    ebnf: Optional[str] = None


class GenerateRequest(_Body, GenerateDialect):  # + the routers' fields (dialects.py)
    """``POST /generate``: one prompt (``input_ids`` a list of ids, ``text`` a string) or a batch
    (a list of lists, a list of strings); per-prompt fields may be one value or one per prompt."""

    text: Optional[Union[str, List[str]]] = None
    input_ids: Optional[Union[List[int], List[List[int]]]] = None
    sampling_params: Optional[Union[Dict[str, Any], List[Dict[str, Any]]]] = None  # NativeSamplingParams
    rid: Optional[Union[str, List[str]]] = None
    return_logprob: Optional[Union[bool, List[bool]]] = None
    logprob_start_len: Optional[Union[int, List[int]]] = None
    top_logprobs_num: Optional[Union[int, List[int]]] = None
    return_text_in_logprobs: bool = False
    stream: bool = False
    return_routed_experts: bool = False


def sampling_params_of(request: GenerateRequest) -> Union[None, NativeSamplingParams, List[NativeSamplingParams]]:
    """``request.sampling_params`` validated; a 400 names ``sampling_params[.i].field``."""
    value = request.sampling_params
    if value is None:
        return None
    items = value if isinstance(value, list) else [value]
    out = []
    for i, item in enumerate(items):
        try:
            out.append(NativeSamplingParams.model_validate(item))
        except ValidationError as exc:
            prefix = ("sampling_params", i) if isinstance(value, list) else ("sampling_params",)
            errors = [dict(e, loc=prefix + tuple(e.get("loc", ()))) for e in exc.errors()]
            raise validation_error(errors) from None
    return out if isinstance(value, list) else out[0]


class PauseRequest(_Body):
    mode: str = "abort"


class AbortRequest(_Body):
    rid: str = ""
    abort_all: bool = False


class MemoryRequest(_Body):
    tags: Optional[List[str]] = None


class DiskUpdateRequest(_Body):
    model_path: str
    load_format: Optional[str] = None
    abort_all_requests: bool = False
    weight_version: Optional[str] = None
    flush_cache: bool = True


class InitGroupRequest(_Body):
    """``POST /init_weights_update_group`` (SGLang's ``InitWeightsUpdateGroupReqInput``)."""

    master_address: str
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"


class DistributedUpdateRequest(_Body):
    """``POST /update_weights_from_distributed`` (SGLang's ``UpdateWeightsFromDistributedReqInput``)."""

    names: List[str]
    dtypes: List[str]
    shapes: List[List[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: Optional[str] = None
    load_format: Optional[str] = None
    torch_empty_cache: bool = False


class DestroyGroupRequest(_Body):
    group_name: str = "weight_update_group"


class TensorUpdateRequest(_Body):
    """``POST /update_weights_from_tensor``: ``serialized_named_tensors``, one item per rank of the
    engine (the same tensors), each the base64 text of a safetensors file (see ``tensor_body``)."""

    serialized_named_tensors: List[str]
    load_format: Optional[str] = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: Optional[str] = None
    disable_draft_model: Optional[bool] = None


class EmptyRequest(_Body):
    pass


def native_params(
    sp: NativeSamplingParams,
    return_logprob: bool,
    top_logprobs_num: int,
    prompt_logprobs: bool,
    routed: bool,
    structured_outputs=None,
) -> SamplingParams:
    """The engine's SamplingParams for one prompt's ``sampling_params`` (``prompt_logprobs``: the
    prompt's logprobs too, for ``logprob_start_len`` >= 0; ``routed``: ``return_routed_experts``;
    ``structured_outputs``: what ``structured.build`` made of its ``json_schema`` / ``regex`` / ``ebnf``)."""
    where = "sampling_params."
    for name in ("frequency_penalty", "presence_penalty"):
        if getattr(sp, name) != 0:
            raise bad_value(where + name, f"{name} is not supported (only 0), got {getattr(sp, name)!r}")
    if sp.seed is not None and sp.sampling_seed is not None and sp.seed != sp.sampling_seed:
        raise bad_value(where + "sampling_seed", f"seed ({sp.seed}) and sampling_seed ({sp.sampling_seed}) disagree")
    stops = [sp.stop] if isinstance(sp.stop, str) else list(sp.stop or ())
    if len(stops) > MAX_STOPS or any(len(s) > MAX_STOP_CHARS for s in stops):
        raise bad_value(where + "stop", f"at most {MAX_STOPS} stop strings of at most {MAX_STOP_CHARS} characters")
    if sp.stop_token_ids is not None and len(sp.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise bad_value(where + "stop_token_ids", f"more than {MAX_STOP_TOKEN_IDS} stop token ids")
    max_new = SGLANG_MAX_NEW_TOKENS if sp.max_new_tokens is None else sp.max_new_tokens
    if max_new == 0:
        raise bad_value(where + "max_new_tokens", "max_new_tokens=0 is not supported: ask for at least 1 token")
    params = dict(
        n=sp.n,
        max_tokens=max_new,
        min_tokens=sp.min_new_tokens,
        temperature=sp.temperature,
        top_p=sp.top_p,
        top_k=sp.top_k,
        min_p=sp.min_p,
        repetition_penalty=sp.repetition_penalty,
        ignore_eos=sp.ignore_eos,
        seed=sp.seed if sp.seed is not None else sp.sampling_seed,
    )
    if stops:
        params["stop"] = stops
    if sp.stop_token_ids:
        params["stop_token_ids"] = list(sp.stop_token_ids)
    if return_logprob:
        params["logprobs"] = top_logprobs_num
        if prompt_logprobs:
            params["prompt_logprobs"] = top_logprobs_num
    if routed:
        params["return_routed_experts"] = True
    if structured_outputs is not None:
        params["structured_outputs"] = structured_outputs
    names = {"max_tokens": "max_new_tokens", "min_tokens": "min_new_tokens", "logprobs": "top_logprobs_num"}
    names.update(prompt_logprobs="top_logprobs_num", return_routed_experts="return_routed_experts")
    try:
        return SamplingParams(**params)
    except (TypeError, ValueError) as exc:
        field = field_named(str(exc), list(params))
        named = names.get(field, field)
        top_level = named in ("top_logprobs_num", "return_routed_experts")
        raise bad_value(named if top_level else where + (named or "?"), str(exc)) from None
