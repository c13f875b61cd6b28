"""The portable host sampler keeps exactly the tokens HF's warpers keep, and draws with the right odds."""

import subprocess
import sys

import numpy as np
import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from hyper_gen import GenerationConfig
from hyper_gen.noise import _softmax, sample_candidates, uniform_noise


def hf_kept(scores, cfg):
    warpers = LogitsProcessorList()
    if cfg.temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(cfg.temperature))
    if cfg.top_k:
        warpers.append(TopKLogitsWarper(cfg.top_k))
    if cfg.top_p < 1.0:
        warpers.append(TopPLogitsWarper(cfg.top_p))
    if cfg.min_p > 0:
        warpers.append(MinPLogitsWarper(cfg.min_p))
    out = warpers(None, torch.from_numpy(scores.astype(np.float64)))
    return [set(np.flatnonzero(np.isfinite(row.numpy())).tolist()) for row in out]


@pytest.mark.parametrize(
    "kw",
    [
        dict(top_k=5),
        dict(top_k=0, top_p=0.7),
        dict(top_k=10, top_p=0.5, temperature=0.6),
        dict(top_k=0, min_p=0.1),
        dict(top_k=0, top_p=0.9, min_p=0.2, temperature=1.7),
    ],
)
def test_candidates_kept_like_hf(kw):
    rng = np.random.default_rng(0)
    scores = rng.normal(0, 2, (6, 50))
    cfg = GenerationConfig(do_sample=True, seed=0, **kw)
    kept = hf_kept(scores, cfg)
    tokens = np.broadcast_to(np.arange(50), scores.shape)
    for step in range(200):
        chosen = sample_candidates(scores, tokens, cfg, step)
        for row, token in enumerate(chosen):
            assert token in kept[row]


def test_draw_frequencies_follow_probabilities():
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    scores = np.log(probs)[None, :]
    cfg = GenerationConfig(do_sample=True, seed=3, top_k=0)
    # row 0's draws at steps 0..19999, in one call of 20000 rows (a step per row, every row keyed as row 0):
    # the draws a step-by-step loop makes, as its first steps show
    steps = np.arange(20000)
    draws = sample_candidates(
        np.repeat(scores, len(steps), 0), np.tile(np.arange(4), (len(steps), 1)), cfg, steps, 0 * steps
    )
    looped = [sample_candidates(scores, np.arange(4)[None, :], cfg, step)[0] for step in range(50)]
    np.testing.assert_array_equal(draws[:50], looped)
    freq = np.bincount(draws, minlength=4) / len(draws)
    np.testing.assert_allclose(freq, probs, atol=0.015)


def test_noise_is_uniform_and_keyed():
    u = uniform_noise(5, np.arange(4), 9, np.broadcast_to(np.arange(10000), (4, 10000)))
    assert 0 < u.min() and u.max() < 1 and abs(u.mean() - 0.5) < 0.01
    assert not np.array_equal(u[0], u[1])
    again = uniform_noise(5, np.array([1]), 9, np.array([[3, 2, 1]]))
    np.testing.assert_array_equal(again[0], u[1, [3, 2, 1]])  # same (seed, row, step, token) -> same noise
    assert not np.array_equal(uniform_noise(6, np.array([1]), 9, np.array([[3]])), again[:, :1])


def test_candidate_order_breaks_ties_by_token_id():
    scores = np.zeros((1, 4))
    cfg = GenerationConfig(do_sample=True, seed=1, top_k=0)
    a = sample_candidates(scores, np.array([[0, 1, 2, 3]]), cfg, 0)
    b = sample_candidates(scores[:, ::-1], np.array([[3, 2, 1, 0]]), cfg, 0)
    assert a[0] == b[0]
    np.testing.assert_allclose(_softmax(scores), 0.25)


def test_import_hyper_gen_imports_no_framework():
    code = "import sys, hyper_gen; print(sorted({'torch', 'mindspore'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"
