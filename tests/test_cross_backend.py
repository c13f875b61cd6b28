"""torch and MindSpore give the same tokens for the same weights; the static cache really writes."""

import numpy as np
import pytest
from backend_harness import MindSporeHarness, TorchHarness

from hyper_gen import DynamicCache, GenerationConfig, StaticCache, generate
from hyper_gen.registry import backend_for

IDS = [[0, 0, 0, 11, 12, 13], [0, 21, 22, 23, 24, 25], [31, 32, 33, 34, 35, 36]]
MASK = [[0, 0, 0, 1, 1, 1], [0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]]

CONFIGS = {
    "greedy": GenerationConfig(max_new_tokens=12, eos_token_id=None),
    "greedy-penalty": GenerationConfig(max_new_tokens=12, eos_token_id=None, repetition_penalty=1.3),
    "seeded-full-vocab": GenerationConfig(max_new_tokens=12, eos_token_id=None, do_sample=True, top_k=0, seed=11),
    "seeded-topk-topp": GenerationConfig(
        max_new_tokens=12, eos_token_id=None, do_sample=True, top_k=20, top_p=0.8, temperature=0.8, seed=12
    ),
    "seeded-minp": GenerationConfig(
        max_new_tokens=12, eos_token_id=None, do_sample=True, top_k=0, min_p=0.05, top_p=0.95, seed=13
    ),
}


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_torch_and_mindspore_same_tokens(name, dtype):
    torch_h, ms_h = TorchHarness(), MindSporeHarness()
    cfg = CONFIGS[name]
    a = torch_h.numpy(generate(torch_h.stub(dtype), IDS, cfg, attention_mask=MASK))
    b = ms_h.numpy(generate(ms_h.stub(dtype), ms_h.tensor(IDS), cfg, attention_mask=ms_h.tensor(MASK)))
    np.testing.assert_array_equal(a, b)


def test_seeded_row_does_not_depend_on_batch_neighbours():
    """A row's seeded tokens depend on (seed, row, step) only, not on the other prompts."""
    h = TorchHarness()
    cfg = CONFIGS["seeded-topk-topp"]
    model = h.stub()
    batch = h.numpy(generate(model, IDS, cfg, attention_mask=MASK))
    other = [IDS[0], [0, 41, 42, 43, 44, 45], [51, 52, 53, 54, 55, 56]]
    mixed = h.numpy(generate(model, other, cfg, attention_mask=[MASK[0], MASK[1], MASK[2]]))
    np.testing.assert_array_equal(batch[0], mixed[0])


@pytest.mark.parametrize("harness", [TorchHarness, MindSporeHarness])
@pytest.mark.parametrize("cache_class", [StaticCache, DynamicCache])
def test_cache_object_writes_really_land(harness, cache_class):
    """A silent no-op write (MindSpore CPU's copy_/index_copy_) would leave zeros behind."""
    h = harness()
    first = h.tensor(np.arange(2 * 3 * 4 * 5).reshape(2, 3, 4, 5) + 1, "float32")
    second = h.tensor(np.full((2, 3, 1, 5), -7.0), "float32")
    ops = backend_for(first)
    cache = cache_class(ops, batch_size=2, max_length=6)
    cache.update(first, first, layer_idx=0)
    cache.advance(4)
    keys, values = cache.update(second, second, layer_idx=0)
    cache.advance(1)
    keys = h.numpy(keys)
    assert keys.shape[2] == (6 if cache_class is StaticCache else 5)
    np.testing.assert_array_equal(keys[:, :, :4], h.numpy(first))
    np.testing.assert_array_equal(keys[:, :, 4:5], h.numpy(second))
    assert cache.get_seq_length() == 5
    with pytest.raises(ValueError, match="overflow"):
        cache.advance(2)
