"""Portable seeded sampling (``seed=<int>``), done on the host in float64.

The device hands over its candidates (the top-k scores and their token ids, or the whole
vocabulary when ``top_k=0``); temperature, top-p, min-p and the draw then run in numpy, so the
result does not depend on the framework, its kernels' tie order, or the device. The noise is a
counter-based hash of (seed, row, step, token id): the same token gets the same noise whatever
else is in the batch, whichever candidates survived, on one device or many. The draw is the
exponential race ``argmax(p / q)``, q = -log(u) ~ Exp(1), which picks token i with probability p_i.
"""

from __future__ import annotations

import numpy as np

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser: a bijective avalanche on uint64."""
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


def uniform_noise(seed: int, rows: np.ndarray, step, tokens: np.ndarray) -> np.ndarray:
    """u in (0, 1), float64, one per (row, token); ``rows`` (B,), ``step`` int or (B,), ``tokens`` (B, K)."""
    steps = np.broadcast_to(np.asarray(step, dtype=np.uint64).reshape(-1), rows.shape)
    with np.errstate(over="ignore"):
        # (seed, row, step) mixed once per row; only the last mix is per token
        h = _mix(np.full((rows.shape[0], 1), np.uint64(seed) * _GOLDEN + np.uint64(1), dtype=np.uint64))
        h = _mix(h ^ (rows.astype(np.uint64)[:, None] + _GOLDEN))
        h = _mix(h ^ (steps[:, None] + _GOLDEN * np.uint64(2)))
        x = tokens.astype(np.uint64)  # the per-token mix in place: (B, V) arrays are the cost here
        x += _GOLDEN * np.uint64(3)
        x ^= h
        t = x >> np.uint64(30)
        x ^= t
        x *= _M1
        np.right_shift(x, np.uint64(27), out=t)
        x ^= t
        x *= _M2
        np.right_shift(x, np.uint64(31), out=t)
        x ^= t
        x >>= np.uint64(11)
    u = x.astype(np.float64)
    u += 0.5
    u *= 1.0 / (1 << 53)
    return u


def _softmax(x: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore"):
        e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def sample_candidates(scores: np.ndarray, tokens: np.ndarray, config, step, rows=None) -> np.ndarray:
    """Pick one token per row from candidates ``scores`` / ``tokens`` (B, K) with HF's warper math.

    Candidates are ordered by score (descending) then token id, so ties resolve the same way on
    every backend. ``rows`` (B,): the noise row of each batch row (default 0..B-1), so a row keyed
    by its global index (a data-parallel rank's offset, a request's choice index) draws the same
    tokens in whatever batch it runs; ``step``: an int, or (B,) one per row.
    """
    scores = scores.astype(np.float64)
    index = np.arange(scores.shape[0])
    rows = index if rows is None else np.asarray(rows, dtype=np.int64).reshape(-1)
    steps = np.broadcast_to(np.asarray(step, dtype=np.int64).reshape(-1), rows.shape)
    if not (0 < config.top_k < scores.shape[1]) and config.top_p >= 1.0 and config.min_p <= 0:
        drawn, tied = _race_unsorted(scores, tokens, config, steps, rows)
        if not tied.any():
            return drawn
        # a row whose race tied exactly is decided by the sorted path; the others keep their draw
        drawn[tied] = _sorted(scores[tied], tokens[tied], config, steps[tied], rows[tied])
        return drawn
    return _sorted(scores, tokens, config, steps, rows)


def _sorted(scores: np.ndarray, tokens: np.ndarray, config, steps: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """``sample_candidates`` with the candidates in order (score descending, then token id)."""
    order = np.lexsort((tokens, -scores), axis=-1)
    scores = np.take_along_axis(scores, order, axis=-1)
    tokens = np.take_along_axis(tokens, order, axis=-1)
    if config.temperature != 1.0:
        scores = scores / config.temperature
    if config.top_k:
        kth = scores[:, min(config.top_k, scores.shape[1]) - 1 :][:, :1]
        scores = np.where(scores < kth, -np.inf, scores)
    if config.top_p < 1.0:
        # HF: ascending cumulative probability, drop cum <= 1 - top_p, always keep the best token
        ascending = _softmax(scores)[:, ::-1]
        cumulative = np.cumsum(ascending, axis=-1)[:, ::-1]
        remove = cumulative <= 1 - config.top_p
        remove[:, 0] = False
        scores = np.where(remove, -np.inf, scores)
    if config.min_p > 0:
        probs = _softmax(scores)
        scores = np.where(probs < config.min_p * probs[:, :1], -np.inf, scores)
    probs = _softmax(scores)
    index = np.arange(scores.shape[0])
    race = probs / -np.log(uniform_noise(config.seed, rows, steps, tokens))
    return tokens[index, race.argmax(axis=-1)]


def _race_unsorted(scores: np.ndarray, tokens: np.ndarray, config, steps, rows) -> tuple:
    """``sample_candidates`` without its sort, where no warper needs the candidates in order (every
    candidate kept): the race's winner is the same whatever their order unless two tie exactly, so
    the rows that tie (the (B,) bool returned beside the (B,) draws) go to the sorted path. A (B, V)
    sort per step was most of a sampled step's cost on a 32k vocabulary. Every step is row-wise, so
    a row draws the same token alone or beside others."""
    if config.temperature != 1.0:
        scores = scores / config.temperature
    probs = _softmax(scores)
    index = np.arange(scores.shape[0])
    race = probs / -np.log(uniform_noise(config.seed, rows, steps, tokens))
    best = race.argmax(axis=-1)
    tied = (race == race[index, best][:, None]).sum(axis=-1) > 1
    return tokens[index, best], tied
