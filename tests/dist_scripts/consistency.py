"""Two ranks: a mismatched input raises the same ValueError on every rank; vocab-sharded logits are gathered.

usage: consistency.py torch|mindspore
"""

import sys

import numpy as np

from hyper_gen import GenerationConfig, generate
from hyper_gen.parallel.launcher import host_ops, init_distributed

framework = sys.argv[1]
assert init_distributed(framework)
ops = host_ops(framework)
rank = ops.rank()
from backend_harness import HARNESSES  # noqa: E402

harness = HARNESSES[framework]()
model = harness.stub()
model.parallel_group = None  # the world group: generate() treats the model as split across ranks
cfg = GenerationConfig(max_new_tokens=6, eos_token_id=None)
ids = [[5, 6, 7, 8]] if rank == 0 else [[5, 6, 7, 9]]
try:
    generate(model, ids, cfg)
    print(f"rank {rank}: NO ERROR", flush=True)
except ValueError as exc:
    print(f"rank {rank}: ValueError: {exc}", flush=True)

# a config difference is caught too
try:
    generate(model, [[5, 6, 7, 8]], cfg.replace(top_k=rank + 1))
    print(f"rank {rank}: NO CONFIG ERROR", flush=True)
except ValueError:
    print(f"rank {rank}: config ValueError", flush=True)

# vocab-parallel: each rank returns only its half of the vocabulary; generate gathers before sampling
full = harness.stub()
sharded = harness.stub()
sharded.parallel_group = None
sharded.vocab_parallel = True
vocab = 64
original = type(sharded).forward if framework == "torch" else type(sharded).construct


def local_slice(self, *args, **kwargs):
    out = original(self, *args, **kwargs)
    out["logits"] = out["logits"][:, :, rank * vocab // 2 : (rank + 1) * vocab // 2]
    return out


setattr(sharded, "forward" if framework == "torch" else "construct", local_slice.__get__(sharded))
padded = [[0, 0, 11, 12], [21, 22, 23, 24]]
mask = [[0, 0, 1, 1], [1, 1, 1, 1]]
for name, c in [("greedy", cfg), ("seeded", cfg.replace(do_sample=True, seed=3, top_k=0))]:
    a = harness.numpy(generate(full, padded, c, attention_mask=mask))
    b = harness.numpy(generate(sharded, padded, c, attention_mask=mask))
    print(f"rank {rank}: vocab-parallel {name} equal={np.array_equal(a, b)} tokens={b.tolist()}", flush=True)

from hyper_gen.parallel.launcher import shutdown_distributed  # noqa: E402

shutdown_distributed(framework)  # a clean teardown: gloo aborts the process if the group outlives it
