"""The in-flight engine on the bundled demo model, torch and MindSpore: every request's tokens are
generate()'s for its prompt alone, whatever else shares the batch, when it arrives or leaves.

References are single-prompt ``hyper_gen.generate`` calls on the same model; requests arrive
while others are mid-decode, outnumber ``max_batch_size``, and ask for different lengths.
"""

import threading
import time

import numpy as np
import pytest
from backend_harness import SLOW_ON_MINDSPORE
from demo_task import DEMO_MODEL_DIR, make_prompts
from transformers import AutoTokenizer

from hyper_gen import generate, load_model
from hyper_gen.engine import Engine, SamplingParams

BACKENDS = ["torch", "mindspore"]
# MindSpore with its decode steps compiled from the first: the engine's steps run PyNative until a
# batch size has been decoded 256 times (decode_compile_after), more than these tests decode
COMPILED = "mindspore-compiled"
_MODELS = {}


def demo(backend):
    if backend not in _MODELS:
        _MODELS[backend] = load_model(DEMO_MODEL_DIR, backend=backend.split("-")[0])
        if backend == COMPILED:
            _MODELS[backend].decode_compile_after = 1
    return _MODELS[backend]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)


def host(tensor):
    return tensor.asnumpy() if hasattr(tensor, "asnumpy") else tensor.numpy()


def reference(model, prompt, max_new_tokens, **overrides):
    """generate()'s new tokens for ``prompt`` alone (with the EOS that ended it, no padding)."""
    out = host(generate(model, [prompt], max_new_tokens=max_new_tokens, **overrides))[0, len(prompt) :]
    return out.tolist() if "eos_token_id" in overrides else until_eos(out, model.generation_defaults["eos_token_id"])


def until_eos(row, eos=1):
    ended = np.flatnonzero(row == eos)
    return row[: ended[0] + 1].tolist() if ended.size else row.tolist()


def prompts(tokenizer, count, seed):
    return [tokenizer(p)["input_ids"] for p, _ in make_prompts(count, seed=seed)]


@pytest.mark.parametrize("backend", BACKENDS + [COMPILED])
def test_greedy_equals_generate_with_staggered_arrivals(backend, tokenizer, one_torch_thread):
    model = demo(backend)
    ids = prompts(tokenizer, 10, seed=7)
    lengths = [3, 12, 5, 9, 1, 12, 7, 2, 11, 6]
    with Engine(model, tokenizer, max_batch_size=3) as engine:
        streams = [engine.submit(ids[0], SamplingParams(max_tokens=lengths[0], temperature=0))]
        next(iter(streams[0]))  # the first request is decoding: the rest arrive mid-run
        for prompt, length in zip(ids[1:], lengths[1:]):
            streams.append(engine.submit(prompt, SamplingParams(max_tokens=length, temperature=0)))
            time.sleep(0.002)
        outs = [s.result(timeout=120) for s in streams]
    for prompt, length, out in zip(ids, lengths, outs):
        choice = out.outputs[0]
        assert choice.token_ids == reference(model, prompt, length)
        assert choice.text == tokenizer.decode(choice.token_ids, skip_special_tokens=True)
        assert choice.finish_reason == ("stop" if choice.token_ids[-1] == 1 else "length")
        assert out.prompt_tokens == len(prompt) and out.completion_tokens == len(choice.token_ids)


@pytest.mark.parametrize("backend", SLOW_ON_MINDSPORE + [COMPILED])
def test_a_request_never_waits_for_the_batch(backend, tokenizer, one_torch_thread):
    """Short requests join a running long one, finish and free their slot while it still runs."""
    model = demo(backend)
    ids = prompts(tokenizer, 7, seed=3)
    held = []  # per decode step: (blocks each row holds, blocks its own positions need)
    with Engine(model, tokenizer, max_batch_size=2, block_size=4) as engine:
        runner, kv = engine._runner, engine._scheduler.kv
        forward = runner.forward

        def recording_forward(groups):
            for rows in (g for g in groups if g.order is not None):  # the decoding rows
                for row, length in zip(rows.order, rows.positions[:, 0]):  # (the pending token has its slot)
                    held.append((len(kv.block_table(runner.rows[row].key)), -(-(int(length) + 1) // 4)))
            return forward(groups)

        runner.forward = recording_forward
        long = engine.submit(ids[0], SamplingParams(max_tokens=120, temperature=0, ignore_eos=True))
        next(iter(long))
        shorts = []
        for prompt in ids[1:]:  # one slot left: each short one reuses the slot the last one freed
            shorts.append(engine.submit(prompt, SamplingParams(max_tokens=4, temperature=0)))
            shorts[-1].result(timeout=60)
            assert not long.finished
        out = long.result(timeout=120)
    assert out.outputs[0].token_ids == reference(model, ids[0], 120, eos_token_id=None)
    assert out.outputs[0].finish_reason == "length"
    for prompt, stream in zip(ids[1:], shorts):
        assert stream.result().outputs[0].token_ids == reference(model, prompt, 4)
    # paged: a row holds the blocks of its own positions, never the longest row's
    assert held and all(blocks == needed for blocks, needed in held)


@pytest.mark.parametrize("backend", BACKENDS)
def test_run_batch_returns_input_order_and_many_more_than_the_batch(backend, tokenizer, one_torch_thread):
    model = demo(backend)
    ids = prompts(tokenizer, 12, seed=11)
    params = [SamplingParams(max_tokens=2 + i % 9, temperature=0) for i in range(len(ids))]
    with Engine(model, tokenizer, max_batch_size=4) as engine:
        outs = engine.run_batch(list(zip(ids, params)))
    assert [o.prompt_token_ids for o in outs] == ids
    for prompt, p, out in zip(ids, params, outs):
        assert out.outputs[0].token_ids == reference(model, prompt, p.max_tokens)


@pytest.mark.parametrize("backend", BACKENDS)
def test_seeded_sampling_is_generates_and_ignores_the_batch(backend, tokenizer, one_torch_thread):
    """seed=s equals generate(do_sample=True, seed=s) for the prompt alone; choice i of n draws as row i."""
    model = demo(backend)
    ids = prompts(tokenizer, 4, seed=5)
    settings = dict(temperature=1.7, top_k=8, top_p=0.95, min_p=0.01)
    with Engine(model, tokenizer, max_batch_size=8) as engine:
        busy = [engine.submit(p, SamplingParams(max_tokens=12, temperature=0)) for p in ids[1:]]
        single = engine.submit(ids[0], SamplingParams(max_tokens=10, seed=1234, **settings))
        many = engine.submit(ids[0], SamplingParams(n=3, max_tokens=10, seed=1234, **settings))
        full_vocab = engine.submit(ids[1], SamplingParams(max_tokens=10, seed=99, temperature=2.0))
        penalised = engine.submit(ids[2], SamplingParams(max_tokens=10, seed=5, repetition_penalty=1.5, min_tokens=6))
        outs = [s.result(timeout=120) for s in (single, many, full_vocab, penalised)]
        [b.result(timeout=120) for b in busy]
    ref = dict(do_sample=True, seed=1234, **settings)
    assert outs[0].outputs[0].token_ids == reference(model, ids[0], 10, **ref)
    rows = host(generate(model, [ids[0]] * 3, max_new_tokens=10, **ref))[:, len(ids[0]) :]
    assert [c.index for c in outs[1].outputs] == [0, 1, 2]
    for choice in outs[1].outputs:
        assert choice.token_ids == until_eos(rows[choice.index])
    assert outs[1].outputs[0].token_ids == outs[0].outputs[0].token_ids
    assert outs[2].outputs[0].token_ids == reference(
        model, ids[1], 10, do_sample=True, seed=99, temperature=2.0, top_k=0
    )
    expected = reference(model, ids[2], 10, do_sample=True, seed=5, repetition_penalty=1.5, min_new_tokens=6, top_k=0)
    assert outs[3].outputs[0].token_ids == expected and len(expected) >= 6


@pytest.mark.parametrize("backend", BACKENDS)
def test_unseeded_sampling_differs_between_requests(backend, tokenizer, one_torch_thread):
    model = demo(backend)
    prompt = prompts(tokenizer, 1, seed=1)[0]
    with Engine(model, tokenizer) as engine:
        out = engine.submit(prompt, SamplingParams(n=6, max_tokens=8, temperature=3.0, ignore_eos=True)).result(60)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_logprobs_are_the_raw_logits_log_softmax(backend, tokenizer, one_torch_thread):
    """Against numpy: float64 log_softmax of the model's full-sequence logits at each chosen token."""
    model = demo(backend)
    prompt = prompts(tokenizer, 1, seed=9)[0]
    with Engine(model, tokenizer) as engine:
        params = SamplingParams(max_tokens=6, temperature=0.9, seed=3, logprobs=4, repetition_penalty=1.2)
        stream = engine.submit(prompt, params)
        chunks = list(stream)
        out = stream.result()
    choice = out.outputs[0]
    assert [entry for c in chunks for entry in c.logprobs] == choice.logprobs
    sequence = prompt + choice.token_ids
    logits = host(model(_ids(backend, [sequence]))["logits"])[0].astype(np.float64)
    logits -= logits.max(axis=-1, keepdims=True)
    expected = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
    for step, entry in enumerate(choice.logprobs):
        row = expected[len(prompt) - 1 + step]
        assert entry["token_id"] == choice.token_ids[step]
        assert abs(entry["logprob"] - row[entry["token_id"]]) < 1e-4
        top = entry["top_logprobs"]
        assert len(top) == 4
        np.testing.assert_allclose([lp for _, lp in top], np.sort(row)[::-1][:4], atol=1e-4)
        assert all(abs(row[i] - lp) < 1e-4 for i, lp in top)


def _ids(backend, rows):
    if backend == "torch":
        import torch

        return torch.tensor(rows, dtype=torch.int64)
    import mindspore

    return mindspore.Tensor(np.asarray(rows, dtype=np.int64))


@pytest.mark.parametrize("backend", SLOW_ON_MINDSPORE)
def test_stop_reasons(backend, tokenizer, one_torch_thread):
    model = demo(backend)
    prompt = tokenizer("rev 123456 =")["input_ids"]
    three = tokenizer.convert_tokens_to_ids("3")
    with Engine(model, tokenizer) as engine:

        def run(**kwargs):
            stream = engine.submit(prompt, SamplingParams(temperature=0, **kwargs))
            chunks = list(stream)
            out = stream.result().outputs[0]
            assert "".join(c.text for c in chunks) == out.text  # streamed text adds up to the final text
            assert [t for c in chunks for t in c.token_ids] == out.token_ids
            assert [c.finished for c in chunks] == [False] * (len(chunks) - 1) + [True]
            return out

        eos = run(max_tokens=20)
        assert eos.text == " 654321" and eos.finish_reason == "stop" and eos.token_ids[-1] == 1
        stop = run(max_tokens=20, stop=["43", "x"])
        assert stop.text == " 65" and stop.finish_reason == "stop" and stop.token_ids == eos.token_ids[:5]
        ids_stop = run(max_tokens=20, stop_token_ids=[three])
        assert ids_stop.token_ids == eos.token_ids[:5] and ids_stop.text == " 6543" and ids_stop.finish_reason == "stop"
        length = run(max_tokens=3)
        assert length.token_ids == eos.token_ids[:3] and length.finish_reason == "length"
        ignore = run(max_tokens=15, ignore_eos=True)
        assert len(ignore.token_ids) == 15 and ignore.finish_reason == "length"
        assert ignore.token_ids == reference(model, prompt, 15, eos_token_id=None)
        at_least = run(max_tokens=15, min_tokens=11)
        assert len(at_least.token_ids) >= 11 and 1 not in at_least.token_ids[:11]
        assert at_least.token_ids == reference(model, prompt, 15, min_new_tokens=11)


@pytest.mark.parametrize("backend", BACKENDS)
def test_cancel_frees_the_slot(backend, tokenizer, one_torch_thread):
    model = demo(backend)
    ids = prompts(tokenizer, 2, seed=4)
    with Engine(model, tokenizer, max_batch_size=1) as engine:
        long = engine.submit(ids[0], SamplingParams(max_tokens=400, temperature=0, ignore_eos=True))
        next(iter(long))
        waiting = engine.submit(ids[1], SamplingParams(max_tokens=6, temperature=0))
        queued = engine.submit(ids[1], SamplingParams(max_tokens=6, temperature=0))
        queued.cancel()  # still in the queue: ends without running
        long.cancel()
        out = long.result(timeout=60)
        assert out.outputs[0].finish_reason == "abort" and len(out.outputs[0].token_ids) < 400
        assert queued.result(timeout=60).outputs[0].finish_reason == "abort"
        assert waiting.result(timeout=60).outputs[0].token_ids == reference(model, ids[1], 6)
        long.cancel()  # after the end: nothing happens
    assert not engine.alive


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_requests_are_refused_before_queueing_and_disturb_nobody(backend, tokenizer, one_torch_thread):
    model = demo(backend)
    prompt = prompts(tokenizer, 1, seed=2)[0]
    with Engine(model, tokenizer, max_batch_size=4) as engine:
        running = engine.submit(prompt, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
        bad = {
            "must not be empty": ([], SamplingParams()),
            r"prompt_token_ids\[1\] = 99 is not a token id": ([3, 99], SamplingParams()),
            r"prompt_token_ids\[0\] = -1": ([-1], SamplingParams()),
            "max_model_len=512": (prompt, SamplingParams(max_tokens=510)),
            "n=5 is more than the engine's max_batch_size=4": (prompt, SamplingParams(n=5)),
            "outside the vocabulary": (prompt, SamplingParams(stop_token_ids=[500])),
        }
        for message, (ids, params) in bad.items():
            with pytest.raises(ValueError, match=message):
                engine.submit(ids, params)
        with pytest.raises(TypeError, match="list of ints"):
            engine.submit([1.5, 2.0])
        with pytest.raises(TypeError, match="SamplingParams"):
            engine.submit(prompt, {"max_tokens": 3})
        assert running.result(60).outputs[0].token_ids == reference(model, prompt, 10, eos_token_id=None)
    with pytest.raises(RuntimeError, match="shut down"):
        engine.submit(prompt)
    with Engine(model) as bare, pytest.raises(ValueError, match="stop=.* needs text"):
        bare.submit(prompt, SamplingParams(stop="x"))
    with pytest.raises(ValueError, match="max_model_len=600 is more than the model's context of 512"):
        Engine(model, max_model_len=600)


def test_async_iteration_from_several_event_loops(tokenizer, one_torch_thread):
    import asyncio

    model = demo("torch")
    ids = prompts(tokenizer, 4, seed=8)

    async def collect(engine, prompt):
        return [c async for c in engine.generate(prompt, SamplingParams(max_tokens=8, temperature=0))]

    async def both(engine, pair):
        return await asyncio.gather(*(collect(engine, p) for p in pair))

    results = {}
    with Engine(model, tokenizer) as engine:
        threads = [
            threading.Thread(
                target=lambda i=i: results.setdefault(i, asyncio.run(both(engine, ids[2 * i : 2 * i + 2])))
            )
            for i in range(2)
        ]
        [t.start() for t in threads]
        [t.join(60) for t in threads]
    chunks = [results[0][0], results[0][1], results[1][0], results[1][1]]
    for prompt, got in zip(ids, chunks):
        assert [t for c in got for t in c.token_ids] == reference(model, prompt, 8)
        assert got[-1].finished and all(c.request_id == got[0].request_id for c in got)
