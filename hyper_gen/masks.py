"""Additive attention masks, built on the host.

Masked entries hold the dtype's most negative *finite* value, never -inf: with -inf a
left-padding query row is fully masked, softmax gives NaN, and the NaN reaches real tokens
through the next layer's values (design guide, "Where we differ from the RFC").
"""

from __future__ import annotations

import numpy as np

# most negative finite value per dtype name (bfloat16 has no numpy type)
_MIN_FINITE = {
    "float16": float(np.finfo(np.float16).min),
    "bfloat16": -3.3895313892515355e38,
    "float32": float(np.finfo(np.float32).min),
    "float64": float(np.finfo(np.float64).min),
}


def min_finite(dtype: str) -> float:
    if dtype not in _MIN_FINITE:
        raise ValueError(f"attention masks support float16, bfloat16, float32 and float64, got {dtype!r}")
    return _MIN_FINITE[dtype]


def _host_dtype(dtype: str):
    return np.float64 if dtype == "float64" else np.float32


def prefill_mask(mask: np.ndarray, key_length: int, dtype: str) -> np.ndarray:
    """(B, 1, S, T) causal + padding-column mask for a prompt of width S; columns >= S masked."""
    batch, width = mask.shape
    causal = np.tril(np.ones((width, key_length), dtype=bool))
    visible = causal[None, :, :] & np.pad(mask.astype(bool), ((0, 0), (0, key_length - width)))[:, None, :]
    return np.where(visible, 0.0, min_finite(dtype)).astype(_host_dtype(dtype))[:, None, :, :]


def full_sequence_mask(mask: np.ndarray, dtype: str) -> np.ndarray:
    """Prefill mask over a whole sequence (used by ``use_cache=False`` recomputation)."""
    return prefill_mask(mask, mask.shape[1], dtype)


def decode_mask(mask: np.ndarray, total_length: int, dtype: str) -> np.ndarray:
    """(B, 1, 1, total_length): padding columns and not-yet-written positions masked.

    ``mask`` covers the positions written so far; later columns start masked and the loop
    unmasks one per step.
    """
    batch, width = mask.shape
    visible = np.zeros((batch, total_length), dtype=bool)
    visible[:, :width] = mask.astype(bool)
    return np.where(visible, 0.0, min_finite(dtype)).astype(_host_dtype(dtype))[:, None, None, :]


def causal_mask(seq: int, past: int, total: int, dtype: str) -> np.ndarray:
    """(1, 1, seq, total) additive mask of a forward given no mask: query i (at position
    past + i) sees the columns <= past + i (a model port's default, every row unpadded)."""
    hidden = np.arange(total)[None, :] > np.arange(past, past + seq)[:, None]
    return np.where(hidden, min_finite(dtype), 0.0).astype(_host_dtype(dtype))[None, None]


def contract_defaults(ops, cache, batch: int, seq: int, position_ids, attention_mask, dtype: str):
    """A port's ``position_ids`` and ``attention_mask`` where the contract's caller gave None:
    positions continuing from the cache, and the causal mask over its columns (a static cache's
    whole buffer) with no padding."""
    past = cache.seq_length if cache is not None else 0
    if position_ids is None:
        position_ids = ops.asarray(np.tile(np.arange(past, past + seq), (batch, 1)))
    if attention_mask is None:
        total = cache.max_length if cache is not None and cache.is_static else past + seq
        attention_mask = ops.asarray(causal_mask(seq, past, total, dtype), dtype)
    return position_ids, attention_mask
