"""Host array copies the ports' weight loading shares (numpy only)."""

import numpy as np


def contiguous(array: np.ndarray, dtype) -> np.ndarray:
    """``np.ascontiguousarray(array, dtype)``; a transposed matrix copied 64 columns at a time (~8x faster)."""
    if array.ndim != 2 or array.flags.c_contiguous:
        return np.ascontiguousarray(array, dtype=dtype)
    out = np.empty(array.shape, dtype)
    for j in range(0, array.shape[1], 64):
        out[:, j : j + 64] = array[:, j : j + 64]
    return out


__all__ = ["contiguous"]
