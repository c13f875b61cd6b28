"""Two msrun ranks, the ZeRO-3-style model of rollout_ms_synced.py, in the two cases only the
collective timeout ends. Run with a short $HYPER_GEN_TIMEOUT_S (MindSpore's MS_CPU_COMM_OP_TIMEOUT).

usage: rollout_ms_timeouts.py forward-raises|unsynced FLAG_DIR      (one case per job: after a
MindSpore CPU collective timed out, the job's next collectives fail at once or time out too)

- ``forward-raises``: step-synced, the model declaring no vocab_size, rank 1 given a token id
  outside the vocabulary: its prefill raises inside the forward (MindSpore's embedding gather),
  after the forward's all-gathers, so rank 0 finishes that forward and waits at the step's
  exchange until the timeout fails it (``parallel/step_sync.py``: an exception inside a forward is
  left to the collective timeout);
- ``unsynced``: ``synced_gpus=False``: rank 0's rows finish after step 3 and its generate returns;
  rank 1's next forward waits in an all-gather nobody joins until the timeout fails it. This is
  what step-syncing prevents.

The rank that does not time out stays alive and out of collectives until the other touches a
flag file in FLAG_DIR, so the failure seen is the timeout, not a dead peer. Both ranks then exit
normally (an os._exit would leave msrun's scheduler waiting out MS_NODE_TIMEOUT for the missing
nodes, failing the job).
"""

import json
import os
import sys
import time
from collections import Counter

from zero3_mindspore import GREEDY, PROMPTS, VOCAB, Zero3StubLM, left_padded

from hyper_gen import generate
from hyper_gen.parallel.launcher import host_ops, init_distributed

CASE, FLAGS = sys.argv[1], sys.argv[2]
assert init_distributed("mindspore")
ops = host_ops("mindspore")
rank, world = ops.rank(), ops.world_size()
model = Zero3StubLM(rank, world)
IDS, MASK = left_padded(PROMPTS[rank])
generate(model, IDS, GREEDY.replace(max_new_tokens=2), attention_mask=MASK)  # warm-up, both ranks step alike


def timed_out_case(check, ids, config, waiting_rank):
    """Run generate; the rank that timed out (``waiting_rank``) touches the flag, the other waits for it."""
    model.calls.clear()
    start = time.monotonic()
    try:
        generate(model, ids, config, attention_mask=MASK)
        error = None
    except Exception as exc:  # noqa: BLE001 - what each rank raises is the finding
        error = exc
    item = dict(
        rank=rank,
        check=check,
        error_type=None if error is None else type(error).__name__,
        message=None if error is None else str(error).strip().splitlines()[0][:400],
        calls=dict(Counter(model.calls)),
        seconds=round(time.monotonic() - start, 3),
    )
    print("ROLLOUT " + json.dumps(item), flush=True)
    flag = os.path.join(FLAGS, check)
    if rank == waiting_rank:
        with open(flag, "w") as f:
            f.write("done")
    deadline = time.monotonic() + 40  # the waiting rank fails within about the timeout
    while not os.path.exists(flag) and time.monotonic() < deadline:
        time.sleep(0.2)


if CASE == "forward-raises":
    bad = IDS.copy()
    if rank == 1:
        bad[1, -1] = VOCAB + 5
    model.vocab_size = None  # undeclared: nothing can check the ids before the forward
    timed_out_case(CASE, bad, GREEDY, waiting_rank=0)
else:
    assert CASE == "unsynced", CASE
    timed_out_case(CASE, IDS, GREEDY.replace(synced_gpus=False), waiting_rank=1)
print(f"rank {rank}: done", flush=True)
