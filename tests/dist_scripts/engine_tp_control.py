"""Two ranks: abort_all, pause("keep") / resume and pause("abort") on the in-flight engine at TP=2
(demo model). Rank 0 checks its outputs against single-device generate; both ranks record, after
every step they run, the rows in the batch and each row's tokens, and print them: the decision to
end or hold rows travels in the step plan, so the follower must show exactly rank 0's steps.
Prints ``rank R: RESULT {json}`` lines, never raises on a failed comparison
(tests/test_engine_control.py reads the lines).
"""

import hashlib
import json
import sys
import time

import numpy as np
import torch
from transformers import AutoTokenizer

from hyper_gen import generate, load_model
from hyper_gen.demo import demo_model_path
from hyper_gen.demo.task import make_prompts
from hyper_gen.engine import Engine, SamplingParams

torch.set_num_threads(1)
path = demo_model_path()
model = load_model(path, backend="torch", tp=2)
tokenizer = AutoTokenizer.from_pretrained(path)
engine = Engine(model, tokenizer, max_batch_size=3)
rank = engine.rank
steps, tokens = [], {}  # every executed plan: (hold, rows after it); each choice's tokens when last seen
execute = engine._core.execute  # the one function that applies a plan, on every rank


sleeps = []  # every sleep / wake_up plan this rank ran: (asleep asked, is_sleeping after, pool allocated after)


def traced(plan):
    execute(plan)
    if plan.sleep is not None:
        sleeps.append([plan.sleep, engine.is_sleeping, engine._runner.store.allocated])
    rows = engine._runner.rows
    steps.append([plan.hold, [[c.request.serial, c.index, len(c.token_ids)] for c in rows]])
    for c in rows:
        tokens[f"{c.request.serial}:{c.index}"] = list(c.token_ids)


engine._core.execute = traced


def say(label, value):
    sys.stdout.write(f"rank {rank}: {label} {json.dumps(value)}\n")
    sys.stdout.flush()


def trace():
    return {
        "trace": hashlib.sha1(json.dumps(steps).encode()).hexdigest(),
        "steps": len(steps),
        "tokens": tokens,
        "sleeps": sleeps,
    }


if rank != 0:
    engine.run_follower()
    say("RESULT", trace())
    sys.exit(0)

single = load_model(path, backend="torch")


def reference(prompt, count, **overrides):
    out = generate(single, [prompt], max_new_tokens=count, **overrides).numpy()[0, len(prompt) :]
    ended = np.flatnonzero(out == 1)
    return out[: ended[0] + 1].tolist() if ended.size and "eos_token_id" not in overrides else out.tolist()


forward, decodes = engine._runner.forward, [0]


def slow_forward(groups):  # rank 0 only: the follower waits in the step's collectives
    decodes[0] += 1
    time.sleep(0.02)
    return forward(groups)


engine._runner.forward = slow_forward
ids = [tokenizer(p)["input_ids"] for p, _ in make_prompts(7, seed=41)]
checks = {}
with engine:
    long = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    engine.pause(mode="keep")  # submitted while paused: the 3 rows are admitted together at resume
    streams = [engine.submit(p, long) for p in ids[:3]]  # the batch is full: the 4th waits
    queued = engine.submit(ids[3], long)
    engine.resume()
    first = iter(streams[0])
    [next(first) for _ in range(3)]
    outs = engine.abort_all()
    checks["abort_reasons"] = [o.outputs[0].finish_reason for o in outs]
    partial = [o.outputs[0].token_ids for o in outs]
    checks["abort_prefix"] = all(3 <= len(t) < 60 for t in partial[:3]) and partial[3] == []
    checks["abort_prefix"] &= all(t == reference(p, len(t), eos_token_id=None) for p, t in zip(ids, partial[:3]))

    sampled = dict(temperature=1.3, top_k=8)
    kept = [
        SamplingParams(max_tokens=16, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=16, seed=5, ignore_eos=True, **sampled),
    ]
    streams = [engine.submit(ids[i], q) for i, q in zip((4, 5), kept)]
    next(iter(streams[0]))
    engine.pause("keep")
    held = decodes[0]
    late = engine.submit(ids[6], SamplingParams(max_tokens=5, temperature=0))
    time.sleep(2.5)  # longer than the heartbeat: "hold" plans reach the follower while paused
    checks["held"] = decodes[0] == held and not any(s.finished for s in streams + [late])
    engine.resume()
    got = [s.result(timeout=120).outputs[0].token_ids for s in streams]
    want = [reference(ids[4], 16, eos_token_id=None)]
    want.append(reference(ids[5], 16, eos_token_id=None, do_sample=True, seed=5, **sampled))
    checks["keep_equals_generate"] = got == want
    checks["late"] = late.result(timeout=120).outputs[0].token_ids == reference(ids[6], 5)

    running = engine.submit(ids[0], long)
    next(iter(running))
    checks["pause_abort"] = engine.pause("abort")[0].outputs[0].finish_reason
    engine.resume()
    after = engine.submit(ids[1], SamplingParams(max_tokens=5, temperature=0)).result(timeout=120)
    checks["after_resume"] = after.outputs[0].token_ids == reference(ids[1], 5)

    running = engine.submit(ids[2], long)
    next(iter(running))
    try:
        engine.sleep()  # a request runs: refused on rank 0, no plan
        checks["busy_refused"] = False
    except RuntimeError as error:
        checks["busy_refused"] = "abort=True" in str(error)
    checks["sleep_abort"] = [o.outputs[0].finish_reason for o in engine.sleep(abort=True)]
    try:
        engine.submit(ids[3], long)
        checks["asleep_refuses"] = False
    except RuntimeError:
        checks["asleep_refuses"] = True
    engine.wake_up()
    again = engine.submit(ids[1], SamplingParams(max_tokens=5, temperature=0)).result(timeout=120)
    checks["after_wake"] = again.outputs[0].token_ids == reference(ids[1], 5)
say("RESULT", dict(checks, **trace()))
