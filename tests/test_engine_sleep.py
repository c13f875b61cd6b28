"""Engine.sleep() / wake_up() between rollouts, and the prefix cache across a weight update, torch and
MindSpore: asleep the pool is released (torch's RSS drops by the pool's bytes) and submit is refused;
woken, the same prompt gives the same tokens; a busy engine refuses to sleep unless told to abort; after
update_weights nothing the old weights computed is served from the prefix cache."""

import time

import numpy as np
import psutil
import pytest
from demo_task import DEMO_MODEL_DIR
from safetensors.numpy import load_file

from hyper_gen import generate, load_model
from hyper_gen.engine import Engine, SamplingParams

BACKENDS = ["torch", "mindspore"]
PROMPT = [int(t) for t in np.random.default_rng(0).integers(8, 99, 40)]
_MODELS = {}


def demo(backend):
    if backend not in _MODELS:
        _MODELS[backend] = load_model(DEMO_MODEL_DIR, backend=backend)
    return _MODELS[backend]


def greedy(n, **kw):
    return SamplingParams(max_tokens=n, temperature=0, **kw)


def host(tensor):
    return tensor.asnumpy() if hasattr(tensor, "asnumpy") else tensor.numpy()


@pytest.mark.parametrize("backend", BACKENDS)
def test_sleep_and_wake_up_keep_the_tokens(backend, one_torch_thread):
    with Engine(demo(backend), block_size=8, state_snapshot_blocks=1) as engine:
        before = engine.submit(PROMPT, greedy(6)).result(timeout=60).outputs[0].token_ids
        deadline = time.monotonic() + 10  # the finished row leaves at the next step: its blocks stay cached
        while engine.stats()["blocks_used"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.stats()["blocks_used"] == 0 and engine.stats()["blocks_cached"] > 0
        assert engine.sleep() == [] and engine.is_sleeping
        assert engine.sleep() == []  # a no-op
        with pytest.raises(RuntimeError, match="asleep"):
            engine.submit(PROMPT, greedy(2))
        engine.wake_up()
        assert not engine.is_sleeping
        stats = engine.stats()
        assert stats["blocks_cached"] == 0 and stats["blocks_used"] == 0  # the prefix cache went with the pool
        after = engine.submit(PROMPT, greedy(6)).result(timeout=60)
    assert after.outputs[0].token_ids == before


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_busy_engine_sleeps_only_when_told_to_abort(backend, one_torch_thread):
    with Engine(demo(backend)) as engine:
        stream = engine.submit(PROMPT, greedy(400, ignore_eos=True))
        next(iter(stream))
        with pytest.raises(RuntimeError, match=r"1 request\(s\) are running or queued.*abort=True"):
            engine.sleep()
        assert not engine.is_sleeping
        outputs = engine.sleep(abort=True)
        assert engine.is_sleeping and [o.outputs[0].finish_reason for o in outputs] == ["abort"]
        assert stream.result(timeout=30).outputs[0].finish_reason == "abort"
        engine.wake_up()
        assert engine.submit(PROMPT, greedy(2)).result(timeout=60).outputs[0].token_ids
    with pytest.raises(TypeError, match="abort must be a bool"):
        Engine(demo(backend)).sleep(abort="yes")


def test_sleep_hands_the_pool_back_to_the_os_on_torch(one_torch_thread):
    """RSS falls by at least 90% of the pool's bytes asleep (what wake_up allocates again may reuse
    memory the process had freed, so its growth is not asserted; the tokens after it are, above)."""
    process = psutil.Process()
    with Engine(demo("torch"), cache_memory_bytes=256 << 20) as engine:
        engine.submit(PROMPT, greedy(2)).result(timeout=60)
        pool = engine.stats()["cache_memory_bytes"]
        awake = process.memory_info().rss
        engine.sleep()
        time.sleep(0.2)
        asleep = process.memory_info().rss
        engine.wake_up()
        assert engine._runner.store.allocated
    assert awake - asleep >= 0.9 * pool, (awake, asleep, pool)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_weight_update_empties_the_prefix_cache(backend, one_torch_thread):
    weights = load_file(f"{DEMO_MODEL_DIR}/model.safetensors")
    rng = np.random.default_rng(1)
    new = {k: v + rng.normal(0, 0.02, v.shape).astype(v.dtype) for k, v in weights.items()}
    model = load_model(DEMO_MODEL_DIR, backend=backend)
    with Engine(model, block_size=8, state_snapshot_blocks=1) as engine:
        engine.submit(PROMPT, greedy(4)).result(timeout=60)
        engine.submit(PROMPT, greedy(4)).result(timeout=60)
        hits = engine.stats()["prefix_cache_hits"]
        assert hits == 32  # 4 of the 40-token prompt's 8-token blocks (its last token is always recomputed)
        engine.update_weights(new.items(), version=2)
        out = engine.submit(PROMPT, greedy(4, ignore_eos=True)).result(timeout=60)
        assert engine.stats()["prefix_cache_hits"] == hits  # nothing computed by the old weights is reused
    ref = host(generate(model, [PROMPT], max_new_tokens=4, eos_token_id=None))[0, len(PROMPT) :]
    assert out.outputs[0].token_ids == ref.tolist()


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_sleep_with_abort_while_threads_keep_submitting(backend, one_torch_thread):
    """Issue 48: ``sleep(abort=True)`` never fails for requests that arrive meanwhile. Submissions
    are refused from the moment the sleep is asked for until ``wake_up``; everything accepted ends
    (its tokens, or finish_reason "abort"), none is left waiting."""
    import threading

    stop, accepted, refused, unexpected = threading.Event(), [], [], []

    def submit_forever(seed):
        rng = np.random.default_rng(seed)
        while not stop.is_set():
            try:
                prompt = PROMPT[: int(rng.choice([9, 40]))]  # (two shapes: MindSpore compiles one graph a shape)
                accepted.append(engine.submit(prompt, greedy(int(rng.integers(1, 12)))))
            except RuntimeError as error:
                (refused if "sleep" in str(error) else unexpected).append(error)
            time.sleep(0.002)  # a few hundred requests a second from each

    with Engine(demo(backend), max_batch_size=4) as engine:
        threads = [threading.Thread(target=submit_forever, args=(seed,)) for seed in range(3)]
        for thread in threads:
            thread.start()
        try:
            for _ in range(8):
                while not accepted:
                    time.sleep(0.001)
                engine.sleep(abort=True)
                assert engine.is_sleeping
                count = len(accepted)
                time.sleep(0.01)
                assert len(accepted) == count  # asleep: nothing is taken
                engine.wake_up()
        finally:
            stop.set()
            for thread in threads:
                thread.join()
        assert refused and not unexpected, unexpected[:3]
        reasons = {o.finish_reason for stream in accepted for o in stream.result(timeout=60).outputs}
        assert reasons <= {"abort", "stop", "length"} and "abort" in reasons
        assert engine.stats()["running"] == engine.stats()["waiting"] == 0
        assert engine.submit(PROMPT, greedy(2)).result(timeout=60).outputs[0].token_ids
