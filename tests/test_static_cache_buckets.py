"""A static cache's length is rounded up to the model's ``static_cache_multiple``: the MindSpore
port's one-graph decode step is compiled for its buffers' shape, so batches whose prompt +
max_new_tokens fall in one bucket share a graph. The extra positions change no token."""

import numpy as np
import pytest

from hyper_gen import generate, load_model
from hyper_gen.cache import MAX_STATIC_POSITIONS, static_length
from hyper_gen.demo import demo_model_path

IDS = [[0, 0, 85, 72, 89, 3, 20, 21], [85, 72, 89, 3, 24, 23, 22, 21]]
MASK = [[0, 0, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1, 1]]


def test_static_length_rounds_up_to_the_multiple():
    assert [static_length(n, 256) for n in (1, 255, 256, 257)] == [256, 256, 256, 512]
    assert static_length(37, 1) == 37 and static_length(37, 0) == 37
    # rounding never takes a cache past the bound a caller was checked against
    assert static_length(MAX_STATIC_POSITIONS - 3, 256) == MAX_STATIC_POSITIONS
    assert static_length(MAX_STATIC_POSITIONS - 3, 1000) == MAX_STATIC_POSITIONS - 3


_MODELS = {}


def _demo(backend):
    if backend.name not in _MODELS:
        _MODELS[backend.name] = load_model(demo_model_path(), backend=backend.name, dtype="float64")
    return _MODELS[backend.name]


def _run(backend, model, multiple, prompt_ids, mask, new_tokens):
    """Tokens, float64 logits and the static cache length each forward saw."""
    lengths = []
    name = "forward" if backend.name == "torch" else "construct"
    original = getattr(type(model), name)

    def spying(self, *args, **kwargs):
        lengths.append(kwargs["past_key_values"].max_length)
        return original(self, *args, **kwargs)

    setattr(model, name, spying.__get__(model))
    kept = model.__dict__.get("static_cache_multiple")
    model.static_cache_multiple = multiple
    try:
        out = generate(
            model,
            backend.tensor(prompt_ids),
            attention_mask=backend.tensor(mask),
            max_new_tokens=new_tokens,
            eos_token_id=None,
            return_dict_in_generate=True,
            output_logits=True,
        )
    finally:
        model.__dict__.pop(name, None)
        model.static_cache_multiple = kept if kept is not None else 1
    logits = np.stack([backend.numpy(step).astype(np.float64) for step in out.logits])
    return backend.numpy(out.sequences), logits, set(lengths)


@pytest.mark.parametrize("multiple", [16, 256])
def test_a_rounded_static_cache_gives_the_same_tokens(backend, multiple):
    model = _demo(backend)
    exact_tokens, exact_logits, exact_lengths = _run(backend, model, 1, IDS, MASK, 6)
    tokens, logits, lengths = _run(backend, model, multiple, IDS, MASK, 6)
    assert exact_lengths == {8 + 6} and lengths == {multiple}
    np.testing.assert_array_equal(tokens, exact_tokens)
    assert np.abs(logits - exact_logits).max() < 1e-9


def test_prompts_of_other_lengths_in_one_bucket_share_the_cache_shape(backend):
    """Two batches of different widths and max_new_tokens, one bucket: the same buffer length,
    so the MindSpore port's compiled decode step is reused (the one shape it was compiled for)."""
    model = _demo(backend)
    first = _run(backend, model, 32, IDS, MASK, 6)[2]
    second = _run(backend, model, 32, [row[3:] for row in IDS], [row[3:] for row in MASK], 11)[2]
    assert first == second == {32}


def test_the_mindspore_port_rounds_its_one_graph_static_cache():
    """Loaded with compiled decode (the default), the dense MindSpore port declares the multiple."""
    from hyper_gen.backends.mindspore.compile import COMPILED_DECODE, STATIC_CACHE_MULTIPLE

    model = load_model(demo_model_path(), backend="mindspore")
    assert COMPILED_DECODE and model.static_cache_multiple == STATIC_CACHE_MULTIPLE == 256
