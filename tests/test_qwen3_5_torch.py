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
    layout) except in float64, which keeps HF's (out, in) memory to stay bitwise HF's, and the
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
