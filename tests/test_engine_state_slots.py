"""The live Gated DeltaNet states' slot pool (``KVStore.conv`` / ``.recurrent``), torch and MindSpore:
requests admitted, forked into n choices, preempted, aborted and finished in a random order each keep
their own slot (never the null one, never shared), every slot comes back, and every request that ran
to its end has generate()'s tokens. The pool is part of the cache budget, and sleep releases it.
"""

import numpy as np
import pytest
from qwen_checkpoints import make_checkpoint

from hyper_gen import generate, load_model
from hyper_gen.engine import Engine, SamplingParams

BACKENDS = ["torch", "mindspore"]
VOCAB = 97
_MODELS = {}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("state_slots")


def model_of(root, backend):
    if backend not in _MODELS:
        _MODELS[backend] = load_model(make_checkpoint(root, "dense", "float32"), backend=backend)
    return _MODELS[backend]


def host(tensor):
    return tensor.asnumpy() if hasattr(tensor, "asnumpy") else tensor.detach().numpy()


def check_slots(runner):
    """Every live sequence owns one slot of its own, the null slot none; owned + free = the pool."""
    owned = list(runner.slot_of.values())
    assert len(set(owned)) == len(owned) and 0 not in owned
    assert sorted(owned + runner.free_slots) == list(range(1, runner.store.num_rows + 1))
    assert set(runner.slot_of) == {row.key for row in runner.rows} | set(runner.prefills)


@pytest.mark.parametrize("backend", BACKENDS)
def test_slots_follow_admissions_forks_preemptions_and_aborts(root, backend, one_torch_thread):
    model = model_of(root, backend)
    probe = Engine(model, block_size=4, max_num_seqs=5).stats()
    budget = 20 * probe["bytes_per_block"] + probe["state_slot_bytes"] + 1
    engine = Engine(
        model, block_size=4, max_num_seqs=5, cache_memory_bytes=budget, max_num_batched_tokens=16,
        state_snapshot_blocks=2,
    ).start(background=False)  # fmt: skip
    runner = engine._runner
    rng = np.random.default_rng(11)
    requests = []
    shared = rng.integers(8, VOCAB, 16).tolist()  # (some prompts share a prefix: hits resume from a snapshot)
    for i in range(12):
        prompt = rng.integers(8, VOCAB, int(rng.integers(3, 30))).tolist()
        prompt = shared + prompt[:10] if i % 3 == 0 else prompt
        n = int(rng.choice([1, 1, 2, 3]))
        seeded = bool(rng.integers(2))
        extra = dict(temperature=1.2, top_k=9, seed=100 + i) if seeded else dict(temperature=0)
        params = SamplingParams(n=n, max_tokens=int(rng.integers(3, 14)), ignore_eos=True, **extra)
        requests.append((f"r{i}", prompt, params, extra))
    streams, aborted, waiting = {}, set(), list(requests)
    while waiting or engine.step():
        if waiting and rng.random() < 0.7:
            rid, prompt, params, _ = waiting.pop(0)
            streams[rid] = engine.submit(prompt, params, request_id=rid)
        live = [rid for rid, s in streams.items() if rid not in aborted and not s.finished]
        if live and rng.random() < 0.08:
            rid = live[int(rng.integers(len(live)))]
            engine.abort(rid)
            aborted.add(rid)
        check_slots(runner)
    stats = engine.stats()
    assert stats["prefix_cache_hits"] > 0
    assert not runner.slot_of and len(runner.free_slots) == 5
    engine.shutdown()
    assert stats["preemptions"] > 0 and aborted
    for rid, prompt, params, extra in requests:
        if rid in aborted:
            continue
        sample = dict(do_sample=True, temperature=1.2, top_k=9, seed=extra["seed"]) if "seed" in extra else {}
        ref = host(generate(model, [prompt] * params.n, max_new_tokens=params.max_tokens, eos_token_id=None, **sample))
        out = streams[rid].result(timeout=0)
        assert [c.token_ids for c in out.outputs] == ref[:, len(prompt) :].tolist(), rid


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_slot_pool_is_in_the_budget_and_goes_with_sleep(root, backend, one_torch_thread):
    model = model_of(root, backend)
    with Engine(model, block_size=4, max_num_seqs=3) as engine:
        store = engine._runner.store
        layout = store.layout
        assert store.state_slots_nbytes() == 4 * layout.bytes_per_state() == engine.stats()["state_slot_bytes"] > 0
        assert store.nbytes() <= engine.stats()["cache_memory_bytes"]
        for pools, specs in ((store.conv, layout.conv), (store.recurrent, layout.recurrent)):
            assert set(pools) == set(specs)
            assert all(tuple(pools[i].shape) == (4,) + specs[i].shape for i in specs)
        prompt = list(range(10, 30))
        want = engine.submit(prompt, SamplingParams(max_tokens=5, temperature=0)).result(timeout=120)
        engine.sleep()
        assert not store.conv and not store.recurrent and not store.allocated
        engine.wake_up()
        assert set(store.recurrent) == set(layout.recurrent)
        again = engine.submit(prompt, SamplingParams(max_tokens=5, temperature=0)).result(timeout=120)
    assert again.outputs[0].token_ids == want.outputs[0].token_ids
    with pytest.raises(ValueError, match=r"cannot hold one KV cache block .* beside the Gated DeltaNet states"):
        Engine(model, max_num_seqs=3, cache_memory_bytes=store.state_slots_nbytes() + 1)
