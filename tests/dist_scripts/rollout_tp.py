"""An HF Qwen3.5 tensor-parallelized with torch's ``parallelize_module``: on 2 ranks TP=2; on 4
ranks the 2-D mesh ``init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))``, TP inside
each data-parallel group and each DP group with its own prompts (DP group 0 stops after 3 tokens,
DP group 1 after up to 16).

The plan: the full-attention layers' q/k/v ``ColwiseParallel`` and o_proj ``RowwiseParallel``
(heads split; HF's attention reshapes with -1 heads), every MLP gate/up colwise and down rowwise,
the embedding ``RowwiseParallel`` (vocab-parallel lookup, all-reduced) and the LM head
``ColwiseParallel`` (logits: this rank's vocabulary block; ``use_local_output=False`` keeps them a
DTensor, the other label). The Gated DeltaNet layers stay replicated: their fused
``in_proj_qkv`` packs q, k and v blocks whose head split a plain column split does not follow.

Prints ``rank R: <check> <label> OK|MISMATCH ...`` lines (tests/test_rollout_fsdp.py): greedy vs
HF generate on the unsharded copy (this DP group's prompts), seeded sampling and n samples with
logprobs vs hyper_gen on the unsharded copy running every DP group's prompts as one batch.
float64, so the row-parallel sums' different order cannot flip a token.
"""

import copy

import torch
from rollout_common import WIDTH, build_model, catch, hf_generated, ours_generated, prompts, say, setup, timed, verdict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from hyper_gen import generate
from hyper_gen.backends.torch.ops import TorchOps
from hyper_gen.parallel.model_group import parallel_group

rank, world = setup()
VOCAB = 96  # a multiple of the TP degree: the LM head's vocabulary blocks are equal
TP = 2
DP = world // TP
if DP > 1:
    mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    tp_mesh, dp_rank = mesh["tp"], mesh.get_local_rank("dp")
else:
    tp_mesh, dp_rank = init_device_mesh("cpu", (TP,), mesh_dim_names=("tp",)), 0
LENGTHS = {0: (5, 3), 1: (8, 2, 6)}
CAPS = {0: 3, 1: 16} if DP > 1 else {0: 16}
SAMPLING = dict(do_sample=True, top_k=20, top_p=0.9, temperature=0.9, seed=5)


def tensor_parallel(model, local_logits=True):
    plan = {
        "model.embed_tokens": RowwiseParallel(input_layouts=torch.distributed.tensor.Replicate()),
        "lm_head": ColwiseParallel(use_local_output=local_logits),
    }
    for i, layer in enumerate(model.model.layers):
        for name in ("gate_proj", "up_proj"):
            plan[f"model.layers.{i}.mlp.{name}"] = ColwiseParallel()
        plan[f"model.layers.{i}.mlp.down_proj"] = RowwiseParallel()
        if hasattr(layer, "self_attn"):
            for name in ("q_proj", "k_proj", "v_proj"):
                plan[f"model.layers.{i}.self_attn.{name}"] = ColwiseParallel()
            plan[f"model.layers.{i}.self_attn.o_proj"] = RowwiseParallel()
    return parallelize_module(model, tp_mesh, plan)


reference = build_model(torch.float64, vocab_size=VOCAB)
models = {
    "local": tensor_parallel(copy.deepcopy(reference)),
    "dtensor": tensor_parallel(copy.deepcopy(reference), False),
}
if DP > 1:  # a trainer's FSDP2 + TP: fully_shard over the TP model on the data-parallel sub-mesh
    fsdp_tp = tensor_parallel(copy.deepcopy(reference))
    for layer in fsdp_tp.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    models["fsdp_tp"] = fully_shard(fsdp_tp, mesh=mesh["dp"])
groups = range(DP)
batches = [prompts(LENGTHS[g], VOCAB, seed=10 + g) for g in groups]
ids, mask = batches[dp_rank]
cap = CAPS[dp_rank]
probe = reference.generate(
    batches[-1][0], attention_mask=batches[-1][1], max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0
)
EOS = [int(probe[0, -1])]
common = dict(eos_token_id=EOS, pad_token_id=0, return_dict_in_generate=True)
_, size = parallel_group(TorchOps("cpu"), models["local"])
say(rank, "setup", f"dp{dp_rank}", f"eos={EOS} cap={cap} tp_group_size={size} world={world}")

expected = hf_generated(
    reference.generate(ids, attention_mask=mask, max_new_tokens=cap, do_sample=False, eos_token_id=EOS, pad_token_id=0),
    WIDTH,
    EOS,
)
runs = [(label, model, {}) for label, model in models.items()]
if "fsdp_tp" in models:
    runs.append(("fsdp_tp_unshard", models["fsdp_tp"], {"unshard_params": True}))
for label, model, extra in runs:
    out, seconds = timed(generate, model, ids, attention_mask=mask, max_new_tokens=cap, **common, **extra)
    got = ours_generated(out, mask)
    say(rank, "greedy", label, f"{verdict(got == expected)} lengths={[len(r) for r in got]} seconds={seconds:.2f}")

whole_ids, whole_mask = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
offset = sum(len(LENGTHS[g]) for g in range(dp_rank))
rows = len(LENGTHS[dp_rank])
whole = generate(
    reference, whole_ids, attention_mask=whole_mask, max_new_tokens=max(CAPS.values()), **common, **SAMPLING
)
expected = [row[:cap] for row in ours_generated(whole, whole_mask)[offset : offset + rows]]
for label, model, extra in runs:
    out, seconds = timed(generate, model, ids, attention_mask=mask, max_new_tokens=cap, **common, **SAMPLING, **extra)
    got = ours_generated(out, mask)
    say(rank, "seeded", label, f"{verdict(got == expected)} lengths={[len(r) for r in got]} seconds={seconds:.2f}")

n = 3
rollout = dict(num_return_sequences=n, output_logprobs=True, **common, **SAMPLING)
whole = generate(reference, whole_ids, attention_mask=whole_mask, max_new_tokens=cap, **rollout)
out, seconds = timed(generate, models["local"], ids, attention_mask=mask, max_new_tokens=cap, **rollout)
span = slice(offset * n, (offset + rows) * n)
steps = out.logprobs.shape[1]
tokens_ok = ours_generated(out, mask) == ours_generated(whole, whole_mask)[span]
logprobs_ok = out.logprobs.shape == (rows * n, steps) and torch.allclose(
    out.logprobs, whole.logprobs[span, :steps], atol=1e-9
)
say(rank, "samples", f"n={n}", f"{verdict(tokens_ok and logprobs_ok)} shape={tuple(out.logprobs.shape)}")


# a processor raising on one rank at step 3: every rank raises, naming it
def boom(input_ids, scores):
    if rank == world - 1 and input_ids.shape[1] - WIDTH == 3:
        raise RuntimeError("processor failed at step 3")
    return scores


kind, message, seconds, _ = catch(
    lambda: generate(models["local"], ids, attention_mask=mask, max_new_tokens=16, logits_processor=[boom], **common)
)
say(rank, "error", "processor", f"type={kind} seconds={seconds:.2f} message={message}")
# a vocabulary the TP degree does not divide: a ValueError on every rank before any forward
uneven = parallelize_module(build_model(torch.float64, vocab_size=VOCAB + 1), tp_mesh, {"lm_head": ColwiseParallel()})
kind, message, seconds, _ = catch(lambda: generate(uneven, ids, attention_mask=mask, max_new_tokens=2, **common))
say(rank, "error", "uneven_vocab", f"type={kind} seconds={seconds:.2f} message={message}")
torch.distributed.barrier()
say(rank, "done", "all", "ok")
