"""The generalised model contract: generate() passes a model only the keywords its forward takes.

Each model here wraps the RFC stub (tests/stub_torch.py, tests/stub_mindspore.py) behind a forward
with a narrower (or **kwargs) signature, as a torch Module (``forward``) or a MindSpore Cell
(``construct``), and must give the stub's own greedy tokens.
"""

import functools
import inspect

import numpy as np
import pytest

from hyper_gen import GenerationConfig, generate
from hyper_gen.masks import min_finite

PROMPT = [[5, 6, 7, 8], [9, 10, 11, 12]]
PADDED_IDS = [[0, 0, 0, 11, 12], [0, 21, 22, 23, 24], [31, 32, 33, 34, 35]]
PADDED_MASK = [[0, 0, 0, 1, 1], [0, 1, 1, 1, 1], [1, 1, 1, 1, 1]]
NEW = 8


def greedy(**kw):
    return GenerationConfig(do_sample=False, eos_token_id=None, max_new_tokens=NEW, **kw)


def wrap(backend, forward):
    """A Module / Cell holding the stub as ``self.inner``, whose forward is ``forward``."""
    if backend.name == "torch":
        import torch

        base, method = torch.nn.Module, "forward"
    else:
        import mindspore

        base, method = mindspore.nn.Cell, "construct"

    def __init__(self):
        base.__init__(self)
        self.inner = backend.stub()
        self.calls = []  # (input shape, sorted keywords) per forward

    cls = type(f"Wrapped_{forward.__name__}", (base,), {"__init__": __init__, method: forward})
    return cls()


def causal_inputs(backend, input_ids):
    """What a model without position_ids / attention_mask assumes: positions 0.., a causal mask."""
    b, s = input_ids.shape
    positions = backend.tensor(np.tile(np.arange(s), (b, 1)))
    mask = np.triu(np.full((s, s), min_finite("float32")), 1)[None, None].repeat(b, 0)
    return positions, backend.tensor(mask, "float32")


def ids_only_model(backend):
    def forward(self, input_ids):
        self.calls.append((tuple(input_ids.shape), ()))
        positions, mask = causal_inputs(backend, input_ids)
        return {"logits": self.inner(input_ids, position_ids=positions, attention_mask=mask)["logits"]}

    return wrap(backend, forward)


def no_past_model(backend):
    def forward(self, input_ids, position_ids=None, attention_mask=None):
        self.calls.append((tuple(input_ids.shape), ("attention_mask", "position_ids")))
        return self.inner(input_ids, position_ids=position_ids, attention_mask=attention_mask)  # its past is ignored

    return wrap(backend, forward)


def kwargs_model(backend):
    def forward(self, input_ids, **kwargs):
        self.calls.append((tuple(input_ids.shape), tuple(sorted(kwargs))))
        return self.inner(input_ids, **kwargs)

    return wrap(backend, forward)


def tokens(backend, model, ids, cfg, mask=None):
    return backend.numpy(generate(model, backend.tensor(ids), cfg, attention_mask=mask))


def reference(backend, ids, mask=None):
    """The stub's greedy tokens, cached and recomputed (they agree)."""
    stub = backend.stub()
    cached = tokens(backend, stub, ids, greedy(), mask)
    recomputed = tokens(backend, stub, ids, greedy(use_cache=False), mask)
    np.testing.assert_array_equal(cached, recomputed)
    return cached


# ---- a forward that takes only input_ids -------------------------------------------------
def test_ids_only_model_recomputes_to_the_stub_tokens(backend):
    model = ids_only_model(backend)
    out = tokens(backend, model, PROMPT, greedy())
    np.testing.assert_array_equal(out, reference(backend, PROMPT))
    assert [shape for shape, _ in model.calls] == [(2, 4 + step) for step in range(NEW)]  # whole sequence each step


def test_ids_only_model_accepts_an_all_ones_mask(backend):
    out = tokens(backend, ids_only_model(backend), PROMPT, greedy(), np.ones((2, 4), dtype=np.int64))
    np.testing.assert_array_equal(out, reference(backend, PROMPT))


def test_ids_only_model_refuses_a_padded_batch(backend):
    model = ids_only_model(backend)
    with pytest.raises(ValueError, match="attention_mask"):
        generate(model, backend.tensor(PADDED_IDS), greedy(), attention_mask=PADDED_MASK)
    assert model.calls == []  # refused before any forward


def test_ids_only_model_with_sampling_matches_the_stub(backend):
    cfg = GenerationConfig(max_new_tokens=NEW, do_sample=True, top_k=10, seed=3, eos_token_id=None)
    out = tokens(backend, ids_only_model(backend), PROMPT, cfg)
    np.testing.assert_array_equal(out, tokens(backend, backend.stub(), PROMPT, cfg.replace(use_cache=False)))


# ---- a forward without past_key_values ---------------------------------------------------
@pytest.mark.parametrize("use_cache", [True, False])
def test_model_without_past_recomputes_padded_batch(backend, use_cache):
    model = no_past_model(backend)
    out = tokens(backend, model, PADDED_IDS, greedy(use_cache=use_cache), PADDED_MASK)
    np.testing.assert_array_equal(out, reference(backend, PADDED_IDS, PADDED_MASK))
    assert [shape for shape, _ in model.calls] == [(3, 5 + step) for step in range(NEW)]


# ---- a forward taking **kwargs: everything is passed, the cache is used -------------------
def test_kwargs_model_gets_everything_and_uses_the_cache(backend):
    model = kwargs_model(backend)
    out = tokens(backend, model, PADDED_IDS, greedy(), PADDED_MASK)
    np.testing.assert_array_equal(out, reference(backend, PADDED_IDS, PADDED_MASK))
    assert [shape for shape, _ in model.calls] == [(3, 5)] + [(3, 1)] * (NEW - 1)  # cached decode
    assert {keys for _, keys in model.calls} == {("attention_mask", "past_key_values", "position_ids")}


# ---- a plain callable (no Module / Cell): its own signature counts -----------------------
def test_plain_callable_with_ids_only(backend):
    stub = backend.stub()
    calls = []

    def model(input_ids):
        calls.append(tuple(input_ids.shape))
        positions, mask = causal_inputs(backend, input_ids)
        return stub(input_ids, position_ids=positions, attention_mask=mask)

    out = tokens(backend, model, PROMPT, greedy())
    np.testing.assert_array_equal(out, reference(backend, PROMPT))
    assert calls == [(2, 4 + step) for step in range(NEW)]


# ---- errors inside the model propagate unchanged -----------------------------------------
class ModelBroke(Exception):
    pass


@pytest.mark.parametrize("error", [ModelBroke("layer 3 overflowed at step 2"), TypeError("bad weight dtype in wq")])
@pytest.mark.parametrize(
    "make", [ids_only_model, kwargs_model, lambda backend: backend.stub()], ids=["ids_only", "kwargs", "stub"]
)
def test_error_inside_model_propagates_unchanged(backend, error, make):
    model = make(backend)
    calls = []
    original = model.forward if backend.name == "torch" else model.construct

    @functools.wraps(original)  # keeps the forward's signature
    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise error
        return original(*args, **kwargs)

    setattr(model, "forward" if backend.name == "torch" else "construct", failing)
    with pytest.raises(type(error)) as raised:
        generate(model, backend.tensor(PROMPT), greedy())
    assert raised.value is error and str(raised.value) == str(error)
    assert len(calls) == 3  # not retried with other arguments


def test_type_error_from_a_narrow_forward_is_not_swallowed(backend):
    """A TypeError raised inside a forward that takes only input_ids is the model's, not a retry cue."""

    def forward(self, input_ids):
        self.calls.append(1)
        raise TypeError("forward() got an unexpected keyword argument 'position_ids'")

    model = wrap(backend, forward)
    with pytest.raises(TypeError, match="unexpected keyword argument 'position_ids'"):
        generate(model, backend.tensor(PROMPT), greedy())
    assert model.calls == [1]


# ---- HF models: the cache under the name the forward declares ----------------------------
def tiny_qwen3():
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
    )
    torch.manual_seed(0)
    return Qwen3ForCausalLM(cfg).eval(), cfg


def renamed_cache_qwen3(cfg, state):
    """An HF model whose forward declares ``cache`` (not ``past_key_values``), no return_dict, no **kwargs."""
    from transformers import Qwen3ForCausalLM

    # transformers 5.25 renamed its own argument to ``cache`` (``past_key_values`` deprecated): hand
    # the parent the name it declares, so only generate()'s own calls are under test
    parent_name = "cache" if "cache" in inspect.signature(Qwen3ForCausalLM.forward).parameters else "past_key_values"

    class CacheNamedQwen3(Qwen3ForCausalLM):
        def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, use_cache=None):
            self.seen.append((tuple(input_ids.shape), type(cache).__name__, use_cache))
            return super().forward(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                use_cache=use_cache,
                **{parent_name: cache},
            )

    model = CacheNamedQwen3(cfg).eval()
    model.load_state_dict(state)
    model.seen = []
    return model


def hf_padded_batch():
    import torch

    ids = np.random.default_rng(0).integers(3, 128, (2, 7))
    mask = np.ones_like(ids)
    mask[0, :3] = 0
    ids[mask == 0] = 0
    return torch.from_numpy(ids), torch.from_numpy(mask)


def test_hf_model_gets_the_cache_under_its_declared_name():
    import warnings

    import torch

    reference_model, cfg = tiny_qwen3()
    model = renamed_cache_qwen3(cfg, reference_model.state_dict())
    ids, mask = hf_padded_batch()
    hf = reference_model.generate(
        ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0, eos_token_id=None
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ours = generate(model, ids, greedy(), attention_mask=mask)
    expected = [hf[i, int((mask[i] == 0).sum()) :].tolist() for i in range(2)]
    assert [row[: len(ref)] for row, ref in zip(ours.tolist(), expected)] == expected
    assert model.seen == [((2, 7), "DynamicCache", True)] + [((2, 1), "DynamicCache", True)] * (NEW - 1)
    recomputed = generate(model, ids, greedy(use_cache=False), attention_mask=mask)
    assert torch.equal(ours, recomputed)


def test_hf_model_without_a_cache_argument_is_recomputed():
    from transformers import Qwen3ForCausalLM

    reference_model, cfg = tiny_qwen3()

    class NoCacheQwen3(Qwen3ForCausalLM):
        def forward(self, input_ids=None, attention_mask=None, position_ids=None):
            self.seen.append(tuple(input_ids.shape))
            return super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)

    model = NoCacheQwen3(cfg).eval()
    model.load_state_dict(reference_model.state_dict())
    model.seen = []
    ids, mask = hf_padded_batch()
    ours = generate(model, ids, greedy(), attention_mask=mask)
    ref = generate(reference_model, ids, greedy(), attention_mask=mask)
    assert ours.tolist() == ref.tolist()
    assert model.seen == [(2, 7 + step) for step in range(NEW)]
