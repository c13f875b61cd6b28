"""GRPO/PPO-style rollouts from an FSDP2-sharded HF model, inside the training job.

    torchrun --nproc_per_node 2 examples/rollout_fsdp.py [MODEL_DIR] [--samples 4] [--seed 0] [--max-new-tokens 12]

MODEL_DIR: an HF causal-LM checkpoint folder with its tokenizer (default: the bundled demo model,
a tiny Qwen3.5 that reverses digit strings). What a trainer does, in order:

1. its model, sharded as it trains it: ``fully_shard`` on every decoder layer, then the root;
2. its own prompts on every data-parallel rank (different prompts, different batch sizes);
3. one ``generate`` per rank: ``num_return_sequences`` samples per prompt (prefilled once),
   ``seed``-ed noise keyed by the global row (rank 1's rows follow rank 0's, so no two ranks draw
   the same samples), per-token logprobs under the sampling distribution (``logprobs``, the PPO
   ratio's denominator) and under the raw model (``raw_logprobs``, for a KL term).

Ranks whose rows all reached EOS keep stepping (one-token dummy forwards) until every rank is done,
because FSDP's forward all-gathers parameters with every rank: generate decides this from the model
(``synced_gpus=None``). ``unshard_params=True`` gathers the parameters once for the whole call
instead of in every forward (the full model in memory meanwhile). Use the default CPU gloo group
here; on GPUs, ``init_process_group("nccl")`` and the model on ``cuda:LOCAL_RANK``.
"""

import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM, AutoTokenizer

from hyper_gen import generate
from hyper_gen.demo import demo_model_path

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("model_dir", nargs="?", default=demo_model_path())
parser.add_argument("--samples", type=int, default=4, help="samples per prompt (num_return_sequences)")
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--max-new-tokens", type=int, default=12)
parser.add_argument("--temperature", type=float, default=2.0, help="high: the demo model is very sure of its answers")
parser.add_argument(
    "--sharder",
    choices=("torch", "hyperparallel"),
    default="torch",
    help="whose fully_shard: torch's FSDP2, or HyperParallel's (examples/rollout_hyperparallel.py)",
)
args = parser.parse_args()

torch.set_num_threads(1)  # CPU ranks sharing a host
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()

# 1. the policy, sharded as the trainer shards it
model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32).eval()
if args.sharder == "hyperparallel":
    os.environ.setdefault("HYPER_PARALLEL_PLATFORM", "torch")  # it picks MindSpore whenever MindSpore imports
    from hyper_parallel import init_device_mesh
    from hyper_parallel.core.fully_shard import fully_shard as hyper_fully_shard

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    for layer in model.model.layers:  # the root stays whole: HyperParallel splits dim 0 evenly only, and
        hyper_fully_shard(layer, mesh=mesh)  # the demo's tied embedding has 99 rows
else:
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
tokenizer = AutoTokenizer.from_pretrained(args.model_dir, padding_side="left")

# 2. this rank's prompts (a data-parallel shard of the rollout batch)
numbers = ["12345", "908", "4711", "20", "386", "7", "55012"]
mine = numbers[rank::world]
batch = tokenizer([f"rev {n} =" for n in mine], padding=True, return_tensors="pt")

# 3. n samples per prompt with logprobs
out = generate(
    model,
    batch["input_ids"],
    attention_mask=batch["attention_mask"],
    max_new_tokens=args.max_new_tokens,
    do_sample=True,
    temperature=args.temperature,
    num_return_sequences=args.samples,
    seed=args.seed,
    return_dict_in_generate=True,
    output_logprobs=True,
    unshard_params=True,
)

lines = []
for row in range(out.sequences.shape[0]):
    start, count = int(out.prompt_lengths[row]), int(out.generated_lengths[row])
    completion = tokenizer.decode(out.sequences[row, start : start + count], skip_special_tokens=True)
    prompt = mine[row // args.samples]
    reward = 1.0 if completion.strip() == prompt[::-1] else 0.0  # the demo task's reward: reversed correctly
    logprob = float(out.logprobs[row, :count].sum())
    raw = float(out.raw_logprobs[row, :count].sum())
    lines.append(
        f"rank {rank}: rev {prompt} = {completion.strip()!r:10} tokens={count:2d} reward={reward:.0f} "
        f"logprob={logprob:8.3f} raw_logprob={raw:8.3f}"
    )
everyone = [None] * world
dist.all_gather_object(everyone, lines)  # rank 0 prints them all: ranks writing one pipe can interleave
if rank == 0:
    print("\n".join(line for rank_lines in everyone for line in rank_lines), flush=True)
    print(f"done: {len(numbers)} prompts over {world} ranks, {args.samples} samples each", flush=True)
dist.barrier()  # every rank done with the group before any rank tears it down
dist.destroy_process_group()
# Leave without the interpreter's teardown: gloo worker threads still holding FSDP's async work
# can abort a rank at finalization ("terminate called without an active exception", SIGABRT;
# pytorch/pytorch#179291) after all its work is done.
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
