"""Portable sampling noise for ``seed=<int>``.

The noise is made on the host by numpy's Philox, a counter-based generator, keyed by the seed
with the counter set from (row, step). It does not depend on the framework, the device, the
parallel layout or the other rows of the batch, so the same seed gives the same tokens
everywhere. Tokens are drawn by the exponential race ``argmax(p / q)``, q ~ Exp(1), which picks
token i with probability p_i.
"""

from __future__ import annotations

import numpy as np


def exponential_noise(seed: int, step: int, rows: int, vocab_size: int) -> np.ndarray:
    """(rows, vocab_size) float32 Exp(1) samples; row r depends only on (seed, r, step)."""
    noise = np.empty((rows, vocab_size), dtype=np.float32)
    for row in range(rows):
        counter = np.array([0, 0, row, step], dtype=np.uint64)
        generator = np.random.Generator(np.random.Philox(key=seed, counter=counter))
        generator.standard_exponential(out=noise[row], dtype=np.float32)
    # Exp(1) can be exactly 0; keep p / q finite
    np.maximum(noise, np.finfo(np.float32).tiny, out=noise)
    return noise
