"""``hyper-gen chat``: streaming multi-turn chat, on one process or every rank of a job.

A thin caller of :func:`hyper_gen.chat` (hyper_gen/chat_loop.py), which holds the loop: rank 0
reads stdin and prints, the text is broadcast so every rank runs the same generate(), sampling
uses a seed shared by all ranks, a person's pause never trips the collective timeout
(``--timeout``), and every rank leaves together when rank 0 quits.
"""

from __future__ import annotations

from hyper_gen.chat_loop import EXIT_WORDS, chat
from hyper_gen.chat_prompt import fit_context, format_conversation
from hyper_gen.parallel.launcher import host_ops

from .common import end_sharded_job, generation_config, load_everything

__all__ = ["run_chat", "fit_context", "format_conversation", "EXIT_WORDS"]


def run_chat(args) -> int:
    generation_config(args, {})  # the sampling flags checked before any framework loads (no defaults needed)
    model, tokenizer, defaults = load_everything(args)
    config = generation_config(args, defaults)
    ops = host_ops(args.backend)
    rank, world = ops.rank(), ops.world_size()
    if rank == 0:
        print(f"Entering chat ({args.backend}, {world} rank{'s' if world > 1 else ''}). Type 'exit' to quit.")
    chat(model, tokenizer, config, timeout_s=getattr(args, "timeout", None))
    del model  # before a --shard job leaves its group
    return end_sharded_job(args, 0)
