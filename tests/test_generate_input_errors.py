"""Bad input to generate() is a ValueError / TypeError naming the field and the value, raised before any
forward where the information is there, identically on torch and MindSpore (stub models and the demo model)."""

import re
import tracemalloc

import numpy as np
import pytest

from hyper_gen import GenerationConfig, StaticCache, demo, generate, load_model
from hyper_gen.noise import uniform_noise
from hyper_gen.registry import backend_for

STUB_VOCAB = 64  # tests/stub_weights.py
STUB_POSITIONS = 128
IDS = [[0, 0, 5, 6, 7], [8, 9, 10, 11, 12]]
MASK = [[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]
_DEMO = {}


def greedy(**kw):
    kw.setdefault("eos_token_id", None)
    kw.setdefault("max_new_tokens", 4)
    return GenerationConfig(**kw)


def declared_stub(backend, **kw):
    """A stub that declares its vocabulary (and optionally its context), as native and HF models do."""
    model = backend.stub()
    model.vocab_size = STUB_VOCAB
    for name, value in kw.items():
        setattr(model, name, value)
    return model


def declared_context(model):
    """What the model declares as its context (``max_position_embeddings``), as generate() reads it."""
    value = getattr(model, "max_position_embeddings", None)
    return value if value is not None else getattr(getattr(model, "config", None), "max_position_embeddings", None)


def first_tokens(backend):
    """Each row's first greedy token with the stub (IDS / MASK)."""
    out = backend.numpy(generate(backend.stub(), IDS, greedy(max_new_tokens=1), attention_mask=MASK))
    return [int(out[row, sum(MASK[row])]) for row in range(len(IDS))]


def demo_model(backend):
    if backend.name not in _DEMO:
        _DEMO[backend.name] = load_model(demo.demo_model_path(), backend=backend.name)
    return _DEMO[backend.name]


def count_forwards(backend, model):
    """Wrap the model's forward (instance attribute) to count calls; returns the list of calls."""
    calls = []
    name = "forward" if backend.name == "torch" else "construct"
    original = getattr(type(model), name)

    def counting(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    setattr(model, name, counting.__get__(model))
    return calls


def uncount(backend, model):
    model.__dict__.pop("forward" if backend.name == "torch" else "construct", None)


# ---- 1. pad / EOS ids outside the vocabulary ----------------------------------------------
@pytest.mark.parametrize("declared", [True, False])
def test_pad_token_id_outside_vocab(backend, declared):
    model = declared_stub(backend) if declared else backend.stub()
    first = first_tokens(backend)
    steps = []
    cfg = greedy(pad_token_id=STUB_VOCAB, eos_token_id=int(first[0]))  # row 0 finishes at once, then is fed pad
    with pytest.raises(ValueError, match=rf"pad_token_id={STUB_VOCAB} .*vocabulary of {STUB_VOCAB} tokens"):
        generate(model, IDS, cfg, attention_mask=MASK, on_tokens=lambda *a: steps.append(a))
    assert steps == []  # before the first token is chosen
    assert len(model.forward_calls) == (0 if declared else 1)  # declared: before any forward


@pytest.mark.parametrize("declared", [True, False])
def test_eos_token_id_outside_vocab(backend, declared):
    model = declared_stub(backend) if declared else backend.stub()
    with pytest.raises(ValueError, match=rf"eos_token_id 99 .*vocabulary of {STUB_VOCAB} tokens.*never stop"):
        generate(model, IDS, greedy(eos_token_id=[3, 99]), attention_mask=MASK)
    assert len(model.forward_calls) == (0 if declared else 1)


@pytest.mark.parametrize("field, value", [("pad_token_id", 99), ("eos_token_id", 120)])
def test_demo_model_pad_eos_outside_vocab_before_any_forward(backend, field, value):
    model = demo_model(backend)
    calls = count_forwards(backend, model)
    try:
        with pytest.raises(ValueError, match=rf"{field}.*{value} .*vocabulary of 99 tokens"):
            generate(model, [[5, 6, 7], [8, 9, 10]], max_new_tokens=4, **{field: value})
    finally:
        uncount(backend, model)
    assert calls == []


# ---- 2. prompt ids ------------------------------------------------------------------------
def test_prompt_id_outside_vocab_names_value_and_position(backend):
    model = declared_stub(backend)
    ids = [[1, 2, 3], [4, 5, STUB_VOCAB + 6]]
    with pytest.raises(ValueError, match=rf"input_ids\[1, 2\] = {STUB_VOCAB + 6} .*vocabulary of {STUB_VOCAB}"):
        generate(model, backend.tensor(ids), greedy())
    assert model.forward_calls == []


def test_demo_model_prompt_id_outside_vocab_before_any_forward(backend):
    model = demo_model(backend)
    calls = count_forwards(backend, model)
    try:
        with pytest.raises(ValueError, match=r"input_ids\[0, 1\] = 99 .*vocabulary of 99 tokens"):
            generate(model, [[5, 99, 7]], max_new_tokens=2)
    finally:
        uncount(backend, model)
    assert calls == []


def test_padding_id_outside_vocab_is_named_as_padding(backend):
    with pytest.raises(ValueError, match=r"input_ids\[0, 0\] = 200 \(a padding position"):
        generate(declared_stub(backend), [[200, 5, 6]], greedy(), attention_mask=[[0, 1, 1]])


def test_negative_prompt_id_names_value_and_position(backend):
    model = declared_stub(backend)
    with pytest.raises(ValueError, match=r"input_ids\[0, 1\] = -3"):
        generate(model, backend.tensor([[1, -3, 4]]), greedy())
    assert model.forward_calls == []


def test_uint64_ids_in_range_are_accepted(backend):
    model = backend.stub()
    a = backend.numpy(generate(model, np.array([[5, 6, 7]], dtype=np.int64), greedy()))
    b = backend.numpy(generate(model, np.array([[5, 6, 7]], dtype=np.uint64), greedy()))
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("declared", [True, False])
def test_huge_uint64_id_is_reported_as_itself_not_negative(backend, declared):
    model = declared_stub(backend) if declared else backend.stub()
    value = 2**63 + 1
    with pytest.raises(ValueError, match=rf"input_ids\[0, 1\] = {value} "):
        generate(model, np.array([[5, value]], dtype=np.uint64), greedy())
    assert model.forward_calls == []


def test_uint64_id_outside_vocab(backend):
    with pytest.raises(ValueError, match=rf"input_ids\[0, 0\] = 1000 .*vocabulary of {STUB_VOCAB}"):
        generate(declared_stub(backend), np.array([[1000, 5]], dtype=np.uint64), greedy())


@pytest.mark.parametrize("ids", [[[1.0, 2.0]], np.array([[1.5, 2.0]], dtype=np.float32), [[True, False]]])
def test_non_integer_ids_are_a_type_error(backend, ids):
    with pytest.raises(TypeError, match="input_ids must hold integers"):
        generate(backend.stub(), ids, greedy())


# ---- 3. prompt longer than the context ----------------------------------------------------
def test_prompt_longer_than_context(backend):
    model = declared_stub(backend, max_position_embeddings=STUB_POSITIONS)
    ids = np.ones((2, STUB_POSITIONS + 1), dtype=np.int64)
    mask = np.ones_like(ids)
    mask[0, :10] = 0
    with pytest.raises(ValueError) as error:
        generate(model, ids, greedy(max_new_tokens=7), attention_mask=mask)
    message = str(error.value)
    for part in ("row 1", f"{STUB_POSITIONS + 1} tokens", "max_new_tokens=7", f"context of {STUB_POSITIONS}"):
        assert part in message, message
    assert model.forward_calls == []


def test_prompt_as_long_as_context_leaves_no_room(backend):
    model = declared_stub(backend, max_position_embeddings=STUB_POSITIONS)
    with pytest.raises(ValueError, match=rf"{STUB_POSITIONS} tokens, as long as the model's context"):
        generate(model, np.ones((1, STUB_POSITIONS), dtype=np.int64), greedy())
    assert model.forward_calls == []


def test_generation_stops_where_the_context_ends(backend):
    """Today the stub's position table overflows mid-generation; a declared context stops the row there."""
    model = declared_stub(backend, max_position_embeddings=STUB_POSITIONS)
    ids = np.arange(1, 121)[None, :] % STUB_VOCAB
    out = backend.numpy(generate(model, ids, greedy(max_new_tokens=50)))
    assert out.shape == (1, STUB_POSITIONS)  # prompt + generated fit the context
    free = backend.numpy(generate(backend.stub(), ids, greedy(max_new_tokens=8)))
    np.testing.assert_array_equal(out, free)


def test_context_caps_each_row_alone(backend):
    # a context below the stub's 128 positions: a row that stopped is still fed (pad) while the others run
    model = declared_stub(backend, max_position_embeddings=100)
    ids = np.zeros((2, 96), dtype=np.int64)
    ids[0, :] = np.arange(96) % 60 + 1
    ids[1, -4:] = [5, 6, 7, 8]
    mask = (ids != 0).astype(np.int64)
    steps = []
    out = backend.numpy(
        generate(model, ids, greedy(max_new_tokens=6), attention_mask=mask, on_tokens=lambda s, t, f: steps.append(f))
    )
    assert out.shape == (2, 100)  # row 0: 96 + 4 (its context); row 1: 4 + 6 (max_new_tokens)
    assert steps[3].tolist() == [True, False] and len(steps) == 6
    alone = backend.numpy(generate(backend.stub(), [[5, 6, 7, 8]], greedy(max_new_tokens=6)))[0]
    np.testing.assert_array_equal(out[1, : alone.size], alone)
    assert (out[1, alone.size :] == 0).all()


def test_hf_model_prompt_longer_than_its_context():
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(demo.demo_model_path(), dtype=torch.float32).eval()
    assert model.config.max_position_embeddings == 512
    calls = []
    model.register_forward_pre_hook(lambda *a: calls.append(1))
    with pytest.raises(ValueError, match=r"600 tokens, longer than the model's context of 512.*max_new_tokens=3"):
        generate(model, torch.full((1, 600), 5), max_new_tokens=3)
    assert calls == []


def test_demo_model_prompt_longer_than_declared_context(backend):
    model = demo_model(backend)
    had = declared_context(model)
    model.max_position_embeddings = 16  # as Qwen3_5Config would declare it
    calls = count_forwards(backend, model)
    try:
        with pytest.raises(ValueError, match=r"20 tokens, longer than the model's context of 16"):
            generate(model, np.full((1, 20), 5), max_new_tokens=3)
        assert calls == []
        out = generate(model, np.full((1, 10), 5), max_new_tokens=30, eos_token_id=None)
        assert tuple(out.shape) == (1, 16)
    finally:
        uncount(backend, model)
        del model.max_position_embeddings
    assert declared_context(model) == had


# ---- 4. huge max_new_tokens ---------------------------------------------------------------
def stop_after(n):
    return lambda input_ids, scores: input_ids.shape[1] >= len(IDS[0]) + n


def test_huge_max_new_tokens_sizes_nothing_up_front(backend):
    model = backend.stub()
    expected = backend.numpy(generate(model, IDS, greedy(max_new_tokens=3), attention_mask=MASK))
    tracemalloc.start()
    try:
        out = generate(model, IDS, greedy(max_new_tokens=10**9, stopping_criteria=[stop_after(3)]), attention_mask=MASK)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    np.testing.assert_array_equal(backend.numpy(out), expected)
    assert peak < 64 << 20, f"{peak / 2**20:.0f} MiB of host memory for 3 steps"


@pytest.mark.parametrize("cache", ["static", "dynamic"])
def test_demo_model_huge_max_new_tokens(backend, cache):
    model = demo_model(backend)
    cfg = dict(max_new_tokens=10**9, eos_token_id=None, cache_implementation=cache, stopping_criteria=[stop_after(3)])
    ids = [[5, 6, 7, 8, 9], [10, 11, 12, 13, 14]]
    if cache == "static" and declared_context(model) is None:
        calls = count_forwards(backend, model)
        try:
            with pytest.raises(ValueError, match=r"max_new_tokens is too large.*cache_implementation='dynamic'"):
                generate(model, ids, **cfg)
        finally:
            uncount(backend, model)
        assert calls == []
        return
    out = backend.numpy(generate(model, ids, **cfg))
    expected = backend.numpy(generate(model, ids, max_new_tokens=3, eos_token_id=None, cache_implementation=cache))
    np.testing.assert_array_equal(out, expected)


def test_decode_mask_grows_past_its_first_block(backend, monkeypatch):
    """Dynamic caches get a decode mask that doubles as the sequence grows: same tokens as the static
    cache. The first mask is made 8 steps wide here, so 30 tokens grow it twice (5 + 8 -> 26 -> 35)."""
    from hyper_gen import drivers

    monkeypatch.setattr(drivers, "DECODE_MASK_STEPS", 8)
    model = demo_model(backend)
    ids, mask = [[0, 0, 5, 6, 7], [8, 9, 10, 11, 12]], [[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]
    cfg = dict(max_new_tokens=30, eos_token_id=None, attention_mask=mask)
    static = backend.numpy(generate(model, ids, cache_implementation="static", **cfg))
    dynamic = backend.numpy(generate(model, ids, cache_implementation="dynamic", **cfg))
    assert static.shape == (2, 35)
    np.testing.assert_array_equal(static, dynamic)


def test_declared_context_caps_the_static_cache(backend):
    model = demo_model(backend)
    model.max_position_embeddings = 64
    try:
        cfg = dict(max_new_tokens=10**9, eos_token_id=None, stopping_criteria=[stop_after(3)])
        out = backend.numpy(generate(model, [[5, 6, 7, 8, 9]], **cfg))
        expected = backend.numpy(generate(model, [[5, 6, 7, 8, 9]], max_new_tokens=3, eos_token_id=None))
        np.testing.assert_array_equal(out, expected)
    finally:
        del model.max_position_embeddings


def test_static_cache_length_is_bounded(backend):
    ops = backend_for(backend.tensor([[1]]))
    with pytest.raises(ValueError, match=r"max_new_tokens.*1000000005 positions.*MAX_STATIC_POSITIONS"):
        StaticCache(ops, 2, 10**9 + 5)


# ---- 5. processors and criteria of the wrong shape -----------------------------------------
@pytest.mark.parametrize(
    "processor, shape",
    [(lambda ids, scores: scores[:1], (1, STUB_VOCAB)), (lambda ids, scores: scores[:, :10], (2, 10))],
)
def test_logits_processor_wrong_shape(backend, processor, shape):
    expected = re.escape(f"returned scores of shape {shape}, expected (B, V) = (2, {STUB_VOCAB})")
    with pytest.raises(ValueError, match=rf"logits_processor\[0\].*{expected}"):
        generate(backend.stub(), IDS, greedy(logits_processor=[processor]), attention_mask=MASK)


def test_logits_processor_must_return_a_tensor(backend):
    with pytest.raises(TypeError, match=r"logits_processor\[0\].*must return a .* tensor"):
        generate(backend.stub(), IDS, greedy(logits_processor=[lambda i, s: backend.numpy(s)]), attention_mask=MASK)


def test_stopping_criterion_wrong_length(backend):
    def three_rows(input_ids, scores):
        return np.array([True, False, True])

    expected = re.escape("returned shape (3,), expected a bool or (B,) = (2,) bools")
    with pytest.raises(ValueError, match=rf"stopping_criteria\[0\].*{expected}"):
        generate(backend.stub(), IDS, greedy(stopping_criteria=[three_rows]), attention_mask=MASK)


def test_stopping_criterion_scalar_and_column_still_accepted(backend):
    a = generate(backend.stub(), IDS, greedy(stopping_criteria=[lambda i, s: True]), attention_mask=MASK)
    b = generate(
        backend.stub(), IDS, greedy(stopping_criteria=[lambda i, s: np.ones((2, 1), bool)]), attention_mask=MASK
    )
    assert tuple(a.shape) == tuple(b.shape) == (2, 6)


# ---- 6. non-finite scores -------------------------------------------------------------------
PATHS = {
    "greedy": dict(),
    "seeded": dict(do_sample=True, seed=1),
    "seeded-full-vocab": dict(do_sample=True, seed=1, top_k=0),
    "framework-rng": dict(do_sample=True),
    "framework-rng-topp": dict(do_sample=True, top_k=0, top_p=0.9),
}


def poison(backend, row, value, at_step=0, everywhere=False):
    """A processor putting ``value`` in ``row`` (token 7, or every token) from step ``at_step`` on."""
    seen = []

    def processor(input_ids, scores):
        seen.append(1)
        if len(seen) - 1 < at_step:
            return scores
        bias = np.zeros(tuple(scores.shape), dtype=np.float32)
        if everywhere:
            bias[row, :] = value
        else:
            bias[row, 7] = value
        return scores + backend.tensor(bias, "float32")

    return processor


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize(
    "value, everywhere, kind",
    [(np.nan, False, "hold NaN"), (np.inf, False, r"hold \+inf"), (-np.inf, True, "are all -inf")],
)
def test_non_finite_scores_raise_on_every_path(backend, path, value, everywhere, kind):
    cfg = greedy(max_new_tokens=6, logits_processor=[poison(backend, 1, value, at_step=2, everywhere=everywhere)])
    with pytest.raises(ValueError, match=rf"step 2: row 1's scores {kind} after the logits processors"):
        generate(backend.stub(), IDS, cfg.replace(**PATHS[path]), attention_mask=MASK)


def test_some_minus_inf_is_fine(backend):
    """Masking some tokens with -inf (min_new_tokens, bad-word processors) is not an error."""
    model = backend.stub()
    out = backend.numpy(
        generate(model, IDS, greedy(logits_processor=[poison(backend, 1, -np.inf)], min_new_tokens=2, eos_token_id=3))
    )
    assert out.shape[0] == 2 and 7 not in out[1, 5:].tolist()


def test_non_finite_scores_of_a_finished_row_are_ignored(backend):
    first = first_tokens(backend)
    assert first[0] != first[1]
    cfg = greedy(max_new_tokens=4, eos_token_id=int(first[0]), logits_processor=[poison(backend, 0, np.nan, at_step=1)])
    out = backend.numpy(generate(backend.stub(), IDS, cfg, attention_mask=MASK))
    assert out[0, 3] == first[0]


def test_nan_logits_from_the_model(backend):
    model = backend.stub()
    if backend.name == "torch":
        import torch

        with torch.no_grad():
            model.lm_head[:, 9] = float("nan")
    else:
        weights = backend.numpy(model.lm_head)
        weights[:, 9] = np.nan
        model.lm_head.set_data(backend.tensor(weights, "float32"))
    for extra in PATHS.values():
        with pytest.raises(ValueError, match=r"step 0: row 0's scores hold NaN, row 1's scores hold NaN"):
            generate(model, IDS, greedy(**extra), attention_mask=MASK)


# ---- 7. seeds -------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [2**64 - 1, np.uint64(2**64 - 1), np.int64(5), np.uint32(7)])
def test_numpy_and_largest_seeds(backend, seed):
    cfg = GenerationConfig(max_new_tokens=5, eos_token_id=None, do_sample=True, top_k=0)
    a = backend.numpy(generate(backend.stub(), IDS, cfg.replace(seed=seed), attention_mask=MASK))
    b = backend.numpy(generate(backend.stub(), IDS, cfg.replace(seed=int(seed)), attention_mask=MASK))
    np.testing.assert_array_equal(a, b)


def test_largest_seed_noise_is_portable():
    u = uniform_noise(2**64 - 1, np.arange(2), 3, np.arange(6).reshape(2, 3))
    assert u.dtype == np.float64 and ((u > 0) & (u < 1)).all()
    np.testing.assert_array_equal(u, uniform_noise(np.uint64(2**64 - 1), np.arange(2), 3, np.arange(6).reshape(2, 3)))
