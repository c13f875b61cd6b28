"""Chat with the MoE the job is training: experts split over ranks (expert parallel), FSDP2 over the rest.

    torchrun --nproc_per_node 2 examples/chat_fsdp2_ep.py [--ep-size 2] [--steps 3] [--seed 0]

What a trainer holding an expert-parallel MoE does, in order (CPU, gloo):

1. its model: an HF ``Qwen3_5MoeForCausalLM`` (small, random, the demo tokenizer's vocabulary);
   each rank keeps ``num_experts / ep_size`` of every MoE layer's routed experts, and the experts'
   forward sends each token to its experts' ranks and back with two ``all_to_all`` calls (the
   trainer's own dispatch / combine, :class:`ExpertParallel` below, as MindSpeed-LLM's
   expert-parallel dispatcher does); FSDP2 ``fully_shard`` over everything else, the expert
   weights ignored (``ignored_params``);
2. a few optimizer steps on the demo task;
3. a rollout with logprobs (``generate``, each rank its own prompts);
4. a chat with the same object (``hyper_gen.chat``), sampled, on every rank; rank 0's input here
   is scripted (``--lines``), stdin without it.

generate() and chat() know the ranks must step together because FSDP2 is around the model; an
expert-parallel model without FSDP says so itself: ``model.collective_forward = True``.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

import hyper_gen
from hyper_gen.demo import demo_model_path

# a small Qwen3.5 MoE (tests/qwen_checkpoints.py's tiny config, with the demo tokenizer's 99 ids)
TINY_MOE = dict(
    hidden_size=32,
    num_hidden_layers=4,
    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=16,
    num_experts=6,
    num_experts_per_tok=2,
    moe_intermediate_size=24,
    shared_expert_intermediate_size=40,
    max_position_embeddings=256,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
)


def tiny_moe(tokenizer, seed: int = 0, dtype=torch.float32, **overrides):
    """The same random model on every rank (``seed``), at a scale that gives O(1) logits."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    config = Qwen3_5MoeTextConfig(
        vocab_size=len(tokenizer),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **dict(TINY_MOE, **overrides),
    )
    torch.manual_seed(seed)
    model = Qwen3_5MoeForCausalLM(config).to(dtype)
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim >= 2:
                param.normal_(0.0, param.shape[-1] ** -0.5)
    model.config._experts_implementation = "eager"  # HF's loop over experts: the one ExpertParallel replaces
    return model


class ExpertParallel(nn.Module):
    """One MoE layer's routed experts, ``ep_size`` ranks each holding a contiguous slice of them.

    Same call as HF's experts module (``hidden (T, H), top_k_index (T, K), top_k_weights (T, K)``):
    every (token, expert) pair goes to the rank holding the expert (``all_to_all``), is computed
    there, and comes back (``all_to_all``) to be weighted and summed. Differentiable
    (``torch.distributed.nn``), so it trains."""

    def __init__(self, experts: nn.Module, group, ep_size: int):
        super().__init__()
        self.group, self.ep_size, self.ep_rank = group, ep_size, dist.get_rank(group)
        self.num_experts = experts.num_experts
        self.local = self.num_experts // ep_size
        mine = slice(self.ep_rank * self.local, (self.ep_rank + 1) * self.local)
        self.gate_up_proj = nn.Parameter(experts.gate_up_proj.detach()[mine].clone())  # (local, 2I, H)
        self.down_proj = nn.Parameter(experts.down_proj.detach()[mine].clone())  # (local, H, I)
        self.act_fn = experts.act_fn

    def forward(self, hidden, top_k_index, top_k_weights):
        tokens, k = top_k_index.shape
        expert = top_k_index.reshape(-1)
        order = torch.argsort(expert, stable=True)  # pairs grouped by expert, so by destination rank
        send_counts = torch.bincount(expert // self.local, minlength=self.ep_size)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        send, recv = send_counts.tolist(), recv_counts.tolist()
        # dispatch: the pairs' hidden states and their experts (local index) to the experts' ranks
        x = self._exchange(hidden[order // k], recv, send)
        ids = self._exchange(expert[order].unsqueeze(1), recv, send, differentiable=False)
        local_ids = ids.squeeze(1) - self.ep_rank * self.local  # the receiver's own slice of the experts
        y = torch.zeros_like(x)
        for e in range(self.local):
            rows = (local_ids == e).nonzero().squeeze(1)
            if rows.numel():
                gate, up = nn.functional.linear(x[rows], self.gate_up_proj[e]).chunk(2, dim=-1)
                y = y.index_add(0, rows, nn.functional.linear(self.act_fn(gate) * up, self.down_proj[e]))
        # combine: the results back to the tokens' ranks, weighted and summed per token
        back = self._exchange(y, send, recv)
        pairs = torch.empty_like(back).index_copy(0, order, back)
        return (pairs.view(tokens, k, -1) * top_k_weights.unsqueeze(-1).to(back.dtype)).sum(dim=1)

    def _exchange(self, rows, out_counts, in_counts, differentiable=True):
        if differentiable:
            return _AllToAll.apply(rows, out_counts, in_counts, self.group)
        return _all_to_all(rows, out_counts, in_counts, self.group)


def _all_to_all(rows, out_counts, in_counts, group):
    """Rows to the ranks of ``group``: ``in_counts[r]`` of ours to rank r, ``out_counts[r]`` from it."""
    out = rows.new_empty((sum(out_counts), rows.shape[1]))
    dist.all_to_all_single(out, rows.contiguous(), out_counts, in_counts, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """all_to_all whose backward sends the gradients back the way the rows came."""

    @staticmethod
    def forward(ctx, rows, out_counts, in_counts, group):
        ctx.counts, ctx.group = (out_counts, in_counts), group
        return _all_to_all(rows, out_counts, in_counts, group)

    @staticmethod
    def backward(ctx, grad):
        out_counts, in_counts = ctx.counts
        return _all_to_all(grad, in_counts, out_counts, ctx.group), None, None, None


def expert_parallel(model, ep_size: int):
    """Replace every MoE layer's experts with this rank's :class:`ExpertParallel` slice (ranks in
    groups of ``ep_size`` consecutive ranks). Returns (the expert parameters, in one order on every
    rank, which FSDP ignores; the group of the ranks holding the same slice, whose gradients add up)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if world % ep_size or model.config.num_experts % ep_size:
        experts = model.config.num_experts
        raise ValueError(f"ep_size {ep_size} must divide the world ({world}) and the experts ({experts})")
    groups = [dist.new_group(list(range(s, s + ep_size))) for s in range(0, world, ep_size)]
    replicas = [dist.new_group(list(range(r, world, ep_size))) for r in range(ep_size)]
    params = []
    for layer in model.model.layers:
        layer.mlp.experts = ExpertParallel(layer.mlp.experts, groups[rank // ep_size], ep_size)
        params += list(layer.mlp.experts.parameters())
    return params, replicas[rank % ep_size]


def shard(model, ep_size: int):
    """Experts over ``ep_size`` ranks, FSDP2 over the rest (each decoder layer, then the root);
    returns what :func:`expert_parallel` does."""
    experts, replicas = expert_parallel(model, ep_size)
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer, ignored_params=set(experts))
    fully_shard(model, ignored_params=set(experts))
    return experts, replicas


def train(model, tokenizer, experts, replicas, steps: int):
    """A few optimizer steps on the demo task (each rank its own batch)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(steps):
        gen = torch.Generator().manual_seed(1000 * step + rank)
        numbers = [str(int(n)) for n in torch.randint(1, 10**5, (4,), generator=gen)]
        batch = tokenizer([f"rev {n} = {n[::-1]}" for n in numbers], padding=True, return_tensors="pt")
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        loss = model(**batch, labels=labels).loss
        loss.backward()
        # expert gradients: the all_to_all's backward summed its EP group's tokens; add the other EP
        # groups' (the ranks holding the same slice), then average over every rank as FSDP does
        for param in experts:
            if dist.get_world_size(replicas) > 1:
                dist.all_reduce(param.grad, group=replicas)
            param.grad /= world
        optimizer.step()
        optimizer.zero_grad()
        if rank == 0:
            print(f"step {step}: loss {loss.item():.3f}", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ep-size", type=int, default=None, help="ranks the experts are split over (default: all)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lines", nargs="*", default=["rev 123 =", "rev 45 ="], help="rank 0's chat input")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    torch.set_num_threads(1)  # CPU ranks sharing a host
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    tokenizer = AutoTokenizer.from_pretrained(demo_model_path(), padding_side="left")

    # 1. the trainer's model: experts over ep_size ranks, FSDP2 over the rest
    model = tiny_moe(tokenizer, seed=args.seed)
    experts, replicas = shard(model, args.ep_size or world)

    # 2. a few optimizer steps
    train(model, tokenizer, experts, replicas, args.steps)
    model.eval()

    # 3. a rollout with logprobs: each rank its own prompts
    prompts = [f"rev {n} =" for n in ("12", "345", "6789")[rank::world]]
    batch = tokenizer(prompts, padding=True, return_tensors="pt")
    out = hyper_gen.generate(
        model,
        batch["input_ids"],
        attention_mask=batch["attention_mask"],
        max_new_tokens=6,
        do_sample=True,
        seed=args.seed,
        return_dict_in_generate=True,
        output_logprobs=True,
    )
    lines = []
    for row, prompt in enumerate(prompts):
        start, count = int(out.prompt_lengths[row]), int(out.generated_lengths[row])
        text = tokenizer.decode(out.sequences[row, start : start + count], skip_special_tokens=True)
        logprob = float(out.logprobs[row, :count].sum())
        lines.append(f"rank {rank} rollout: {prompt!r} -> {text!r} logprob={logprob:.3f}")
    everyone = [None] * world
    dist.all_gather_object(everyone, lines)  # rank 0 prints them all: ranks writing one pipe can interleave
    if rank == 0:
        print("\n".join(line for rank_lines in everyone for line in rank_lines), flush=True)

    # 4. a chat with the same object, sampled (the same seed on every rank); rank 0 reads the lines
    script = iter(args.lines)
    hyper_gen.chat(model, tokenizer, input=lambda: next(script, None), max_new_tokens=8, do_sample=True, seed=args.seed)

    dist.barrier()
    dist.destroy_process_group()
    # leave without the interpreter's teardown: gloo threads still holding FSDP's async work can abort
    # a rank at finalization (pytorch/pytorch#179291)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
