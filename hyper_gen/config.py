"""GenerationConfig: the RFC fields plus the additions the design guide makes, validated once."""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Union

import numpy as np

CACHE_IMPLEMENTATIONS = ("static", "dynamic")

# Bounds on the sizes generate() allocates from, checked before anything is allocated: a typo'd
# 10**9 is a ValueError naming the field, not a numpy MemoryError or a framework allocator error.
# MAX_ROWS: rows of one call, batch x num_return_sequences (each row gets its prompt copy, a cache
# row and its host bookkeeping); far past what any device holds caches for, split larger batches.
MAX_ROWS = 1 << 16
# MAX_NEW_TOKENS: nothing is sized to max_new_tokens up front (host buffers grow, the static cache is
# capped at the context), but positions and lengths are int64 on the host: this keeps "until EOS or the
# context" (10**9) and refuses what would overflow them.
MAX_NEW_TOKENS = 2**31 - 1
# token ids (pad, EOS) are int64 on the host and the device
MAX_TOKEN_ID = 2**63 - 1
# top_logprobs: the most alternatives reported per token, vLLM's default max_logprobs and OpenAI's
# top_logprobs limit (the engine's SamplingParams.logprobs has the same bound)
MAX_TOP_LOGPROBS = 20


@dataclass
class GenerationConfig:
    """What to generate and how; every field is checked in ``__post_init__``.

    Defaults follow the HyperParallel RFC (``eos_token_id=2``, ``pad_token_id=0``, greedy), but
    generate() fills every field the caller did not set from the model's own generation settings
    first, as HF does (see :func:`resolve_config`); ``explicit_fields`` are the ones set.
    ``eos_token_id`` may be an int, a list of ints or None (never stop early).
    ``seed=None`` draws with the framework RNG exactly as HF does; ``seed=<int>`` draws with
    portable host noise, identical on every backend and parallel layout.
    """

    max_new_tokens: int = 256
    temperature: float = 1.0
    top_k: int = 50
    top_p: float = 1.0
    do_sample: bool = False
    eos_token_id: Optional[Union[int, List[int]]] = 2
    pad_token_id: int = 0
    repetition_penalty: float = 1.0
    logits_processor: Optional[List[Callable]] = None
    stopping_criteria: Optional[List[Callable]] = None
    min_p: float = 0.0
    min_new_tokens: int = 0
    seed: Optional[int] = None
    use_cache: bool = True
    cache_implementation: str = "static"
    # rollouts (HF's names where HF has them)
    num_return_sequences: int = 1
    return_dict_in_generate: bool = False
    output_scores: bool = False
    output_logits: bool = False
    output_logprobs: bool = False
    stop_strings: Optional[Union[str, List[str]]] = None
    synced_gpus: Optional[bool] = None
    unshard_params: bool = False
    # with output_logprobs: the k most probable tokens of every step under the raw model (vLLM's logprobs=k)
    top_logprobs: int = 0
    # MoE models: every generated token's router choices, per MoE layer (GenerateOutput.routed_experts)
    return_routed_experts: bool = False

    def __post_init__(self):
        _check_int("max_new_tokens", self.max_new_tokens, minimum=1, maximum=MAX_NEW_TOKENS, bound="MAX_NEW_TOKENS")
        _check_int("min_new_tokens", self.min_new_tokens, minimum=0)
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens must be <= max_new_tokens ({self.max_new_tokens}), got {self.min_new_tokens}"
            )
        _check_number("temperature", self.temperature)
        if not self.temperature > 0:  # the RFC's rule; the CLI maps --temperature 0 to greedy
            raise ValueError(f"temperature must be > 0 (use do_sample=False for greedy), got {self.temperature}")
        _check_int("top_k", self.top_k, minimum=0)
        _check_number("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_number("min_p", self.min_p)
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        _check_number("repetition_penalty", self.repetition_penalty)
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not isinstance(self.do_sample, bool):
            raise TypeError(f"do_sample must be a bool, got {self.do_sample!r}")
        for name in (
            "use_cache",
            "return_dict_in_generate",
            "output_scores",
            "output_logits",
            "output_logprobs",
            "unshard_params",
            "return_routed_experts",
        ):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.return_routed_experts and not self.return_dict_in_generate:
            raise ValueError(
                "return_routed_experts=True needs return_dict_in_generate=True: the routed experts are "
                "returned as GenerateOutput.routed_experts"
            )
        _check_int("top_logprobs", self.top_logprobs, minimum=0, maximum=MAX_TOP_LOGPROBS, bound="MAX_TOP_LOGPROBS")
        if self.top_logprobs and not self.output_logprobs:
            raise ValueError(
                f"top_logprobs={self.top_logprobs} needs output_logprobs=True (and return_dict_in_generate=True): "
                "the top tokens are reported beside each chosen token's logprob"
            )
        if self.synced_gpus is not None and not isinstance(self.synced_gpus, bool):
            raise TypeError(f"synced_gpus must be a bool or None (decide from the model), got {self.synced_gpus!r}")
        _check_int("num_return_sequences", self.num_return_sequences, minimum=1, maximum=MAX_ROWS, bound="MAX_ROWS")
        if self.num_return_sequences > 1 and not self.do_sample:
            raise ValueError(
                f"num_return_sequences={self.num_return_sequences} needs do_sample=True: greedy decoding would "
                "return the same row that many times (HF raises the same)"
            )
        self.stop_strings = _normalize_stop_strings(self.stop_strings)
        _check_int("pad_token_id", self.pad_token_id, minimum=0, maximum=MAX_TOKEN_ID, bound="MAX_TOKEN_ID")
        self.eos_token_id = _normalize_eos(self.eos_token_id)
        if self.seed is not None:
            _check_int("seed", self.seed, minimum=0)
            if self.seed >= 2**64:
                raise ValueError(f"seed must be < 2**64, got {self.seed}")
        if self.cache_implementation not in CACHE_IMPLEMENTATIONS:
            raise ValueError(
                f"cache_implementation must be one of {CACHE_IMPLEMENTATIONS}, got {self.cache_implementation!r}"
            )
        for name in (
            "max_new_tokens",
            "min_new_tokens",
            "top_k",
            "pad_token_id",
            "seed",
            "num_return_sequences",
            "top_logprobs",
        ):
            if getattr(self, name) is not None:
                setattr(self, name, int(getattr(self, name)))
        for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
            setattr(self, name, float(getattr(self, name)))
        for name in ("logits_processor", "stopping_criteria"):
            callables = getattr(self, name)
            if callables is None:
                continue
            if callable(callables):
                raise TypeError(f"{name} must be a list of callables, got a single callable {callables!r}")
            callables = list(callables)
            for item in callables:
                if not callable(item):
                    raise TypeError(f"{name} entries must be callable, got {item!r}")
            setattr(self, name, callables)

    @property
    def eos_token_ids(self) -> List[int]:
        """The stop ids as a list (empty when ``eos_token_id`` is None)."""
        return (
            []
            if self.eos_token_id is None
            else list(self.eos_token_id)
            if isinstance(self.eos_token_id, list)
            else [self.eos_token_id]
        )

    @property
    def explicit_fields(self) -> frozenset:
        """The fields given to the constructor or to ``replace``: they beat the model's defaults."""
        return getattr(self, "_explicit", frozenset())

    def replace(self, **overrides) -> "GenerationConfig":
        """A copy with ``overrides`` applied (validated); unknown names raise ``TypeError``."""
        _check_names(overrides)
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        values.update(overrides)
        copy = GenerationConfig(**values)
        copy._explicit = self.explicit_fields | frozenset(overrides)
        return copy


_dataclass_init = GenerationConfig.__init__


def _init_recording_explicit(self, *args, **kwargs):
    _dataclass_init(self, *args, **kwargs)
    names = [f.name for f in dataclasses.fields(GenerationConfig)]
    self._explicit = frozenset(names[: len(args)]) | frozenset(kwargs)


GenerationConfig.__init__ = _init_recording_explicit
GenerationConfig.__init__.__doc__ = _dataclass_init.__doc__
FIELDS = tuple(f.name for f in dataclasses.fields(GenerationConfig))


def _check_names(options: dict) -> None:
    unknown = sorted(set(options) - set(FIELDS))
    if unknown:
        raise TypeError(f"unknown generation option(s) {unknown}; valid options are {sorted(FIELDS)}")


def _check_int(name, value, minimum, maximum=None, bound=None):
    """Python or numpy integers (not bools); fields are stored back as plain ints by the caller.
    ``maximum``: the largest value, ``bound`` the name of the module constant that holds it."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum} (hyper_gen.config.{bound}), got {value}")


def _check_number(name, value):
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")


def _normalize_stop_strings(stop):
    """A str or a list of non-empty str, as a list; None stays None."""
    if stop is None:
        return None
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, (list, tuple)) or not items:
        raise TypeError(f"stop_strings must be a str or a non-empty list of str, got {stop!r}")
    for item in items:
        if not isinstance(item, str) or not item:
            raise ValueError(f"stop_strings entries must be non-empty strings, got {item!r}")
    return list(items)


def _normalize_eos(eos: Optional[Union[int, Sequence[int]]]):
    if eos is None:
        return None
    if isinstance(eos, (list, tuple)):
        if not eos:
            raise ValueError("eos_token_id must not be an empty list (use None to disable EOS)")
        for item in eos:
            _check_int("eos_token_id", item, minimum=0, maximum=MAX_TOKEN_ID, bound="MAX_TOKEN_ID")
        return [int(item) for item in eos]
    _check_int("eos_token_id", eos, minimum=0, maximum=MAX_TOKEN_ID, bound="MAX_TOKEN_ID")
    return int(eos)


# the HF generation_config fields generate() takes from a model when the caller did not set them
MODEL_DEFAULT_FIELDS = (
    "eos_token_id",
    "pad_token_id",
    "max_new_tokens",
    "do_sample",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repetition_penalty",
)


def model_defaults(model) -> dict:
    """The model's own generation settings, as HF ``generate`` would take them.

    Native models carry ``generation_defaults`` (eos/pad from the checkpoint's
    generation_config.json); HF models their ``generation_config``, of which only the fields it
    sets away from HF's own defaults count (``to_diff_dict``), as in HF. When the model names an
    EOS but no pad id, finished rows are padded with the first EOS id, as HF does."""
    found = {}
    native = getattr(model, "generation_defaults", None)
    if isinstance(native, dict):
        found.update({k: v for k, v in native.items() if k in FIELDS and v is not None})
    hf_config = getattr(model, "generation_config", None)
    if hf_config is not None and hasattr(hf_config, "to_diff_dict"):
        diff = hf_config.to_diff_dict()
        for name in MODEL_DEFAULT_FIELDS:
            value = diff.get(name, getattr(hf_config, name, None) if name.endswith("token_id") else None)
            if value is not None:
                found[name] = value
    if found.get("pad_token_id") is None and found.get("eos_token_id") is not None:
        eos = found["eos_token_id"]
        found["pad_token_id"] = eos[0] if isinstance(eos, (list, tuple)) else eos
    if isinstance(found.get("eos_token_id"), tuple):
        found["eos_token_id"] = list(found["eos_token_id"])
    return found


def resolve_config(generation_config: Optional[GenerationConfig], overrides: dict, model=None) -> GenerationConfig:
    """The config a call runs with, HF's precedence: keyword overrides > the fields the passed
    config sets explicitly > the model's own settings (:func:`model_defaults`) > the defaults."""
    if generation_config is not None and not isinstance(generation_config, GenerationConfig):
        raise TypeError(f"generation_config must be a GenerationConfig, got {type(generation_config).__name__}")
    _check_names(overrides)
    values = model_defaults(model) if model is not None else {}
    if generation_config is not None:
        values.update({name: getattr(generation_config, name) for name in generation_config.explicit_fields})
    values.update(overrides)
    try:
        return GenerationConfig(**values)
    except (TypeError, ValueError) as error:
        if generation_config is None and not overrides and model is not None:
            raise ValueError(f"the model's generation settings are invalid: {error}") from None
        raise


__all__ = [
    "GenerationConfig",
    "resolve_config",
    "CACHE_IMPLEMENTATIONS",
    "MAX_ROWS",
    "MAX_NEW_TOKENS",
    "MAX_TOKEN_ID",
    "MAX_TOP_LOGPROBS",
]
