"""Rotary positions of left-padded rows, the way HF's ``generate`` computes them."""

from __future__ import annotations

import numpy as np


def cumsum_positions(mask: np.ndarray) -> np.ndarray:
    """(B, S) int64: padding 0, real tokens 0, 1, 2, ... (HF: cumsum - 1, padding filled with 0);
    ``mask`` is 1 / True for a real token."""
    return np.where(mask == 1, np.cumsum(mask, axis=1) - 1, 0).astype(np.int64)
