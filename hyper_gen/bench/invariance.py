"""``hyper-gen bench invariance``: what batch-invariant mode costs, and what it buys.

On a random-weight Qwen3.5 checkpoint (torch, float32), the default model and the same checkpoint
loaded with ``batch_invariant=True``: greedy decode tokens/s at each ``--batches`` size (a run of
``1 + new`` tokens minus a run of 1, the faster of ``--repeats`` runs, the two modes timed in turn so
a shared host's load falls on both) and the prefill's seconds; then, over a left-padded batch of
mixed-length prompts, the largest and mean |rollout raw logprob - score()| of every generated token
in each mode (invariant: 0.0). The engine (``serve``) does not run batch-invariant yet.
"""

from __future__ import annotations

import time

import numpy as np

from hyper_gen import registry
from hyper_gen.config import GenerationConfig
from hyper_gen.generation import generate
from hyper_gen.host import describe_host
from hyper_gen.models.loading import load_model

from .logprobs import generated_scores
from .models import SHAPES, make_checkpoint, prompt_batch


def add_parser(sub):
    from .arguments import CACHE_DIR, add_command, positive, positive_list

    parser = add_command(sub, "invariance", "batch-invariant vs default: tok/s, logprob gap")
    parser.add_argument("--shape", default="mid", choices=["mid", "0.8b"], help="checkpoint shape")
    parser.add_argument("--batches", type=positive_list, default=(1, 16), help="decode batch sizes, comma-separated")
    parser.add_argument("--prompt-len", type=positive, default=32, help="the longest prompt (the shortest is 1/4)")
    parser.add_argument("--new-tokens", type=positive, default=16, help="decode steps timed")
    parser.add_argument("--repeats", type=positive, default=2, help="timed runs per mode; the fastest is kept")
    parser.add_argument("--cache-dir", default=CACHE_DIR, help="where the random-weight checkpoint is written once")
    return parser


def _seconds(model, ids, mask, tokens: int) -> float:
    config = GenerationConfig(max_new_tokens=tokens, eos_token_id=None)
    start = time.perf_counter()
    generate(model, ids, config, attention_mask=mask)
    return time.perf_counter() - start


def decode_rates(models: dict, ids, mask, new: int, repeats: int) -> dict:
    """mode -> (decode tokens/s, prefill seconds), the modes timed in turn, fastest of ``repeats``."""
    for model in models.values():
        _seconds(model, ids, mask, 2)  # warm-up
    prefill = {mode: [] for mode in models}
    whole = {mode: [] for mode in models}
    for _ in range(repeats):
        for mode, model in models.items():
            prefill[mode].append(_seconds(model, ids, mask, 1))
            whole[mode].append(_seconds(model, ids, mask, 1 + new))
    batch = ids.shape[0]
    return {m: (new * batch / max(min(whole[m]) - min(prefill[m]), 1e-9), min(prefill[m])) for m in models}


def logprob_gaps(model, ids, mask, new: int):
    """(max, mean) |rollout raw logprob - score()| over every generated token of a greedy rollout."""
    config = GenerationConfig(max_new_tokens=new, eos_token_id=None, return_dict_in_generate=True, output_logprobs=True)
    rollout, scored = generated_scores(model, generate(model, ids, config, attention_mask=mask))
    gap = np.abs(rollout - scored)
    return float(gap.max()), float(gap.mean())


def run_invariance(args):
    path = make_checkpoint(args.shape, args.cache_dir)
    models = {
        "default": load_model(path, backend="torch", dtype="float32"),
        "invariant": load_model(path, backend="torch", dtype="float32", batch_invariant=True),
    }
    vocab = SHAPES[args.shape]["vocab_size"]
    print(describe_host(registry.adapter("torch").intra_op_threads()))
    print(
        f"Qwen3.5 '{args.shape}' random weights, torch float32, greedy, prompts {max(1, args.prompt_len // 4)}-"
        f"{args.prompt_len} tokens (left-padded), {args.new_tokens} decode steps timed"
    )
    print(f"  {'batch':>5s}{'default tok/s':>15s}{'invariant tok/s':>17s}{'ratio':>7s}{'prefill s def/inv':>19s}")
    for batch in args.batches:
        ids, mask = prompt_batch(batch, args.prompt_len, max(1, args.prompt_len // 4), vocab)
        rates = decode_rates(models, ids, mask, args.new_tokens, args.repeats)
        (fast, pre), (slow, pre_inv) = rates["default"], rates["invariant"]
        print(f"  {batch:5d}{fast:15.1f}{slow:17.1f}{slow / fast:7.2f}{pre:10.3f}/{pre_inv:.3f}")
    ids, mask = prompt_batch(max(args.batches), args.prompt_len, max(1, args.prompt_len // 4), vocab)
    print(f"|rollout raw logprob - score()| over a batch of {ids.shape[0]}, {args.new_tokens} new tokens:")
    for mode, model in models.items():
        largest, mean = logprob_gaps(model, ids, mask, args.new_tokens)
        print(f"  {mode:10s} max {largest:.3e}  mean {mean:.3e}")


__all__ = ["add_parser", "decode_rates", "logprob_gaps", "run_invariance"]
