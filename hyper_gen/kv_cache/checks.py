"""Argument checks shared by the KV-cache modules: a bad value raises naming its field and value.

``bool`` is refused wherever a count is asked for (``True`` is an ``int`` in Python, and
``num_blocks=True`` is always a mistake); numpy integers are accepted, since block tables and
token ids often come out of arrays.
"""

from __future__ import annotations

import numbers
from typing import Hashable

import numpy as np


def count(name: str, value, minimum: int = 0) -> int:
    """``value`` as an ``int`` >= ``minimum``; TypeError for a non-integer, ValueError below it."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    value = int(value)
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def token_ids(name: str, tokens) -> np.ndarray:
    """A 1-D sequence of non-negative integer token ids as an int64 array (a copy-free view where possible)."""
    if isinstance(tokens, (str, bytes)):
        raise TypeError(f"{name} must be a sequence of int token ids, got {type(tokens).__name__}")
    try:
        array = np.asarray(tokens)
    except (TypeError, ValueError) as error:
        raise TypeError(f"{name} must be a sequence of int token ids: {error}") from None
    if array.size == 0:
        return np.zeros(0, dtype=np.int64)
    if array.ndim != 1:
        raise ValueError(f"{name} must be 1-D (one sequence), got shape {tuple(array.shape)}")
    if array.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold int token ids, got dtype {array.dtype}")
    if array.dtype.kind == "i" and int(array.min()) < 0:
        raise ValueError(f"{name} holds a negative token id: {int(array.min())}")
    return array.astype(np.int64, copy=False)


def request_id(value) -> Hashable:
    """A request id: any hashable value but None (the engine uses str or int ids)."""
    if value is None or isinstance(value, (bool, np.bool_)):
        raise TypeError(f"request_id must be a str or int, got {value!r}")
    try:
        hash(value)
    except TypeError:
        raise TypeError(f"request_id must be hashable, got {type(value).__name__}") from None
    return value
