"""``hyper-gen generate``: prompts from flags, or a resumable JSONL batch job for rollouts and evals."""

from __future__ import annotations

import os
import sys

from hyper_gen.generation import generate
from hyper_gen.jobs.complete import completions
from hyper_gen.jobs.errors import UsageError
from hyper_gen.jobs.jsonl import context_length, open_job, run_jsonl
from hyper_gen.streaming import TextStreamer

from .common import generation_config, load_everything, model_path, rank


def run_generate(args) -> int:
    if bool(args.prompt) == bool(args.input):
        raise UsageError("give either --prompt TEXT (repeatable) or --input FILE.jsonl")
    if args.input and not args.output:
        raise UsageError("--input needs --output FILE.jsonl")
    if args.batch_size < 1:
        raise UsageError(f"--batch-size must be >= 1, got {args.batch_size}")
    for prompt in args.prompt:
        if not prompt.strip():
            raise UsageError(f"--prompt must not be empty, got {prompt!r}")
    if args.output and not args.input:
        raise UsageError("--output is for --input FILE.jsonl jobs; --prompt prints to stdout")
    # the job's paths and files are checked before the model loads, by every rank alike
    job = open_job(args.input, args.output) if args.input else None
    model, tokenizer, defaults = load_everything(args)
    config = generation_config(args, defaults)
    rank0 = rank(args.backend) == 0
    if job is not None:
        context = context_length(model, tokenizer, model_path(args))
        return run_jsonl(
            model, tokenizer, config, job, args.batch_size, write=rank0, context=context, batching=args.batching
        )
    if args.stream:
        for prompt in args.prompt:
            streamer = TextStreamer(
                tokenizer,
                skip_prompt=True,
                skip_special_tokens=True,
                file=sys.stdout if rank0 else open(os.devnull, "w"),
            )
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


__all__ = ["run_generate"]
