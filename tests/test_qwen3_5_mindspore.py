"""Native MindSpore Qwen3.5 (dense and MoE) against HF transformers (torch) on tiny random checkpoints.

The model is driven directly through the cache-object contract (docs/model_contract.md): hyper_gen
StaticCache / DynamicCache objects, additive masks built here, prefill then teacher-forced decode.
Each left-padded row must match HF run on that prompt alone.

float64: the MindSpore model computes everything in float64 (rotary, norms, softmax, router, the
delta rule and its state). HF upcasts those to float32 even in a float64 model, so the float64
reference is HF made to compute them in float64 (:func:`hf_in_float64`); then both agree to ~1e-14
whatever the chunk boundaries.

MindSpore is imported unconditionally: without it these tests fail, never skip.
"""

import contextlib
import functools
import inspect

import mindspore as ms
import numpy as np
import pytest
import torch
from error_log import ErrorLog
from qwen_checkpoints import TINY_TEXT_CONFIG, VARIANTS, load_hf, make_checkpoint

from hyper_gen.backends.mindspore import configure
from hyper_gen.backends.mindspore.models import qwen3_5 as native
from hyper_gen.backends.mindspore.ops import MindSporeOps
from hyper_gen.cache import DynamicCache, StaticCache
from hyper_gen.models.checkpoint import Checkpoint
from hyper_gen.models.loading import load_model
from hyper_gen.models.qwen3_5 import Qwen3_5Config

configure("CPU")

TOLERANCE = {"float32": 1e-4, "float64": 1e-9}
VOCAB = TINY_TEXT_CONFIG["vocab_size"]
DECODE_STEPS = 3
ERRORS = ErrorLog()
MAX_ERRORS = ERRORS.max_errors  # (test id) -> max abs error, printed at the end with -s


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("qwen3_5_mindspore")


@pytest.fixture(scope="module")
def path(checkpoint_dir):
    @functools.lru_cache(maxsize=None)
    def get(variant):
        kind, kwargs = VARIANTS[variant]
        return make_checkpoint(checkpoint_dir, kind, **kwargs)

    return get


@pytest.fixture(scope="module")
def models(path):
    """(variant, dtype) -> (MindSpore model, HF reference model), each built once per module."""

    @functools.lru_cache(maxsize=None)
    def get(variant, dtype):
        return native.load(Checkpoint(path(variant)), dtype), _hf_reference(path(variant), dtype)

    return get


report_errors = ERRORS.fixture()
_record = ERRORS.record


# ------------------------------------------------------------------------------ HF reference


class _Float64Torch:
    """``torch`` as HF's Qwen3.5 modules see it inside :func:`hf_in_float64`: float32 is float64."""

    float32 = torch.float64
    float = torch.float64

    def __getattr__(self, name):
        return getattr(torch, name)


@contextlib.contextmanager
def hf_in_float64():
    """HF computes norms, rotary angles, softmax, the router and the delta rule in float32 even
    in a float64 model (``.float()``, ``.to(torch.float32)``, ``dtype=torch.float``); here those
    compute in float64 instead."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as dense_module
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as moe_module

    to_float = torch.Tensor.float
    torch.Tensor.float = lambda self, *a, **k: self if self.dtype == torch.float64 else to_float(self, *a, **k)
    dense_module.torch = moe_module.torch = _Float64Torch()
    try:
        yield
    finally:
        dense_module.torch = moe_module.torch = torch
        torch.Tensor.float = to_float


def _hf_reference(path, dtype):
    model = load_hf(path, dtype)
    if dtype == "float64":  # exact rotary frequencies (HF computes them in float32)
        for module in model.modules():
            if type(module).__name__.endswith("TextRotaryEmbedding"):
                dim = module.inv_freq.shape[0] * 2
                base = module.config.rope_parameters["rope_theta"]
                module.inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    return model


def run_hf(hf_model, prompt, decode_tokens):
    """HF's own cached run on one unpadded prompt: [prefill (L, V)] + one (V,) per decode token."""
    float64 = next(hf_model.parameters()).dtype == torch.float64
    with hf_in_float64() if float64 else contextlib.nullcontext(), torch.no_grad():
        out = hf_model(torch.tensor([list(prompt)]), use_cache=True)
        logits = [out.logits[0].float().numpy() if not float64 else out.logits[0].numpy()]
        for token in decode_tokens:
            out = hf_model(torch.tensor([[int(token)]]), past_key_values=out.past_key_values, use_cache=True)
            logits.append(out.logits[0, -1].float().numpy() if not float64 else out.logits[0, -1].numpy())
    return logits


# ------------------------------------------------------------------- driving the native model


def contract_mask(pads, past, seq, total, dtype):
    """(B, 1, seq, total): column j visible to the query at cache position past + i iff
    pad_b <= j <= past + i (causal + left padding + unwritten static columns)."""
    cols = np.arange(total)[None, None, :]
    rows = np.arange(past, past + seq)[None, :, None]
    visible = (cols <= rows) & (cols >= np.asarray(pads)[:, None, None])
    np_dtype = np.dtype(dtype)
    return ms.Tensor(np.where(visible, 0, np.finfo(np_dtype).min).astype(np_dtype)[:, None])


def run_native(model, prompts, decode_tokens, cache_kind, extra_length=2):
    """Left-padded batch through the model with a hyper_gen cache: per row [its real prompt
    positions' logits (L, V)] + one (V,) per decode step."""
    dtype = {ms.float16: "float16", ms.float32: "float32", ms.float64: "float64"}[model.dtype]
    batch, width = len(prompts), max(len(p) for p in prompts)
    pads = [width - len(p) for p in prompts]
    ids = np.zeros((batch, width), np.int64)  # pad id 0
    positions = np.zeros((batch, width), np.int64)
    for row, (prompt, pad) in enumerate(zip(prompts, pads)):
        ids[row, pad:] = prompt
        positions[row, pad:] = np.arange(len(prompt))
    steps = len(decode_tokens[0])
    cache_class = StaticCache if cache_kind == "static" else DynamicCache
    cache = cache_class(MindSporeOps(), batch, width + steps + extra_length)
    if any(pads):
        cache.prompt_mask = ms.Tensor((np.arange(width)[None] >= np.asarray(pads)[:, None]).astype(dtype))

    def total(seq):
        return cache.max_length if cache_kind == "static" else cache.seq_length + seq

    out = model(
        ms.Tensor(ids),
        position_ids=ms.Tensor(positions),
        attention_mask=contract_mask(pads, 0, width, total(width), dtype),
        past_key_values=cache,
    )
    cache.advance(width)
    logits = out["logits"].asnumpy()
    rows = [[logits[row, pad:]] for row, pad in enumerate(pads)]
    for step in range(steps):
        out = model(
            ms.Tensor(np.array([[d[step]] for d in decode_tokens], np.int64)),
            position_ids=ms.Tensor(np.array([[len(p) + step] for p in prompts], np.int64)),
            attention_mask=contract_mask(pads, cache.seq_length, 1, total(1), dtype),
            past_key_values=cache,
            logits_to_keep=1,
        )
        cache.advance(1)
        for row in range(batch):
            rows[row].append(out["logits"].asnumpy()[row, 0])
    return rows


def max_error(ours, reference):
    return max(
        float(np.abs(a.astype(np.float64) - b.astype(np.float64)).max())
        for ours_row, ref_row in zip(ours, reference)
        for a, b in zip(ours_row, ref_row)
    )


def _prompts(seed, lengths):
    rng = np.random.default_rng(seed)
    return (
        [rng.integers(1, VOCAB, n).tolist() for n in lengths],
        [rng.integers(1, VOCAB, DECODE_STEPS).tolist() for _ in lengths],
    )


def _compare(models, variant, dtype, lengths, seed, cache_kind="static"):
    model, hf_model = models(variant, dtype)
    prompts, decode = _prompts(seed, lengths)
    ours = run_native(model, prompts, decode, cache_kind)
    return max_error(ours, [run_hf(hf_model, p, d) for p, d in zip(prompts, decode)])


# ------------------------------------------------------------------------------ parity tests


@pytest.mark.parametrize("cache_kind", ["static", "dynamic"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("variant", ["dense", "moe"])
def test_left_padded_rows_match_hf_on_each_prompt_alone(models, variant, dtype, cache_kind):
    """A 70-token prompt (two 64-chunks) and a 3-token one in one left-padded batch."""
    error = _compare(models, variant, dtype, (70, 3), seed=1, cache_kind=cache_kind)
    _record(f"{variant}/{dtype}/padded-rows", error, TOLERANCE[dtype])


@pytest.mark.parametrize("variant", ["dense_tied", "moe_fused", "multimodal_tied", "multimodal_moe"])
def test_checkpoint_variants_match_hf(models, variant):
    """Tied embeddings, the fused expert layout and multimodal checkpoints (language model only)."""
    error = _compare(models, variant, "float64", (9, 9), seed=2, cache_kind="dynamic")
    _record(f"{variant}/float64", error, TOLERANCE["float64"])


@pytest.mark.parametrize("variant", ["dense", "dense_tied"])
def test_lm_head_in_column_blocks(path, monkeypatch, variant):
    """The LM head is stored in blocks of vocabulary columns (one block at this vocabulary); with
    blocks of 20 the logits are concatenated and a tied embedding gathers each row's ids from the
    blocks holding them (several blocks in one prefill or decode step)."""
    monkeypatch.setattr(native, "_block_width", lambda columns, most: 20)
    model = native.load(Checkpoint(path(variant)), "float64")
    assert [tuple(p.shape) for p in model.lm_head] == [(TINY_TEXT_CONFIG["hidden_size"], 20)] * 4 + [
        (TINY_TEXT_CONFIG["hidden_size"], VOCAB - 80)
    ]
    prompts, decode = _prompts(8, (9, 6, 4))
    ours = run_native(model, prompts, decode, "static")
    reference = [run_hf(_hf_reference(path(variant), "float64"), p, d) for p, d in zip(prompts, decode)]
    _record(f"{variant}/float64/lm-head-blocks", max_error(ours, reference), TOLERANCE["float64"])


def test_lm_head_block_width():
    """Even shares of the vocabulary, 64 times an odd number of columns (no power-of-two row stride)."""
    assert native._block_width(248320, 65536) == 62144  # Qwen3.5: 3 x 62144 + 61888
    assert native._block_width(262144, 65536) == 65600  # not 65536 (half the bandwidth)
    assert native._block_width(97, 65536) == 192  # >= 97: one block
    assert native._block_width(151936, 65536) == 50752


@pytest.mark.parametrize("length", [1, 2])
def test_prompts_shorter_than_the_conv_kernel(models, length):
    _record("dense/float64/short-prompt", _compare(models, "dense", "float64", (length,), seed=3), TOLERANCE["float64"])


def test_chunked_prefill_continues_the_cached_state(models):
    """A second multi-token forward after a cached prefill carries conv and delta-rule state."""
    model, hf_model = models("dense", "float64")
    ids = np.random.default_rng(4).integers(0, VOCAB, (1, 80))
    cache = DynamicCache(MindSporeOps(), 1, 80)
    first = model(ms.Tensor(ids[:, :50]), past_key_values=cache)["logits"].asnumpy()
    cache.advance(50)
    second = model(ms.Tensor(ids[:, 50:]), past_key_values=cache)["logits"].asnumpy()
    reference = run_hf(hf_model, ids[0], [])[0]
    _record(
        "dense/float64/chunked-prefill",
        float(np.abs(np.concatenate([first, second], 1)[0] - reference).max()),
        TOLERANCE["float64"],
    )


def test_cacheless_forward_and_logits_to_keep(models):
    model, hf_model = models("moe", "float64")
    ids = np.random.default_rng(5).integers(0, VOCAB, (2, 11))
    full = model(ms.Tensor(ids))["logits"].asnumpy()  # no cache, no mask: causal, unpadded
    last = model(ms.Tensor(ids), logits_to_keep=3)["logits"].asnumpy()
    assert last.shape == (2, 3, VOCAB)
    np.testing.assert_array_equal(last, full[:, -3:])
    with hf_in_float64(), torch.no_grad():
        reference = hf_model(torch.from_numpy(ids)).logits.numpy()
    _record("moe/float64/cacheless", float(np.abs(full - reference).max()), TOLERANCE["float64"])


def test_float16_is_as_close_to_float32_as_hf(models):
    model, hf_model = models("moe", "float16")
    _, hf32 = models("moe", "float32")
    prompts, decode = _prompts(6, (12, 5))
    ours = run_native(model, prompts, decode, "static")
    theirs = [run_hf(hf_model, p, d) for p, d in zip(prompts, decode)]
    truth = [run_hf(hf32, p, d) for p, d in zip(prompts, decode)]
    assert all(step.dtype == np.float16 and np.isfinite(step).all() for row in ours for step in row)
    _record("moe/float16-vs-hf-float32", max_error(ours, truth), 2 * max_error(theirs, truth) + 1e-2)


def test_bfloat16_checkpoint_loads_as_float32(checkpoint_dir):
    path = make_checkpoint(checkpoint_dir, "dense", dtype="bfloat16")
    model, hf_model = native.load(Checkpoint(path), "float32"), load_hf(path, "float32")
    prompts, decode = _prompts(7, (10,))
    error = max_error(run_native(model, prompts, decode, "static"), [run_hf(hf_model, prompts[0], decode[0])])
    _record("dense/bf16-checkpoint-as-float32", error, TOLERANCE["float32"])


# ------------------------------------------------------------------------ contract attributes


def test_model_attributes(models, path):
    model, _ = models("moe", "float16")
    assert model.supports_cache_object is True and isinstance(model, ms.nn.Cell)
    assert isinstance(model.config, Qwen3_5Config) and model.config.is_moe
    assert model.vocab_size == VOCAB
    assert model.dtype == ms.float16 and MindSporeOps().param_dtype(model) == "float16"
    assert all(p.dtype == ms.float16 and not p.requires_grad for p in model.get_parameters())
    assert list(inspect.signature(model.construct).parameters) == [
        "input_ids",
        "position_ids",
        "attention_mask",
        "past_key_values",
        "logits_to_keep",
    ]
    loaded = load_model(path("dense"), backend="mindspore", dtype="float32")
    assert isinstance(loaded, native.Qwen3_5ForCausalLM)
    assert loaded.generation_defaults == {"eos_token_id": [5, 7], "pad_token_id": 0}


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_linear_attention_state_layout(models, dtype):
    model, _ = models("dense", dtype)
    config = model.config
    cache = StaticCache(MindSporeOps(), 2, 8)
    model(ms.Tensor(np.ones((2, 5), np.int64)), past_key_values=cache)
    conv_dim = (
        2 * config.linear_num_key_heads * config.linear_key_head_dim
        + config.linear_num_value_heads * config.linear_value_head_dim
    )
    assert sorted(cache.recurrent_states) == [0, 2] and sorted(cache.keys) == [1, 3]
    assert cache.conv_states[0].shape == (2, conv_dim, config.linear_conv_kernel_dim - 1)
    assert cache.recurrent_states[0].shape == (
        2,
        config.linear_num_value_heads,
        config.linear_key_head_dim,
        config.linear_value_head_dim,
    )
    assert cache.recurrent_states[0].dtype == getattr(ms, dtype)  # float32, or float64 in a float64 model
    assert cache.keys[1].shape == (2, config.num_key_value_heads, 8, config.head_dim)


def test_bad_dtypes_are_rejected(path):
    with pytest.raises(ValueError, match="bfloat16.*CPU"):
        native.load(Checkpoint(path("dense")), "bfloat16")
    with pytest.raises(ValueError, match="dtype must be one of"):
        native.load(Checkpoint(path("dense")), "int8")


def test_bfloat16_rounding_matches_torch():
    """Weights HF upcasts are first rounded to the model dtype; bf16 (Ascend) has no numpy type."""
    values = np.random.default_rng(8).standard_normal(1000).astype(np.float32) * 100
    values[:4] = [1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 0.0]  # ties round to even
    expected = torch.from_numpy(values).to(torch.bfloat16).float().numpy()
    np.testing.assert_array_equal(native._round_to(values, "bfloat16"), expected)
