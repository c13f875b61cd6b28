"""``hyper-gen generate``: prompts from flags, or a resumable JSONL batch job for rollouts and evals."""

from __future__ import annotations

import os
import sys

from hyper_gen.config import MAX_ROWS
from hyper_gen.generation import generate
from hyper_gen.jobs.complete import completions
from hyper_gen.jobs.errors import UsageError
from hyper_gen.jobs.jsonl import context_length, open_job, run_jsonl
from hyper_gen.streaming import TextStreamer

from .common import end_sharded_job, generation_config, load_everything, model_path, rank


def run_generate(args) -> int:
    if bool(args.prompt) == bool(args.input):
        raise UsageError("give either --prompt TEXT (repeatable) or --input FILE.jsonl")
    if args.input and not args.output:
        raise UsageError("--input needs --output FILE.jsonl")
    if not 1 <= args.batch_size <= MAX_ROWS:
        raise UsageError(f"--batch-size must be in [1, {MAX_ROWS}] (hyper_gen.config.MAX_ROWS), got {args.batch_size}")
    for number, prompt in enumerate(args.prompt, start=1):
        if not prompt.strip():
            raise UsageError(f"--prompt must not be empty, got {prompt!r}")
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as exc:  # bytes the shell passed that are not UTF-8 (surrogate-escaped)
            raise UsageError(
                f"{_which(number, args.prompt)} is not UTF-8 text: {prompt[exc.start]!r} at character {exc.start}"
            ) from None
    if args.output and not args.input:
        raise UsageError("--output is for --input FILE.jsonl jobs; --prompt prints to stdout")
    if args.batch_invariant and args.input and args.batching == "inflight":
        # inflight jobs run on the engine, whose steps are not batch-invariant yet
        raise UsageError("--batch-invariant runs --input jobs with --batching fixed (inflight runs on the engine)")
    # the job's paths and files are checked before the model loads, by every rank alike
    job = open_job(args.input, args.output) if args.input else None
    generation_config(args, {})  # the sampling flags checked before any framework loads (no defaults needed)
    model, tokenizer, defaults = load_everything(args)
    config = generation_config(args, defaults)
    rank0 = rank(args.backend) == 0
    if job is not None:
        context = context_length(model, tokenizer, model_path(args))
        code = run_jsonl(
            model, tokenizer, config, job, args.batch_size, write=rank0, context=context, batching=args.batching
        )
    else:
        check_prompts(args.prompt, tokenizer, context_length(model, tokenizer, model_path(args)))
        try:
            code = _print_completions(args, model, tokenizer, config, rank0)
        except (TypeError, ValueError) as exc:  # what generate() rejects in this input (it names the field and value)
            raise UsageError(_first_line(exc)) from None
    del model  # before a --shard job leaves its group
    return end_sharded_job(args, code)


def check_prompts(prompts, tokenizer, context) -> None:
    """UsageError for a --prompt generate cannot take: one the tokenizer rejects, no tokens, or as
    many tokens as the model's context or more (no room for a new one). A shorter prompt whose
    completion would pass the context stops there, as generate() does."""
    for number, prompt in enumerate(prompts, start=1):
        which = _which(number, prompts)
        try:
            length = len(tokenizer(prompt, add_special_tokens=False, verbose=False)["input_ids"])
        except Exception as exc:  # any tokenizer failure is this prompt's
            raise UsageError(f"{which}: the tokenizer rejects it: {_first_line(exc)}") from None
        if length == 0:
            raise UsageError(f"{which} has no tokens")
        if context is not None and length >= context:
            raise UsageError(
                f"{which} is {length} tokens, {'more than' if length > context else 'as many as'} the model's "
                f"context of {context} positions (prompt + generated tokens): no room for a new token; shorten "
                f"it to under {context} tokens"
            )


def _which(number: int, prompts) -> str:
    return f"--prompt {number}" if len(prompts) > 1 else "--prompt"


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def _print_completions(args, model, tokenizer, config, rank0: bool) -> int:
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
