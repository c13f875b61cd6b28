"""``hyper-gen bench tp``: TP=2 vs TP=1 on one checkpoint, under torchrun or msrun (RFC DIST-02).

    torchrun --nproc_per_node 2 -m hyper_gen bench tp --backend torch --shape mid
    msrun --worker_num=2 --local_worker_num=2 --join=True hyper_gen/__main__.py bench tp --backend mindspore

Every rank loads the tp=1 model and its tp=2 shard of the same random-weight checkpoint (see
bench_models) and times prefill and decode through ``generate``; all ranks run both at once (the
TP=1 figure is one replica per rank sharing the machine). Rank 0 prints both next to the bytes a
decode step moves through collectives.
"""

from __future__ import annotations

import time

import numpy as np

from hyper_gen.config import GenerationConfig
from hyper_gen.generation import generate
from hyper_gen.host import describe_host


def run_tp(args):
    from hyper_gen.models.checkpoint import Checkpoint
    from hyper_gen.models.loading import load_model
    from hyper_gen.models.qwen3_5 import Qwen3_5Config
    from hyper_gen.models.qwen3_5.tp_traffic import collective_bytes_per_decode_step

    from .models import SHAPES, join_with_checkpoint

    ops, rank, world, threads, path = join_with_checkpoint(args, "tp")
    ids = np.random.default_rng(0).integers(3, SHAPES[args.shape]["vocab_size"], (args.batch, args.prompt_len))
    cfg = GenerationConfig(max_new_tokens=args.new_tokens, eos_token_id=None)
    results = {}
    outputs = {}
    for tp in (1, world):
        model = load_model(path, backend=args.backend, dtype="float32", tp=tp)
        run = lambda n, m=model: generate(m, ids, cfg.replace(max_new_tokens=n))  # noqa: E731
        run(2)
        prefill = min(_seconds(lambda r=run: r(1)) for _ in range(args.repeats))
        start = time.perf_counter()
        outputs[tp] = ops.to_numpy(run(args.new_tokens))
        total = time.perf_counter() - start
        results[tp] = (prefill, (args.new_tokens - 1) * args.batch / max(total - prefill, 1e-9))
        del model
    config = Qwen3_5Config.from_dict(Checkpoint(path).config)
    moved = collective_bytes_per_decode_step(config, args.batch, world, 4)
    if rank == 0:
        print(describe_host())
        print(
            f"{args.backend}: Qwen3.5 '{args.shape}' float32, B={args.batch}, prompt {args.prompt_len}, "
            f"{args.new_tokens} new tokens, {world} ranks running at once, {threads}"
        )
        for tp, (prefill, rate) in results.items():
            print(f"  TP={tp}: prefill {prefill * 1e3:9.1f} ms   decode {rate:8.2f} tok/s")
        print(
            f"  TP={world} / TP=1 decode: {results[world][1] / results[1][1]:.2f}x; "
            f"collectives per decode step: {moved / 1e3:.1f} kB per rank; "
            f"tokens identical: {np.array_equal(outputs[1], outputs[world])}"
        )


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start
