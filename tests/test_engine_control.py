"""abort_all / abort / pause / resume on the demo model, torch and MindSpore, with the engine on its own
thread and stepped by the caller: an aborted request keeps every token and logprob it had (a prefix
of the uninterrupted run), the requests left alone are untouched, and a kept pause changes no token.
The TP=2 check runs tests/dist_scripts/engine_tp_control.py under torchrun.
"""

import json
import re
import threading
import time

import pytest
from backend_harness import SLOW_ON_MINDSPORE
from launch import script, torchrun
from test_engine import demo, host, prompts, reference
from transformers import AutoTokenizer

from hyper_gen import generate
from hyper_gen.engine import Engine, SamplingParams
from hyper_gen.engine.outputs import RequestOutput

BACKENDS = ["torch", "mindspore"]
SAMPLED = dict(temperature=1.3, top_k=8, top_p=0.9)


@pytest.fixture(scope="module")
def tokenizer():
    from demo_task import DEMO_MODEL_DIR

    return AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)


def slowed(engine, seconds=0.02):
    """Count the engine's decode steps (``counter[0]``) and make each one last at least ``seconds``,
    so a request of a few dozen tokens is surely still running when the test acts on it."""
    forward, counter = engine._runner.forward, [0]

    def counted(groups):
        counter[0] += 1
        time.sleep(seconds)
        return forward(groups)

    engine._runner.forward = counted
    return counter


def same_prefix(partial, full) -> int:
    """Assert ``partial`` (a choice of an aborted request) is the start of ``full`` (the same choice
    uninterrupted): the same tokens and, position by position, the same logprobs; returns its length."""
    k = len(partial.token_ids)
    assert partial.token_ids == full.token_ids[:k]
    if full.logprobs is None:
        assert partial.logprobs is None
        return k
    assert len(partial.logprobs) == k
    for got, want in zip(partial.logprobs, full.logprobs):
        assert got["token_id"] == want["token_id"]
        assert got["logprob"] == pytest.approx(want["logprob"], abs=1e-5)
        assert [i for i, _ in got["top_logprobs"]] == [i for i, _ in want["top_logprobs"]]
    return k


@pytest.mark.parametrize("backend", BACKENDS)
def test_abort_all_returns_the_partial_rollouts(backend, tokenizer, one_torch_thread):
    model = demo(backend)
    ids = prompts(tokenizer, 3, seed=21)
    steps = 40
    params = [
        SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True, logprobs=2),
        SamplingParams(n=2, max_tokens=steps, seed=3, ignore_eos=True, logprobs=1, **SAMPLED),
        SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True),
    ]
    with Engine(model, tokenizer, max_batch_size=4) as engine:
        full = engine.run_batch(list(zip(ids, params)))
        slowed(engine)
        engine.pause(mode="keep")  # submitted while paused: admitted together at resume
        streams = [engine.submit(p, q) for p, q in zip(ids, params)]  # 4 rows: the batch is full
        queued = engine.submit(ids[0], SamplingParams(max_tokens=4))
        engine.resume()
        first = iter(streams[0])
        seen = [next(first) for _ in range(3)]
        outs = engine.abort_all()
        assert [o.request_id for o in outs] == [s.request_id for s in streams + [queued]]  # submission order
        lengths = set()
        for out, whole in zip(outs, full):
            assert isinstance(out, RequestOutput) and len(out.outputs) == len(whole.outputs)
            for partial, choice in zip(out.outputs, whole.outputs):
                assert partial.finish_reason == "abort"
                lengths.add(same_prefix(partial, choice))
                assert partial.text == tokenizer.decode(partial.token_ids, skip_special_tokens=True)
            assert out.completion_tokens == sum(len(c.token_ids) for c in out.outputs)
        assert len(lengths) == 1 and 3 <= lengths.pop() < steps  # admitted together: as far as each other
        assert outs[3].outputs[0].token_ids == [] and outs[3].outputs[0].finish_reason == "abort"
        rest = list(first)  # the stream ends cleanly: a last "abort" chunk, no exception
        assert rest[-1].finished and rest[-1].finish_reason == "abort"
        assert [t for c in seen + rest for t in c.token_ids] == outs[0].outputs[0].token_ids
        assert [s.result(timeout=10) for s in streams + [queued]] == outs
        assert engine.abort_all() == []  # nothing left to abort
        after = engine.submit(ids[1], SamplingParams(max_tokens=6, temperature=0)).result(timeout=60)
    assert after.outputs[0].token_ids == reference(model, ids[1], 6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_abort_one_leaves_the_others_unchanged(backend, tokenizer, one_torch_thread):
    """Stepped by the caller: the aborted request has exactly the steps run so far."""
    model = demo(backend)
    ids = prompts(tokenizer, 3, seed=22)
    params = [
        SamplingParams(max_tokens=10, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=1),
        SamplingParams(max_tokens=10, seed=9, ignore_eos=True, **SAMPLED),
    ]
    engine = Engine(model, tokenizer, max_batch_size=4).start(background=False)
    streams = [engine.submit(p, q, request_id=f"r{i}") for i, (p, q) in enumerate(zip(ids, params))]
    for _ in range(4):
        assert engine.step()
    out = engine.abort("r1")
    assert out.request_id == "r1" and out.outputs[0].finish_reason == "abort"
    assert out.outputs[0].token_ids == reference(model, ids[1], 10, eos_token_id=None)[:4]
    assert len(out.outputs[0].logprobs) == 4
    assert streams[1].result(timeout=0) == out
    assert engine.abort("r1") is None  # already finished: a no-op
    while engine.step():
        pass
    assert streams[0].result(timeout=0).outputs[0].token_ids == reference(model, ids[0], 10, eos_token_id=None)
    seeded = reference(model, ids[2], 10, eos_token_id=None, do_sample=True, seed=9, **SAMPLED)
    assert streams[2].result(timeout=0).outputs[0].token_ids == seeded
    assert engine.abort("r0") is None
    engine.shutdown()


@pytest.mark.parametrize("backend", SLOW_ON_MINDSPORE)
def test_pause_keep_then_resume_is_an_uninterrupted_run(backend, tokenizer, one_torch_thread):
    model = demo(backend)
    ids = prompts(tokenizer, 3, seed=23)
    steps = 16
    params = [
        SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True, logprobs=1),
        SamplingParams(n=2, max_tokens=steps, seed=11, ignore_eos=True, **SAMPLED),
    ]
    with Engine(model, tokenizer, max_batch_size=3) as engine:
        full = engine.run_batch(list(zip(ids, params)))
        decodes = slowed(engine, 0.01)
        streams = [engine.submit(p, q) for p, q in zip(ids, params)]
        first = iter(streams[0])
        next(first), next(first)
        assert engine.pause("keep") == [] and engine.paused
        held = decodes[0]
        late = engine.submit(ids[2], SamplingParams(max_tokens=6, temperature=0))  # queues while paused
        time.sleep(0.3)
        assert decodes[0] == held and not any(s.finished for s in streams + [late])  # nothing ran
        assert engine.stats()["waiting"] == 1
        engine.resume()
        assert not engine.paused
        outs = [s.result(timeout=60) for s in streams]
        assert late.result(timeout=60).outputs[0].token_ids == reference(model, ids[2], 6)
        engine.resume()  # not paused: a no-op
    for out, whole in zip(outs, full):
        assert [c.token_ids for c in out.outputs] == [c.token_ids for c in whole.outputs]
        assert [c.finish_reason for c in out.outputs] == ["length"] * len(out.outputs)
        for got, want in zip(out.outputs, whole.outputs):
            same_prefix(got, want)
    assert outs[0].outputs[0].token_ids == reference(model, ids[0], steps, eos_token_id=None)
    ref = dict(do_sample=True, seed=11, eos_token_id=None, **SAMPLED)
    rows = host(generate(model, [ids[1]] * 2, max_new_tokens=steps, **ref))[:, len(ids[1]) :]
    assert [c.token_ids for c in outs[1].outputs] == [r.tolist() for r in rows]


@pytest.mark.parametrize("backend", BACKENDS)
def test_pause_abort_ends_everything_and_later_requests_wait_for_resume(backend, tokenizer, one_torch_thread):
    model = demo(backend)
    ids = prompts(tokenizer, 2, seed=24)
    with Engine(model, tokenizer, max_batch_size=2) as engine:
        slowed(engine)
        running = engine.submit(ids[0], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
        next(iter(running))
        outs = engine.pause()  # mode="abort"
        assert engine.paused and [o.request_id for o in outs] == [running.request_id]
        assert outs[0].outputs[0].finish_reason == "abort" and running.result(timeout=10) == outs[0]
        assert 1 <= len(outs[0].outputs[0].token_ids) < 40
        queued = engine.submit(ids[1], SamplingParams(max_tokens=6, temperature=0))
        time.sleep(0.2)
        stats = engine.stats()
        assert not queued.finished and (stats["running"], stats["waiting"]) == (0, 1)
        assert stats["blocks_used"] == 0  # the aborted row's blocks went back to the pool
        engine.resume()
        assert queued.result(timeout=60).outputs[0].token_ids == reference(model, ids[1], 6)


def test_a_caller_driven_engine_pauses_between_steps(tokenizer, one_torch_thread):
    """step() on a driver thread, pause / resume from this one: pause returns between two steps,
    step() runs nothing while paused, and the tokens are an uninterrupted run's."""
    model = demo("torch")
    ids = prompts(tokenizer, 2, seed=25)
    engine = Engine(model, tokenizer, max_batch_size=2).start(background=False)
    decodes = slowed(engine, 0.005)
    stop = threading.Event()

    def drive():
        while not stop.is_set():
            if not engine.step():
                time.sleep(0.002)

    driver = threading.Thread(target=drive)
    driver.start()
    try:
        stream = engine.submit(ids[0], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
        next(iter(stream))
        assert engine.pause("keep") == []
        held = decodes[0]
        late = engine.submit(ids[1], SamplingParams(max_tokens=5, temperature=0))
        time.sleep(0.1)
        assert decodes[0] == held and not stream.finished and not late.finished
        assert engine.step() is False  # paused: no forward
        engine.resume()
        assert stream.result(timeout=60).outputs[0].token_ids == reference(model, ids[0], 20, eos_token_id=None)
        assert late.result(timeout=60).outputs[0].token_ids == reference(model, ids[1], 5)
    finally:
        stop.set()
        driver.join(30)
        engine.shutdown()


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_control_calls_name_what_is_wrong(backend, tokenizer, one_torch_thread):
    model = demo(backend)
    prompt = prompts(tokenizer, 1, seed=26)[0]
    with pytest.raises(RuntimeError, match="not running"):
        Engine(model).abort_all()
    with Engine(model, tokenizer) as engine:
        with pytest.raises(ValueError, match=r"mode.*'later'"):
            engine.pause(mode="later")
        assert not engine.paused
        with pytest.raises(ValueError, match="request_id='ghost'"):
            engine.abort("ghost")
        with pytest.raises(TypeError, match="request_id"):
            engine.abort(7)
        caught = []

        def from_the_engine_thread(stream):
            try:
                engine.abort_all()
            except RuntimeError as error:
                caught.append(str(error))

        stream = engine.submit(prompt, SamplingParams(max_tokens=3, temperature=0))
        stream.add_done_callback(from_the_engine_thread)
        stream.result(timeout=60)
        assert caught and "another thread" in caught[0]  # refused, not a deadlock
        assert engine.abort(stream.request_id) is None
    with pytest.raises(RuntimeError, match="shut down"):
        engine.abort_all()
    engine.resume()  # not paused: a no-op, even after shutdown


@pytest.mark.distributed
def test_tp2_ranks_agree_after_abort_all_pause_resume_and_sleep():
    result = torchrun([script("engine_tp_control.py")], timeout=240)
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-4000:]
    found = {int(r): json.loads(v) for r, v in re.findall(r"rank (\d): RESULT (.+)", log)}
    assert set(found) == {0, 1}, log[-4000:]
    checks = found[0]
    assert checks["abort_reasons"] == ["abort"] * 4 and checks["abort_prefix"], checks
    assert checks["keep_equals_generate"] and checks["held"] and checks["late"], checks
    assert checks["pause_abort"] == "abort" and checks["after_resume"], checks
    # sleep / wake_up travel in the plan: both ranks release their pool and allocate it again
    assert checks["busy_refused"] and checks["sleep_abort"] == ["abort"] and checks["asleep_refuses"], checks
    assert checks["after_wake"], checks
    assert found[0]["sleeps"] == found[1]["sleeps"] == [[True, True, False], [False, False, True]], found
    # the follower ran the same steps on the same rows and drew the same tokens
    assert found[1]["trace"] == checks["trace"] and found[1]["tokens"] == checks["tokens"], (found[1], checks)
