"""Controls as messages (engine/messages.py, engine/core.py), torch and MindSpore: every call the engine
takes is one typed message on the core's one queue, applied at a step boundary by the one step function
(at world size 1 too: a weight update and a sleep travel in the step plan, applied by the same
``execute`` every rank runs), the messages of one boundary apply in the order they came, a control from
the engine's own thread is refused instead of waiting for itself, and no waiter outlives the engine.
"""

import threading
import time

import numpy as np
import pytest
from demo_task import DEMO_MODEL_DIR
from safetensors.numpy import load_file

from hyper_gen import load_model
from hyper_gen.engine import Engine, EngineDeadError, SamplingParams
from hyper_gen.engine.messages import (
    Abort,
    AddRequest,
    Pause,
    Resume,
    Shutdown,
    Sleep,
    UpdateWeights,
    WakeUp,
)

BACKENDS = ["torch", "mindspore"]
PROMPT = [int(t) for t in np.random.default_rng(3).integers(8, 99, 12)]
_MODELS = {}


def demo(backend):
    if backend not in _MODELS:
        _MODELS[backend] = load_model(DEMO_MODEL_DIR, backend=backend)
    return _MODELS[backend]


def greedy(n, **kw):
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, **kw)


class Traced:
    """Records what goes through an engine's core: every message posted, every call of the step
    function (and the thread it ran on), every plan executed."""

    def __init__(self, engine):
        core = self.core = engine._core
        self.posted, self.steps, self.plans = [], [], []
        post, step, execute = core.post, core.step, core.execute

        def traced_post(message):
            post(message)
            self.posted.append(message)  # (queued: a refused message raised above)

        def traced_step(*args, **kwargs):
            self.steps.append(threading.get_ident())
            return step(*args, **kwargs)

        def traced_execute(plan):
            self.plans.append(plan)
            return execute(plan)

        core.post, core.step, core.execute = traced_post, traced_step, traced_execute

    def kinds(self):
        return [type(m).__name__ for m in self.posted]


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_call_is_one_message_applied_by_the_one_step(backend, one_torch_thread):
    """Stepped by the caller, world size 1: each control posts exactly one message, which is answered
    inside a call of the step function on the caller's thread; a weight update and a sleep reach the
    model only through a plan executed by that step, and such a step computes nothing."""
    model = demo(backend)
    engine = Engine(model, block_size=4).start(background=False)
    trace = Traced(engine)
    me = threading.get_ident()

    stream = engine.submit(PROMPT, greedy(30))
    assert trace.kinds() == ["AddRequest"] and not trace.steps  # queued: nothing runs until a step
    assert engine.stats()["waiting"] == 1
    for _ in range(3):
        assert engine.step()
    assert len(trace.plans) == 3 and all(p.scheduled is not None for p in trace.plans)

    calls = [
        (lambda: engine.pause("keep"), Pause),
        (engine.resume, Resume),
        (lambda: engine.update_weights(load_file(f"{DEMO_MODEL_DIR}/model.safetensors"), version=5), UpdateWeights),
        (lambda: engine.abort(stream.request_id), Abort),
        (engine.sleep, Sleep),
        (engine.wake_up, WakeUp),
    ]
    for call, kind in calls:
        posted, steps, plans = len(trace.posted), len(trace.steps), len(trace.plans)
        call()
        assert [type(m) for m in trace.posted[posted:]] == [kind], kind
        message = trace.posted[posted]
        assert message.future.done() and message.future.exception() is None, kind
        assert len(trace.steps) > steps and set(trace.steps[steps:]) == {me}, kind  # the step function did it
        new = trace.plans[plans:]
        assert all(p.scheduled is None for p in new), (kind, new)  # a control's step computes nothing
        if kind is UpdateWeights:
            assert [p.update["version"] for p in new] == ["5"] and engine.weight_version == 5
        if kind in (Sleep, WakeUp):
            assert [p.sleep for p in new] == [kind is Sleep]
    assert stream.result(timeout=0).outputs[0].finish_reason == "abort"
    assert stream.result(timeout=0).weight_version == 5
    engine.shutdown()
    assert type(trace.posted[-1]) is Shutdown and trace.plans[-1].shutdown
    assert not engine.alive


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_engine_thread_calls_the_same_step(backend, one_torch_thread):
    """On its own thread the engine runs the same step function, and a control waits for it there."""
    model = demo(backend)
    engine = Engine(model)
    trace = Traced(engine)
    with engine:
        out = engine.submit(PROMPT, greedy(4)).result(timeout=60)
        engine.pause("keep")
        engine.resume()
        assert engine.abort_all() == []
    assert len(out.outputs[0].token_ids) == 4
    assert trace.kinds() == ["AddRequest", "Pause", "Resume", "Abort", "Shutdown"]
    assert trace.steps and set(trace.steps) == {engine._core._thread.ident}


@pytest.mark.parametrize("backend", BACKENDS)
def test_messages_of_one_boundary_apply_in_order(backend, one_torch_thread):
    model = demo(backend)
    engine = Engine(model).start(background=False)
    trace = Traced(engine)
    core = engine._core

    # a pause then a resume in one boundary: not paused, and the step computes
    core.post(Pause("keep"))
    core.post(Resume())
    stream = engine.submit(PROMPT, greedy(3))
    assert engine.step() and not engine.paused and trace.plans[-1].scheduled is not None
    # a resume then a pause: paused, nothing computed
    core.post(Resume())
    core.post(Pause("keep"))
    plans = len(trace.plans)
    assert engine.step() is False and engine.paused and len(trace.plans) == plans
    core.post(Resume())
    while engine.step():
        pass
    assert len(stream.result(timeout=0).outputs[0].token_ids) == 3

    # an abort after the add it names, in one boundary: the request ends without running
    plans = len(trace.plans)
    late = engine.submit(PROMPT, greedy(5), request_id="late")
    abort = Abort("late")
    core.post(abort)
    engine.step()
    assert abort.future.result(timeout=0)[0].request_id == "late"
    out = late.result(timeout=0)
    assert out.outputs[0].finish_reason == "abort" and out.outputs[0].token_ids == []
    assert not any(p.admissions for p in trace.plans[plans:])

    # a sleep ends the boundary's messages: what came after it waits for the next step
    core.post(Pause("keep"))
    sleep, wake = Sleep(), WakeUp()
    core.post(sleep)
    core.post(Resume())
    core.post(wake)
    engine.step()
    assert sleep.future.done() and engine.is_sleeping and engine.paused  # the Resume waits
    assert trace.plans[-1].sleep is True and trace.plans[-1].hold and not wake.future.done()
    engine.step()
    assert not engine.paused and wake.future.done() and not engine.is_sleeping
    assert trace.plans[-1].sleep is False and not trace.plans[-1].hold
    again = engine.submit(PROMPT, greedy(3))
    while engine.step():
        pass
    assert again.result(timeout=0).outputs[0].token_ids == stream.result(timeout=0).outputs[0].token_ids
    engine.shutdown()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_control_from_the_engine_thread_is_refused(backend, one_torch_thread):
    """A done callback runs inside a step: a control there would wait for its own thread, so it is
    refused at once and queues nothing; a cancel, which nobody waits for, is taken."""
    model = demo(backend)
    caught, kinds = [], []
    with Engine(model) as engine:
        trace = Traced(engine)
        other = engine.submit(PROMPT, greedy(200))
        calls = [
            engine.abort_all,
            lambda: engine.abort("x"),
            engine.pause,
            engine.sleep,
            engine.wake_up,
            lambda: engine.update_weights({}, version=1),
        ]

        def from_the_engine_thread(stream):
            for call in calls:
                try:
                    call()
                except RuntimeError as error:
                    caught.append(str(error))
            kinds.extend(trace.kinds())
            other.cancel()

        stream = engine.submit(PROMPT, greedy(2))
        stream.add_done_callback(from_the_engine_thread)
        stream.result(timeout=60)
        out = other.result(timeout=60)
    assert len(caught) == len(calls) and all("another thread" in c for c in caught), caught
    assert kinds == ["AddRequest", "AddRequest"]  # nothing refused was queued
    assert out.outputs[0].finish_reason == "abort" and len(out.outputs[0].token_ids) < 200


def test_futures_fail_when_the_engine_dies(one_torch_thread):
    """An engine bug inside a step: a request queued meanwhile and a control another thread waits on
    get EngineDeadError (no hang), and so does every later call."""
    model = demo("torch")
    engine = Engine(model).start(background=False)
    core = engine._core
    stream = engine.submit(PROMPT, greedy(20))
    engine.step()
    late, failed = [], []

    def waiter():
        try:
            engine.abort_all()
        except BaseException as error:
            failed.append(error)

    thread = threading.Thread(target=waiter)

    def bug(*args, **kwargs):
        late.append(engine.submit(PROMPT, greedy(2)))  # (a submit does not wait: allowed here)
        thread.start()
        deadline = time.monotonic() + 10
        while not any(isinstance(m, Abort) for m in core._queue) and time.monotonic() < deadline:
            time.sleep(0.01)
        raise KeyError("bug")

    core.runner._select = bug
    with pytest.raises(KeyError):
        engine.step()
    thread.join(10)
    assert not thread.is_alive() and failed and isinstance(failed[0], EngineDeadError), failed
    for waited in (stream, late[0]):
        with pytest.raises(EngineDeadError, match="KeyError"):
            waited.result(timeout=0)
    with pytest.raises(EngineDeadError):
        engine.submit(PROMPT, greedy(2))
    with pytest.raises(EngineDeadError):
        engine.pause()
    assert not engine.alive and not core._queue


def test_a_waiting_control_fails_when_the_engine_thread_dies(one_torch_thread):
    model = demo("torch")
    entered, release = threading.Event(), threading.Event()
    with Engine(model) as engine:
        select = engine._core.runner._select

        def stuck_then_bug(*args, **kwargs):
            entered.set()
            if not release.wait(30):
                return select(*args, **kwargs)
            raise KeyError("bug")

        stream = engine.submit(PROMPT, greedy(50))
        engine._core.runner._select = stuck_then_bug
        failed = []

        def control():
            try:
                engine.pause("keep")
            except BaseException as error:
                failed.append(error)

        assert entered.wait(30)  # the engine thread is inside a step
        waiting = threading.Thread(target=control)
        waiting.start()
        time.sleep(0.2)
        assert waiting.is_alive()  # waiting for the step boundary the stuck step has not reached
        release.set()
        waiting.join(30)
        assert not waiting.is_alive() and failed and isinstance(failed[0], EngineDeadError), failed
        with pytest.raises(EngineDeadError):
            stream.result(timeout=10)


@pytest.mark.parametrize("backend", BACKENDS)
def test_shutdown_answers_what_was_queued_before_it(backend, one_torch_thread):
    """The shutdown is a message too: what was queued before it is applied first, in order."""
    model = demo(backend)
    engine = Engine(model).start(background=False)
    core = engine._core
    running = engine.submit(PROMPT, greedy(40))
    engine.step()
    pause = Pause("keep")
    core.post(pause)
    queued = engine.submit(PROMPT, greedy(3))
    engine.shutdown()
    assert pause.future.result(timeout=0) == []
    for stream in (running, queued):
        assert stream.result(timeout=0).outputs[0].finish_reason == "abort"
    with pytest.raises(RuntimeError, match="shut down"):
        core.post(AddRequest())
    assert core.stop() is None and not engine.alive
