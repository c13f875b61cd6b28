"""SamplingParams: one request's sampling settings, with vLLM's names and meanings.

The server maps OpenAI request fields onto these one to one, so every check names the field and
the value the client sent (the server turns the ``ValueError`` / ``TypeError`` into a 400).
Differences from ``GenerationConfig`` are vLLM's: ``temperature=0`` is greedy, ``top_k=0`` (or
-1) is off, ``max_tokens`` / ``min_tokens`` count new tokens.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import asdict, dataclass
from typing import Any, List, Optional, Union

MAX_LOGPROBS = 20  # vLLM's default max_logprobs, OpenAI's top_logprobs limit


def _int(name, value, minimum, maximum=None):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < minimum or (maximum is not None and value > maximum):
        bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ValueError(f"{name} must be {bound}, got {value}")
    return int(value)


def _number(name, value):
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return float(value)


@dataclass
class SamplingParams:
    """Per-request settings; checked in ``__post_init__`` (``ValueError`` / ``TypeError`` naming the field).

    ``temperature=0``: greedy (``top_*``, ``min_p`` and ``seed`` then play no part). ``seed=None``
    samples with fresh entropy; ``seed=s`` samples the tokens ``generate(..., do_sample=True,
    seed=s)`` samples for the same prompt, whatever else runs in the batch (choice i of ``n``
    draws as row i). ``stop``: strings that end the choice when its text contains one (the text
    returned excludes it; needs the engine's tokenizer). ``stop_token_ids``: ids that end it (kept
    in ``token_ids``, like EOS). ``logprobs=k``: each new token's logprob, plus the top ``k``.
    ``prompt_logprobs=k``: each prompt token's logprob given the tokens before it, plus the top ``k``
    (``RequestOutput.prompt_logprobs``, vLLM's; one extra forward over the prompt at admission).
    """

    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: Optional[int] = None
    stop: Optional[Union[str, List[str]]] = None
    stop_token_ids: Optional[List[int]] = None
    ignore_eos: bool = False
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    min_tokens: int = 0
    # MoE models: each token's router choices, per MoE layer (ChoiceOutput.routed_experts; vLLM / SGLang's R3)
    return_routed_experts: bool = False
    # a grammar the output must follow: grammar.StructuredOutputs or its dict (vLLM's StructuredOutputsParams:
    # json / json_object / regex / choice / grammar / lark); needs the engine's tokenizer
    structured_outputs: Optional[Any] = None

    def __post_init__(self):
        self.n = _int("n", self.n, 1)
        self.max_tokens = _int("max_tokens", self.max_tokens, 1)
        self.min_tokens = _int("min_tokens", self.min_tokens, 0)
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        self.temperature = _number("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 is greedy), got {self.temperature}")
        self.top_p = _number("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        self.top_k = _int("top_k", self.top_k, -1)
        self.top_k = max(self.top_k, 0)  # vLLM: -1 and 0 both mean off
        self.min_p = _number("min_p", self.min_p)
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        self.repetition_penalty = _number("repetition_penalty", self.repetition_penalty)
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.seed is not None:
            self.seed = _int("seed", self.seed, 0, 2**64 - 1)
        if self.stop is not None:
            stops = [self.stop] if isinstance(self.stop, str) else self.stop
            if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) for s in stops):
                raise TypeError(f"stop must be a string or a list of strings, got {self.stop!r}")
            if any(s == "" for s in stops):
                raise ValueError(f"stop strings must not be empty, got {self.stop!r}")
            self.stop = list(stops)
        if self.stop_token_ids is not None:
            if isinstance(self.stop_token_ids, (str, bytes)) or not isinstance(self.stop_token_ids, (list, tuple)):
                raise TypeError(f"stop_token_ids must be a list of ints, got {self.stop_token_ids!r}")
            self.stop_token_ids = [_int("stop_token_ids", t, 0) for t in self.stop_token_ids]
        for name in ("ignore_eos", "return_routed_experts"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.logprobs is not None:
            self.logprobs = _int("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        if self.structured_outputs is not None:
            from ..grammar import StructuredOutputs

            self.structured_outputs = StructuredOutputs.of(self.structured_outputs)
        if self.prompt_logprobs is not None:
            self.prompt_logprobs = _int("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def stop_strings(self) -> List[str]:
        return list(self.stop or ())

    def to_dict(self) -> dict:
        """Plain values (what rank 0 broadcasts to the other ranks of a multi-rank engine)."""
        return asdict(self)


__all__ = ["SamplingParams", "MAX_LOGPROBS"]
