"""Two ranks that must end every step with the same tokens, and a callable given on one rank only.

usage: rank_agreement.py torch|mindspore

- seed=None sampling on a 2-rank vocab-parallel stub whose ranks seed their framework RNG
  differently (1234 + rank): every rank must return rank 0's tokens;
- a logits_processor (or stopping_criteria) on one rank only, or a different one on each: every
  rank raises the same ValueError naming the field (not a peer's "Connection closed by peer" or a hang);
- a streamer on rank 0 only (the usual "rank 0 prints"): allowed, same tokens.
Each finding is one line "rank R: <case> ..." for the test to read.
"""

import sys

import numpy as np

from hyper_gen import GenerationConfig, generate
from hyper_gen.parallel.launcher import host_ops, init_distributed, shutdown_distributed

framework = sys.argv[1]
assert init_distributed(framework)
ops = host_ops(framework)
rank = ops.rank()
from backend_harness import HARNESSES  # noqa: E402

harness = HARNESSES[framework]()
VOCAB = 64
sharded = harness.stub()
sharded.parallel_group = None  # the world group
sharded.vocab_parallel = True
original = type(sharded).forward if framework == "torch" else type(sharded).construct


def local_slice(self, *args, **kwargs):
    out = original(self, *args, **kwargs)
    out["logits"] = out["logits"][:, :, rank * VOCAB // 2 : (rank + 1) * VOCAB // 2]
    return out


setattr(sharded, "forward" if framework == "torch" else "construct", local_slice.__get__(sharded))
prompts, mask = [[0, 0, 11, 12], [21, 22, 23, 24]], [[0, 0, 1, 1], [1, 1, 1, 1]]
sampling = GenerationConfig(max_new_tokens=12, eos_token_id=None, do_sample=True, top_k=0, temperature=1.5)

harness.manual_seed(1234 + rank)  # a different RNG state on every rank
tokens = harness.numpy(generate(sharded, prompts, sampling, attention_mask=mask))
print(f"rank {rank}: unseeded tokens={tokens.tolist()}", flush=True)


def mark(input_ids, scores):
    return scores


def stop_never(input_ids, scores):
    return False


def other_mark(input_ids, scores):
    return scores


for name, overrides in [
    ("logits_processor", {"logits_processor": [mark] if rank == 1 else None}),
    ("stopping_criteria", {"stopping_criteria": [stop_never] if rank == 0 else None}),
    ("different logits_processor", {"logits_processor": [mark if rank == 0 else other_mark]}),
]:
    try:
        generate(sharded, prompts, sampling.replace(seed=0, **overrides), attention_mask=mask)
        print(f"rank {rank}: one-rank {name}: NO ERROR", flush=True)
    except ValueError as exc:
        print(f"rank {rank}: one-rank {name}: ValueError: {exc}", flush=True)


class Collect:
    def __init__(self):
        self.parts = []

    def put(self, value):
        self.parts.append(np.asarray(value).tolist())

    def end(self):
        pass


streamer = Collect() if rank == 0 else None
out = harness.numpy(generate(sharded, prompts, sampling.replace(seed=0), attention_mask=mask, streamer=streamer))
print(f"rank {rank}: rank-0 streamer tokens={out.tolist()}", flush=True)

shutdown_distributed(framework)
