"""Weights of the RFC-contract stub model, made once in numpy so every backend's stub is the same model."""

import numpy as np


def stub_weights(vocab_size=64, hidden=32, heads=2, max_positions=128, seed=0):
    rng = np.random.default_rng(seed)
    scale = 1.0 / np.sqrt(hidden)
    return {
        "embed": rng.normal(0, 1.0, (vocab_size, hidden)),
        "positions": rng.normal(0, 0.5, (max_positions, hidden)),
        "wq": rng.normal(0, scale, (hidden, hidden)),
        "wk": rng.normal(0, scale, (hidden, hidden)),
        "wv": rng.normal(0, scale, (hidden, hidden)),
        "wo": rng.normal(0, scale, (hidden, hidden)),
        "w_up": rng.normal(0, scale, (hidden, 2 * hidden)),
        "w_down": rng.normal(0, scale / 2, (2 * hidden, hidden)),
        "lm_head": rng.normal(0, 2 * scale, (hidden, vocab_size)),
        "heads": heads,
    }
