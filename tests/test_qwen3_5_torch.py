"""Torch-only layout facts of the native Qwen3.5 port; its HF parity, cache contents, checkpoint
variants and load errors are checked with the MindSpore port's in tests/test_model_conformance.py.

Here: a tied LM head is the embedding matrix itself, and every matmul weight is stored (in, out)
(HF's (out, in) memory in float64), as the fast batch-1 decode wants.
"""

import functools
import os

import pytest
import torch
from qwen_checkpoints import TINY_TEXT_CONFIG, VARIANTS, make_checkpoint
from safetensors.torch import load_file

from hyper_gen.models.loading import load_model

VOCAB = TINY_TEXT_CONFIG["vocab_size"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("qwen3_5_torch")


@pytest.fixture(scope="module")
def models(checkpoint_dir):
    """(variant, dtype) -> native torch model, each loaded once per module."""

    @functools.lru_cache(maxsize=None)
    def get(variant, dtype):
        kind, kwargs = VARIANTS[variant]
        return load_model(make_checkpoint(checkpoint_dir, kind, **kwargs), backend="torch", dtype=dtype)

    return get


def test_tied_embeddings_share_one_matrix(models):
    """No LM head of its own when tied (the config flag itself: test_model_conformance.py)."""
    assert models("dense_tied", "float32").lm_head is None
    assert models("dense", "float32").lm_head is not None
    # multimodal: the top-level tie_word_embeddings governs (text_config says false there)
    assert models("multimodal_tied", "float32").lm_head is None


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_matrices_are_stored_in_out(models, checkpoint_dir, dtype):
    """Every matmul is ``x @ w`` with w (in, out): (in, out)-contiguous (the fast batch-1 decode
    layout) except in float64, which keeps HF's (out, in) memory (HF's ``F.linear`` sums), and the
    Gated DeltaNet b / a projections, which keep it in every dtype (the decay's rounding). The
    embedding is one (H, V) matrix, looked up by columns, that a tied head multiplies by."""
    model = models("moe", dtype)
    config = model.config
    hid, vocab = config.hidden_size, VOCAB
    attention, deltanet, moe = model.layers[1].mixer, model.layers[0].mixer, model.layers[0].mlp
    shapes = {
        attention.qkv_proj: (
            hid,
            2 * config.num_attention_heads * config.head_dim + 2 * config.num_key_value_heads * config.head_dim,
        ),
        attention.o_proj: (config.num_attention_heads * config.head_dim, hid),
        deltanet.in_proj: (hid, deltanet.conv_dim + deltanet.value_dim),
        deltanet.out_proj: (deltanet.value_dim, hid),
        moe.router: (hid, config.num_experts),
        moe.experts_gate_up: (config.num_experts, hid, 2 * config.moe_intermediate_size),
        moe.experts_down: (config.num_experts, config.moe_intermediate_size, hid),
        moe.shared_expert.gate_up_proj: (hid, 2 * config.shared_expert_intermediate_size),
        moe.shared_expert_gate: (hid, 1),
        model.embed_tokens: (hid, vocab),
        model.lm_head: (hid, vocab),
    }
    for weight, shape in shapes.items():
        assert weight.shape == shape
        assert (weight.transpose(-1, -2) if dtype == "float64" else weight).is_contiguous()
    for weight in (deltanet.in_proj_b, deltanet.in_proj_a):
        assert weight.shape == (hid, config.linear_num_value_heads) and weight.t().is_contiguous()

    tied = models("dense_tied", dtype)
    assert [p.shape for p in tied.parameters()].count((hid, vocab)) == 1
    path = make_checkpoint(checkpoint_dir, "dense", tie_word_embeddings=True)
    rows = load_file(os.path.join(path, "model.safetensors"))["model.embed_tokens.weight"].to(model.dtype)
    ids = torch.tensor([[3, 0, 96, 3], [50, 7, 1, 2]])
    assert torch.equal(tied.embed_tokens.t(), rows)  # the head's matrix is the checkpoint's embedding
    embedded = tied._embed(ids)
    assert embedded.is_contiguous() and torch.equal(embedded, rows[ids])  # contiguous: norms sum as HF's


def _padded_prompts(lengths, seed=0):
    """A left-padded (ids, mask) batch of prompts of ``lengths``."""
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(3, VOCAB, (len(lengths), width), generator=generator)
    mask = (torch.arange(width)[None, :] >= width - torch.tensor(lengths)[:, None]).long()
    return ids * mask, mask


@pytest.mark.parametrize("variant", ["dense", "moe"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_left_padded_prefill_packs_the_real_tokens(models, monkeypatch, variant, dtype):
    """The row-wise work of a left-padded prefill runs on the real tokens only (TokenPacking): same
    greedy tokens and the same logits at every step as the padded layout (float64 to 1e-12), the
    row with 130 positions of padding (two all-padding chunks of the delta rule) included."""
    from hyper_gen.config import GenerationConfig
    from hyper_gen.generation import generate
    from hyper_gen.token_packing import TokenPacking

    model = models(variant, dtype)
    ids, mask = _padded_prompts([133, 3, 70, 129])
    config = GenerationConfig(max_new_tokens=5, return_dict_in_generate=True, output_logits=True)
    packed_rows = []
    real_of = TokenPacking.of

    def spy(ops, prompt_mask):
        packing = real_of(ops, prompt_mask)
        packed_rows.append(None if packing is None else packing.count)
        return packing

    monkeypatch.setattr(TokenPacking, "of", staticmethod(spy))
    packed = generate(model, ids, config, attention_mask=mask)
    assert packed_rows[0] == int(mask.sum()) and all(n is None for n in packed_rows[1:])  # decode: no padding
    monkeypatch.setattr(TokenPacking, "of", staticmethod(lambda ops, prompt_mask: None))
    padded = generate(model, ids, config, attention_mask=mask)
    assert torch.equal(torch.as_tensor(packed.sequences), torch.as_tensor(padded.sequences))
    tolerance = 1e-12 if dtype == "float64" else 1e-5
    for a, b in zip(packed.logits, padded.logits):
        assert (torch.as_tensor(a) - torch.as_tensor(b)).abs().max().item() <= tolerance


def _elementwise_step(query, key, value, decay, beta, state):
    """HF torch_recurrent_gated_delta_rule with S == 1, its elementwise form."""
    state = state * decay.exp()[..., None, None]
    kv_mem = (state * key.unsqueeze(-1)).sum(dim=-2)
    delta = (value - kv_mem) * beta.unsqueeze(-1)
    state = state + key.unsqueeze(-1) * delta.unsqueeze(-2)
    return (state * query.unsqueeze(-1)).sum(dim=-2), state


def test_batched_recurrent_step_is_the_elementwise_step():
    """The decode step through bmm computes HF's elementwise step (to 1e-12 in float64 inputs)."""
    from hyper_gen.backends.torch.gated_deltanet import recurrent_gated_delta_step

    generator = torch.Generator().manual_seed(0)
    b, h, dk, dv = 3, 4, 16, 8
    query, key = (
        torch.nn.functional.normalize(torch.randn(b, h, dk, generator=generator, dtype=torch.float64), dim=-1)
        for _ in range(2)
    )
    value = torch.randn(b, h, dv, generator=generator, dtype=torch.float64)
    decay = -torch.rand(b, h, generator=generator, dtype=torch.float64)
    beta = torch.rand(b, h, generator=generator, dtype=torch.float64)
    state = torch.randn(b, h, dk, dv, generator=generator, dtype=torch.float64)
    before = state.clone()
    expected = _elementwise_step(query, key, value, decay, beta, state)
    got = recurrent_gated_delta_step(query, key, value, decay, beta, state)
    assert torch.equal(state, before)  # the cache's state tensor is not written in place
    for a, e in zip(got, expected):
        assert a.shape == e.shape and (a - e).abs().max().item() < 1e-12
