"""``hyper-gen chat``: streaming multi-turn chat, on one process or every rank of a job.

Under torchrun / msrun only rank 0 reads stdin; the text is broadcast so every rank runs the
same generate() (collectives inside a parallel model stay in step), only rank 0 prints, sampling
uses a seed shared by all ranks, and every rank leaves the loop together when rank 0 quits.
While rank 0 waits for the user it tells the other ranks so about every second, so a pause of
any length never trips the collective timeout (``--timeout``).
"""

from __future__ import annotations

import os
import sys

import numpy as np

from hyper_gen.generation import generate
from hyper_gen.inputs import ModelLimits
from hyper_gen.jobs.complete import host
from hyper_gen.parallel.launcher import (
    broadcast_ints,
    broadcast_text_patiently,
    collective_timeout_s,
    heartbeat_s,
    host_ops,
)
from hyper_gen.streaming import TextStreamer

from .common import end_sharded_job, generation_config, load_everything

EXIT_WORDS = ("exit", "quit")


def format_conversation(tokenizer, messages) -> str:
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    lines = [f"{m['role'].capitalize()}: {m['content']}" for m in messages]
    return "\n".join(lines + ["Assistant:"])


def _read_user_line():
    """The next non-empty line (blank lines are ignored), None at EOF or an exit word. A line that
    is not UTF-8 (bytes the terminal could not decode) is refused with a note, as an overlong one."""
    while True:
        try:
            line = input("User: ")
        except EOFError:
            return None
        try:
            line.encode("utf-8")
        except UnicodeEncodeError as exc:
            print(f"(message is not UTF-8 text: {line[exc.start]!r} at character {exc.start}; try again)")
            continue
        if line.strip():
            return None if line.strip().lower() in EXIT_WORDS else line


def fit_context(tokenizer, messages, context, max_new_tokens):
    """(messages, prompt ids) with the oldest turns dropped until the prompt and ``max_new_tokens``
    fit the model's ``context`` (None: no limit); ids None when even the last message does not fit."""
    while True:
        ids = tokenizer(format_conversation(tokenizer, messages), return_tensors="np", add_special_tokens=False)[
            "input_ids"
        ]
        if context is None or ids.shape[1] + max_new_tokens <= context:
            return messages, ids
        if len(messages) <= 1:
            return [], None
        messages = messages[2:] if len(messages) > 2 else messages[-1:]  # drop the oldest user/assistant pair


def run_chat(args) -> int:
    generation_config(args, {})  # the sampling flags checked before any framework loads (no defaults needed)
    model, tokenizer, defaults = load_everything(args)
    config = generation_config(args, defaults)
    ops = host_ops(args.backend)
    tick = heartbeat_s(collective_timeout_s(getattr(args, "timeout", None)))
    rank, world = ops.rank(), ops.world_size()
    out = sys.stdout if rank == 0 else open(os.devnull, "w")
    print(f"Entering chat ({args.backend}, {world} rank{'s' if world > 1 else ''}). Type 'exit' to quit.", file=out)
    messages, turn = [], 0
    context = ModelLimits.of(model).context
    rng = np.random.default_rng()
    while True:
        # the other ranks hear from rank 0 every heartbeat while a person thinks: never a timeout
        text = broadcast_text_patiently(ops, _read_user_line, tick_s=tick) if world > 1 else _read_user_line()
        if text is None:
            break
        seed = args.seed + turn if args.seed is not None else int(rng.integers(0, 2**31 - 1))
        if world > 1:
            seed = int(broadcast_ints(ops, [seed])[0])
        fitted, ids = fit_context(
            tokenizer, messages + [{"role": "user", "content": text}], context, config.max_new_tokens
        )
        if ids is None:  # the conversation so far is kept
            print(f"(message too long: the model's context is {context} tokens; try a shorter one)", file=out)
            continue
        messages = fitted
        print("Assistant:", end=" ", file=out, flush=True)
        streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True, file=out)
        result = np.asarray(
            host(generate(model, ids, config.replace(seed=seed) if config.do_sample else config, streamer=streamer))
        )
        reply = tokenizer.decode(result[0, ids.shape[1] :].tolist(), skip_special_tokens=True)
        messages.append({"role": "assistant", "content": reply.strip()})
        turn += 1
    print("", file=out, flush=True)
    del model  # before a --shard job leaves its group
    return end_sharded_job(args, 0)
