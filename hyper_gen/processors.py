"""The row processors generate() and the in-flight engine share, with HF's math: the seen-token
mask and the repetition penalty over it, a token mask (min_new_tokens' stop ids), and the check
that a row's scores still allow a token. One copy, so a request's tokens in the engine are
generate()'s for the same settings.
"""

from __future__ import annotations

import math
from typing import Iterable, List, Optional, Tuple

import numpy as np

NEG_INF = -math.inf


def seen_tokens(ops, rows: Iterable[np.ndarray], vocab_size: int):
    """(B, V) device bool: True where row b's ids (prompt and generated so far) hold the token;
    ids past the vocabulary (a padded embedding's) are left out."""
    rows = list(rows)
    seen = np.zeros((len(rows), vocab_size), dtype=bool)
    for row, ids in enumerate(rows):
        ids = np.asarray(ids, dtype=np.int64)
        seen[row, ids[ids < vocab_size]] = True
    return ops.asarray(seen, "bool")


def mark_seen(ops, seen, tokens, vocab_size: int, true_column):
    """``seen`` with the (B, 1) device int64 ``tokens`` just appended marked; ``true_column`` is a
    (B, 1) device bool of True. A chosen token is always inside the vocabulary; the guard is for a
    finished row's pad id, which may lie past it (it marks column 0 instead)."""
    in_vocab = ops.where(tokens < vocab_size, tokens, 0)
    return ops.scatter(seen, in_vocab, true_column, axis=-1)


def repetition_penalty(ops, scores, seen, penalty: float):
    """HF's ``RepetitionPenaltyLogitsProcessor``: a seen token's score divided by ``penalty`` if
    positive, multiplied if negative."""
    penalized = ops.where(scores < 0, scores * penalty, scores / penalty)
    return ops.where(seen, penalized, scores)


def token_mask(ops, token_ids: Iterable[int], vocab_size: int):
    """(1, V) device bool, True at ``token_ids`` inside the vocabulary; None if none is."""
    inside = [t for t in token_ids if 0 <= t < vocab_size]
    if not inside:
        return None
    mask = np.zeros((1, vocab_size), dtype=bool)
    mask[0, inside] = True
    return ops.asarray(mask, "bool")


def masked(ops, scores, mask):
    """-inf where ``mask`` (HF's min_new_tokens: the stop ids before the minimum)."""
    return ops.where(mask, NEG_INF, scores)


def row_sums(ops, scores):
    """(B,) device: each row's sum, NaN when the row holds a NaN (on MindSpore CPU a third of the cost
    of ``max``, which ignores NaN there). Through the backend's ``sum``, whose MindSpore primitive
    keeps no host memory a call (``Tensor.sum(axis)`` does)."""
    return ops.sum(scores, -1)


def unusable_rows(ops, scores, sums=None, active: Optional[np.ndarray] = None) -> List[Tuple[int, str]]:
    """The rows of (B, V) ``scores`` no token can be chosen from, as (row, "hold NaN" / "hold +inf" /
    "are all -inf"); ``active`` (B,) bool limits the check to running rows.

    A row's sum is finite unless the row holds NaN (sum NaN), +inf (+inf, or NaN beside -inf) or
    -inf (some or all of it): only then is the row max fetched (a second reduction, on those steps
    alone) to tell all -inf from some -inf and +inf from a finite overflow."""
    total = ops.to_numpy(row_sums(ops, scores) if sums is None else sums).reshape(-1).astype(np.float64)
    suspect = ~np.isfinite(total)
    if active is not None:
        suspect &= active
    if not suspect.any():
        return []
    most = ops.to_numpy(ops.max(scores, axis=-1)).reshape(-1).astype(np.float64)
    rows = []
    for row in np.flatnonzero(suspect & (np.isnan(total) | (total == most))):  # NaN; +inf; all -inf
        if most[row] == np.inf:
            kind = "hold +inf"
        elif most[row] == -np.inf and not np.isnan(total[row]):
            kind = "are all -inf"
        else:
            kind = "hold NaN"
        rows.append((int(row), kind))
    return rows
