"""Two ranks: ``hyper_gen.score`` on sharded torch models (tests/test_scoring_distributed.py).

usage: score_sharded_torch.py CHECKPOINT_DIR

- native Qwen3.5 loaded ``tp=2`` (float64 and float32), against the same checkpoint loaded whole on
  each rank: a left-padded batch with ``prompt_lengths`` (a 70-token row: two delta-rule chunks) and
  a right-padded one; ``prompt_top_logprobs`` (the server's prompt_logprobs); an out-of-vocabulary id
  on rank 1 only and a different (valid) prompt on rank 1 only: both ranks raise, in seconds;
- an HF Qwen3.5 sharded with FSDP2 (``fully_shard`` on every decoder layer and the root), float64:
  each rank scores its own batch (different sizes), compared with HF's log-softmax of an unsharded
  copy on that batch and with score() on the copy; both ranks scoring the same batch; a bad id on
  rank 1 only: both ranks raise naming rank 1, in seconds, then scoring works again.

Prints ``rank R: <check> <label> <values>`` lines and never raises on a failed comparison (a rank
stopping early would leave the other waiting in a collective).
"""

import copy
import hashlib
import sys

import numpy as np
import torch
from rollout_common import build_model, catch, prompts, say, setup
from torch.distributed.fsdp import fully_shard

from hyper_gen import load_model, score
from hyper_gen.scoring import prompt_top_logprobs

rank, world = setup(timeout_s=60)
PATH = sys.argv[1]
LENGTHS = (70, 3, 17)
PROMPTS = (50, 1, 9)  # prompt_lengths of the left-padded batch


def digest(array):
    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()[:16]


def batch(vocab, side, seed=0):
    rng = np.random.default_rng(seed)  # the same on every rank
    width = max(LENGTHS)
    ids = np.zeros((len(LENGTHS), width), np.int64)
    mask = np.zeros_like(ids)
    for row, n in enumerate(LENGTHS):
        where = slice(width - n, width) if side == "left" else slice(0, n)
        ids[row, where] = rng.integers(1, vocab, n)
        mask[row, where] = 1
    return torch.from_numpy(ids), torch.from_numpy(mask)


def hf_log_softmax(model, ids, mask):
    """HF's own forward on the padded batch (positions from each row's first real token), its float64
    log-softmax at each real token after a real token, 0 elsewhere: (B, T) numpy."""
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(ids, attention_mask=mask, position_ids=positions).logits
    picked = torch.log_softmax(logits[:, :-1].double(), -1).gather(2, ids[:, 1:, None])[..., 0]
    expected = np.zeros(ids.shape, np.float64)
    scored = ((mask[:, 1:] == 1) & (mask[:, :-1] == 1)).numpy()
    expected[:, 1:] = np.where(scored, picked.numpy(), 0.0)
    return expected


def shape(tensor):
    return "x".join(map(str, tensor.shape))


def maxdiff(a, b):
    return float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max())


# ------------------------------------------------------------------ native tensor parallelism

for dtype in ("float64", "float32"):
    tp_model = load_model(PATH, backend="torch", dtype=dtype, tp=2)
    single = load_model(PATH, backend="torch", dtype=dtype)
    vocab = single.vocab_size
    for side in ("left", "right"):
        ids, mask = batch(vocab, side)
        lengths = torch.tensor(PROMPTS) if side == "left" else None
        got = score(tp_model, ids, mask, lengths)
        want = score(single, ids, mask, lengths)
        say(
            rank,
            "tp",
            f"{dtype}/{side}",
            f"dtype={str(got.dtype).split('.')[-1]} shape={shape(got)} maxdiff={maxdiff(got, want):.3e} "
            f"zeros_equal={bool(((got == 0) == (want == 0)).all())} digest={digest(got.numpy())}",
        )
    row = batch(vocab, "left")[0][0, -LENGTHS[0] :].tolist()
    got, want = prompt_top_logprobs(tp_model, row, 5), prompt_top_logprobs(single, row, 5)
    say(
        rank,
        "tp_top",
        dtype,
        f"chosen={maxdiff(got[0], want[0]):.3e} values={maxdiff(got[1], want[1]):.3e} "
        f"ids_equal={np.array_equal(got[2], want[2])} ranks_equal={np.array_equal(got[3], want[3])} "
        f"digest={digest(np.concatenate([got[0].ravel(), got[1].ravel()]))}",
    )

ids, mask = batch(tp_model.vocab_size, "left")
bad = ids.clone()
if rank == 1:
    bad[1, -1] = tp_model.vocab_size + 3
kind, message, seconds, _ = catch(lambda: score(tp_model, bad, mask))
say(rank, "tp_error", "oov", f"type={kind} seconds={seconds:.2f} message={message}")
other = ids.clone()
if rank == 1:
    other[0, -1] = other[0, -1] % (tp_model.vocab_size - 1) + 1
kind, message, seconds, _ = catch(lambda: score(tp_model, other, mask))
say(rank, "tp_error", "mismatch", f"type={kind} seconds={seconds:.2f} message={message}")
after = score(tp_model, ids, mask)
say(rank, "tp_after", "errors", f"maxdiff={maxdiff(after, score(single, ids, mask)):.3e}")

# ---------------------------------------------------------------------------------- FSDP2


def shard(model):
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


VOCAB = 97
reference = build_model(dtype=torch.float64)
sharded = shard(copy.deepcopy(reference))
own = prompts({0: (5, 3), 1: (8, 2, 6)}[rank], VOCAB, seed=10 + rank)  # each rank its own batch
same = prompts((7, 4), VOCAB, seed=3)  # one batch on both ranks
for label, (ids, mask) in (("own", own), ("same", same)):
    got = score(sharded, ids, mask)
    expected = hf_log_softmax(reference, ids, mask)
    say(
        rank,
        "fsdp",
        label,
        f"dtype={str(got.dtype).split('.')[-1]} shape={shape(got)} vs_hf={maxdiff(got, expected):.3e} "
        f"vs_unsharded={maxdiff(got, score(reference, ids, mask)):.3e} "
        f"zeros_equal={bool(((got.numpy() == 0) == (expected == 0)).all())} digest={digest(got.numpy())}",
    )
ids, mask = own
bad = ids.clone()
if rank == 1:
    bad[0, -1] = VOCAB + 3
kind, message, seconds, _ = catch(lambda: score(sharded, bad, mask))
say(rank, "fsdp_error", "oov", f"type={kind} seconds={seconds:.2f} message={message}")
got = score(sharded, ids, mask)
say(rank, "fsdp_after", "errors", f"vs_hf={maxdiff(got, hf_log_softmax(reference, ids, mask)):.3e}")
say(rank, "done", "all", "ok")
