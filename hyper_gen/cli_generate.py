"""``hyper-gen generate``: prompts from flags, or a resumable JSONL batch job for rollouts and evals."""

from __future__ import annotations

import os
import sys

import numpy as np

from .cli import UsageError, generation_config, load_everything
from .generation import generate
from .streaming import TextStreamer


def completions(model, tokenizer, prompts, config, on_tokens=None):
    """(completion texts, generated token counts, finish reasons) for a left-padded batch of prompts."""
    batch = tokenizer(prompts, padding=True, return_tensors="np", add_special_tokens=False)
    mask = batch["attention_mask"]
    out = _host(generate(model, batch["input_ids"], config, attention_mask=mask, on_tokens=on_tokens))
    texts, counts, reasons = [], [], []
    eos = set(config.eos_token_ids)
    for row, length in enumerate(mask.sum(axis=1)):
        generated = out[row, int(length):].tolist()
        ended = next((i for i, t in enumerate(generated) if t in eos), None)
        generated = generated[:ended + 1] if ended is not None else generated
        if ended is None:  # trailing pad ids only pad the output to the common width
            generated = generated[:config.max_new_tokens]
        texts.append(tokenizer.decode(generated, skip_special_tokens=True))
        counts.append(len(generated))
        reasons.append("eos" if ended is not None else "length")
    return texts, counts, reasons


def _host(tensor) -> np.ndarray:
    from .ops import to_host

    return np.asarray(to_host(tensor))


def run_generate(args) -> int:
    if bool(args.prompt) == bool(args.input):
        raise UsageError("give either --prompt TEXT (repeatable) or --input FILE.jsonl")
    if args.input and not args.output:
        raise UsageError("--input needs --output FILE.jsonl")
    if args.batch_size < 1:
        raise UsageError(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.input and not os.path.isfile(args.input):
        raise UsageError(f"--input file {args.input!r} does not exist")
    model, tokenizer, defaults = load_everything(args)
    config = generation_config(args, defaults)
    rank0 = _rank(args.backend) == 0
    if args.input:
        from .batch_jobs import run_jsonl

        return run_jsonl(model, tokenizer, config, args.input, args.output, args.batch_size, write=rank0)
    if args.stream:
        for prompt in args.prompt:
            streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True,
                                    file=sys.stdout if rank0 else open(os.devnull, "w"))
            if rank0:
                print(prompt, end="", flush=True)
            batch = tokenizer([prompt], return_tensors="np", add_special_tokens=False)
            generate(model, batch["input_ids"], config, streamer=streamer)
        return 0
    texts, _, _ = completions(model, tokenizer, args.prompt, config)
    if rank0:
        for prompt, text in zip(args.prompt, texts):
            print(prompt + text)
    return 0


def _rank(backend: str) -> int:
    from .distributed import host_ops

    if not (int(os.environ.get("WORLD_SIZE", "1")) > 1 or int(os.environ.get("MS_WORKER_NUM", "1")) > 1):
        return 0
    return host_ops(backend).rank()


__all__ = ["run_generate", "completions"]
