"""Two ranks: an HF Qwen3.5 sharded by HyperParallel's own torch ``fully_shard`` (every decoder
layer and the root, on a 1-D dp mesh over gloo), each rank with its own left-padded prompts, rank 0
stopping after 3 tokens and rank 1 after up to 16 (with an EOS the model emits, so its rows end at
different steps too). HyperParallel is installed from ../shared/vendor (tests/test_rollout_hyperparallel.py).

Prints ``rank R: <check> <label> ...`` lines:

- greedy: hyper_gen vs HF generate on an unsharded copy, for ``synced_gpus`` None and True, called
  as is and inside HyperParallel's ``SkipDTensorDispatch()``, with ``reshard_after_forward`` True
  and False (a second sharded copy);
- seeded sampling vs the unsharded copy running both ranks' prompts as one batch (the DP row offset);
- n samples with logprobs;
- stop strings: a string one of rank 1's rows emits ends that row there, the other rows and rank 0
  run on, and every rank gets the tokens one process gets on the unsharded copy;
- all-gathers (``all_gather_into_tensor`` calls) of one forward, of a generate call, and of one with
  ``unshard_params=True``; after it the parameters are HyperParallel DTensors again and every
  module's reshard-after-forward is back, also after a call that raised;
- tp: the output layer split by vocabulary with HyperParallel's ``shard_module``: its logits come
  back as a vocab-sharded HyperParallel DTensor, greedy tokens are HF's on the unsharded copy; an
  uneven split (97 rows on 2 ranks) is a ValueError on every rank;
- errors: an out-of-vocabulary id on rank 1 only: every rank raises, naming rank 1.
"""

import copy
import os

from torch_exit import exit_past_teardown  # this folder: on sys.path as the script's

os.environ.setdefault("HYPER_PARALLEL_PLATFORM", "torch")  # it picks MindSpore whenever MindSpore imports

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from hyper_parallel import DTensor, SkipDTensorDispatch, init_device_mesh  # noqa: E402
from hyper_parallel.core.fully_shard import fully_shard  # noqa: E402
from hyper_parallel.core.placement_types import Replicate, Shard  # noqa: E402
from hyper_parallel.core.shard.api import shard_module  # noqa: E402
from hyper_parallel.core.shard.sharding_plan import ShardingPlan  # noqa: E402
from rollout_common import (  # noqa: E402
    WIDTH,
    CharTokenizer,
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

from hyper_gen import generate  # noqa: E402

rank, world = setup()
VOCAB = 96  # HyperParallel shards dim 0 evenly only
LENGTHS = {0: (5, 3), 1: (8, 2, 6)}
CAPS = {0: 3, 1: 16}
SAMPLING = dict(do_sample=True, top_k=20, top_p=0.9, temperature=0.9, seed=5)


def shard(model, reshard_after_forward):
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
    return model


def sharded_state(model):
    """(every parameter a HyperParallel DTensor, each HSDP module's reshard_after_forward)."""
    dtensors = all(type(p).__module__.startswith("hyper_parallel.") for p in model.parameters())
    return dtensors, [m.hsdp_scheduler.reshard_after_forward for m in model.modules() if hasattr(m, "hsdp_scheduler")]


reference = build_model(vocab_size=VOCAB)
models = {"reshard": shard(copy.deepcopy(reference), True), "keep": shard(copy.deepcopy(reference), False)}
sharded = models["reshard"]
say(rank, "setup", "type", f"{type(sharded).__name__} {type(next(sharded.parameters())).__module__}")
ids, mask = prompts(LENGTHS[rank], VOCAB, seed=10 + rank)
batches = [prompts(LENGTHS[r], VOCAB, seed=10 + r) for r in range(world)]
cap = CAPS[rank]
probe = reference.generate(
    batches[1][0], attention_mask=batches[1][1], max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0
)
EOS = [int(probe[0, -1])]
common = dict(eos_token_id=EOS, pad_token_id=0, return_dict_in_generate=True)

expected = hf_generated(
    reference.generate(ids, attention_mask=mask, max_new_tokens=cap, do_sample=False, eos_token_id=EOS, pad_token_id=0),
    WIDTH,
    EOS,
)
for name, model in models.items():
    for synced in (None, True):
        for skip in (False, True):
            label = f"{name}-synced={synced}-skip={skip}"

            def call(model=model, synced=synced, skip=skip):
                if not skip:
                    return generate(model, ids, attention_mask=mask, max_new_tokens=cap, synced_gpus=synced, **common)
                with SkipDTensorDispatch():
                    return generate(model, ids, attention_mask=mask, max_new_tokens=cap, synced_gpus=synced, **common)

            kind, message, seconds, _ = catch(call)
            if kind is not None:
                say(rank, "greedy", label, f"ERROR type={kind} message={message}")
                continue
            out = call()
            got = ours_generated(out, mask)
            say(rank, "greedy", label, f"{verdict(got == expected)} lengths={[len(r) for r in got]}")

whole_ids = torch.cat([b[0] for b in batches])
whole_mask = torch.cat([b[1] for b in batches])
offset = sum(len(LENGTHS[r]) for r in range(rank))
whole = generate(
    reference, whole_ids, attention_mask=whole_mask, max_new_tokens=max(CAPS.values()), **common, **SAMPLING
)
expected_seeded = [row[:cap] for row in ours_generated(whole, whole_mask)[offset : offset + len(LENGTHS[rank])]]
for label, extra in (("auto", {}), ("unshard", {"unshard_params": True})):
    out = generate(sharded, ids, attention_mask=mask, max_new_tokens=cap, **common, **SAMPLING, **extra)
    say(rank, "seeded", label, verdict(ours_generated(out, mask) == expected_seeded))

n = 3
rollout = dict(num_return_sequences=n, output_logprobs=True, **common, **SAMPLING)
whole = generate(reference, whole_ids, attention_mask=whole_mask, max_new_tokens=cap, **rollout)
rows = slice(offset * n, (offset + len(LENGTHS[rank])) * n)
out, seconds = timed(generate, sharded, ids, attention_mask=mask, max_new_tokens=cap, **rollout)
steps = out.logprobs.shape[1]
ok = ours_generated(out, mask) == ours_generated(whole, whole_mask)[rows] and torch.allclose(
    out.logprobs, whole.logprobs[rows, :steps], atol=1e-5
)
say(rank, "samples", f"n={n}", f"{verdict(ok)} shape={tuple(out.logprobs.shape)}")

tokenizer = CharTokenizer()
stop = dict(stop_strings=tokenizer.convert_ids_to_tokens(int(probe[0, -3])), tokenizer=tokenizer, **common)
expected_stop = ours_generated(generate(reference, ids, attention_mask=mask, max_new_tokens=cap, **stop), mask)
out = generate(sharded, ids, attention_mask=mask, max_new_tokens=cap, **stop)
got = ours_generated(out, mask)
say(rank, "stop", "strings", f"{verdict(got == expected_stop)} lengths={[len(r) for r in got]}")

calls = {"n": 0}
original = dist.all_gather_into_tensor


def counting(*args, **kwargs):
    calls["n"] += 1
    return original(*args, **kwargs)


dist.all_gather_into_tensor = counting
try:
    before = sharded_state(sharded)
    calls["n"] = 0
    with torch.no_grad():
        sharded(ids, attention_mask=mask)
    say(rank, "allgathers", "forward", f"count={calls['n']}")
    for label, extra in (("per_forward", {}), ("unshard", {"unshard_params": True})):
        calls["n"] = 0
        out = generate(sharded, ids, attention_mask=mask, max_new_tokens=cap, **common, **extra)
        say(rank, "allgathers", label, f"count={calls['n']} steps={max(out.generated_lengths.tolist())}")
    say(rank, "after", "unshard", verdict(sharded_state(sharded) == before and before[0]))

    def boom(input_ids, scores):
        if input_ids.shape[1] - WIDTH == 1:
            raise RuntimeError("processor failed at step 1")
        return scores

    kind, message, seconds, _ = catch(
        lambda: generate(
            sharded, ids, attention_mask=mask, max_new_tokens=4, logits_processor=[boom], unshard_params=True, **common
        )
    )
    say(rank, "after", "raised", f"{verdict(sharded_state(sharded) == before)} type={kind}")
finally:
    dist.all_gather_into_tensor = original


def head_sharded(model):
    """The output layer split by vocabulary with HyperParallel's tensor parallelism (``shard_module``),
    its input made a replicated DTensor (``DTensor.from_local``) as its linear's layout rule needs: the
    logits come back as a vocab-sharded HyperParallel DTensor. (Its whole-model plan does not run an HF
    decoder on CPU: no layout rule for the ``__getitem__`` of the rotary embedding.)"""
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    model = shard_module(model, mesh, ShardingPlan(plan={"lm_head.weight": (Shard(0),)}))
    model.lm_head.register_forward_pre_hook(lambda module, args: (DTensor.from_local(args[0], mesh, (Replicate(),)),))
    return model


head = head_sharded(copy.deepcopy(reference))
tp_ids, tp_mask = batches[1]  # tensor parallel: every rank the same prompts
with torch.no_grad():
    logits = head(tp_ids, attention_mask=tp_mask).logits
say(rank, "tp", "logits", f"{type(logits).__module__} placements={list(logits.placements)}")
tp_expected = hf_generated(
    reference.generate(
        tp_ids, attention_mask=tp_mask, max_new_tokens=8, do_sample=False, eos_token_id=EOS, pad_token_id=0
    ),
    WIDTH,
    EOS,
)
got = ours_generated(generate(head, tp_ids, attention_mask=tp_mask, max_new_tokens=8, **common), tp_mask)
say(rank, "tp", "greedy", f"{verdict(got == tp_expected)} lengths={[len(r) for r in got]}")
uneven = head_sharded(build_model(vocab_size=VOCAB + 1))  # 97 rows: HyperParallel keeps 48 a rank
kind, message, seconds, _ = catch(lambda: generate(uneven, tp_ids, attention_mask=tp_mask, max_new_tokens=8, **common))
say(rank, "tp", "uneven", f"type={kind} seconds={seconds:.2f} message={message}")

bad_ids = ids.clone()
if rank == 1:
    bad_ids[0, -1] = VOCAB + 3
kind, message, seconds, _ = catch(lambda: generate(sharded, bad_ids, attention_mask=mask, max_new_tokens=cap, **common))
say(rank, "error", "oov", f"type={kind} seconds={seconds:.2f} message={message}")
out = generate(sharded, ids, attention_mask=mask, max_new_tokens=cap, **common)
say(rank, "after_errors", "greedy", verdict(ours_generated(out, mask) == expected))
dist.barrier()
say(rank, "done", "all", "ok")
exit_past_teardown()
