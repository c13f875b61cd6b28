"""generate(hf_model, ...) gives exactly HF ``model.generate``'s tokens (torch, transformers pinned in pyproject)."""

import warnings

import numpy as np
import pytest
import torch
import transformers
from transformers import (
    Qwen3_5ForCausalLM,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from hyper_gen import GenerationConfig, generate

transformers.logging.set_verbosity_error()
warnings.filterwarnings("ignore", message=".*fall(ing)? back.*")

LINEAR = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16)
COMMON = dict(vocab_size=256, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16)


def _build(kind):
    torch.manual_seed(0)
    if kind == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config(intermediate_size=128, num_hidden_layers=2, **COMMON)).eval()
    if kind == "qwen3_5":
        return Qwen3_5ForCausalLM(
            Qwen3_5TextConfig(intermediate_size=128, num_hidden_layers=4, **COMMON, **LINEAR)
        ).eval()
    cfg = Qwen3_5MoeTextConfig(
        num_hidden_layers=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        **COMMON,
        **LINEAR,
    )
    return Qwen3_5MoeForCausalLM(cfg).eval()


MODELS = {}


def model(kind):
    if kind not in MODELS:
        MODELS[kind] = _build(kind)
    return MODELS[kind]


def padded_batch():
    rng = np.random.default_rng(0)
    ids = rng.integers(3, 256, (3, 12))
    mask = np.ones_like(ids)
    mask[0, :4] = 0
    mask[2, :9] = 0  # a 3-token prompt
    ids[mask == 0] = 0
    return torch.from_numpy(ids), torch.from_numpy(mask)


def hf_rows(out, mask):
    """HF's left-padded output without its padding, per row."""
    return [out[i, int((mask[i] == 0).sum()) :].tolist() for i in range(out.shape[0])]


SETTINGS = [
    dict(do_sample=False),
    dict(do_sample=False, repetition_penalty=1.3),
    dict(do_sample=True, top_k=20, top_p=0.9, temperature=0.7, repetition_penalty=1.2),
    dict(do_sample=True, top_k=0, min_p=0.1, repetition_penalty=0.8),
    dict(do_sample=True, top_k=5),
    dict(do_sample=True, top_k=0, top_p=0.6, temperature=1.5),
]


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5", "qwen3_5_moe"])
@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()))
def test_tokens_equal_hf_generate(kind, setting):
    m = model(kind)
    ids, mask = padded_batch()
    torch.manual_seed(7)
    hf = m.generate(ids, attention_mask=mask, max_new_tokens=10, pad_token_id=0, eos_token_id=None, **setting)
    torch.manual_seed(7)
    ours = generate(m, ids, GenerationConfig(max_new_tokens=10, eos_token_id=None, **setting), attention_mask=mask)
    assert isinstance(ours, torch.Tensor) and ours.dtype == torch.int64
    assert [row[: len(ref)] for row, ref in zip(ours.tolist(), hf_rows(hf, mask))] == hf_rows(hf, mask)


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])
def test_eos_and_min_new_tokens_match_hf(kind):
    m = model(kind)
    ids, mask = padded_batch()
    free = hf_rows(
        m.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None), mask
    )
    eos = free[1][12 + 2]
    for min_new in (0, 4):
        hf = m.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=8,
            do_sample=False,
            pad_token_id=1,
            eos_token_id=eos,
            min_new_tokens=min_new,
        )
        ours = generate(
            m,
            ids,
            GenerationConfig(max_new_tokens=8, eos_token_id=eos, pad_token_id=1, min_new_tokens=min_new),
            attention_mask=mask,
        )
        expected = [trim_after_eos(row, len(row) - 8, eos) for row in hf_rows(hf, mask)]
        assert any(len(r) < len(ids[0]) + 8 for r in expected)  # some row really stopped early
        assert ours.shape[1] == max(len(r) for r in expected)
        assert [row[: len(ref)] for row, ref in zip(ours.tolist(), expected)] == expected
        assert all(set(row[len(ref) :]) <= {1} for row, ref in zip(ours.tolist(), expected))


def trim_after_eos(row, prompt_len, eos):
    generated = row[prompt_len:]
    return row[: prompt_len + generated.index(eos) + 1] if eos in generated else row


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])
def test_use_cache_false_matches(kind):
    m = model(kind)
    ids, mask = padded_batch()
    a = generate(m, ids, GenerationConfig(max_new_tokens=6, eos_token_id=None), attention_mask=mask)
    b = generate(m, ids, GenerationConfig(max_new_tokens=6, eos_token_id=None, use_cache=False), attention_mask=mask)
    assert torch.equal(a, b)


def test_padded_row_equals_prompt_alone():
    m = model("qwen3_5")
    ids, mask = padded_batch()
    batch = generate(m, ids, GenerationConfig(max_new_tokens=8, eos_token_id=None), attention_mask=mask)
    for row in range(3):
        alone = generate(
            m, ids[row : row + 1, int((mask[row] == 0).sum()) :], GenerationConfig(max_new_tokens=8, eos_token_id=None)
        )
        assert batch[row, : alone.shape[1]].tolist() == alone[0].tolist()


def test_no_grad_during_generation():
    m = model("qwen3")
    seen = []
    hook = m.register_forward_hook(lambda mod, args, out: seen.append(torch.is_grad_enabled()))
    try:
        generate(m, [[5, 6, 7]], max_new_tokens=3, eos_token_id=None)
    finally:
        hook.remove()
    assert seen and not any(seen)
