"""Model conformance: each native Qwen3.5 port (torch, MindSpore) against HF transformers on tiny
random checkpoints, and the same clear checkpoint errors from ``load_model`` on both backends.

Every test runs once per backend: the ``backend`` parameter, "torch" / "mindspore" (it stands in
for conftest's stub-harness fixture of that name here). The model is loaded through ``load_model``
and driven through the cache-object contract by tests/model_harness.py (prefill then
teacher-forced decode; HF's own cached run is the reference). Both backends share the tolerances of
:data:`TOLERANCE`; where they differ (what their float64 computes, whether their float32 / half
precision rounds as HF's, which dtypes their CPU computes, how exactly ``logits_to_keep`` slices,
the device error), the difference is an entry of :data:`BACKEND_FACTS`. float64 is the same on both:
everything computes in float64 (the recurrent state too), against HF computing in float64
(``HFReference(..., exact=True)``), exact on any chunking. Backend-specific facts
(torch's (in, out) weight layout, MindSpore's LM-head blocks and bfloat16 rounding) stay in
tests/test_qwen3_5_torch.py and tests/test_qwen3_5_mindspore.py.
"""

import functools
import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
from error_log import ErrorLog
from model_harness import (
    BACKENDS,
    FORWARD_PARAMETERS,
    HFReference,
    Tokens,
    max_error,
    padded_batch,
    port,
    row_of,
    run_native,
    signature,
)
from qwen_checkpoints import TINY_TEXT_CONFIG, VARIANTS, make_checkpoint
from safetensors.torch import load_file, save_file

from hyper_gen.cache import DynamicCache, StaticCache
from hyper_gen.models.loading import load_model
from hyper_gen.models.qwen3_5 import ARCHITECTURES, Qwen3_5Config

# max abs logit error against HF, both backends
TOLERANCE = {"float32": 1e-4, "float64": 1e-9}
# what differs between the backends, in one table
BACKEND_FACTS = {
    "torch": dict(
        # float32 and half precision round as HF's do: HF's tolerances hold on any token draw
        rounds_like_hf=True,
        draws={"padded": ("torch", 2), "half": ("torch", 6)},  # (source, seed) of Tokens
        half_dtypes=("float16", "bfloat16"),
        half_slack=1e-3,  # half-precision error <= 2 x HF's own half-precision error + this
        keep_atol=1e-6,  # logits_to_keep rows against the full forward's last rows
        bad_device="'nonsense' is not a torch device",
    ),
    "mindspore": dict(
        # float32 and float16 do not round as HF's do. float32 differs from HF float32 by about HF's
        # own float32 error (MindSpore is often the nearer to the float64 truth): 1.1e-4 / 1.8e-4
        # (dense / moe) on the torch suite's 70-token draws, 3e-5 / 5e-5 on the MindSpore suite's.
        # float16 can route a token to the other of two near-tied experts (0.2031 / 0.2027 in
        # float32, equal in its float16 router, on the torch suite's half-precision draws: error 1.5
        # where HF's float16 has 0.02). So the padded-rows and half-precision checks use the draws the
        # MindSpore suite was always checked on, and chunked prefill (against one 80-token HF
        # prefill) runs in float64 only.
        rounds_like_hf=False,
        draws={"padded": ("numpy", 1), "half": ("numpy", 6)},
        half_dtypes=("float16",),  # bfloat16 cannot compute on CPU (test_qwen3_5_mindspore.py)
        half_slack=1e-2,
        keep_atol=0.0,  # logits_to_keep slices the hidden state: bitwise the full forward's rows
        bad_device="device 'nonsense' is not the selected MindSpore device target",
    ),
}
VOCAB = TINY_TEXT_CONFIG["vocab_size"]
DECODE_STEPS = 4
PADDED_LENGTHS = [70, 3]  # a 70-token prompt (two 64-chunks) and a 3-token one
ERRORS = ErrorLog()
_record = ERRORS.record
report_errors = ERRORS.fixture()

backends = pytest.mark.parametrize("backend", BACKENDS)


def _cases(*axes, where=lambda backend, *values: True):
    """(backend, *values) for every backend and every combination of ``axes`` that ``where`` keeps."""
    cases = [(backend,) for backend in BACKENDS]
    for axis in axes:
        cases = [case + (value,) for case in cases for value in axis]
    return [case for case in cases if where(*case)]


def _draws(backend, check):
    source, seed = BACKEND_FACTS[backend]["draws"][check]
    return Tokens(seed, source)


def _holds_on_other_chunk_boundaries(backend, dtype):
    """Whether ``dtype`` holds its tolerance on any draw against HF run with other chunk boundaries."""
    return dtype == "float64" or BACKEND_FACTS[backend]["rounds_like_hf"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("qwen3_5_conformance")


@pytest.fixture(scope="module")
def checkpoint(checkpoint_dir):
    @functools.lru_cache(maxsize=None)
    def get(variant):
        kind, kwargs = VARIANTS[variant]
        return make_checkpoint(checkpoint_dir, kind, **kwargs)

    return get


@pytest.fixture(scope="module")
def models(checkpoint):
    """(backend, variant, dtype) -> (native model from load_model, its HF reference), each built once."""

    @functools.lru_cache(maxsize=None)
    def reference(variant, dtype, exact):
        return HFReference(checkpoint(variant), dtype, exact=exact)

    @functools.lru_cache(maxsize=None)
    def get(backend, variant, dtype):
        model = load_model(checkpoint(variant), backend=backend, dtype=dtype)
        return model, reference(variant, dtype, dtype == "float64")

    return get


# -------------------------------------------------------------------------------- parity tests


@pytest.mark.parametrize("cache_kind", ["static", "dynamic"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("variant", list(VARIANTS))
@backends
def test_prefill_and_decode_match_hf(models, backend, variant, dtype, cache_kind):
    """Dense, tied, MoE per-expert and fused, multimodal (language model only): an unpadded batch."""
    model, hf_model = models(backend, variant, dtype)
    tokens = Tokens(1)
    input_ids, decode_ids = tokens((2, 9)), tokens((2, DECODE_STEPS))
    ours = run_native(port(backend), model, input_ids, np.ones_like(input_ids), decode_ids, cache_kind)
    assert ours[0].shape == (2, 9, VOCAB) and ours[1].shape == (2, 1, VOCAB)
    error = max_error(ours, hf_model.run(input_ids, decode_ids))
    _record(f"{backend}/{variant}/{dtype}/unpadded", error, TOLERANCE[dtype])


@pytest.mark.parametrize(
    "backend,variant,dtype,cache_kind",
    _cases(["dense", "moe"], ["float32", "float64"], ["static", "dynamic"]),
)
def test_left_padded_rows_match_hf_on_each_prompt_alone(models, backend, variant, dtype, cache_kind):
    """A long and a short prompt left-padded into one batch; each row's real positions against
    HF run on that prompt alone (other chunk boundaries than the batch's)."""
    model, hf_model = models(backend, variant, dtype)
    tokens = _draws(backend, "padded")
    prompts, input_ids, prompt_mask = padded_batch(tokens, PADDED_LENGTHS)
    decode_ids = tokens.rows(2, DECODE_STEPS)
    ours = run_native(port(backend), model, input_ids, prompt_mask, decode_ids, cache_kind)
    for row, prompt in enumerate(prompts):
        reference = hf_model.run(prompt[None], decode_ids[row : row + 1])
        error = max_error(row_of(ours, row, len(prompt)), reference)
        _record(f"{backend}/{variant}/{dtype}/padded-row-vs-alone", error, TOLERANCE[dtype])


@pytest.mark.parametrize("cache_kind", ["static", "dynamic"])
@pytest.mark.parametrize("variant", ["dense", "moe"])
@backends
def test_left_padded_batch_matches_hf_padded_batch_float64(models, backend, variant, cache_kind):
    """float64: the same padded batch against HF fed the same padded batch (its padding and masks)."""
    model, hf_model = models(backend, variant, "float64")
    tokens = Tokens(2)
    _, input_ids, prompt_mask = padded_batch(tokens, PADDED_LENGTHS)
    decode_ids = tokens((2, DECODE_STEPS))
    ours = run_native(port(backend), model, input_ids, prompt_mask, decode_ids, cache_kind)
    reference = hf_model.run(input_ids, decode_ids, prompt_mask=prompt_mask)
    real = prompt_mask.astype(bool)[..., None]
    ours[0], reference[0] = ours[0] * real, reference[0] * real  # padding rows are not compared
    _record(f"{backend}/{variant}/float64/padded-batch", max_error(ours, reference), TOLERANCE["float64"])


@pytest.mark.parametrize("length", [1, 2])
@backends
def test_prompts_shorter_than_the_conv_kernel(models, backend, length):
    model, hf_model = models(backend, "dense", "float64")
    tokens = Tokens(3)
    input_ids, decode_ids = tokens((1, length)), tokens((1, DECODE_STEPS))
    ours = run_native(port(backend), model, input_ids, np.ones_like(input_ids), decode_ids, "static")
    error = max_error(ours, hf_model.run(input_ids, decode_ids))
    _record(f"{backend}/dense/float64/short-prompt", error, TOLERANCE["float64"])


@pytest.mark.parametrize("backend,dtype", _cases(["float32", "float64"]))
def test_cacheless_forward_and_logits_to_keep(models, backend, dtype):
    model, hf_model = models(backend, "moe", dtype)
    harness = port(backend)
    input_ids = Tokens(4)((2, 11))
    full = harness.numpy(harness.forward(model, input_ids))  # no cache, no mask: causal over the whole batch
    last = harness.numpy(harness.forward(model, input_ids, logits_to_keep=3))
    assert last.shape == (2, 3, VOCAB)
    np.testing.assert_allclose(last, full[:, -3:], rtol=0, atol=BACKEND_FACTS[backend]["keep_atol"])
    _record(f"{backend}/moe/{dtype}/cacheless", max_error([full], [hf_model.logits(input_ids)]), TOLERANCE[dtype])


@pytest.mark.parametrize("backend,dtype", _cases(["float32", "float64"], where=_holds_on_other_chunk_boundaries))
def test_chunked_prefill_continues_the_cached_state(models, backend, dtype):
    """A second multi-token forward after a cached prefill (conv + delta-rule state carried),
    against HF's one prefill of all 80 tokens (other chunk boundaries)."""
    model, hf_model = models(backend, "dense", dtype)
    harness = port(backend)
    input_ids = Tokens(5)((1, 80))
    cache = DynamicCache(harness.ops(), 1, 80)
    first = harness.numpy(harness.forward(model, input_ids[:, :50], past_key_values=cache))
    cache.advance(50)
    second = harness.numpy(harness.forward(model, input_ids[:, 50:], past_key_values=cache))
    error = max_error([np.concatenate([first, second], 1)], [hf_model.logits(input_ids)])
    _record(f"{backend}/dense/{dtype}/chunked-prefill", error, TOLERANCE[dtype])


@pytest.mark.parametrize("backend,dtype", [(b, d) for b in BACKENDS for d in BACKEND_FACTS[b]["half_dtypes"]])
def test_half_precision_padded_batch_is_as_close_to_float32_as_hf(models, backend, dtype):
    """Against HF float32 on each prompt alone, our half-precision padded batch is within twice
    HF's own half-precision error (and finite: padding rows must not overflow the mask)."""
    model, hf_model = models(backend, "moe", dtype)
    _, hf32 = models(backend, "moe", "float32")
    harness = port(backend)
    assert harness.dtype_name(model.dtype) == dtype
    assert all(harness.dtype_name(p.dtype) == dtype for _, p in harness.named_parameters(model))
    tokens = _draws(backend, "half")
    prompts, input_ids, prompt_mask = padded_batch(tokens, [12, 5])
    decode_ids = tokens.rows(2, 2)
    ours = run_native(harness, model, input_ids, prompt_mask, decode_ids, "static")
    assert ours.dtypes == {dtype}  # logits in the model dtype
    for row, prompt in enumerate(prompts):
        truth = hf32.run(prompt[None], decode_ids[row : row + 1])
        theirs = hf_model.run(prompt[None], decode_ids[row : row + 1])
        mine = row_of(ours, row, len(prompt))
        assert all(bool(np.isfinite(step).all()) for step in mine)
        hf_error = max_error(theirs, truth)
        tolerance = 2 * hf_error + BACKEND_FACTS[backend]["half_slack"]
        _record(f"{backend}/moe/{dtype}/padded-vs-hf-float32 (hf {hf_error:.1e})", max_error(mine, truth), tolerance)


@backends
def test_bfloat16_checkpoint_loads_as_float32(checkpoint_dir, backend):
    """A bfloat16 checkpoint loaded as float32: a cacheless forward and a cached prefill + decode."""
    path = make_checkpoint(checkpoint_dir, "dense", dtype="bfloat16")
    model, hf_model = load_model(path, backend=backend, dtype="float32"), HFReference(path, "float32")
    harness = port(backend)
    tokens = Tokens(8)
    input_ids, decode_ids = tokens((1, 10)), tokens((1, DECODE_STEPS))
    error = max_error([harness.numpy(harness.forward(model, input_ids))], [hf_model.logits(input_ids)])
    _record(f"{backend}/dense/bf16-checkpoint-as-float32/cacheless", error, TOLERANCE["float32"])
    ours = run_native(harness, model, input_ids, np.ones_like(input_ids), decode_ids, "static")
    error = max_error(ours, hf_model.run(input_ids, decode_ids))
    _record(f"{backend}/dense/bf16-checkpoint-as-float32", error, TOLERANCE["float32"])


# -------------------------------------------------------------------- checkpoint variants


@backends
def test_fused_and_per_expert_layouts_load_the_same_weights(models, backend):
    harness = port(backend)
    per_expert, _ = models(backend, "moe", "float32")
    fused, _ = models(backend, "moe_fused", "float32")
    per_expert, fused = harness.state(per_expert), harness.state(fused)
    assert [name for name, _ in per_expert] == [name for name, _ in fused]
    for (_, a), (_, b) in zip(per_expert, fused):
        np.testing.assert_array_equal(harness.numpy(a), harness.numpy(b))


@backends
def test_tie_word_embeddings_follows_the_top_level_flag(models, backend):
    assert models(backend, "dense_tied", "float32")[0].config.tie_word_embeddings
    assert not models(backend, "dense", "float32")[0].config.tie_word_embeddings
    # multimodal: the top-level tie_word_embeddings governs (text_config says false there)
    assert models(backend, "multimodal_tied", "float32")[0].config.tie_word_embeddings


# ------------------------------------------------------------------------ contract attributes


@pytest.mark.parametrize("backend,dtype", _cases(["float32", "float16"]))
def test_model_attributes(models, backend, dtype):
    harness = port(backend)
    model, _ = models(backend, "moe", dtype)
    assert isinstance(model, harness.native.Qwen3_5ForCausalLM) and isinstance(model, harness.module_class)
    assert model.supports_cache_object is True
    assert isinstance(model.config, Qwen3_5Config) and model.config.is_moe
    assert model.vocab_size == VOCAB
    assert model.generation_defaults == {"eos_token_id": [5, 7], "pad_token_id": 0}
    assert harness.dtype_name(model.dtype) == dtype and harness.ops().param_dtype(model) == dtype
    parameters = harness.named_parameters(model)
    assert parameters and all(harness.dtype_name(p.dtype) == dtype for _, p in parameters)
    assert not any(harness.requires_grad(p) for _, p in parameters)
    assert signature(harness.entry(model)) == FORWARD_PARAMETERS


@pytest.mark.parametrize("backend,dtype", _cases(["float32", "float64"]))
def test_linear_attention_state_layout(models, backend, dtype):
    harness = port(backend)
    model, _ = models(backend, "dense", dtype)
    config = model.config
    cache = StaticCache(harness.ops(), 2, 8)
    harness.forward(model, np.ones((2, 5), np.int64), past_key_values=cache)
    conv_dim = (
        2 * config.linear_num_key_heads * config.linear_key_head_dim
        + config.linear_num_value_heads * config.linear_value_head_dim
    )
    assert sorted(cache.recurrent_states) == [0, 2] and sorted(cache.keys) == [1, 3]
    assert tuple(cache.conv_states[0].shape) == (2, conv_dim, config.linear_conv_kernel_dim - 1)
    assert tuple(cache.recurrent_states[0].shape) == (
        2,
        config.linear_num_value_heads,
        config.linear_key_head_dim,
        config.linear_value_head_dim,
    )
    assert harness.dtype_name(cache.recurrent_states[0].dtype) == ("float64" if dtype == "float64" else "float32")
    assert tuple(cache.keys[1].shape) == (2, config.num_key_value_heads, 8, config.head_dim)


# ------------------------------------------------------------------------------ load errors


def test_loading_imports_no_framework():
    code = "import sys, hyper_gen.models.loading; assert 'torch' not in sys.modules and 'mindspore' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


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
def dense_path(checkpoint):
    return checkpoint("dense")


def test_unknown_backend(dense_path):
    with pytest.raises(ValueError, match="backend must be one of .*'jax'"):
        load_model(dense_path, backend="jax")


@backends
def test_bad_dtype(dense_path, backend):
    with pytest.raises(ValueError, match="dtype must be one of .*'int8'"):
        load_model(dense_path, backend=backend, dtype="int8")
    with pytest.raises(TypeError, match="dtype must be a str"):
        load_model(dense_path, backend=backend, dtype=port(backend).dtype("float32"))


@backends
def test_bad_device(dense_path, backend):
    with pytest.raises(ValueError, match=BACKEND_FACTS[backend]["bad_device"]):
        load_model(dense_path, backend=backend, device="nonsense")


@backends
def test_missing_path_and_files(tmp_path, backend):
    with pytest.raises(ValueError, match="does not exist"):
        load_model(os.path.join(tmp_path, "nowhere"), backend=backend)
    with pytest.raises(ValueError, match="no config.json"):
        load_model(tmp_path, backend=backend)
    with open(os.path.join(tmp_path, "config.json"), "w") as f:
        json.dump({"architectures": ["Qwen3_5ForCausalLM"]}, f)
    with pytest.raises(ValueError, match="neither model.safetensors"):
        load_model(tmp_path, backend=backend)


@backends
def test_unknown_architecture_lists_supported(dense_path, tmp_path, backend):
    path = _copy(dense_path, tmp_path, "llama")
    _edit_config(path, architectures=["LlamaForCausalLM"])
    with pytest.raises(ValueError, match="'LlamaForCausalLM'.*supported: " + ", ".join(ARCHITECTURES)):
        load_model(path, backend=backend)


@backends
def test_missing_config_field_is_named(dense_path, tmp_path, backend):
    path = _copy(dense_path, tmp_path, "no-vocab")
    _edit_config(path, vocab_size=None)
    with pytest.raises(ValueError, match="missing field 'vocab_size'"):
        load_model(path, backend=backend)


# (variant, stored name, name in the message: multimodal text weights are reported as "model.")
MISSING_TENSORS = [
    ("dense", "model.layers.2.linear_attn.in_proj_z.weight", None),
    ("dense", "lm_head.weight", None),
    ("moe", "model.layers.0.mlp.experts.3.up_proj.weight", None),
    ("moe_fused", "model.layers.0.mlp.experts.down_proj", None),
    (
        "multimodal_moe",
        "model.language_model.layers.3.self_attn.o_proj.weight",
        "model.layers.3.self_attn.o_proj.weight",
    ),
]
# (variant, name, the axis cut one short, shape found, shape expected)
MISSHAPED_TENSORS = [
    ("dense", "model.layers.1.self_attn.q_proj.weight", 0, (127, 32), (128, 32)),
    ("moe", "model.layers.0.mlp.experts.3.down_proj.weight", 0, (31, 24), (32, 24)),
    ("moe_fused", "model.layers.0.mlp.experts.gate_up_proj", 1, (6, 47, 32), (6, 48, 32)),
    ("moe", "model.layers.1.mlp.gate.weight", 0, (5, 32), (6, 32)),
]


def _exactly(message):
    return "^" + re.escape(message) + "$"


@pytest.mark.parametrize("variant,stored,reported", MISSING_TENSORS, ids=[f"{v}-{n}" for v, n, _ in MISSING_TENSORS])
@backends
def test_missing_tensor_is_named(checkpoint, tmp_path, backend, variant, stored, reported):
    path = _copy(checkpoint(variant), tmp_path, "missing")
    _edit_tensors(path, lambda t: t.pop(stored))
    with pytest.raises(ValueError, match=_exactly(f"checkpoint {path!r} is missing tensor {reported or stored!r}")):
        load_model(path, backend=backend)


@pytest.mark.parametrize(
    "variant,name,axis,found,expected", MISSHAPED_TENSORS, ids=[f"{case[0]}-{case[1]}" for case in MISSHAPED_TENSORS]
)
@backends
def test_misshaped_tensor_is_named(checkpoint, tmp_path, backend, variant, name, axis, found, expected):
    path = _copy(checkpoint(variant), tmp_path, "misshaped")
    _edit_tensors(path, lambda t: t.update({name: t[name].narrow(axis, 0, t[name].shape[axis] - 1).clone()}))
    message = f"checkpoint {path!r}: tensor {name!r} has shape {found}, expected {expected}"
    with pytest.raises(ValueError, match=_exactly(message)):
        load_model(path, backend=backend)
