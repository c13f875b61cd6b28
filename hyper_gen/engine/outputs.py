"""What a request yields: ``CompletionChunk`` as tokens arrive, ``RequestOutput`` when it is done.

Plain dataclasses of host values (ints, floats, strings), so a chunk can cross threads and event
loops and be serialised by the server without touching a framework tensor.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

import numpy as np

# finish_reason: "stop" (EOS, a stop token id or a stop string), "length" (max_tokens), "abort" (cancelled
# or the engine shut down); None while the choice runs


@dataclass
class CompletionChunk:
    """New tokens of one choice (``index`` in 0..n-1) of one request.

    ``text``: the new text ("" without a tokenizer; a multi-byte character split across tokens is
    held back until complete, and text that could still become a stop string until it cannot).
    ``logprobs``: one entry per new token, ``{"token_id", "logprob", "top_logprobs": [(id, logprob), ...]}``,
    or None when the request asked for none. ``completion_tokens``: the choice's tokens so far.
    """

    request_id: str
    index: int
    token_ids: List[int]
    text: str
    finished: bool
    finish_reason: Optional[str]
    logprobs: Optional[List[dict]]
    prompt_tokens: int
    completion_tokens: int


@dataclass
class ChoiceOutput:
    """One finished choice: every token (with the EOS / stop token that ended it), its text (without
    a stop string that ended it), why it ended, and its logprobs (None when not asked for).

    ``routed_experts``: with ``return_routed_experts=True`` (an MoE model), a (T, moe_layers, top_k)
    int64 numpy array, one entry per token of ``token_ids``: the expert ids each MoE layer's router
    chose, in its top-k order, in the forward whose logits chose that token (which fed the prompt's
    last token for the first, the previous token after): ``generate``'s ``routed_experts`` row."""

    index: int
    token_ids: List[int]
    text: str
    finish_reason: Optional[str]
    logprobs: Optional[List[dict]] = None
    routed_experts: Optional[np.ndarray] = None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: List[int]
    outputs: List[ChoiceOutput] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0  # over every choice
    weight_version: Optional[object] = None  # Engine.update_weights' version when this output was made
    # SamplingParams.prompt_logprobs=k: vLLM's, one per prompt token: None for the first, then a logprob entry
    # (ChoiceOutput.logprobs' format, plus its "rank") of that token given the tokens before it, with the top k;
    # None when not asked
    prompt_logprobs: Optional[List[Optional[dict]]] = None
    cached_tokens: int = 0  # prompt tokens served from the prefix cache at admission (SGLang's cached_tokens)


def logprob_entry(token_id: int, logprob: float, top_logprobs) -> dict:
    """One token's logprob entry (``CompletionChunk.logprobs``' format): its id, its logprob, the top
    ``(id, logprob)`` pairs."""
    return {"token_id": int(token_id), "logprob": float(logprob), "top_logprobs": list(top_logprobs)}


def prompt_logprob_entries(prompt: List[int], chosen, values, ids, ranks) -> List[Optional[dict]]:
    """``RequestOutput.prompt_logprobs`` from ``scoring.prompt_top_logprobs``' host arrays: logprob
    entries with one more key, ``rank``: the prompt token's rank in its position's distribution (1 = likeliest)."""
    return [None] + ranked_entries(prompt[1:], chosen, values, ids, ranks)


def ranked_entries(tokens: List[int], chosen, values, ids, ranks) -> List[dict]:
    """The entries of ``tokens``, each scored at its own row of the arrays (a stretch of a prompt)."""
    entries = []
    for t, token in enumerate(tokens):
        top = [] if values is None else [(int(i), float(v)) for i, v in zip(ids[t], values[t])]
        entries.append(dict(logprob_entry(token, chosen[t], top), rank=int(ranks[t])))
    return entries


__all__ = [
    "CompletionChunk",
    "ChoiceOutput",
    "RequestOutput",
    "logprob_entry",
    "prompt_logprob_entries",
    "ranked_entries",
]
