"""Next tokens for a batch of rows that each have their own sampling settings.

One step's float32 logits (B, V) come in; each row gets generate()'s math for its own settings,
so a request's tokens do not depend on what else is in the batch:

- greedy rows with nothing to process share one ``argmax`` over the batch;
- repetition penalty (HF: divide positive scores, multiply negative, over prompt + generated ids)
  and the ``min_tokens`` mask of the stop ids run per row, on the device, as generate's
  ``TokenSelector.process`` does;
- sampled rows draw with ``noise.sample_candidates`` keyed by (seed, choice index, the row's own
  token index): the candidates are the row's top-k (one ``topk`` per distinct k) or its whole
  vocabulary, the warpers and the draw run on the host in float64. A request with ``seed=s`` and
  n=1 thus samples exactly what ``generate(model, [prompt], do_sample=True, seed=s, top_k=k, ...)``
  samples; ``seed=None`` requests carry a seed drawn from fresh entropy, which is the same
  sampler with a seed nobody chose (and lets every rank of a multi-rank engine agree).

Logprobs are vLLM's default: float32 ``log_softmax`` of the raw logits (before penalty and
temperature), the chosen token's and the top k. A row whose logits hold NaN or +inf, or are all
-inf, gets an error instead of a token (its request fails; the other rows go on).
"""

from __future__ import annotations

from typing import List, Optional

import numpy as np

from .. import processors
from ..noise import sample_candidates


class _Warpers:
    """What ``sample_candidates`` reads from a config: one row's settings."""

    def __init__(self, params, seed: int):
        self.temperature = params.temperature
        self.top_k = params.top_k
        self.top_p = params.top_p
        self.min_p = params.min_p
        self.seed = seed


def _needs_processing(choice) -> bool:
    params = choice.request.params
    return params.repetition_penalty != 1.0 or (choice.step < params.min_tokens and bool(choice.request.stop_ids))


class Selection:
    """One step's result: ``tokens`` (B,), per row a logprob entry (or None) and an error (or None)."""

    def __init__(self, batch: int):
        self.tokens = np.zeros(batch, dtype=np.int64)
        self.logprobs: List[Optional[dict]] = [None] * batch
        self.errors: List[Optional[Exception]] = [None] * batch


def select(ops, scores, choices, vocab_size: int, logprobs: bool = True) -> Selection:
    """Tokens for rows ``choices`` (one per row of ``scores``, (B, V) float32 on the device);
    ``logprobs=False`` skips them (the ranks of a multi-rank engine that stream nothing)."""
    batch = len(choices)
    out = Selection(batch)
    bad = _non_finite_rows(ops, scores, choices, out)
    plain_greedy, per_row, by_k = [], [], {}
    for row, choice in enumerate(choices):
        if row in bad:
            continue
        params = choice.request.params
        if _needs_processing(choice):
            per_row.append(row)
        elif params.greedy:
            plain_greedy.append(row)
        else:
            by_k.setdefault(params.top_k, []).append(row)
    if plain_greedy:
        argmax = ops.to_numpy(ops.argmax(scores, axis=-1)).reshape(-1)
        out.tokens[plain_greedy] = argmax[plain_greedy]
    for k, rows in by_k.items():
        picked = ops.take(scores, np.asarray(rows), 0)
        for row, token in zip(rows, _draw(ops, picked, [choices[r] for r in rows], k, vocab_size)):
            out.tokens[row] = token
    for row in per_row:
        choice = choices[row]
        processed = _process(ops, scores[row : row + 1], choice, vocab_size)
        if choice.request.params.greedy:
            out.tokens[row] = int(ops.to_numpy(ops.argmax(processed, axis=-1)).reshape(-1)[0])
        else:
            out.tokens[row] = _draw(ops, processed, [choice], choice.request.params.top_k, vocab_size)[0]
    for row in range(batch):
        if row not in bad:
            _observe(ops, choices[row], int(out.tokens[row]), vocab_size)
    if logprobs:
        _logprobs(ops, scores, choices, out, bad)
    return out


def _non_finite_rows(ops, scores, choices, out: Selection) -> set:
    """Rows whose logits no token can be chosen from (NaN, +inf, all -inf): an error each."""
    bad = set()
    for row, kind in processors.unusable_rows(ops, scores):
        choice = choices[row]
        out.errors[row] = ValueError(
            f"request {choice.request.request_id!r} choice {choice.index}: the model's logits for token "
            f"{choice.step} {kind}, so no token can be chosen (check the model: overflow in a low-precision dtype?)"
        )
        bad.add(row)
    return bad


def _process(ops, row_scores, choice, vocab_size: int):
    """generate's processors for one row (1, V): repetition penalty, then the min_tokens mask."""
    params = choice.request.params
    if params.repetition_penalty != 1.0:
        if choice.seen is None:
            choice.seen = processors.seen_tokens(ops, [choice.request.prompt + choice.token_ids], vocab_size)
        row_scores = processors.repetition_penalty(ops, row_scores, choice.seen, params.repetition_penalty)
    if choice.step < params.min_tokens:
        mask = processors.token_mask(ops, choice.request.stop_ids, vocab_size)
        if mask is not None:
            row_scores = processors.masked(ops, row_scores, mask)
    return row_scores


def _observe(ops, choice, token: int, vocab_size: int) -> None:
    if choice.seen is not None and token < vocab_size:
        index = ops.asarray(np.array([[token]], dtype=np.int64), "int64")
        true = ops.asarray(np.ones((1, 1), dtype=bool), "bool")
        choice.seen = processors.mark_seen(ops, choice.seen, index, vocab_size, true)


def _draw(ops, rows_scores, choices, top_k: int, vocab_size: int) -> List[int]:
    """Seeded draws for rows sharing ``top_k``: candidates on the device, the draw on the host."""
    if top_k:
        values, indices = ops.topk(rows_scores, min(top_k, vocab_size))
        values, indices = ops.to_numpy(values), ops.to_numpy(indices).astype(np.int64)
    else:
        values = ops.to_numpy(rows_scores)
        indices = np.broadcast_to(np.arange(values.shape[1]), values.shape)
    tokens = []
    for i, choice in enumerate(choices):
        warpers = _Warpers(choice.request.params, choice.request.noise_seed)
        drawn = sample_candidates(
            values[i : i + 1], indices[i : i + 1], warpers, np.array([choice.step]), rows=np.array([choice.index])
        )
        tokens.append(int(drawn[0]))
    return tokens


def _logprobs(ops, scores, choices, out: Selection, bad: set) -> None:
    rows = [r for r, c in enumerate(choices) if c.request.params.logprobs is not None and r not in bad]
    if not rows:
        return
    logprobs = ops.log_softmax(ops.take(scores, np.asarray(rows), 0), axis=-1)
    chosen_ids = ops.asarray(out.tokens[rows][:, None], "int64")
    chosen = ops.to_numpy(ops.take_along_axis(logprobs, chosen_ids, axis=-1)).reshape(-1)
    top = max(choices[r].request.params.logprobs for r in rows)
    if top:
        values, indices = ops.topk(logprobs, min(top, int(scores.shape[-1])))
        values, indices = ops.to_numpy(values), ops.to_numpy(indices)
    for i, row in enumerate(rows):
        k = choices[row].request.params.logprobs
        pairs = [(int(indices[i, j]), float(values[i, j])) for j in range(min(k, values.shape[1]))] if k else []
        out.logprobs[row] = {"token_id": int(out.tokens[row]), "logprob": float(chosen[i]), "top_logprobs": pairs}


__all__ = ["select", "Selection"]
