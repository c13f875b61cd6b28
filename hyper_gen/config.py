"""GenerationConfig: the RFC fields plus the additions the design guide makes, validated once."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Union

CACHE_IMPLEMENTATIONS = ("static", "dynamic")


@dataclass
class GenerationConfig:
    """What to generate and how; every field is checked in ``__post_init__``.

    Defaults follow the HyperParallel RFC (``eos_token_id=2``, ``pad_token_id=0``, greedy).
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

    def __post_init__(self):
        _check_int("max_new_tokens", self.max_new_tokens, minimum=1)
        _check_int("min_new_tokens", self.min_new_tokens, minimum=0)
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens must be <= max_new_tokens ({self.max_new_tokens}), got {self.min_new_tokens}"
            )
        _check_number("temperature", self.temperature)
        if not self.temperature > 0:
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
        if not isinstance(self.use_cache, bool):
            raise TypeError(f"use_cache must be a bool, got {self.use_cache!r}")
        _check_int("pad_token_id", self.pad_token_id, minimum=0)
        self.eos_token_id = _normalize_eos(self.eos_token_id)
        if self.seed is not None:
            _check_int("seed", self.seed, minimum=0)
        if self.cache_implementation not in CACHE_IMPLEMENTATIONS:
            raise ValueError(
                f"cache_implementation must be one of {CACHE_IMPLEMENTATIONS}, got {self.cache_implementation!r}"
            )
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

    def replace(self, **overrides) -> "GenerationConfig":
        """A copy with ``overrides`` applied (validated); unknown names raise ``TypeError``."""
        known = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise TypeError(f"unknown generation option(s) {unknown}; valid options are {sorted(known)}")
        return dataclasses.replace(self, **overrides)


def _check_int(name, value, minimum):
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _check_number(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r}")


def _normalize_eos(eos: Optional[Union[int, Sequence[int]]]):
    if eos is None:
        return None
    if isinstance(eos, (list, tuple)):
        if not eos:
            raise ValueError("eos_token_id must not be an empty list (use None to disable EOS)")
        for item in eos:
            _check_int("eos_token_id", item, minimum=0)
        return list(eos)
    _check_int("eos_token_id", eos, minimum=0)
    return eos


def resolve_config(generation_config: Optional[GenerationConfig], overrides: dict) -> GenerationConfig:
    """The config a call runs with: the given one (or the defaults) with keyword overrides applied."""
    if generation_config is None:
        generation_config = GenerationConfig()
    elif not isinstance(generation_config, GenerationConfig):
        raise TypeError(f"generation_config must be a GenerationConfig, got {type(generation_config).__name__}")
    return generation_config.replace(**overrides) if overrides else generation_config


__all__ = ["GenerationConfig", "resolve_config", "CACHE_IMPLEMENTATIONS"]
