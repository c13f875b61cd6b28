"""The core's conformance suite (RFC GEN-UT-01..08, GEN-BATCH-01..03 and more), run on every backend."""

import numpy as np
import pytest

from hyper_gen import GenerationConfig, KVCache, generate

PROMPT = [[5, 6, 7, 8]]
PADDED_IDS = [[0, 0, 0, 11, 12], [0, 21, 22, 23, 24], [31, 32, 33, 34, 35]]
PADDED_MASK = [[0, 0, 0, 1, 1], [0, 1, 1, 1, 1], [1, 1, 1, 1, 1]]


def greedy(**kw):
    kw.setdefault("eos_token_id", None)
    return GenerationConfig(do_sample=False, **kw)


# ---- GEN-UT-01: defaults and validation ---------------------------------------------------
def test_gen_ut_01_defaults():
    cfg = GenerationConfig()
    assert (cfg.max_new_tokens, cfg.temperature, cfg.top_k, cfg.top_p, cfg.do_sample) == (256, 1.0, 50, 1.0, False)
    assert (cfg.eos_token_id, cfg.pad_token_id, cfg.repetition_penalty) == (2, 0, 1.0)
    assert cfg.logits_processor is None and cfg.stopping_criteria is None
    assert (cfg.min_p, cfg.min_new_tokens, cfg.seed, cfg.use_cache, cfg.cache_implementation) == (
        0.0,
        0,
        None,
        True,
        "static",
    )


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", 0),
        ("temperature", -1.0),
        ("top_k", -1),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("min_p", -0.1),
        ("min_p", 1.1),
        ("repetition_penalty", 0),
        ("max_new_tokens", 0),
        ("min_new_tokens", -1),
        ("min_new_tokens", 300),
        ("cache_implementation", "paged"),
        ("eos_token_id", []),
    ],
)
def test_gen_ut_01_invalid_values_name_field(field, value):
    with pytest.raises(ValueError, match=field):
        GenerationConfig(**{field: value})


@pytest.mark.parametrize(
    "field, value",
    [("max_new_tokens", 2.5), ("top_k", "5"), ("do_sample", "yes"), ("logits_processor", lambda i, s: s)],
)
def test_gen_ut_01_wrong_types(field, value):
    with pytest.raises(TypeError, match=field):
        GenerationConfig(**{field: value})


def test_eos_accepts_int_list_none():
    assert GenerationConfig(eos_token_id=[3, 4]).eos_token_ids == [3, 4]
    assert GenerationConfig(eos_token_id=None).eos_token_ids == []
    assert GenerationConfig(eos_token_id=7).eos_token_ids == [7]


# ---- GEN-UT-02..05 ------------------------------------------------------------------------
def test_gen_ut_02_greedy_shape(backend):
    out = generate(backend.stub(), backend.tensor([[5, 6, 7, 8]]), greedy(max_new_tokens=8))
    assert backend.is_native(out) and backend.int64(out)
    assert tuple(out.shape) == (1, 12)
    np.testing.assert_array_equal(backend.numpy(out)[0, :4], [5, 6, 7, 8])


def test_gen_ut_03_greedy_deterministic(backend):
    model = backend.stub()
    a = backend.numpy(generate(model, PROMPT, greedy(max_new_tokens=10)))
    b = backend.numpy(generate(model, PROMPT, greedy(max_new_tokens=10)))
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("n", [1, 3])
def test_gen_ut_04_max_new_tokens(backend, n):
    out = generate(backend.stub(), PROMPT, greedy(max_new_tokens=n))
    assert out.shape[1] == 4 + n


def test_gen_ut_05_eos_stops_early(backend):
    model = backend.stub()
    free = backend.numpy(generate(model, PROMPT, greedy(max_new_tokens=10)))[0]
    eos = int(free[6])  # the third generated token
    first = int(np.flatnonzero(free[4:] == eos)[0])
    out = backend.numpy(generate(model, PROMPT, greedy(max_new_tokens=10, eos_token_id=eos)))[0]
    assert len(out) == 4 + first + 1 < 14
    assert out[-1] == eos
    np.testing.assert_array_equal(out, free[: len(out)])


def test_eos_list_any_id_stops(backend):
    model = backend.stub()
    free = backend.numpy(generate(model, PROMPT, greedy(max_new_tokens=10)))[0]
    out = backend.numpy(generate(model, PROMPT, greedy(max_new_tokens=10, eos_token_id=[999 % 64, int(free[5])])))
    assert out.shape[1] <= 6


# ---- GEN-UT-06..08 ------------------------------------------------------------------------
def test_gen_ut_06_kvcache_api(backend):
    cache = KVCache()
    assert cache.is_empty() and cache.get_seq_length() == 0 and len(cache) == 0
    k = backend.tensor(np.zeros((1, 2, 3, 4)), "float32")
    cache.update([(k, k), (k, k)])
    assert len(cache) == 2 and cache.get_seq_length() == 3
    new = backend.tensor(np.ones((1, 2, 1, 4)), "float32")
    from hyper_gen.registry import backend_for

    cache.merge([(new, new), (new, new)], backend_for(k).concat)
    assert cache.get_seq_length() == 4
    merged = backend.numpy(cache.past_key_values[1][0])
    assert merged[0, 0, 3].tolist() == [1, 1, 1, 1] and merged[0, 0, 0].tolist() == [0, 0, 0, 0]
    cache.detach()
    assert cache.get_seq_length() == 4
    cache.clear()
    assert cache.is_empty()
    with pytest.raises(ValueError, match="merge"):
        cache.update([(k, k)])
        cache.merge([(new, new), (new, new)], backend_for(k).concat)


@pytest.mark.parametrize("sample", [False, True])
def test_gen_ut_07_cache_on_off_same_tokens(backend, sample):
    model = backend.stub()
    cfg = (
        greedy(max_new_tokens=8)
        if not sample
        else GenerationConfig(max_new_tokens=8, do_sample=True, seed=5, eos_token_id=None)
    )
    on = generate(model, PADDED_IDS, cfg, attention_mask=PADDED_MASK)
    model.forward_calls.clear()
    off = generate(model, PADDED_IDS, cfg.replace(use_cache=False), attention_mask=PADDED_MASK)
    np.testing.assert_array_equal(backend.numpy(on), backend.numpy(off))
    assert [shape[1] for shape in model.forward_calls] == list(range(5, 13))  # really recomputed


def test_model_without_cache_is_recomputed(backend):
    model = backend.stub(returns_cache=False)
    out = generate(model, PROMPT, greedy(max_new_tokens=5))
    ref = generate(backend.stub(), PROMPT, greedy(max_new_tokens=5))
    np.testing.assert_array_equal(backend.numpy(out), backend.numpy(ref))


@pytest.mark.parametrize(
    "kw", [dict(top_k=5), dict(top_p=0.5, top_k=0), dict(top_k=3, top_p=0.8, temperature=0.5), dict(min_p=0.2, top_k=0)]
)
def test_gen_ut_08_topk_topp_tokens_valid(backend, kw):
    out = backend.numpy(
        generate(
            backend.stub(),
            PADDED_IDS,
            GenerationConfig(max_new_tokens=12, do_sample=True, eos_token_id=None, seed=1, **kw),
            attention_mask=PADDED_MASK,
        )
    )
    assert out.min() >= 0 and out.max() < 64


def test_top_k_1_sampling_equals_greedy(backend):
    model = backend.stub()
    sampled = generate(
        model,
        PADDED_IDS,
        GenerationConfig(max_new_tokens=6, do_sample=True, top_k=1, eos_token_id=None),
        attention_mask=PADDED_MASK,
    )
    argmax = generate(model, PADDED_IDS, greedy(max_new_tokens=6), attention_mask=PADDED_MASK)
    np.testing.assert_array_equal(backend.numpy(sampled), backend.numpy(argmax))


def test_repetition_penalty_changes_repeats(backend):
    model = backend.stub()
    plain = backend.numpy(generate(model, PROMPT, greedy(max_new_tokens=16)))[0, 4:]
    penalised = backend.numpy(generate(model, PROMPT, greedy(max_new_tokens=16, repetition_penalty=50.0)))[0, 4:]
    assert len(set(plain.tolist())) < len(plain)  # the stub repeats itself
    assert len(set(penalised.tolist())) == len(penalised)  # a huge penalty forbids any repeat
    assert not set(penalised.tolist()) & {5, 6, 7, 8}  # prompt tokens are penalised too


def test_repetition_penalty_ignores_left_padding(backend):
    """transformers 5.x: the pad id used as left padding is not penalised."""
    model = backend.stub()
    free = backend.numpy(generate(model, PROMPT, greedy(max_new_tokens=1)))[0, -1]
    ids = [[int(free)] * 3 + [5, 6, 7, 8]]  # left padding made of the id greedy would pick
    mask = [[0, 0, 0, 1, 1, 1, 1]]
    out = backend.numpy(
        generate(
            model, ids, greedy(max_new_tokens=1, repetition_penalty=50.0, pad_token_id=int(free)), attention_mask=mask
        )
    )
    assert out[0, -1] == free


def test_seeded_sampling_reproducible_and_seed_dependent(backend):
    model = backend.stub()
    cfg = GenerationConfig(max_new_tokens=10, do_sample=True, top_k=0, eos_token_id=None, seed=123)
    a = backend.numpy(generate(model, PADDED_IDS, cfg, attention_mask=PADDED_MASK))
    b = backend.numpy(generate(model, PADDED_IDS, cfg, attention_mask=PADDED_MASK))
    c = backend.numpy(generate(model, PADDED_IDS, cfg.replace(seed=124), attention_mask=PADDED_MASK))
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


def test_min_new_tokens_blocks_eos(backend):
    model = backend.stub()
    free = backend.numpy(generate(model, PROMPT, greedy(max_new_tokens=8)))[0]
    eos = int(free[4])  # greedy's first token
    out = backend.numpy(generate(model, PROMPT, greedy(max_new_tokens=8, eos_token_id=eos, min_new_tokens=3)))[0]
    assert len(out) >= 4 + 3
    assert eos not in out[4:7].tolist()


def test_logits_processor_and_stopping_criteria(backend):
    model = backend.stub()
    seen = []

    def forbid_all_but_9(input_ids, scores):
        seen.append((tuple(input_ids.shape), tuple(scores.shape), backend.is_native(input_ids)))
        bias = np.full(tuple(scores.shape), -1e9, dtype=np.float32)
        bias[:, 9] = 0
        return scores + backend.tensor(bias, "float32")

    def stop_after_three(input_ids, scores):
        return input_ids.shape[1] >= 4 + 3

    out = backend.numpy(
        generate(
            model,
            PROMPT,
            greedy(max_new_tokens=10, logits_processor=[forbid_all_but_9], stopping_criteria=[stop_after_three]),
        )
    )
    np.testing.assert_array_equal(out, [[5, 6, 7, 8, 9, 9, 9]])
    assert seen[0] == ((1, 4), (1, 64), True) and seen[1][0] == (1, 5)


def test_per_row_stopping_criteria(backend):
    def stop_row_0(input_ids, scores):
        return np.array([True, False])

    out = backend.numpy(
        generate(
            backend.stub(), [[1, 2], [3, 4]], greedy(max_new_tokens=4, pad_token_id=63, stopping_criteria=[stop_row_0])
        )
    )
    assert out.shape == (2, 6) and (out[0, 3:] == 63).all()


# ---- GEN-BATCH ---------------------------------------------------------------------------
def test_gen_batch_01_equal_lengths(backend):
    out = generate(backend.stub(), [[1, 2, 3], [4, 5, 6]], greedy(max_new_tokens=5))
    assert tuple(out.shape) == (2, 8)


def test_gen_batch_02_left_padded_deterministic_and_equal_to_alone(backend):
    model = backend.stub()
    cfg = greedy(max_new_tokens=7)
    a = backend.numpy(generate(model, PADDED_IDS, cfg, attention_mask=PADDED_MASK))
    b = backend.numpy(generate(model, backend.tensor(PADDED_IDS), cfg, attention_mask=backend.tensor(PADDED_MASK)))
    np.testing.assert_array_equal(a, b)
    for row, (ids, mask) in enumerate(zip(PADDED_IDS, PADDED_MASK)):
        alone = backend.numpy(generate(model, [[t for t, m in zip(ids, mask) if m]], cfg))[0]
        np.testing.assert_array_equal(a[row, : len(alone)], alone)


def test_gen_batch_03_no_mask_equals_all_ones(backend):
    model = backend.stub()
    ids = [[1, 2, 3], [4, 5, 6]]
    a = backend.numpy(generate(model, ids, greedy(max_new_tokens=5)))
    b = backend.numpy(generate(model, ids, greedy(max_new_tokens=5), attention_mask=np.ones((2, 3), dtype=np.int64)))
    np.testing.assert_array_equal(a, b)


def test_rfc_output_format_with_early_eos(backend):
    model = backend.stub()
    free = backend.numpy(generate(model, PADDED_IDS, greedy(max_new_tokens=6), attention_mask=PADDED_MASK))
    eos = int(free[1, 4 + 1])  # row 1's second generated token
    out = backend.numpy(
        generate(
            model, PADDED_IDS, greedy(max_new_tokens=6, eos_token_id=eos, pad_token_id=63), attention_mask=PADDED_MASK
        )
    )
    for row in range(3):
        real = [t for t, m in zip(PADDED_IDS[row], PADDED_MASK[row]) if m]
        gen = free[row, len(real) : len(real) + 6].tolist()
        stop = gen.index(eos) + 1 if eos in gen else 6
        expected = real + gen[:stop]
        np.testing.assert_array_equal(out[row, : len(expected)], expected)
        assert (out[row, len(expected) :] == 63).all()
    assert out.shape[1] == max(
        len([m for m in mask if m]) + min(6, 1 + (free[r, sum(mask) :].tolist() + [eos]).index(eos))
        for r, mask in enumerate(PADDED_MASK)
    )


def test_keyword_overrides_and_mixin(backend):
    model = backend.stub()
    a = backend.numpy(model.generate(backend.tensor(PROMPT), max_new_tokens=3, eos_token_id=None))
    b = backend.numpy(generate(model, PROMPT, GenerationConfig(max_new_tokens=3, eos_token_id=None)))
    np.testing.assert_array_equal(a, b)
    with pytest.raises(TypeError, match="max_tokens"):
        generate(model, PROMPT, max_tokens=3)


def test_float64_stub_matches_float32_tokens(backend):
    a = backend.numpy(
        generate(backend.stub("float64"), PADDED_IDS, greedy(max_new_tokens=6), attention_mask=PADDED_MASK)
    )
    b = backend.numpy(
        generate(backend.stub("float32"), PADDED_IDS, greedy(max_new_tokens=6), attention_mask=PADDED_MASK)
    )
    np.testing.assert_array_equal(a, b)


def test_streaming_callbacks(backend):
    puts, steps = [], []

    class Recorder:
        def put(self, value):
            puts.append(np.asarray(value).tolist())

        def end(self):
            puts.append("end")

    out = backend.numpy(
        generate(
            backend.stub(),
            PADDED_IDS,
            greedy(max_new_tokens=3),
            attention_mask=PADDED_MASK,
            streamer=Recorder(),
            on_tokens=lambda s, t, f: steps.append((s, t.tolist(), f.tolist())),
        )
    )
    assert puts[0] == PADDED_IDS and puts[-1] == "end" and len(puts) == 5
    assert [s for s, _, _ in steps] == [0, 1, 2]
    lengths = [sum(m) for m in PADDED_MASK]
    assert [t for _, t, _ in steps] == [[out[r, n + s] for r, n in enumerate(lengths)] for s in range(3)]


# ---- bad input ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "ids, mask, match",
    [
        ([[1, 2, 3]], [[1, 1]], "attention_mask shape"),
        ([[1, 2, 3]], [[1, 0, 1]], "right-padded"),
        ([[1, 2, 3], [4, 5, 6]], [[1, 1, 1], [0, 0, 0]], "row 1 has no real token"),
        ([1, 2, 3], None, "2-D"),
        ([[1.5, 2.0]], None, "integers"),
        ([[1, 2], [3]], None, "rectangular"),
        ([[1, -2]], None, "non-negative"),
        ([[1, 2]], [[1, 2]], "only 0"),
    ],
)
def test_bad_inputs_raise_value_error(backend, ids, mask, match):
    with pytest.raises(ValueError, match=match):
        generate(backend.stub(), ids, greedy(max_new_tokens=2), attention_mask=mask)


def test_bad_model_and_config_types(backend):
    with pytest.raises(TypeError, match="model"):
        generate(None, PROMPT)
    with pytest.raises(TypeError, match="generation_config"):
        generate(backend.stub(), PROMPT, {"max_new_tokens": 3})


def test_generation_runs_without_grad(backend):
    model = backend.stub()
    states = []
    original = type(model).forward if backend.name == "torch" else type(model).construct

    def recording(self, *args, **kwargs):
        if backend.name == "torch":
            import torch

            states.append(torch.is_grad_enabled())
        else:
            from mindspore.common.api import _pynative_executor

            states.append(_pynative_executor.enable_grad())
        return original(self, *args, **kwargs)

    setattr(model, "forward" if backend.name == "torch" else "construct", recording.__get__(model))
    generate(model, PROMPT, greedy(max_new_tokens=3))
    assert states and not any(states)
