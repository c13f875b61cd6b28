"""Output processing off the step loop (engine/output_processor.py), torch and MindSpore.

A stop string is found by the output processor after the core drew the token that completed it,
perhaps with more behind it: the choice still ends exactly as generate()'s text says (finish_reason
"stop", the stop string cut from the text, the token that completed it kept, nothing drawn later),
and the abort it sends through the core's queue frees the choice's blocks. The tokenizer is
called on the output processor's thread only, never inside a step.
"""

import threading
import time

import pytest
from demo_task import DEMO_MODEL_DIR
from transformers import AutoTokenizer

from hyper_gen import generate, load_model
from hyper_gen.engine import Engine, SamplingParams
from hyper_gen.engine.messages import Abort
from hyper_gen.engine.request import Choice

STOP = "43"
_MODELS = {}


def demo(backend):
    if backend not in _MODELS:
        _MODELS[backend] = load_model(DEMO_MODEL_DIR, backend=backend)
    return _MODELS[backend]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)


class CountingTokenizer:
    """A tokenizer whose every decode records the thread it ran on (and, with ``gate``, waits for it).
    It hides ``backend_tokenizer``, so the engine's text goes through ``decode``."""

    def __init__(self, inner, gate=None):
        self._inner, self.gate = inner, gate
        self.threads, self.inside_steps = [], 0
        self.stepping = threading.local()

    def decode(self, ids, **kwargs):
        self.threads.append(threading.current_thread().name)
        self.inside_steps += bool(getattr(self.stepping, "on", False))
        if self.gate is not None:
            self.gate.wait(60)
        return self._inner.decode(ids, **kwargs)

    def __getattr__(self, name):
        if name == "backend_tokenizer":
            raise AttributeError(name)
        return getattr(self._inner, name)


def _expected(model, tokenizer, prompt, new):
    """Today's output for ``stop=[STOP]`` with greedy decoding past EOS: the shortest run of
    generate()'s tokens whose text holds the stop string, and that text cut before it."""
    out = generate(model, [prompt], max_new_tokens=new, eos_token_id=None)
    out = out.asnumpy() if hasattr(out, "asnumpy") else out.numpy()
    ids = out[0, len(prompt) :].tolist()
    for k in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:k], skip_special_tokens=True)
        if STOP in text:
            return ids[:k], text[: text.index(STOP)]
    raise AssertionError(f"{STOP!r} is not in generate()'s text {text!r}")


def _stops(engine):
    """The Abort messages the output processor sends (one per stop string found), as posted."""
    core, posted = engine._core, []
    post = core.post

    def traced(message):
        post(message)
        if isinstance(message, Abort) and isinstance(message.target, Choice):
            posted.append(message.target)

    core.post = traced
    return posted


def _check_chunks(chunks, out):
    assert "".join(c.text for c in chunks) == out.text
    assert [t for c in chunks for t in c.token_ids] == out.token_ids
    assert [c.finished for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert chunks[-1].finish_reason == "stop"


def _blocks_back(engine, baseline, seconds=30):
    deadline = time.monotonic() + seconds
    while engine.stats()["blocks_used"] != baseline and time.monotonic() < deadline:
        time.sleep(0.01)
    return engine.stats()["blocks_used"]


@pytest.mark.parametrize("backend", ["torch", "mindspore"])
def test_a_stop_string_ends_the_choice_as_today_and_frees_its_blocks(backend, tokenizer, one_torch_thread):
    """The core would draw 200 tokens (EOS ignored); the stop string ends the choice at generate()'s
    token with the text cut before it, and its abort gives the blocks back."""
    model = demo(backend)
    prompt = tokenizer("rev 123456 =")["input_ids"]
    want_ids, want_text = _expected(model, tokenizer, prompt, 12)
    params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True, stop=["x", STOP])
    with Engine(model, tokenizer, block_size=4) as engine:
        stops = _stops(engine)
        baseline = engine.stats()["blocks_used"]
        stream = engine.submit(prompt, params)
        chunks = list(stream)
        out = stream.result(timeout=60).outputs[0]
        assert _blocks_back(engine, baseline) == baseline
        assert _wait_idle(engine)
    assert out.token_ids == want_ids and out.text == want_text and out.finish_reason == "stop"
    _check_chunks(chunks, out)
    assert len(stops) == 1 and stops[0].finish_reason == "stop"
    assert len(stops[0].token_ids) < 200  # the abort ended it, not max_tokens


def _wait_idle(engine, seconds=30):
    deadline = time.monotonic() + seconds
    while engine.stats()["running"] and time.monotonic() < deadline:
        time.sleep(0.01)
    return engine.stats()["running"] == 0


def test_tokens_the_core_drew_after_the_stop_never_reach_the_output(tokenizer, one_torch_thread):
    """The output processor is held back until the core has drawn well past the stop string: the
    output is still today's, and the core's choice ends "stop" once the abort reaches it."""
    model = demo("torch")
    prompt = tokenizer("rev 123456 =")["input_ids"]
    want_ids, want_text = _expected(model, tokenizer, prompt, 12)
    gate = threading.Event()
    counting = CountingTokenizer(tokenizer, gate)
    params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True, stop=[STOP], logprobs=1)
    with Engine(model, counting, block_size=4) as engine:
        stops = _stops(engine)
        stream = engine.submit(prompt, params)
        deadline = time.monotonic() + 60
        drawn = []
        while time.monotonic() < deadline:
            drawn = [c for r in list(engine._core.live.values()) for c in r.choices]
            if drawn and len(drawn[0].token_ids) >= len(want_ids) + 8:
                break
            time.sleep(0.005)
        gate.set()
        chunks = list(stream)
        out = stream.result(timeout=60).outputs[0]
        assert _blocks_back(engine, 0) == 0
    assert len(drawn[0].token_ids) >= len(want_ids) + 8  # the core ran ahead of the text
    assert out.token_ids == want_ids and out.text == want_text and out.finish_reason == "stop"
    assert [e["token_id"] for e in out.logprobs] == want_ids  # the later tokens' logprobs are dropped too
    _check_chunks(chunks, out)
    assert stops == [drawn[0]] and drawn[0].finish_reason == "stop"


def test_the_tokenizer_runs_on_the_output_thread_never_in_a_step(tokenizer, one_torch_thread):
    model = demo("torch")
    counting = CountingTokenizer(tokenizer)
    prompt = tokenizer("rev 123456 =")["input_ids"]
    params = [SamplingParams(max_tokens=12, temperature=0), SamplingParams(max_tokens=12, temperature=0, stop=[STOP])]
    with Engine(model, counting, max_batch_size=2) as engine:
        outs = engine.run_batch([(prompt, p) for p in params])
    assert counting.threads and set(counting.threads) == {"hyper_gen-output"}
    plain = outs[0].outputs[0]
    assert plain.text == tokenizer.decode(plain.token_ids, skip_special_tokens=True)
    assert outs[1].outputs[0].finish_reason == "stop" and STOP not in outs[1].outputs[0].text

    # an engine stepped by its caller: the text is made on that thread, after each step, never inside it
    counting = CountingTokenizer(tokenizer)
    engine = Engine(model, counting, max_batch_size=2, block_size=4).start(background=False)
    core = engine._core
    step = core._step

    def marked(*args, **kwargs):
        counting.stepping.on = True
        try:
            return step(*args, **kwargs)
        finally:
            counting.stepping.on = False

    core._step = marked
    streams = [engine.submit(prompt, p) for p in params]
    while engine.step():
        pass
    inline = [s.result(timeout=0) for s in streams]
    assert engine.stats()["blocks_used"] == 0  # the stop's abort came in at the next step boundary
    engine.shutdown()
    assert counting.threads and counting.inside_steps == 0
    assert set(counting.threads) == {threading.current_thread().name}
    assert [o.outputs[0] for o in inline] == [o.outputs[0] for o in outs]
    stopped = inline[1].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.token_ids == _expected(model, tokenizer, prompt, 12)[0]


@pytest.mark.parametrize("background", [True, False])
def test_an_output_processing_error_kills_the_engine_loudly(tokenizer, background, one_torch_thread):
    """A tokenizer that raises: every open stream and later call gets EngineDeadError (no hang)."""
    from hyper_gen.engine import EngineDeadError

    model = demo("torch")

    class Broken(CountingTokenizer):
        def decode(self, ids, **kwargs):
            raise KeyError("tokenizer bug")

    prompt = tokenizer("rev 123456 =")["input_ids"]
    engine = Engine(model, Broken(tokenizer)).start(background=background)
    stream = engine.submit(prompt, SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    if not background:
        while engine.alive and engine.step():
            pass
    with pytest.raises(EngineDeadError, match="tokenizer bug"):
        stream.result(timeout=60)
    deadline = time.monotonic() + 30
    while engine.alive and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(EngineDeadError):
        engine.submit(prompt)
    engine.shutdown()
