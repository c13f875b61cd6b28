"""Two msrun ranks: ``hyper_gen.score`` on split MindSpore models (tests/test_scoring_distributed.py).

usage: score_sharded_mindspore.py CHECKPOINT_DIR

- native Qwen3.5 loaded ``tp=2`` (float64 and float32), against the same checkpoint loaded whole on
  each rank: a left-padded batch with ``prompt_lengths`` (a 70-token row: two delta-rule chunks) and
  a right-padded one; ``prompt_top_logprobs`` (the server's prompt_logprobs); an out-of-vocabulary id
  and a different (valid) prompt on rank 1 only: both ranks raise, in seconds;
- the ZeRO-3-style stub (tests/zero3_mindspore.py: every forward all-gathers its weights,
  ``collective_forward = True``): each rank scores its own batch, equal to score() on the unsharded
  twin; a bad id on rank 1 only: both ranks raise naming rank 1, then scoring works again.

Prints one ``SCORE {json}`` line per check and rank; nothing raises between collectives.
"""

import hashlib
import json
import sys
import time

import numpy as np
from zero3_mindspore import PROMPTS, UnshardedStubLM, Zero3StubLM, left_padded

from hyper_gen import load_model, score
from hyper_gen.parallel.launcher import host_ops, init_distributed
from hyper_gen.scoring import prompt_top_logprobs

assert init_distributed("mindspore")
ops = host_ops("mindspore")
rank, world = ops.rank(), ops.world_size()
assert world == 2, world
PATH = sys.argv[1]
LENGTHS = (70, 3, 17)
PROMPT_LENGTHS = np.array([50, 1, 9])


def report(check, **values):
    print("SCORE " + json.dumps(dict(rank=rank, check=check, **values)), flush=True)


def digest(array):
    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()[:16]


def maxdiff(a, b):
    return float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max())


def batch(vocab, side, seed=0):
    rng = np.random.default_rng(seed)  # the same on every rank
    width = max(LENGTHS)
    ids = np.zeros((len(LENGTHS), width), np.int64)
    mask = np.zeros_like(ids)
    for row, n in enumerate(LENGTHS):
        where = slice(width - n, width) if side == "left" else slice(0, n)
        ids[row, where] = rng.integers(1, vocab, n)
        mask[row, where] = 1
    return ids, mask


def caught(fn):
    start = time.monotonic()
    try:
        fn()
    except Exception as error:  # noqa: BLE001 - what every rank raised is the finding
        return dict(type=type(error).__name__, message=str(error), seconds=time.monotonic() - start)
    return dict(type=None, message=None, seconds=time.monotonic() - start)


# ------------------------------------------------------------------ native tensor parallelism

for dtype in ("float64", "float32"):
    tp_model = load_model(PATH, backend="mindspore", dtype=dtype, tp=2)
    single = load_model(PATH, backend="mindspore", dtype=dtype)
    vocab = single.vocab_size
    for side in ("left", "right"):
        ids, mask = batch(vocab, side)
        lengths = PROMPT_LENGTHS if side == "left" else None
        got = score(tp_model, ids, mask, lengths).asnumpy()
        want = score(single, ids, mask, lengths).asnumpy()
        report(
            f"tp-{dtype}-{side}",
            dtype=str(got.dtype),
            shape=list(got.shape),
            maxdiff=maxdiff(got, want),
            zeros_equal=bool(((got == 0) == (want == 0)).all()),
            digest=digest(got),
        )
    row = batch(vocab, "left")[0][0, -LENGTHS[0] :].tolist()
    got, want = prompt_top_logprobs(tp_model, row, 5), prompt_top_logprobs(single, row, 5)
    report(
        f"tp-top-{dtype}",
        chosen=maxdiff(got[0], want[0]),
        values=maxdiff(got[1], want[1]),
        ids_equal=bool(np.array_equal(got[2], want[2])),
        ranks_equal=bool(np.array_equal(got[3], want[3])),
        digest=digest(np.concatenate([got[0].ravel(), got[1].ravel()])),
    )

ids, mask = batch(tp_model.vocab_size, "left")
bad = ids.copy()
if rank == 1:
    bad[1, -1] = tp_model.vocab_size + 3
report("tp-error-oov", **caught(lambda: score(tp_model, bad, mask)))
other = ids.copy()
if rank == 1:
    other[0, -1] = other[0, -1] % (tp_model.vocab_size - 1) + 1
report("tp-error-mismatch", **caught(lambda: score(tp_model, other, mask)))
report("tp-after-errors", maxdiff=maxdiff(score(tp_model, ids, mask).asnumpy(), score(single, ids, mask).asnumpy()))

# ------------------------------------------------------- ZeRO-3 style: collective every forward

twin = UnshardedStubLM()
zero3 = Zero3StubLM(rank, world)
ids, mask = left_padded(PROMPTS[rank])  # each rank its own batch (2 and 3 rows)
got = score(zero3, ids, mask).asnumpy()
want = score(twin, ids, mask).asnumpy()
report("zero3-own", shape=list(got.shape), maxdiff=maxdiff(got, want), exact=bool(np.array_equal(got, want)))
bad = ids.copy()
if rank == 1:
    bad[0, -1] = 64 + 3
report("zero3-error-oov", **caught(lambda: score(zero3, bad, mask)))
report("zero3-after-errors", exact=bool(np.array_equal(score(zero3, ids, mask).asnumpy(), want)))
print(f"rank {rank}: done", flush=True)
