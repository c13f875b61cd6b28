"""Two ranks: the in-flight engine on the demo model at TP=2. Rank 0 owns the queue and checks its
outputs against single-device generate (it also loads the model whole); rank 1 runs
``engine.run_follower()`` until rank 0 shuts down. Prints ``rank R: RESULT {json}`` lines, never
raises on a failed comparison (tests/test_engine_distributed.py reads the lines).
"""

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


def say(label, value):
    sys.stdout.write(f"rank {rank}: {label} {json.dumps(value)}\n")
    sys.stdout.flush()


if rank != 0:
    started = time.time()
    engine.run_follower()
    say("FOLLOWER", {"seconds": round(time.time() - started, 1)})
    sys.exit(0)

single = load_model(path, backend="torch")


def reference(prompt, steps, **overrides):
    out = generate(single, [prompt], max_new_tokens=steps, **overrides).numpy()[0, len(prompt) :]
    ended = np.flatnonzero(out == 1)
    return out[: ended[0] + 1].tolist() if ended.size and "eos_token_id" not in overrides else out.tolist()


ids = [tokenizer(p)["input_ids"] for p, _ in make_prompts(8, seed=31)]
lengths = [12, 3, 9, 1, 12, 6, 11, 4]
checks = {}
with engine:
    streams = [engine.submit(ids[0], SamplingParams(max_tokens=lengths[0], temperature=0))]
    next(iter(streams[0]))
    long = engine.submit(ids[1], SamplingParams(max_tokens=300, temperature=0, ignore_eos=True))
    for prompt, length in zip(ids[1:], lengths[1:]):
        streams.append(engine.submit(prompt, SamplingParams(max_tokens=length, temperature=0)))
        time.sleep(0.003)
    seeded = engine.submit(ids[2], SamplingParams(n=2, max_tokens=8, seed=7, temperature=1.5, top_k=6))
    unseeded = engine.submit(ids[3], SamplingParams(max_tokens=5, temperature=1.0))
    schema = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 999}}, "required": ["n"]}
    schema["additionalProperties"] = False
    grammars = [{"json": schema}, {"regex": "[0-9]{3} (yes|no)"}]
    held = [
        engine.submit(ids[5], SamplingParams(max_tokens=16, temperature=0, structured_outputs=grammars[0])),
        engine.submit(ids[6], SamplingParams(max_tokens=16, temperature=1.2, seed=5, structured_outputs=grammars[1])),
    ]
    stopped = engine.submit(
        tokenizer("rev 123456 =")["input_ids"], SamplingParams(max_tokens=12, temperature=0, stop="3")
    )
    outs = [s.result(timeout=120).outputs[0].token_ids for s in streams]
    checks["greedy"] = [out == reference(p, n) for p, n, out in zip(ids, lengths, outs)]
    rows = generate(single, [ids[2]] * 2, max_new_tokens=8, do_sample=True, seed=7, temperature=1.5, top_k=6).numpy()
    expected = [r[len(ids[2]) :].tolist() for r in rows]
    expected = [e[: e.index(1) + 1] if 1 in e else e for e in expected]
    checks["seeded"] = [c.token_ids for c in seeded.result(timeout=120).outputs] == expected
    checks["unseeded"] = len(unseeded.result(timeout=120).outputs[0].token_ids) > 0
    checks["stop"] = stopped.result(timeout=120).outputs[0].text
    held = [h.result(timeout=120).outputs[0].token_ids for h in held]
    grammar_refs = [
        reference(ids[5], 16, tokenizer=tokenizer, structured_outputs=grammars[0]),
        reference(
            ids[6], 16, tokenizer=tokenizer, structured_outputs=grammars[1], do_sample=True, temperature=1.2, seed=5
        ),
    ]
    checks["grammar"] = [h == r for h, r in zip(held, grammar_refs)]
    checks["grammar_text"] = [tokenizer.decode(h, skip_special_tokens=True) for h in held]
    long.cancel()
    checks["cancel"] = long.result(timeout=120).outputs[0].finish_reason
    after = engine.submit(ids[4], SamplingParams(max_tokens=5, temperature=0))
    checks["after_cancel"] = after.result(timeout=120).outputs[0].token_ids == reference(ids[4], 5)
say("RESULT", checks)
