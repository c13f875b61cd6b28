"""``hyper-gen bench logprobs``: how far a float32 rollout's logprobs are from ``score()``'s.

An RL trainer recomputes the logprobs of its rollouts (the policy ratio of PPO / GRPO) and reads
any gap between them and the rollout's as off-policy noise. Per backend, on a random-weight
Qwen3.5 checkpoint: a left-padded batch of mixed-length prompts is rolled out greedy and sampled
(``seed``) in float32 with ``output_logprobs=True``; then ``score()`` recomputes the same tokens
in float32 and in float64 (the same weights loaded as float64: the reference). Printed: the
largest |rollout - score| over every generated token, and each of the two float32 numbers against
the float64 reference, so the gap reads as the sum of two float32 roundings of different
computations (the rollout's one-token decode steps against the cache, the recurrent Gated
DeltaNet step; score's one forward over the whole sequence, the chunked delta rule), not as a
bias of either. A float64 rollout against a float64 score is printed too (the issue's 1e-9 bar).
"""

from __future__ import annotations

import numpy as np

from hyper_gen import registry
from hyper_gen.config import GenerationConfig
from hyper_gen.generation import generate
from hyper_gen.host import describe_host
from hyper_gen.models.loading import load_model
from hyper_gen.registry import to_host
from hyper_gen.scoring import score

from .models import SHAPES, make_checkpoint, prompt_batch


def add_parser(sub):
    from .arguments import CACHE_DIR, add_command, backend_list, positive

    parser = add_command(sub, "logprobs", "rollout logprobs vs score(), float64 reference")
    parser.add_argument("--shape", default="mid", choices=["mid", "0.8b"], help="checkpoint shape")
    parser.add_argument("--backends", type=backend_list, default="torch,mindspore", help="backends, one at a time")
    parser.add_argument("--batch", type=positive, default=8, help="prompts rolled out together")
    parser.add_argument("--prompt-len", type=positive, default=64, help="the longest prompt (the shortest is 1/4)")
    parser.add_argument("--new-tokens", type=positive, default=32, help="tokens generated per row")
    parser.add_argument("--cache-dir", default=CACHE_DIR, help="where the random-weight checkpoint is written once")
    return parser


def generated_scores(model, out):
    """(rollout raw logprobs, score() logprobs) of every generated token of ``out``, flat, float64."""
    total = out.prompt_lengths + out.generated_lengths
    sequences = to_host(out.sequences)
    mask = (np.arange(sequences.shape[1])[None, :] < total[:, None]).astype(np.int64)
    scored = to_host(score(model, sequences, mask, out.prompt_lengths)).astype(np.float64)
    raw = to_host(out.raw_logprobs).astype(np.float64)
    rollout, recomputed = [], []
    for i, (p, n) in enumerate(zip(out.prompt_lengths, out.generated_lengths)):
        rollout.append(raw[i, :n])
        recomputed.append(scored[i, p : p + n])
    return np.concatenate(rollout), np.concatenate(recomputed)


def measure(backend: str, path: str, args) -> list:
    """Rows (backend, mode, |rollout - score|, |rollout - f64|, |score - f64|, f64 rollout vs f64 score, tokens)."""
    model32 = load_model(path, backend=backend, dtype="float32")
    model64 = load_model(path, backend=backend, dtype="float64")
    vocab = SHAPES[args.shape]["vocab_size"]
    ids, mask = prompt_batch(args.batch, args.prompt_len, max(1, args.prompt_len // 4), vocab)
    rows = []
    for mode, sampling in (("greedy", {}), ("sampled", dict(do_sample=True, seed=0))):
        config = GenerationConfig(
            max_new_tokens=args.new_tokens,
            eos_token_id=None,
            return_dict_in_generate=True,
            output_logprobs=True,
            **sampling,
        )
        out = generate(model32, ids, config, attention_mask=mask)
        rollout, score32 = generated_scores(model32, out)
        _, score64 = generated_scores(model64, out)  # the same tokens, recomputed in float64
        out64 = generate(model64, ids, config, attention_mask=mask)
        rollout64, scored64 = generated_scores(model64, out64)
        rows.append(
            (
                backend,
                mode,
                np.abs(rollout - score32).max(),
                np.abs(rollout - score64).max(),
                np.abs(score32 - score64).max(),
                np.abs(rollout64 - scored64).max(),
                rollout.size,
            )
        )
    return rows


def run_logprobs(args):
    path = make_checkpoint(args.shape, args.cache_dir)
    rows = []
    for backend in args.backends.split(","):
        rows += measure(backend, path, args)
    threads = [registry.adapter(b).intra_op_threads() for b in args.backends.split(",")]
    print(describe_host(next((t for t in threads if t is not None), None)))
    print(
        f"Qwen3.5 '{args.shape}' random weights, batch {args.batch}, prompts {max(1, args.prompt_len // 4)}-"
        f"{args.prompt_len} (left-padded), {args.new_tokens} new tokens; largest |difference| of a generated "
        "token's logprob"
    )
    print(
        f"  {'':10s}{'mode':>9s}{'f32 rollout-score':>19s}{'f32 rollout-f64':>17s}{'f32 score-f64':>15s}"
        f"{'f64 rollout-score':>19s}{'tokens':>8s}"
    )
    for backend, mode, gap, rollout_error, score_error, gap64, tokens in rows:
        print(f"  {backend:10s}{mode:>9s}{gap:19.2e}{rollout_error:17.2e}{score_error:15.2e}{gap64:19.2e}{tokens:8d}")
    print("f64: score() of the same tokens with the weights loaded as float64 (the reference)")


__all__ = ["add_parser", "generated_scores", "measure", "run_logprobs"]
