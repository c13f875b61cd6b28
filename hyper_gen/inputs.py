"""Validate a call's input_ids / attention_mask once, on the host, into a ``PromptBatch``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .registry import to_host


@dataclass(frozen=True)
class PromptBatch:
    """Left-padded prompts on the host.

    ``ids`` (B, S) int64 with padding as given, ``mask`` (B, S) int64 (1 real, 0 padding),
    ``lengths`` (B,) real tokens per row, ``padded`` whether any row has padding.
    """

    ids: np.ndarray
    mask: np.ndarray
    lengths: np.ndarray
    padded: bool

    @property
    def batch_size(self) -> int:
        return self.ids.shape[0]

    @property
    def width(self) -> int:
        return self.ids.shape[1]

    def position_ids(self) -> np.ndarray:
        """Padding 0, real tokens 0, 1, 2, ... (HF: cumsum - 1, padding filled with 0)."""
        return np.where(self.mask == 1, np.cumsum(self.mask, axis=1) - 1, 0).astype(np.int64)

    def real_tokens(self, row: int) -> np.ndarray:
        return self.ids[row, self.width - int(self.lengths[row]) :]


def _as_2d_int(name: str, value: Any) -> np.ndarray:
    value = to_host(value)
    try:
        array = np.asarray(value)
    except Exception as exc:  # ragged lists and other junk
        raise ValueError(f"{name} must be a rectangular 2-D array of integers: {exc}") from None
    if array.dtype == object:
        raise ValueError(f"{name} must be a rectangular 2-D array of integers (rows of equal length)")
    if array.ndim != 2:
        raise ValueError(f"{name} must be 2-D (batch, sequence), got shape {array.shape}")
    if array.size == 0:
        raise ValueError(f"{name} must not be empty, got shape {array.shape}")
    if array.dtype == bool and name == "attention_mask":
        array = array.astype(np.int64)
    if not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"{name} must hold integers, got dtype {array.dtype}")
    return array.astype(np.int64, copy=False)


def prepare_prompts(input_ids: Any, attention_mask: Any = None) -> PromptBatch:
    """Check the RFC input rules and return the host-side batch."""
    ids = _as_2d_int("input_ids", input_ids)
    if (ids < 0).any():
        raise ValueError(f"input_ids must be non-negative token ids, got {int(ids.min())}")
    if attention_mask is None:
        mask = np.ones_like(ids)
    else:
        mask = _as_2d_int("attention_mask", attention_mask)
        if mask.shape != ids.shape:
            raise ValueError(f"attention_mask shape {mask.shape} != input_ids shape {ids.shape}")
        if not np.isin(mask, (0, 1)).all():
            raise ValueError("attention_mask must hold only 0 (padding) and 1 (real token)")
    lengths = mask.sum(axis=1)
    empty = np.flatnonzero(lengths == 0)
    if empty.size:
        raise ValueError(f"attention_mask row {int(empty[0])} has no real token")
    # left padding only: once a row turns 1 it stays 1
    right_padded = np.flatnonzero((np.diff(mask, axis=1) < 0).any(axis=1))
    if right_padded.size:
        raise ValueError(
            f"attention_mask row {int(right_padded[0])} is right-padded (a 0 after a 1); "
            "hyper_gen expects left padding (tokenizer padding_side='left')"
        )
    return PromptBatch(ids=ids, mask=mask, lengths=lengths.astype(np.int64), padded=bool((mask == 0).any()))
