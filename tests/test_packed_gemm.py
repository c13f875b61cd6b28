"""torch batched-decode projections through MKL's packed GEMM (hyper_gen.backends.torch.packed_gemm):
the products F.linear gives (to rounding), one packed copy per weight and row count within the byte budget,
plain ``x @ w`` everywhere else, and a model's batched generation unchanged by it."""

import gc

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from qwen_checkpoints import TINY_TEXT_CONFIG, VARIANTS, make_checkpoint

from hyper_gen.backends.torch import packed_gemm
from hyper_gen.config import GenerationConfig
from hyper_gen.generation import generate
from hyper_gen.models.loading import load_model


@pytest.fixture(autouse=True)
def pack_at_once(monkeypatch):
    monkeypatch.setattr(packed_gemm, "STEADY_CALLS", 1)


def test_packed_products_are_f_linear_and_packed_once_per_row_count():
    assert packed_gemm.available()  # the CPU wheel this project pins has MKL
    weights = packed_gemm.PackedWeights(budget=1 << 30)
    w = torch.randn(96, 200)  # (in, out)
    packed_rows = []
    for rows in (16, 16, 9, 9):
        x = torch.randn(rows, 1, 96)
        out = weights.project(x, w)
        packed_rows.append(weights.packed[id(w)][0])
        # HF's product: bitwise on Intel hosts; where MKL takes its generic path (AMD) to rounding
        torch.testing.assert_close(out, F.linear(x, w.t().contiguous()), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out, x @ w, rtol=1e-5, atol=1e-5)
    assert packed_rows == [16, 16, 9, 9] and len(weights.packed) == 1  # one copy, repacked for 9 rows
    assert weights.bytes == weights.packed[id(w)][1].numel() * 4
    prompt = torch.randn(1, 16, 96)  # a prompt's 16 positions: not packed (each length would repack)
    assert torch.equal(weights.project(prompt, w), prompt @ w)
    assert torch.equal(weights.project(prompt.reshape(16, 96), w), prompt.reshape(16, 96) @ w)


@pytest.mark.parametrize("rows", [1, 7, 65])
def test_other_row_counts_and_dtypes_are_plain_products(rows):
    weights = packed_gemm.PackedWeights(budget=1 << 30)
    w = torch.randn(32, 48)
    x = torch.randn(rows, 1, 32)
    assert torch.equal(weights.project(x, w), x @ w) and not weights.packed
    w64, x64 = w.double(), torch.randn(16, 1, 32, dtype=torch.float64)
    assert torch.equal(weights.project(x64, w64), x64 @ w64) and not weights.packed


def test_the_budget_bounds_the_packed_copies_and_a_freed_weight_frees_its_copy():
    weights = packed_gemm.PackedWeights(budget=1 << 30)
    w = torch.randn(256, 512)
    weights.project(torch.randn(16, 1, 256), w)
    one = weights.bytes
    assert one > w.numel() * 4  # a packed copy is larger than the weight
    tight = packed_gemm.PackedWeights(budget=one + one // 2)
    a, b = torch.randn(256, 512), torch.randn(256, 512)
    x = torch.randn(16, 1, 256)
    torch.testing.assert_close(tight.project(x, a), F.linear(x, a.t().contiguous()), rtol=1e-5, atol=1e-5)
    assert torch.equal(tight.project(x, b), x @ b)  # over the budget: the plain product
    assert set(tight.packed) == {id(a)} and (id(b), 16) in tight.refused
    del a
    gc.collect()
    assert tight.packed == {} and tight.bytes == 0
    assert packed_gemm.PackedWeights(budget=0).enabled is False


def test_a_row_count_is_packed_once_it_holds(monkeypatch):
    """Rows that change from call to call (an in-flight engine's batch) are not repacked every call."""
    monkeypatch.setattr(packed_gemm, "STEADY_CALLS", 3)
    weights = packed_gemm.PackedWeights(budget=1 << 30)
    w = torch.randn(32, 64)
    for rows in (16, 12, 16, 12, 16, 16):
        weights.project(torch.randn(rows, 1, 32), w)
        assert not weights.packed
    weights.project(torch.randn(16, 1, 32), w)
    assert weights.packed[id(w)][0] == 16


def test_the_budget_variable_is_checked(monkeypatch):
    monkeypatch.setenv("HYPER_GEN_TORCH_PACKED_GEMM_MB", "lots")
    with pytest.raises(ValueError, match="HYPER_GEN_TORCH_PACKED_GEMM_MB must be a number of MB >= 0, got 'lots'"):
        packed_gemm.PackedWeights()


def test_batched_generation_is_unchanged_by_packing(tmp_path, monkeypatch):
    """A batch of 12 left-padded rows (decode steps of 12 rows go through the packed copies):
    the same tokens as plain products, logits within float32 rounding."""
    kind, kwargs = VARIANTS["dense"]
    model = load_model(make_checkpoint(tmp_path, kind, **kwargs), backend="torch", dtype="float32")
    rng = np.random.default_rng(3)
    lengths = rng.integers(2, 12, 12)
    mask = (np.arange(12)[None, :] >= 12 - lengths[:, None]).astype(np.int64)
    ids = torch.from_numpy(rng.integers(3, TINY_TEXT_CONFIG["vocab_size"], (12, 12)) * mask)
    config = GenerationConfig(max_new_tokens=6, return_dict_in_generate=True, output_logits=True)
    packed = packed_gemm.PackedWeights(budget=1 << 30)
    monkeypatch.setattr(packed_gemm, "_SHARED", packed)
    ours = generate(model, ids, config, attention_mask=torch.from_numpy(mask))
    assert packed.packed  # the decode steps used packed copies
    monkeypatch.setattr(packed_gemm, "_SHARED", packed_gemm.PackedWeights(budget=0))
    plain = generate(model, ids, config, attention_mask=torch.from_numpy(mask))
    assert torch.equal(ours.sequences, plain.sequences)
    for a, b in zip(ours.logits, plain.logits):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_a_weight_changed_in_place_is_packed_again():
    """An optimizer step between two rollouts updates the weight in place: the next decode step
    must multiply the new values, not the copy packed before."""
    weights = packed_gemm.PackedWeights(budget=1 << 30)
    w = torch.nn.Parameter(torch.randn(96, 200))
    x = torch.randn(16, 1, 96)
    with torch.no_grad():
        before = weights.project(x, w)
        w.mul_(-2.0)
        after = weights.project(x, w)
    torch.testing.assert_close(after, -2.0 * before, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(after, x @ w.detach(), rtol=1e-5, atol=1e-5)
    assert len(weights.packed) == 1 and weights.bytes == weights.packed[id(w)][1].numel() * 4


def test_an_inference_tensor_is_a_plain_product():
    """A weight made under torch.inference_mode has no version counter (an in-place change could
    not be seen), so it is never packed."""
    weights = packed_gemm.PackedWeights(budget=1 << 30)
    with torch.inference_mode():
        w = torch.randn(96, 200)
    x = torch.randn(16, 1, 96)
    assert torch.equal(weights.project(x, w), x @ w)
    with torch.inference_mode():
        assert torch.equal(weights.project(x, w), x @ w)
    assert not weights.packed
