"""Two ranks: ``Engine.update_weights`` on a TP=2 engine (torch or MindSpore), called on both ranks.

usage: engine_tp_update.py BACKEND OLD_CHECKPOINT NEW_CHECKPOINT SYNC_DIR

Rank 0 runs the engine thread and is its own trainer (the main thread calls update_weights); rank 1
runs ``run_follower`` on the main thread and its trainer in another thread, as a trainer would.
Every update gives the full HF tensors on both ranks. In order:

1. old weights: the engine's greedy tokens equal single-device generate() on OLD;
2. update to NEW (version 1) while a long request runs: later requests equal generate() on a fresh
   load of NEW, outputs carry weight_version 1, the running one too;
3. refused on both ranks, the model unchanged (NEW's tokens after each): a NaN on rank 1 only, a
   conversion that fails on rank 1 only, a version that differs on rank 1, a tensor rank 1 leaves out;
4. bounded waits: rank 0 calls and rank 1 does not (ValueError on rank 0 naming rank 1; rank 1's
   late call raises), then rank 1 calls and rank 0 does not (TimeoutError on rank 1);
5. OLD again (version 7), between ``pause("keep")`` and ``resume()`` with a request held: generate()'s
   OLD tokens after, version 7 on both ranks and on the held request's output;
6. a second engine on the same model, stepped by rank 0's caller (``start(background=False)``):
   an update between two steps (version 8) travels in a plan of its own; NEW's tokens after.

The two trainers meet through files in SYNC_DIR where a step needs one to wait for the other (no
collective of their own: the engine's collectives run meanwhile). Prints ``rank R: RESULT {json}``;
never raises on a failed comparison (tests/test_engine_update_distributed.py asserts on the lines).
"""

import json
import os
import sys
import threading
import time
import warnings

import numpy as np
from safetensors.numpy import load_file

from hyper_gen import generate, load_model
from hyper_gen.engine import Engine, SamplingParams
from hyper_gen.models import weight_update

BACKEND, OLD, NEW, SYNC = sys.argv[1:5]
if BACKEND == "torch":
    import torch

    torch.set_num_threads(1)
T0 = time.monotonic()
model = load_model(OLD, backend=BACKEND, dtype="float64", tp=2)
engine = Engine(model, max_batch_size=4)
rank = engine.rank
old = load_file(os.path.join(OLD, "model.safetensors"))
new = load_file(os.path.join(NEW, "model.safetensors"))
NAN = "model.layers.0.mlp.down_proj.weight"
DROPPED = "model.layers.2.mlp.up_proj.weight"
SHORT = 2.0  # the update_timeout_s of the bounded-wait checks
results = {}


def say(label, value):
    sys.stdout.write(f"rank {rank}: {label} {json.dumps(value)}\n")
    sys.stdout.flush()


def signal(name):
    open(os.path.join(SYNC, name), "w").close()


def wait_for(name, timeout=120):
    end = time.monotonic() + timeout
    while not os.path.exists(os.path.join(SYNC, name)):
        if time.monotonic() > end:
            raise TimeoutError(f"rank {rank}: no {name} from the other rank")
        time.sleep(0.05)


def call(label, weights, version, on=None):
    """update_weights on this rank: (what it returned or raised, this rank's weight_version after)."""
    on = on or engine
    started = time.monotonic()
    try:
        outcome = ["ok", on.update_weights(weights, version=version)]
    except Exception as error:
        outcome = [type(error).__name__, str(error)]
    results[label] = outcome + [on.weight_version, round(time.monotonic() - started, 2)]


def without(name, tensors):
    return {k: v for k, v in tensors.items() if k != name}


def with_nan(tensors):
    bad = dict(tensors)
    bad[NAN] = tensors[NAN].copy()
    bad[NAN][1, 2] = np.nan
    return bad


def follower_trainer():
    call("new", new, 1)
    call("nan", with_nan(old), 2)
    prepare = weight_update.WeightUpdate.prepare

    def failing(self):
        raise RuntimeError("injected conversion failure")

    weight_update.WeightUpdate.prepare = failing  # the follower converts at the boundary, in its thread
    call("convert", old, 3)
    weight_update.WeightUpdate.prepare = prepare
    call("version", old, 40)
    call("names", without(DROPPED, old), 5)
    engine.update_timeout_s = SHORT  # read live: the boundary rank 0 is already at ends at its start + SHORT
    wait_for("rank0-missed")
    results["warned"] = warned[0]  # the follower thread warned when it gave up on this trainer's call
    call("late", old, 6)
    call("alone", old, 60)
    engine.update_timeout_s = 120.0
    signal("rank1-alone")
    call("old", old, 7)


warned = [False]
if rank != 0:
    show = warnings.showwarning

    def record(message, *args, **kwargs):
        warned[0] |= "was not called on rank 1" in str(message)
        show(message, *args, **kwargs)

    warnings.showwarning = record
    trainer = threading.Thread(target=follower_trainer, name="trainer")
    trainer.start()
    engine.run_follower()
    trainer.join(300)
    stepped = Engine(model, max_batch_size=4)  # 6.: rank 0 steps its engine from its own thread
    trainer = threading.Thread(target=call, args=("stepped", new, 8, stepped), name="trainer")
    trainer.start()
    stepped.run_follower()
    trainer.join(300)
    say("RESULT", results)
    sys.exit(0)

# ---------------------------------------------------------------------------------- rank 0
rng = np.random.default_rng(0)
VOCAB = model.config.vocab_size
PROMPTS = [rng.integers(8, VOCAB, n).tolist() for n in (9, 5)]
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def references(path):
    single = load_model(path, backend=BACKEND, dtype="float64")
    out = []
    for prompt in PROMPTS:
        tokens = generate(single, np.array([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None)
        tokens = tokens.asnumpy() if hasattr(tokens, "asnumpy") else tokens.numpy()
        out.append(tokens[0, len(prompt) :].tolist())
    return out


ref_old, ref_new = references(OLD), references(NEW)  # before the engine thread runs the other model
results["refs_differ"] = ref_old != ref_new


def rollout(label):
    outs = engine.run_batch([(p, GREEDY) for p in PROMPTS])
    results[label] = [[o.outputs[0].token_ids for o in outs], [o.weight_version for o in outs]]


with engine:
    rollout("tokens_old")
    running = engine.submit(PROMPTS[0], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    next(iter(running))
    call("new", new, 1)
    done = running.result(timeout=300)
    results["running"] = [done.weight_version, len(done.outputs[0].token_ids)]
    rollout("tokens_new")
    call("nan", old, 2)
    rollout("after_nan")
    call("convert", old, 3)
    rollout("after_convert")
    call("version", old, 4)
    call("names", old, 5)
    rollout("after_mismatch")
    call("missed", old, 6)  # rank 1's trainer does not call
    signal("rank0-missed")
    wait_for("rank1-alone")  # rank 1's trainer called alone and timed out
    held = engine.submit(PROMPTS[1], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    next(iter(held))
    engine.pause("keep")  # an RL trainer's update between rollouts: held plans carry it
    call("old", old, 7)
    engine.resume()
    done = held.result(timeout=300)
    results["held"] = [done.weight_version, len(done.outputs[0].token_ids)]
    rollout("tokens_old_again")
stepped = Engine(model, max_batch_size=4).start(background=False)
stream = stepped.submit(PROMPTS[1], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
for _ in range(3):
    stepped.step()
call("stepped", new, 8, stepped)  # settled here, between two steps, in a held plan every rank runs
while stepped.step():
    pass
results["stepped_running"] = stream.result(timeout=60).weight_version
stream = stepped.submit(PROMPTS[0], GREEDY)
while stepped.step():
    pass
out = stream.result(timeout=60)
results["stepped_new"] = [out.outputs[0].token_ids, out.weight_version]
stepped.shutdown()
results.update(ref_old=ref_old, ref_new=ref_new, count=len(new), seconds=round(time.monotonic() - T0, 1))
say("RESULT", results)
