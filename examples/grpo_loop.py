"""A tiny GRPO loop: hyper_gen rolls out, a transformers copy of the model trains, the weights go back.

python examples/grpo_loop.py [--backend torch|mindspore] [--iterations 8] [--samples 8] [--seed 0]

The bundled demo model reverses digit strings ("rev 12345 =" -> " 54321") of up to 8 digits; greedy
it solves them all. Sampled at temperature 2.5 it scores about half, so there is room to learn: the
reward is the fraction of the answer's digits in the right place, and GRPO teaches the model to be
sure enough of the right digit that a hot sampler still picks it.

Each iteration:
1. rollout: ``hyper_gen.generate`` samples ``--samples`` completions per prompt (a GRPO group) with
   their log-probabilities: ``logprobs`` under the distribution sampled from (the model's at
   ``--temperature``, top-k / top-p off), the old policy of PPO's ratio, and ``raw_logprobs`` under the
   model itself (temperature 1);
2. ``hyper_gen.score`` recomputes ``raw_logprobs`` by teacher forcing (max |diff| printed);
3. rewards, advantages normalised within each group;
4. a few Adam steps on the trainer's copy (AutoModelForCausalLM, float32) with GRPO's PPO-clip loss,
   the ratio being the trainer's logprobs of the sampled tokens (at the same temperature) over the
   rollout's ``logprobs``; at ``--temperature 1`` these are the ``raw_logprobs``;
5. ``hyper_gen.update_weights`` pushes the trainer's weights (HF checkpoint names) into the rollout model.
"""

import argparse
import random
import time

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import hyper_gen
from hyper_gen.demo import demo_model_path


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--backend", default="torch", choices=["torch", "mindspore"], help="the rollout model's backend")
    p.add_argument("--iterations", type=int, default=8)
    p.add_argument("--samples", type=int, default=8, help="completions per prompt (the GRPO group size)")
    p.add_argument("--prompts", type=int, default=16, help="prompts per iteration")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=2.5, help="the rollout's sampling temperature")
    p.add_argument("--min-digits", type=int, default=2)
    p.add_argument("--max-digits", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=12)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--steps", type=int, default=2, help="optimizer steps per iteration (on the same rollout)")
    p.add_argument("--clip", type=float, default=0.2, help="PPO clip range")
    return p.parse_args(argv)


def to_numpy(x):
    """A torch / MindSpore tensor or a numpy array as numpy."""
    if isinstance(x, np.ndarray):
        return x
    if hasattr(x, "asnumpy"):  # MindSpore
        return x.asnumpy()
    return x.detach().cpu().numpy()


def reward(digits: str, completion: str) -> float:
    """The fraction of the reversed digits in the right place (over the longer of answer and target)."""
    answer = completion.split("<eos>", 1)[0].strip()
    target = digits[::-1]
    hits = sum(a == b for a, b in zip(answer, target))
    return hits / max(len(answer), len(target))


def make_digits(rng: random.Random, n: int, lo: int, hi: int):
    return ["".join(rng.choice("0123456789") for _ in range(rng.randint(lo, hi))) for _ in range(n)]


def at_positions(steps, out):
    """Per-step logprobs (B, steps) of a ``generate`` output placed at their positions in ``out.sequences``
    (B, T), float64, 0 elsewhere."""
    steps = to_numpy(steps).astype(np.float64)
    placed = np.zeros(tuple(out.sequences.shape), dtype=np.float64)
    for row, (s, n) in enumerate(zip(out.prompt_lengths, out.generated_lengths)):
        placed[row, s : s + n] = steps[row, :n]
    return placed


def trainer_logprobs(trainer, sequences, mask, positions, temperature=1.0):
    """log p(token) of every sequence position under the trainer's logits / ``temperature``, (B, T);
    ``positions`` (B, T) selects the generated tokens (the rest is 0). Rows are
    ``[prompt | generated | pad]``: right padded, so causal attention never sees the padding."""
    logits = trainer(input_ids=sequences, attention_mask=mask).logits.float() / temperature
    logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, sequences[:, 1:, None]).squeeze(-1)
    logp = torch.cat([torch.zeros_like(logp[:, :1]), logp], dim=1)  # position t's token given tokens < t
    return logp * positions


def main(argv=None):
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    path = demo_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")

    trainer = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    trainer.train()
    optimizer = torch.optim.Adam(trainer.parameters(), lr=args.lr)
    rollout_model = hyper_gen.load_model(path, backend=args.backend)
    defaults = rollout_model.generation_defaults  # the checkpoint's eos / pad ids
    # a tied lm_head is the embedding, not a checkpoint tensor: update_weights takes checkpoint names only
    skip = {"lm_head.weight"} if trainer.config.tie_word_embeddings else set()

    first = last = None
    worst_score = worst_sync = 0.0
    start = time.time()
    for it in range(args.iterations):
        digits = make_digits(rng, args.prompts, args.min_digits, args.max_digits)
        batch = tokenizer([f"rev {d} =" for d in digits], padding=True, return_tensors="np")
        out = hyper_gen.generate(
            rollout_model,
            batch["input_ids"],
            attention_mask=batch["attention_mask"],
            max_new_tokens=args.max_new_tokens,
            eos_token_id=defaults["eos_token_id"],
            pad_token_id=defaults["pad_token_id"],
            do_sample=True,
            temperature=args.temperature,
            top_k=0,
            top_p=1.0,
            seed=args.seed * 1000 + it,
            num_return_sequences=args.samples,
            return_dict_in_generate=True,
            output_logprobs=True,
        )
        starts, lengths = out.prompt_lengths, out.generated_lengths
        total = starts + lengths
        sequences = to_numpy(out.sequences)
        cols = np.arange(sequences.shape[1])[None, :]
        mask = cols < total[:, None]
        generated = (cols >= starts[:, None]) & mask

        old, raw = at_positions(out.logprobs, out), at_positions(out.raw_logprobs, out)

        # teacher-forced recompute on the rollout model: the rollout's raw logprobs again
        scored = to_numpy(hyper_gen.score(rollout_model, out.sequences, mask, starts)).astype(np.float64)
        score_diff = float(np.abs(scored - raw)[generated].max())

        texts = [tokenizer.decode(sequences[r, s : s + n].tolist()) for r, (s, n) in enumerate(zip(starts, lengths))]
        rewards = np.array([reward(digits[r // args.samples], t) for r, t in enumerate(texts)])
        groups = rewards.reshape(args.prompts, args.samples)
        advantages = ((groups - groups.mean(1, keepdims=True)) / (groups.std(1, keepdims=True) + 1e-4)).reshape(-1)

        seq_t = torch.from_numpy(sequences).long()
        mask_t = torch.from_numpy(mask).long()
        gen_t = torch.from_numpy(generated).float()
        old_t = torch.from_numpy(old).float()
        adv_t = torch.from_numpy(advantages).float()[:, None]
        n_tokens = gen_t.sum()
        sync_diff = None
        for step in range(args.steps):
            new = trainer_logprobs(trainer, seq_t, mask_t, gen_t, args.temperature)
            if step == 0:  # the trainer and the rollout hold the same weights: the ratio starts at 1
                sync_diff = float(((new.detach() - old_t).abs() * gen_t).max())
            ratio = torch.exp(new - old_t)
            surrogate = torch.minimum(ratio * adv_t, torch.clamp(ratio, 1 - args.clip, 1 + args.clip) * adv_t)
            loss = -(surrogate * gen_t).sum() / n_tokens  # token-level mean over the batch
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

        applied = hyper_gen.update_weights(
            rollout_model, [(k, v.detach()) for k, v in trainer.state_dict().items() if k not in skip]
        )
        mean = float(rewards.mean())
        exact = float(np.mean([r == 1.0 for r in rewards]))
        first = mean if first is None else first
        worst_score, worst_sync = max(worst_score, score_diff), max(worst_sync, sync_diff)
        last = mean
        print(
            f"iter {it} reward {mean:.4f} exact {exact:.3f} loss {loss.item():+.4f} "
            f"score max|diff| {score_diff:.2e} trainer max|diff| {sync_diff:.2e} updated {applied}",
            flush=True,
        )
    print(f"example: {digits[0]} -> {texts[0]!r}")
    # float32 noise only: the rollout decodes token by token (recurrent linear attention, cached
    # keys), score and the trainer run one forward over the whole row (HF's own cached decode
    # differs from its full forward by as much); a stale or missed weight push would show ~1e-2
    print(f"max|diff| over all iterations: score {worst_score:.2e} trainer {worst_sync:.2e}")
    print(f"reward {first:.4f} -> {last:.4f} ({args.backend}, {time.time() - start:.1f}s)")


if __name__ == "__main__":
    main()
