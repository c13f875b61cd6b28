"""A step's draws: each row's next token with generate()'s sampler, under its own request's settings.

The runner hands over one forward's float32 scores (B, V) and the choices that own its rows; each
choice becomes a ``sampling.SampledRow`` (its request's warpers and seed, its repetition penalty
and what it has seen, the stop ids ``min_tokens`` still masks) and ``sampling.select_rows`` draws
them all: greedy rows share one argmax, seeded rows draw with ``noise.sample_candidates`` keyed by
(seed, choice index, the row's own token index), so a request with ``seed=s`` samples what
``generate(..., seed=s)`` samples, whatever else shares its step. ``seed=None`` requests carry a
seed drawn from fresh entropy, which every rank shares.

Logprobs are vLLM's default: the raw logits' float32 ``log_softmax`` (before penalty and
temperature), the chosen token's and the top k. A row whose logits hold NaN or +inf, or are all
-inf, gets an error instead of a token (its request fails; the other rows go on). Rows with
structured outputs (``hyper_gen/grammar.py``) then get -inf at the tokens their grammar disallows, after that
check (a masked row is no error) and before the penalty, the warpers and the draw; their logprobs
stay the raw logits' (vLLM's).
"""

from __future__ import annotations

from typing import List, Optional

import numpy as np

from .. import processors
from ..sampling import RowSettings, SampledRow, chosen_and_top_logprobs, select_rows


class Selection:
    """One draw's result: ``tokens`` (B,), per row a logprob entry (or None) and an error (or None)."""

    def __init__(self, batch: int):
        self.tokens = np.zeros(batch, dtype=np.int64)
        self.logprobs: List[Optional[dict]] = [None] * batch
        self.errors: List[Optional[Exception]] = [None] * batch


def select(ops, scores, choices, vocab_size: int, logprobs: bool = True, grammar=None) -> Selection:
    """Tokens for ``choices`` (one a row of ``scores``, (B, V) float32 on the device);
    ``logprobs=False`` skips them (the ranks of a multi-rank engine that stream nothing);
    ``grammar``: the engine's grammars (``mask(ops, scores, choices, rows)``; None: no tokenizer, so no
    structured outputs)."""
    out = Selection(len(choices))
    for row, kind in processors.unusable_rows(ops, scores):
        choice = choices[row]
        out.errors[row] = ValueError(
            f"request {choice.request.request_id!r} choice {choice.index}: the model's logits for token "
            f"{choice.step} {kind}, so no token can be chosen (check the model: overflow in a low-precision dtype?)"
        )
    good = [row for row in range(len(choices)) if out.errors[row] is None]
    batch = [_sampled_row(ops, choice, vocab_size) for choice in choices]
    raw = scores
    constrained = [row for row in good if choices[row].request.params.structured_outputs is not None]
    if constrained:
        if grammar is None:
            raise RuntimeError("structured_outputs reached an engine without a tokenizer (submit checks this)")
        scores = grammar.mask(ops, scores, choices, constrained)
    out.tokens = select_rows(ops, scores, batch, vocab_size, good)
    for row in good:
        choice, token = choices[row], int(out.tokens[row])
        if choice.seen is not None and token < vocab_size:
            index = ops.asarray(np.array([[token]], dtype=np.int64), "int64")
            true = ops.asarray(np.ones((1, 1), dtype=bool), "bool")
            choice.seen = processors.mark_seen(ops, choice.seen, index, vocab_size, true)
    if logprobs:
        _logprobs(ops, raw, choices, out, good)
    return out


def _sampled_row(ops, choice, vocab_size: int) -> SampledRow:
    """A choice's row for ``select_rows``: its request's settings, keyed by (choice index, its token index)."""
    params = choice.request.params
    settings = RowSettings()
    if not params.greedy:
        settings = RowSettings(
            True, params.temperature, params.top_k, params.top_p, params.min_p, choice.request.noise_seed
        )
    if params.repetition_penalty != 1.0 and choice.seen is None:
        choice.seen = processors.seen_tokens(ops, [choice.request.prompt + choice.token_ids], vocab_size)
    masked = tuple(choice.request.stop_ids) if choice.step < params.min_tokens else ()
    seen = choice.seen if params.repetition_penalty != 1.0 else None
    return SampledRow(settings, choice.step, choice.index, params.repetition_penalty, seen, masked)


def _logprobs(ops, scores, choices, out: Selection, good: List[int]) -> None:
    """The raw logits' float32 log_softmax at the chosen token, and the top k."""
    rows = [r for r in good if choices[r].request.params.logprobs is not None]
    if not rows:
        return
    top = max(choices[r].request.params.logprobs for r in rows)
    tokens = ops.asarray(out.tokens[rows][:, None], "int64")
    chosen, values, indices = chosen_and_top_logprobs(ops, ops.take(scores, np.asarray(rows), 0), tokens, top)
    chosen = ops.to_numpy(chosen).reshape(-1)
    if top:
        values, indices = ops.to_numpy(values), ops.to_numpy(indices)
    for i, row in enumerate(rows):
        k = choices[row].request.params.logprobs
        pairs = [(int(indices[i, j]), float(values[i, j])) for j in range(min(k, values.shape[1]))] if k else []
        out.logprobs[row] = {"token_id": int(out.tokens[row]), "logprob": float(chosen[i]), "top_logprobs": pairs}


__all__ = ["Selection", "select"]
