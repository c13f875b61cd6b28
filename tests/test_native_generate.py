"""load_model + generate on both backends gives HF generate's tokens; seeded sampling agrees across frameworks."""

import numpy as np
import pytest
import torch
from qwen_checkpoints import load_hf, make_checkpoint

from hyper_gen import GenerationConfig, generate, load_model

NEW = 8


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("native_generate")
    return {kind: make_checkpoint(root / kind, kind=kind) for kind in ("dense", "moe", "multimodal")}


def padded_batch():
    """A 70-token prompt (two delta-rule chunks), a 3-token one and a 20-token one, left-padded."""
    rng = np.random.default_rng(1)
    lengths = [70, 3, 20]
    ids = np.zeros((3, 70), dtype=np.int64)
    mask = np.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, 70 - n :] = rng.integers(10, 97, n)
        mask[row, 70 - n :] = 1
    return ids, mask


def hf_greedy(path, ids, mask, dtype):
    model = load_hf(path, dtype)
    hf = model.generate(
        torch.from_numpy(ids),
        attention_mask=torch.from_numpy(mask),
        max_new_tokens=NEW,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return [hf[i, int((mask[i] == 0).sum()) :].tolist() for i in range(len(ids))]


def as_numpy(tensor):
    return tensor.asnumpy() if hasattr(tensor, "asnumpy") else tensor.numpy()


@pytest.mark.parametrize("kind", ["dense", "moe", "multimodal"])
@pytest.mark.parametrize("backend", ["torch", "mindspore"])
def test_greedy_tokens_equal_hf_generate(checkpoints, kind, backend):
    # float64 on MindSpore: its float32 kernels drift ~1e-4 from torch's, enough to flip a near-tie
    dtype = "float32" if backend == "torch" else "float64"
    ids, mask = padded_batch()
    expected = hf_greedy(checkpoints[kind], ids, mask, dtype)
    model = load_model(checkpoints[kind], backend=backend, dtype=dtype)
    for cache in ("static", "dynamic"):
        cfg = GenerationConfig(max_new_tokens=NEW, eos_token_id=None, cache_implementation=cache)
        out = as_numpy(generate(model, ids, cfg, attention_mask=mask))
        assert [row[: len(ref)].tolist() for row, ref in zip(out, expected)] == expected, cache


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_seeded_sampling_same_on_torch_and_mindspore(checkpoints, kind):
    ids, mask = padded_batch()
    cfg = GenerationConfig(
        max_new_tokens=NEW, eos_token_id=[5, 7], do_sample=True, top_k=20, top_p=0.9, temperature=0.8, seed=2026
    )
    outs = [
        as_numpy(generate(load_model(checkpoints[kind], backend=b, dtype="float64"), ids, cfg, attention_mask=mask))
        for b in ("torch", "mindspore")
    ]
    np.testing.assert_array_equal(outs[0], outs[1])
    unseeded = as_numpy(
        generate(
            load_model(checkpoints[kind], backend="torch", dtype="float64"),
            ids,
            cfg.replace(seed=7),
            attention_mask=mask,
        )
    )
    assert not np.array_equal(outs[0], unseeded)
