"""``hyper_gen.chat`` / ``ChatSession`` on one model, in one process or on every rank of a torchrun job.

usage: chat_job.py KIND OUT_DIR [--timeout S] [--pause S]

KIND: ``demo`` (the demo checkpoint, HF; FSDP2 on each layer and the root under torchrun), ``ep``
(examples/chat_fsdp2_ep.py's float64 Qwen3.5 MoE: experts split over the ranks with its all_to_all,
FSDP2 over the rest), ``ep_bare`` (experts split, no FSDP: ``collective_forward = True``). In one
process every kind is the unsharded HF model. Under torchrun the group's timeout is ``--timeout``
seconds, and rank 0's input pauses ``--pause`` seconds between two lines (past the timeout).

Runs three chats (greedy with a pause, an overlong message and an exit word; seeded sampling with a
system message ending at EOF; a ChatSession with send / asend / reset) and writes
``OUT_DIR/rank{r}.json``: each chat's transcript (rank 0's output stream; what the other ranks
wrote to their default stdout is checked to be nothing) and returned history.
"""

import asyncio
import contextlib
import io
import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, AutoTokenizer

import hyper_gen
from hyper_gen.demo import demo_model_path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
from chat_fsdp2_ep import expert_parallel, shard, tiny_moe  # noqa: E402

kind, out_dir = sys.argv[1], sys.argv[2]
options = dict(zip(sys.argv[3::2], sys.argv[4::2]))
timeout_s, pause_s = float(options.get("--timeout", 600)), float(options.get("--pause", 0))
torch.set_num_threads(1)
world = int(os.environ.get("WORLD_SIZE", "1"))
if world > 1:
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
rank = dist.get_rank() if world > 1 else 0

tokenizer = AutoTokenizer.from_pretrained(demo_model_path())
if kind == "demo":
    model = AutoModelForCausalLM.from_pretrained(demo_model_path(), dtype=torch.float32).eval()
    long_line = "1" * 700  # the demo model's context is 512 tokens
    if world > 1:
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
else:
    model = tiny_moe(tokenizer, seed=3, dtype=torch.float64, max_position_embeddings=128).eval()
    long_line = "1" * 200
    if world > 1 and kind == "ep":
        shard(model, ep_size=world)
    elif world > 1:
        expert_parallel(model, ep_size=world)
        model.collective_forward = True  # experts on other ranks: every forward is a collective

if world > 1:
    dist.barrier()


def scripted(lines):
    """An ``input=`` callable: the lines in order, sleeping ``pause_s`` at each "<pause>", then EOF."""
    lines = iter(lines)

    def read():
        for line in lines:
            if line == "<pause>":
                time.sleep(pause_s)
                continue
            return line
        return None

    return read


results = {}
stray = io.StringIO()  # what this rank printed to stdout: nothing but on rank 0's own stream
with contextlib.redirect_stdout(stray):
    for name, lines, settings in [
        ("greedy", ["rev 12 =", "<pause>", "", "rev 345 =", long_line, "rev 6 =", " Exit ", "never read"], {}),
        ("sampled", ["rev 12 =", "rev 345 ="], dict(do_sample=True, temperature=1.5, seed=11, system="Reverse.")),
    ]:
        out = io.StringIO()
        history = hyper_gen.chat(
            model, tokenizer, input=scripted(lines), output=out if rank == 0 else None, max_new_tokens=8, **settings
        )
        results[name] = {"transcript": out.getvalue(), "history": history}

    session = hyper_gen.ChatSession(model, tokenizer, max_new_tokens=8, do_sample=True, seed=5)
    if rank == 0:
        turns = []
        for text in ["rev 78 =", "rev 9 ="]:
            pieces = list(session.send(text))
            turns.append({"pieces": pieces, "reply": session.history[-1]["content"]})

        async def streamed(text):
            return [piece async for piece in session.asend(text)]

        pieces = asyncio.run(streamed("rev 5 ="))
        turns.append({"pieces": pieces, "reply": session.history[-1]["content"]})
        before_reset = session.history
        session.reset()
        turns.append({"pieces": list(session.send("rev 78 =")), "reply": session.history[-1]["content"]})
        try:
            session.send(long_line)
        except ValueError as error:
            turns.append({"refused": str(error)})
        session.close()
        results["session"] = {"turns": turns, "before_reset": before_reset, "history": session.history}
    else:
        results["session"] = {"history": session.follow()}
results["stdout"] = stray.getvalue()

with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
    json.dump(results, f)
if world > 1:
    dist.barrier()
    dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)  # gloo threads holding FSDP's async work can abort a rank at finalization (pytorch#179291)
