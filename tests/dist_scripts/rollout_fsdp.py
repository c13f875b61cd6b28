"""Two ranks: an HF Qwen3.5 sharded with FSDP2 (fully_shard on every decoder layer and the root),
each rank with its own left-padded prompts, rank 0 stopping after 3 tokens and rank 1 after up to
16 (with an EOS the model emits, so rank 1's rows end at different steps too).

Prints ``rank R: <check> <label> OK|MISMATCH ... seconds=S`` lines (tests/test_rollout_fsdp.py):

- greedy: hyper_gen on the sharded model vs HF generate on an unsharded copy of the same weights,
  on this rank's prompts (auto step sync; unshard_params=True too);
- seeded sampling: vs hyper_gen on the unsharded copy running both ranks' prompts as one batch
  (rank 1's rows after rank 0's: the data-parallel row offset);
- n samples with logprobs (num_return_sequences=3, return_dict_in_generate, output_logprobs);
- FSDP all-gathers per call with and without unshard_params;
- errors: an out-of-vocabulary id on rank 1 only, a logits processor raising on rank 1 at step 3:
  every rank raises, naming rank 1, within seconds; then a normal call works again;
- without step sync (synced_gpus=False) on a model sharded over a 3 s-timeout group: rank 1's
  forward waits in FSDP's all-gather for a rank that has returned, and fails at the timeout.
"""

import copy
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from rollout_common import (
    WIDTH,
    build_model,
    catch,
    hf_generated,
    ours_generated,
    prompts,
    say,
    setup,
    timed,
    verdict,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch_exit import exit_past_teardown  # this folder: on sys.path as the script's

from hyper_gen import generate

rank, world = setup()
VOCAB = 97
LENGTHS = {0: (5, 3), 1: (8, 2, 6)}  # different prompts and batch sizes per rank
CAPS = {0: 3, 1: 16}  # rank 0 finishes long before rank 1
SEED = 5
SAMPLING = dict(do_sample=True, top_k=20, top_p=0.9, temperature=0.9, seed=SEED)


def shard(model, mesh=None):
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


reference = build_model()
sharded = shard(copy.deepcopy(reference))
ids, mask = prompts(LENGTHS[rank], VOCAB, seed=10 + rank)
batches = [prompts(LENGTHS[r], VOCAB, seed=10 + r) for r in range(world)]
cap = CAPS[rank]

# an EOS id the model emits: rank 1's first row's 6th greedy token (the same choice on every rank)
probe = reference.generate(
    batches[1][0], attention_mask=batches[1][1], max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0
)
EOS = [int(probe[0, -1])]
common = dict(eos_token_id=EOS, pad_token_id=0, return_dict_in_generate=True)
say(rank, "setup", "eos", f"eos={EOS} lengths={LENGTHS[rank]} cap={cap}")

# greedy vs HF generate on the unsharded copy, this rank's prompts
expected = hf_generated(
    reference.generate(ids, attention_mask=mask, max_new_tokens=cap, do_sample=False, eos_token_id=EOS, pad_token_id=0),
    WIDTH,
    EOS,
)
for label, extra in (("auto", {}), ("unshard", {"unshard_params": True}), ("explicit", {"synced_gpus": True})):
    out, seconds = timed(generate, sharded, ids, attention_mask=mask, max_new_tokens=cap, **common, **extra)
    got = ours_generated(out, mask)
    say(rank, "greedy", label, f"{verdict(got == expected)} lengths={[len(r) for r in got]} seconds={seconds:.2f}")

# seeded sampling vs one process running the concatenated batch on the unsharded copy
whole_ids = torch.cat([b[0] for b in batches])
whole_mask = torch.cat([b[1] for b in batches])
offset = sum(len(LENGTHS[r]) for r in range(rank))
whole = generate(
    reference, whole_ids, attention_mask=whole_mask, max_new_tokens=max(CAPS.values()), **common, **SAMPLING
)
expected = [row[:cap] for row in ours_generated(whole, whole_mask)[offset : offset + len(LENGTHS[rank])]]
for label, extra in (("auto", {}), ("unshard", {"unshard_params": True})):
    out, seconds = timed(generate, sharded, ids, attention_mask=mask, max_new_tokens=cap, **common, **SAMPLING, **extra)
    got = ours_generated(out, mask)
    say(rank, "seeded", label, f"{verdict(got == expected)} lengths={[len(r) for r in got]} seconds={seconds:.2f}")
# the same seed on both ranks must not draw the same noise: rank 0's rows against rank 1's rows of equal prompts
# is covered by the offset check above (a zero offset on rank 1 would give rows 0.. of the whole batch)

# n samples per prompt with logprobs, vs the unsharded copy on the concatenated batch
n = 3
rollout = dict(num_return_sequences=n, output_logprobs=True, output_scores=True, **common, **SAMPLING)
whole = generate(reference, whole_ids, attention_mask=whole_mask, max_new_tokens=cap, **rollout)
rows = slice(offset * n, (offset + len(LENGTHS[rank])) * n)
out, seconds = timed(generate, sharded, ids, attention_mask=mask, max_new_tokens=cap, **rollout)
tokens_ok = ours_generated(out, mask) == ours_generated(whole, whole_mask)[rows]
steps = out.logprobs.shape[1]
logprobs_ok = (
    out.sequences.shape[0] == len(LENGTHS[rank]) * n
    and out.logprobs.shape == out.raw_logprobs.shape == (len(LENGTHS[rank]) * n, steps)
    and torch.allclose(out.logprobs, whole.logprobs[rows, :steps], atol=1e-5)
    and torch.allclose(out.raw_logprobs, whole.raw_logprobs[rows, :steps], atol=1e-5)
    and bool((out.logprobs <= 0).all())
    and len(out.scores) == steps
)
say(
    rank,
    "samples",
    f"n={n}",
    f"{verdict(tokens_ok and logprobs_ok)} tokens={verdict(tokens_ok)} logprobs={verdict(logprobs_ok)} "
    f"shape={tuple(out.logprobs.shape)} seconds={seconds:.2f}",
)

# FSDP all-gathers per generate call: every forward vs once with unshard_params
calls = {"n": 0}
original = dist.all_gather_single


def counting(*args, **kwargs):
    calls["n"] += 1
    return original(*args, **kwargs)


dist.all_gather_single = counting
try:
    for label, extra in (("per_forward", {}), ("unshard", {"unshard_params": True})):
        calls["n"] = 0
        generate(sharded, ids, attention_mask=mask, max_new_tokens=cap, **common, **extra)
        say(rank, "allgathers", label, f"count={calls['n']}")
finally:
    dist.all_gather_single = original

# errors: every rank raises, naming the failing rank, within seconds
bad_ids = ids.clone()
if rank == 1:
    bad_ids[0, -1] = VOCAB + 3
kind, message, seconds, _ = catch(lambda: generate(sharded, bad_ids, attention_mask=mask, max_new_tokens=cap, **common))
say(rank, "error", "oov", f"type={kind} seconds={seconds:.2f} message={message}")


def boom(input_ids, scores):
    if rank == 1 and input_ids.shape[1] - WIDTH == 3:
        raise RuntimeError("processor failed at step 3")
    return scores


kind, message, seconds, _ = catch(
    lambda: generate(sharded, ids, attention_mask=mask, max_new_tokens=16, logits_processor=[boom], **common)
)
say(rank, "error", "processor", f"type={kind} seconds={seconds:.2f} message={message}")
kind, message, seconds, _ = catch(
    lambda: generate(
        sharded, ids, attention_mask=mask, max_new_tokens=16, logits_processor=[boom], unshard_params=True, **common
    )
)
say(rank, "error", "processor_unshard", f"type={kind} seconds={seconds:.2f} message={message}")
out = generate(sharded, ids, attention_mask=mask, max_new_tokens=cap, **common)
expected = hf_generated(
    reference.generate(ids, attention_mask=mask, max_new_tokens=cap, do_sample=False, eos_token_id=EOS, pad_token_id=0),
    WIDTH,
    EOS,
)
say(rank, "after_errors", "greedy", verdict(ours_generated(out, mask) == expected))

# without step sync: a model sharded over a group with a 3 s timeout; rank 0 returns after 3 tokens
dist.barrier()
short = dist.new_group(backend="gloo", timeout=timedelta(seconds=3))
unsynced = shard(copy.deepcopy(reference), mesh=DeviceMesh.from_group(short, "cpu"))
kind, message, seconds, _ = catch(
    lambda: generate(unsynced, ids, attention_mask=mask, max_new_tokens=cap, synced_gpus=False, **common)
)
say(rank, "unsynced", "synced_gpus=False", f"type={kind} seconds={seconds:.2f} message={(message or '')[:160]}")
time.sleep(0.1)
dist.barrier()  # on the default group, which the stuck all-gather never touched
say(rank, "done", "all", "ok")
exit_past_teardown()
