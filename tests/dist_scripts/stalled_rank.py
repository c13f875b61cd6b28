"""Two ranks of a TP=2 demo model; rank 1 then stops (SIGSTOP) and rank 0 calls generate.

usage: stalled_rank.py torch|mindspore      (the job's environment sets HYPER_GEN_TIMEOUT_S)

load_model(..., tp=2) joins the job (the timeout comes from HYPER_GEN_TIMEOUT_S); one generate
runs on both ranks; rank 1 stops itself; rank 0's next generate must fail within about the
configured timeout, with an error naming it, instead of waiting out a 600 s default. Rank 0 prints
"rank 0: <ErrorType> after <seconds> s: <message>" and exits 1, so the launcher ends the job.
"""

import os
import signal
import sys
import time

from hyper_gen import GenerationConfig, generate, load_model
from hyper_gen.demo import demo_model_path
from hyper_gen.parallel.launcher import host_ops

framework = sys.argv[1]
model = load_model(demo_model_path(), backend=framework, tp=2)
rank = host_ops(framework).rank()
config = GenerationConfig(max_new_tokens=4, eos_token_id=None)
generate(model, [[5, 6, 7]], config)
print(f"rank {rank}: first generate done", flush=True)
if rank == 1:
    os.kill(os.getpid(), signal.SIGSTOP)  # a stalled rank: alive, silent
    time.sleep(600)
start = time.monotonic()
try:
    generate(model, [[5, 6, 7]], config)
    print(f"rank {rank}: NO ERROR", flush=True)
except Exception as error:  # noqa: BLE001 - what the waiting rank sees is the finding
    elapsed = time.monotonic() - start
    first = str(error).splitlines()[0] if str(error) else ""
    print(f"rank {rank}: {type(error).__name__} after {elapsed:.1f} s: {first}", flush=True)
    sys.stdout.flush()
    os._exit(1)  # the stalled peer holds the group: no orderly teardown
