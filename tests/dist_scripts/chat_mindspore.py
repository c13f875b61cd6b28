"""``hyper_gen.ChatSession`` / ``hyper_gen.chat`` on the native MindSpore demo model, in one process
(``tp=1``) or on both ranks of an msrun job (``tp=2``, the ranks' collectives in every forward).

usage: chat_mindspore.py OUT_DIR

Writes ``OUT_DIR/rank{r}.json``: rank 0's streamed turns (send, asend) with the history's replies,
a scripted chat's transcript, and every rank's returned histories.
"""

import asyncio
import io
import json
import os
import sys

import mindspore

import hyper_gen
from hyper_gen.demo import demo_model_path
from hyper_gen.jobs.tokenizer import load_tokenizer

mindspore.set_device("CPU")
out_dir = sys.argv[1]
world = int(os.environ.get("MS_WORKER_NUM", "1"))
model = hyper_gen.load_model(demo_model_path(), backend="mindspore", tp=world)
tokenizer = load_tokenizer(demo_model_path())
results = {}

session = hyper_gen.ChatSession(model, tokenizer, max_new_tokens=8, do_sample=True, temperature=0.5, seed=3)
if session.rank == 0:
    turns = [{"pieces": list(session.send(text)), "reply": session.history[-1]["content"]} for text in ["rev 123 ="]]

    async def streamed(text):
        return [piece async for piece in session.asend(text)]

    turns.append({"pieces": asyncio.run(streamed("rev 45 =")), "reply": session.history[-1]["content"]})
    session.close()
    results["turns"] = turns
    results["session"] = session.history
else:
    results["session"] = session.follow()

lines = iter(["rev 12 =", "rev 908 =", "exit"])
out = io.StringIO()
results["history"] = hyper_gen.chat(model, tokenizer, input=lambda: next(lines, None), output=out, max_new_tokens=8)
results["transcript"] = out.getvalue() if session.rank == 0 else ""
with open(os.path.join(out_dir, f"rank{session.rank}.json"), "w") as f:
    json.dump(results, f)
