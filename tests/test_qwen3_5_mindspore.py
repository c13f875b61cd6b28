"""MindSpore-only facts of the native Qwen3.5 port; its HF parity, cache contents, checkpoint
variants and load errors are checked with the torch port's in tests/test_model_conformance.py.

Here: the LM head stored in blocks of vocabulary columns (and the parity of such a model against
HF computing in float64, :class:`model_harness.HFReference` with ``exact=True``), the block width
rule, the dtypes this CPU cannot compute, and the bfloat16 rounding of weights HF upcasts.

MindSpore is imported unconditionally: without it these tests fail, never skip.
"""

import functools

import mindspore  # noqa: F401  (imported first: these tests fail, never skip, without MindSpore)
import numpy as np
import pytest
import torch
from error_log import ErrorLog
from model_harness import HFReference, Tokens, max_error, padded_batch, port, row_of, run_native
from qwen_checkpoints import TINY_TEXT_CONFIG, VARIANTS, make_checkpoint

from hyper_gen.backends.mindspore import configure
from hyper_gen.backends.mindspore.layers import MLP
from hyper_gen.backends.mindspore.models import qwen3_5 as native
from hyper_gen.backends.mindspore.weights import matmul_seconds
from hyper_gen.matmul_widths import block_width
from hyper_gen.models.arrays import round_to
from hyper_gen.models.checkpoint import Checkpoint
from hyper_gen.models.loading import load_model
from hyper_gen.token_packing import TokenPacking

configure("CPU")

TOLERANCE = {"float32": 1e-4, "float64": 1e-9}
VOCAB = TINY_TEXT_CONFIG["vocab_size"]
DECODE_STEPS = 3
ERRORS = ErrorLog()


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


report_errors = ERRORS.fixture()
_record = ERRORS.record


@pytest.mark.parametrize("variant", ["dense", "dense_tied"])
def test_lm_head_in_column_blocks(path, monkeypatch, variant):
    """The LM head is stored in blocks of vocabulary columns (one block at this vocabulary); with
    blocks of 20 the logits are concatenated and a tied embedding gathers each row's ids from the
    blocks holding them (several blocks in one prefill or decode step)."""
    monkeypatch.setattr("hyper_gen.matmul_widths.block_width", lambda columns, most: 20)
    model = native.load(Checkpoint(path(variant)), "float64")
    assert [tuple(p.shape) for p in model.lm_head] == [(TINY_TEXT_CONFIG["hidden_size"], 20)] * 4 + [
        (TINY_TEXT_CONFIG["hidden_size"], VOCAB - 80)
    ]
    tokens = Tokens(8, "numpy")
    prompts, input_ids, prompt_mask = padded_batch(tokens, [9, 6, 4])
    decode_ids = tokens.rows(3, DECODE_STEPS)
    ours = run_native(port("mindspore"), model, input_ids, prompt_mask, decode_ids, "static")
    reference = HFReference(path(variant), "float64", exact=True)
    for row, prompt in enumerate(prompts):
        error = max_error(row_of(ours, row, len(prompt)), reference.run(prompt[None], decode_ids[row : row + 1]))
        _record(f"{variant}/float64/lm-head-blocks", error, TOLERANCE["float64"])


def test_lm_head_block_width():
    """Even shares of the vocabulary, 64 times an odd number of columns (no power-of-two row stride)."""
    assert block_width(248320, 65536) == 62144  # Qwen3.5: 3 x 62144 + 61888
    assert block_width(262144, 65536) == 65600  # not 65536 (half the bandwidth)
    assert block_width(97, 65536) == 192  # >= 97: one block
    assert block_width(151936, 65536) == 50752


def test_bad_dtypes_are_rejected(path):
    with pytest.raises(ValueError, match="bfloat16.*CPU"):
        native.load(Checkpoint(path("dense")), "bfloat16")
    with pytest.raises(ValueError, match="dtype must be one of"):
        native.load(Checkpoint(path("dense")), "int8")


def test_load_model_rejects_bfloat16_on_cpu(path):
    with pytest.raises(ValueError, match="'bfloat16' is not supported by MindSpore on CPU"):
        load_model(path("dense"), backend="mindspore", dtype="bfloat16")


def test_bfloat16_rounding_matches_torch():
    """Weights HF upcasts are first rounded to the model dtype; bf16 (Ascend) has no numpy type."""
    values = np.random.default_rng(8).standard_normal(1000).astype(np.float32) * 100
    values[:4] = [1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 0.0]  # ties round to even
    expected = torch.from_numpy(values).to(torch.bfloat16).float().numpy()
    np.testing.assert_array_equal(round_to(values, "bfloat16"), expected)


@pytest.mark.parametrize("variant", ["dense", "moe"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_left_padded_prefill_packs_the_real_tokens(path, monkeypatch, variant, dtype):
    """The row-wise work of a left-padded prefill runs on the real tokens only (TokenPacking): same
    greedy tokens and the same logits at every step as the padded layout (float64 to 1e-12), with
    a row of 130 positions of padding; decode steps (no padding) do not pack."""
    from hyper_gen.config import GenerationConfig
    from hyper_gen.generation import generate

    model = load_model(path(variant), backend="mindspore", dtype=dtype)
    rng = np.random.default_rng(0)
    lengths = np.array([133, 3, 70, 129])
    mask = (np.arange(133)[None, :] >= 133 - lengths[:, None]).astype(np.int64)
    ids = rng.integers(3, VOCAB, (4, 133)) * mask
    config = GenerationConfig(max_new_tokens=5, return_dict_in_generate=True, output_logits=True)
    packed_rows = []
    real_of = TokenPacking.of

    def spy(ops, prompt_mask):
        packing = real_of(ops, prompt_mask)
        packed_rows.append(None if packing is None else packing.count)
        return packing

    monkeypatch.setattr(TokenPacking, "of", staticmethod(spy))
    packed = generate(model, ids, config, attention_mask=mask)
    assert packed_rows[0] == int(mask.sum()) and all(n is None for n in packed_rows[1:])
    monkeypatch.setattr(TokenPacking, "of", staticmethod(lambda ops, prompt_mask: None))
    padded = generate(model, ids, config, attention_mask=mask)
    assert np.array_equal(np.asarray(packed.sequences), np.asarray(padded.sequences))
    tolerance = 1e-12 if dtype == "float64" else 1e-5
    for a, b in zip(packed.logits, padded.logits):
        assert np.abs(np.asarray(a) - np.asarray(b)).max() <= tolerance


def test_a_head_streamed_from_memory_is_read_in_narrow_blocks_on_cpu():
    """The LM head is cut into blocks of up to 65536 columns, and of ~8K on CPU once it is larger
    than the last-level cache (a 1 GB head read faster so; docs/performance.md)."""
    from hyper_gen import host, matmul_widths

    cache = host.last_level_cache_bytes()
    assert cache >= 1 << 20
    assert matmul_widths.streamed_columns(2 * cache, cache) == matmul_widths.STREAMED_HEAD_COLUMNS == 8192
    assert matmul_widths.streamed_columns(cache // 2, cache) == matmul_widths.HEAD_COLUMNS
    assert block_width(248320, 8192) == 8128  # 31 blocks: 64 x an odd number of columns each


def test_faster_keeps_the_faster_of_two_widths():
    """A fused projection is stored at its width or at the padded candidate (64 times an odd
    number, wider), whichever a timed MatMul finds at least 20% faster."""
    from hyper_gen import matmul_widths

    assert [matmul_widths.candidate(w) for w in (3072, 2064, 5120, 7168, 1280, 3136)] == [
        3136,
        2112,
        5184,
        7232,
        1344,
        3264,
    ]
    calls = []

    def timer(seconds):
        def timed(rows, inner, width, dtype):
            calls.append((rows, inner, width))
            return seconds[width]

        return timed

    assert matmul_widths.faster(512, 3072, "f32", timer({3072: 1.0, 3136: 0.5})) == 3136
    assert matmul_widths.faster(512, 2064, "f32", timer({2064: 1.0, 2112: 0.9})) == 2064  # within the margin
    assert calls == [(128, 512, 3136), (128, 512, 3072), (128, 512, 2112), (128, 512, 2064)]
    # the real timer runs MindSpore's MatMul
    assert 0 < matmul_seconds(8, 16, 64, mindspore.float32) < 1


@pytest.mark.parametrize("variant, dtype", [("dense", "float64"), ("moe", "float32")])
def test_padded_projection_widths_change_no_result(path, monkeypatch, tmp_path, variant, dtype):
    """Every fused projection stored at its padded width (the attention q|k|v|gate, the Gated
    DeltaNet in_proj, the dense MLP's up|gate with zero rows in down) gives the tokens and logits of
    the checkpoint's widths, in PyNative prefill and the compiled decode steps, static and dynamic
    caches, a left-padded batch."""
    from hyper_gen import matmul_widths
    from hyper_gen.config import GenerationConfig
    from hyper_gen.generation import generate

    rng = np.random.default_rng(1)
    lengths = np.array([9, 3, 6])
    mask = (np.arange(9)[None, :] >= 9 - lengths[:, None]).astype(np.int64)
    ids = rng.integers(3, VOCAB, (3, 9)) * mask

    def run(model):
        return [
            generate(model, ids, config, attention_mask=mask)
            for config in (
                GenerationConfig(
                    max_new_tokens=4, return_dict_in_generate=True, output_logits=True, cache_implementation=cache
                )
                for cache in ("static", "dynamic")
            )
        ]

    plain = load_model(path(variant), backend="mindspore", dtype=dtype, kernels="plain")
    monkeypatch.setenv("HYPER_GEN_CACHE_DIR", str(tmp_path))  # a host plan of its own, timed as below
    monkeypatch.setattr(matmul_widths, "faster", lambda inner, width, dtype, timer: matmul_widths.candidate(width))
    padded = load_model(path(variant), backend="mindspore", dtype=dtype, kernels="auto")
    for a, b in zip(plain.layers, padded.layers):
        weights = ("qkv_t",) if a.is_attention else ("in_proj_t",)
        for name in weights:
            assert getattr(b.mixer, name).shape[1] == matmul_widths.candidate(getattr(a.mixer, name).shape[1])
        if isinstance(a.mlp, MLP):
            assert b.mlp.up_gate_t.shape[1] == matmul_widths.candidate(a.mlp.up_gate_t.shape[1])
    tolerance = 1e-12 if dtype == "float64" else 1e-5
    for ours, theirs in zip(run(padded), run(plain)):
        assert np.array_equal(np.asarray(ours.sequences), np.asarray(theirs.sequences))
        for a, b in zip(ours.logits, theirs.logits):
            assert np.abs(np.asarray(a) - np.asarray(b)).max() <= tolerance
