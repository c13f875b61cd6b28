"""Native torch Qwen3.5 (dense and MoE) against HF transformers on tiny random checkpoints.

The model is driven directly through the cache-object contract (docs/model_contract.md): a
StaticCache or DynamicCache, additive masks built here, prefill then teacher-forced decode steps.
The reference is HF's own cached run (prefill, then one token at a time with its cache), so
float64 is compared where both implementations run the same float32 islands (HF computes the
norms, rotary angles, router softmax and the delta rule in float32 for every model dtype).
"""

import functools
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from error_log import ErrorLog
from qwen_checkpoints import TINY_TEXT_CONFIG, VARIANTS, load_hf, make_checkpoint
from safetensors.torch import load_file, save_file

from hyper_gen.backends.torch.ops import TorchOps
from hyper_gen.cache import DynamicCache, StaticCache
from hyper_gen.models.loading import load_model
from hyper_gen.models.qwen3_5 import ARCHITECTURES, Qwen3_5Config

TOLERANCE = {"float32": 1e-4, "float64": 1e-9}
VOCAB = TINY_TEXT_CONFIG["vocab_size"]
DECODE_STEPS = 4
ERRORS = ErrorLog()
MAX_ERRORS = ERRORS.max_errors  # (test id) -> max abs error, printed at the end with -s


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matmuls on a shared 2-core machine: a second OpenMP thread costs 30x in waits."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("qwen3_5_torch")


@pytest.fixture(scope="module")
def models(checkpoint_dir):
    """(variant, dtype) -> (native model, HF model), each loaded once per module."""

    @functools.lru_cache(maxsize=None)
    def get(variant, dtype):
        kind, kwargs = VARIANTS[variant]
        path = make_checkpoint(checkpoint_dir, kind, **kwargs)
        return load_model(path, backend="torch", dtype=dtype), load_hf(path, dtype)

    return get


report_errors = ERRORS.fixture()
_record = ERRORS.record


# ------------------------------------------------------------------------- contract drivers


def contract_mask(prompt_mask, past, seq, total, dtype):
    """(B, 1, seq, total) additive mask: causal + padding columns + unwritten static columns."""
    batch, prompt_len = prompt_mask.shape
    real = torch.ones(batch, total, dtype=torch.bool)
    real[:, :prompt_len] = prompt_mask.bool()
    rows = torch.arange(past, past + seq)[:, None]
    visible = (torch.arange(total)[None, :] <= rows)[None] & real[:, None, :]
    mask = torch.zeros(batch, 1, seq, total, dtype=dtype)
    return mask.masked_fill(~visible[:, None], torch.finfo(dtype).min)


def run_native(model, input_ids, prompt_mask, decode_ids, cache_kind):
    """Prefill then one decode step per column of decode_ids; returns the logits of each call."""
    batch, prompt_len = input_ids.shape
    dtype = model.dtype
    cache_class = StaticCache if cache_kind == "static" else DynamicCache
    cache = cache_class(TorchOps("cpu"), batch, prompt_len + decode_ids.shape[1] + 3)
    padded = not bool(prompt_mask.all())
    cache.prompt_mask = prompt_mask.to(dtype) if padded else None

    def total(seq):
        return cache.max_length if cache_kind == "static" else cache.seq_length + seq

    positions = (prompt_mask.cumsum(1) - 1).clamp(min=0) * prompt_mask
    lengths = prompt_mask.sum(1)
    outputs = []
    with torch.no_grad():
        mask = contract_mask(prompt_mask, 0, prompt_len, total(prompt_len), dtype)
        outputs.append(model(input_ids, position_ids=positions, attention_mask=mask, past_key_values=cache)["logits"])
        cache.advance(prompt_len)
        for step in range(decode_ids.shape[1]):
            mask = contract_mask(prompt_mask, cache.seq_length, 1, total(1), dtype)
            outputs.append(
                model(
                    decode_ids[:, step : step + 1],
                    position_ids=(lengths + step)[:, None],
                    attention_mask=mask,
                    past_key_values=cache,
                    logits_to_keep=1,
                )["logits"]
            )
            cache.advance(1)
    return outputs


def run_hf(hf_model, input_ids, decode_ids, attention_mask=None, position_ids=None):
    """HF's own cached run: prefill, then one token per step with its cache."""
    outputs = []
    with torch.no_grad():
        out = hf_model(input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=True)
        outputs.append(out.logits)
        cache = out.past_key_values
        for step in range(decode_ids.shape[1]):
            kwargs = {}
            if attention_mask is not None:
                attention_mask = torch.cat([attention_mask, torch.ones_like(attention_mask[:, :1])], 1)
                kwargs["attention_mask"] = attention_mask
                kwargs["position_ids"] = position_ids[:, -1:] + 1 + step
            out = hf_model(decode_ids[:, step : step + 1], past_key_values=cache, use_cache=True, **kwargs)
            outputs.append(out.logits)
            cache = out.past_key_values
    return outputs


def max_error(ours, reference):
    return max((a.double() - b.double()).abs().max().item() for a, b in zip(ours, reference))


# -------------------------------------------------------------------------------- parity tests


@pytest.mark.parametrize("cache_kind", ["static", "dynamic"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prefill_and_decode_match_hf(models, variant, dtype, cache_kind):
    model, hf_model = models(variant, dtype)
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, VOCAB, (2, 9), generator=generator)
    decode_ids = torch.randint(0, VOCAB, (2, DECODE_STEPS), generator=generator)
    ours = run_native(model, input_ids, torch.ones_like(input_ids), decode_ids, cache_kind)
    reference = run_hf(hf_model, input_ids, decode_ids)
    assert ours[0].shape == (2, 9, VOCAB) and ours[1].shape == (2, 1, VOCAB)
    _record(f"{variant}/{dtype}/unpadded", max_error(ours, reference), TOLERANCE[dtype])


def _padded_batch(lengths, generator):
    prompts = [torch.randint(0, VOCAB, (n,), generator=generator) for n in lengths]
    width = max(lengths)
    input_ids = torch.zeros(len(lengths), width, dtype=torch.long)  # pad id 0
    prompt_mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = prompt
        prompt_mask[row, width - len(prompt) :] = 1
    return prompts, input_ids, prompt_mask


@pytest.mark.parametrize("cache_kind", ["static", "dynamic"])
@pytest.mark.parametrize("variant", ["dense", "moe"])
def test_left_padded_rows_match_hf_on_each_prompt_alone(models, variant, cache_kind):
    """float32: a 70-token prompt (two 64-chunks) and a 3-token one, left-padded into one batch;
    each row's real positions against HF run on that prompt alone."""
    model, hf_model = models(variant, "float32")
    generator = torch.Generator().manual_seed(2)
    prompts, input_ids, prompt_mask = _padded_batch([70, 3], generator)
    decode_ids = torch.randint(0, VOCAB, (2, DECODE_STEPS), generator=generator)
    ours = run_native(model, input_ids, prompt_mask, decode_ids, cache_kind)
    for row, prompt in enumerate(prompts):
        reference = run_hf(hf_model, prompt[None], decode_ids[row : row + 1])
        mine = [ours[0][row : row + 1, -len(prompt) :]] + [step[row : row + 1] for step in ours[1:]]
        _record(f"{variant}/float32/padded-row-vs-alone", max_error(mine, reference), TOLERANCE["float32"])


@pytest.mark.parametrize("cache_kind", ["static", "dynamic"])
@pytest.mark.parametrize("variant", ["dense", "moe"])
def test_left_padded_batch_matches_hf_padded_batch_float64(models, variant, cache_kind):
    """float64: the same padded batch against HF fed the same padded batch (same chunk
    boundaries, so both run identical float32 delta-rule arithmetic)."""
    model, hf_model = models(variant, "float64")
    generator = torch.Generator().manual_seed(2)
    _, input_ids, prompt_mask = _padded_batch([70, 3], generator)
    decode_ids = torch.randint(0, VOCAB, (2, DECODE_STEPS), generator=generator)
    ours = run_native(model, input_ids, prompt_mask, decode_ids, cache_kind)
    positions = (prompt_mask.cumsum(1) - 1).clamp(min=0) * prompt_mask
    reference = run_hf(hf_model, input_ids, decode_ids, attention_mask=prompt_mask, position_ids=positions)
    real = prompt_mask.bool()[..., None]
    ours[0], reference[0] = ours[0] * real, reference[0] * real  # padding rows are not compared
    _record(f"{variant}/float64/padded-batch", max_error(ours, reference), TOLERANCE["float64"])


@pytest.mark.parametrize("length", [1, 2])
def test_prompts_shorter_than_the_conv_kernel(models, length):
    model, hf_model = models("dense", "float64")
    generator = torch.Generator().manual_seed(3)
    input_ids = torch.randint(0, VOCAB, (1, length), generator=generator)
    decode_ids = torch.randint(0, VOCAB, (1, DECODE_STEPS), generator=generator)
    ours = run_native(model, input_ids, torch.ones_like(input_ids), decode_ids, "static")
    _record(
        "dense/float64/short-prompt", max_error(ours, run_hf(hf_model, input_ids, decode_ids)), TOLERANCE["float64"]
    )


def test_fused_and_per_expert_layouts_load_the_same_weights(models):
    per_expert, _ = models("moe", "float32")
    fused, _ = models("moe_fused", "float32")
    for a, b in zip(per_expert.state_dict().values(), fused.state_dict().values()):
        assert torch.equal(a, b)


def test_tied_embeddings_share_one_matrix(models):
    tied, _ = models("dense_tied", "float32")
    untied, _ = models("dense", "float32")
    assert tied.lm_head is None and tied.config.tie_word_embeddings
    assert untied.lm_head is not None and not untied.config.tie_word_embeddings
    # multimodal: the top-level tie_word_embeddings governs (text_config says false there)
    multimodal, _ = models("multimodal_tied", "float32")
    assert multimodal.lm_head is None


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_matrices_are_stored_in_out(models, checkpoint_dir, dtype):
    """Every matmul is ``x @ w`` with w (in, out): (in, out)-contiguous (the fast batch-1 decode
    layout) except in float64, which keeps HF's (out, in) memory to stay bitwise HF's, and the
    Gated DeltaNet b / a projections, which keep it in every dtype (the decay's rounding). The
    embedding is one (H, V) matrix, looked up by columns, that a tied head multiplies by."""
    model, _ = models("moe", dtype)
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

    tied, _ = models("dense_tied", dtype)
    assert [p.shape for p in tied.parameters()].count((hid, vocab)) == 1
    path = make_checkpoint(checkpoint_dir, "dense", tie_word_embeddings=True)
    rows = load_file(os.path.join(path, "model.safetensors"))["model.embed_tokens.weight"].to(model.dtype)
    ids = torch.tensor([[3, 0, 96, 3], [50, 7, 1, 2]])
    assert torch.equal(tied.embed_tokens.t(), rows)  # the head's matrix is the checkpoint's embedding
    embedded = tied._embed(ids)
    assert embedded.is_contiguous() and torch.equal(embedded, rows[ids])  # contiguous: norms sum as HF's


def test_cacheless_forward_and_logits_to_keep(models):
    model, hf_model = models("moe", "float32")
    input_ids = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        full = model(input_ids)["logits"]  # no cache, no mask: causal over the whole batch
        last = model(input_ids, logits_to_keep=3)["logits"]
        reference = hf_model(input_ids).logits
    assert last.shape == (2, 3, VOCAB)
    torch.testing.assert_close(last, full[:, -3:], rtol=0, atol=1e-6)
    _record("moe/float32/cacheless", (full - reference).abs().max().item(), TOLERANCE["float32"])


def test_chunked_prefill_continues_the_cached_state(models):
    """A second multi-token forward after a cached prefill (conv + delta-rule state carried)."""
    model, hf_model = models("dense", "float32")
    input_ids = torch.randint(0, VOCAB, (1, 80), generator=torch.Generator().manual_seed(5))
    cache = DynamicCache(TorchOps("cpu"), 1, 80)
    with torch.no_grad():
        first = model(input_ids[:, :50], past_key_values=cache)["logits"]
        cache.advance(50)
        second = model(input_ids[:, 50:], past_key_values=cache)["logits"]
        reference = hf_model(input_ids).logits
    error = (torch.cat([first, second], 1) - reference).abs().max().item()
    _record("dense/float32/chunked-prefill", error, TOLERANCE["float32"])


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_padded_batch_is_as_close_to_float32_as_hf(models, dtype):
    """Against HF float32 on each prompt alone, our half-precision padded batch is within twice
    HF's own half-precision error (and finite: padding rows must not overflow the mask)."""
    model, hf_model = models("moe", dtype)
    _, hf32 = models("moe", "float32")
    assert model.dtype == getattr(torch, dtype)
    assert all(p.dtype == model.dtype for p in model.parameters())
    generator = torch.Generator().manual_seed(6)
    prompts, input_ids, prompt_mask = _padded_batch([12, 5], generator)
    decode_ids = torch.randint(0, VOCAB, (2, 2), generator=generator)
    ours = run_native(model, input_ids, prompt_mask, decode_ids, "static")
    for row, prompt in enumerate(prompts):
        truth = run_hf(hf32, prompt[None], decode_ids[row : row + 1])
        theirs = run_hf(hf_model, prompt[None], decode_ids[row : row + 1])
        mine = [ours[0][row : row + 1, -len(prompt) :]] + [step[row : row + 1] for step in ours[1:]]
        assert all(bool(torch.isfinite(step).all()) for step in mine)
        error, hf_error = max_error(mine, truth), max_error(theirs, truth)
        MAX_ERRORS[f"moe/{dtype}/padded-vs-hf-float32 (hf {hf_error:.1e})"] = error
        assert error <= 2 * hf_error + 1e-3


def test_bfloat16_checkpoint_loads_as_float32(checkpoint_dir):
    path = make_checkpoint(checkpoint_dir, "dense", dtype="bfloat16")
    model, hf_model = load_model(path, dtype="float32"), load_hf(path, "float32")
    input_ids = torch.randint(0, VOCAB, (1, 10), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        error = (model(input_ids)["logits"] - hf_model(input_ids).logits).abs().max().item()
    _record("dense/bf16-checkpoint-as-float32", error, TOLERANCE["float32"])


# ------------------------------------------------------------------------ contract attributes


def test_model_attributes(models):
    model, _ = models("moe", "float32")
    assert model.supports_cache_object is True
    assert isinstance(model.config, Qwen3_5Config) and model.config.is_moe
    assert model.vocab_size == VOCAB
    assert model.generation_defaults == {"eos_token_id": [5, 7], "pad_token_id": 0}
    assert not any(p.requires_grad for p in model.parameters())
    import inspect

    assert list(inspect.signature(model.forward).parameters) == [
        "input_ids",
        "position_ids",
        "attention_mask",
        "past_key_values",
        "logits_to_keep",
    ]


def test_linear_attention_state_layout(models):
    model, _ = models("dense", "float32")
    cache = StaticCache(TorchOps("cpu"), 2, 8)
    with torch.no_grad():
        model(torch.ones(2, 5, dtype=torch.long), past_key_values=cache)
    config = model.config
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
    assert cache.recurrent_states[0].dtype == torch.float32
    assert cache.keys[1].shape == (2, config.num_key_value_heads, 8, config.head_dim)


def test_loading_imports_no_framework():
    code = "import sys, hyper_gen.models.loading; assert 'torch' not in sys.modules and 'mindspore' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


# ------------------------------------------------------------------------------ load errors


def _copy(path, tmp_path, name):
    target = os.path.join(tmp_path, name)
    shutil.copytree(path, target)
    return target


def _edit_config(path, **changes):
    file = os.path.join(path, "config.json")
    with open(file) as f:
        config = json.load(f)
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    with open(file, "w") as f:
        json.dump(config, f)


def _edit_tensors(path, edit):
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def dense_path(checkpoint_dir):
    return make_checkpoint(checkpoint_dir, "dense")


def test_unknown_backend(dense_path):
    with pytest.raises(ValueError, match="backend must be one of .*'jax'"):
        load_model(dense_path, backend="jax")


def test_bad_dtype(dense_path):
    with pytest.raises(ValueError, match="dtype must be one of .*'int8'"):
        load_model(dense_path, dtype="int8")
    with pytest.raises(TypeError, match="dtype must be a str"):
        load_model(dense_path, dtype=torch.float32)


def test_missing_path_and_files(tmp_path):
    with pytest.raises(ValueError, match="is not a directory"):
        load_model(os.path.join(tmp_path, "nowhere"))
    with pytest.raises(ValueError, match="no config.json"):
        load_model(tmp_path)
    with open(os.path.join(tmp_path, "config.json"), "w") as f:
        json.dump({"architectures": ["Qwen3_5ForCausalLM"]}, f)
    with pytest.raises(ValueError, match="neither model.safetensors"):
        load_model(tmp_path)


def test_unknown_architecture_lists_supported(dense_path, tmp_path):
    path = _copy(dense_path, tmp_path, "llama")
    _edit_config(path, architectures=["LlamaForCausalLM"])
    with pytest.raises(ValueError, match="'LlamaForCausalLM'.*supported: " + ", ".join(ARCHITECTURES)):
        load_model(path)


def test_missing_config_field_is_named(dense_path, tmp_path):
    path = _copy(dense_path, tmp_path, "no-vocab")
    _edit_config(path, vocab_size=None)
    with pytest.raises(ValueError, match="missing field 'vocab_size'"):
        load_model(path)


def test_missing_tensor_is_named(dense_path, tmp_path):
    path = _copy(dense_path, tmp_path, "missing")
    _edit_tensors(path, lambda t: t.pop("model.layers.2.linear_attn.in_proj_z.weight"))
    with pytest.raises(ValueError, match="missing tensor 'model.layers.2.linear_attn.in_proj_z.weight'"):
        load_model(path)


def test_misshaped_tensor_is_named(dense_path, tmp_path):
    path = _copy(dense_path, tmp_path, "misshaped")
    name = "model.layers.1.self_attn.q_proj.weight"
    _edit_tensors(path, lambda t: t.update({name: t[name][:-1].clone()}))
    with pytest.raises(ValueError, match=rf"'{name}' has shape \(127, 32\), expected \(128, 32\)"):
        load_model(path)


def test_bad_torch_device(dense_path):
    with pytest.raises(ValueError, match="'nonsense' is not a torch device"):
        load_model(dense_path, device="nonsense")


def test_bfloat16_rejected_on_mindspore_cpu(dense_path):
    pytest.importorskip("mindspore")
    with pytest.raises(ValueError, match="'bfloat16' is not supported by MindSpore on CPU"):
        load_model(dense_path, backend="mindspore", dtype="bfloat16")
