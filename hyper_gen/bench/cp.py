"""``hyper-gen bench cp``: CP=2 vs CP=1 on one checkpoint and a long prompt, under torchrun or msrun
(RFC DIST-03 / DIST-04).

    torchrun --nproc_per_node 2 -m hyper_gen bench cp --backend torch --prompt-len 2048
    msrun --worker_num=2 --local_worker_num=2 --join=True hyper_gen/__main__.py bench cp --backend mindspore

Every rank loads the cp=1 model and the cp=N one of the same random-weight checkpoint (see
bench_models) and times prefill (a 1-token generate) and decode (between the first and the last
token of a generate call, from ``on_tokens``) through ``generate``; all ranks
run both at once (the CP=1 figure is one replica per rank sharing the machine). The memory figure
is what one prefill into a static cache for prompt + new tokens leaves on each rank: attention
K/V (CP: this rank's slice, the owner rank with room for the decode tokens) and Gated DeltaNet
conv + recurrent state (replicated). Rank 0 prints both, with the host.
"""

from __future__ import annotations

import time

import numpy as np

from hyper_gen import registry
from hyper_gen.cache import make_cache
from hyper_gen.config import GenerationConfig
from hyper_gen.generation import generate
from hyper_gen.host import describe_host
from hyper_gen.masks import prefill_mask
from hyper_gen.models.loading import load_model

from .models import SHAPES, join_with_checkpoint


def run_cp(args):
    ops, rank, world, threads, path = join_with_checkpoint(args, "cp")
    # a backend whose runtime threads spin (MindSpore) binds each local rank to its own cores, else
    # they share every core with the other ranks'; None: nothing to bind
    threads = registry.adapter(args.backend).bind_local_rank_cores() or threads
    ids = np.random.default_rng(0).integers(3, SHAPES[args.shape]["vocab_size"], (args.batch, args.prompt_len))
    cfg = GenerationConfig(max_new_tokens=args.new_tokens, eos_token_id=None)
    results, outputs = {}, {}
    for cp in (1, world):
        model = load_model(path, backend=args.backend, dtype="float32", cp=cp)
        run = lambda n, m=model: generate(m, ids, cfg.replace(max_new_tokens=n))  # noqa: E731
        run(2)
        prefill = min(_seconds(lambda r=run: r(1)) for _ in range(args.repeats))
        stamps = []  # after each step: the decode rate is timed between the first token and the last
        outputs[cp] = ops.to_numpy(
            generate(model, ids, cfg, on_tokens=lambda step, tokens, done, s=stamps: s.append(time.perf_counter()))
        )
        rate = (args.new_tokens - 1) * args.batch / max(stamps[-1] - stamps[0], 1e-9)
        kv, state = cache_bytes(ops, model, ids, args.new_tokens)
        everyone = ops.to_numpy(ops.all_gather(ops.asarray(np.array([[kv, state]], np.float64), "float64"), axis=0))
        results[cp] = (prefill, rate, everyone)
        del model
    if rank == 0:
        print(
            f"{args.backend}: Qwen3.5 '{args.shape}' float32, B={args.batch}, prompt {args.prompt_len}, "
            f"{args.new_tokens} new tokens, {world} ranks running at once"
        )
        print(f"{describe_host()}; {threads}")
        for cp, (prefill, rate, memory) in results.items():
            per_rank = ", ".join(
                f"rank {r}: KV {m[0] / 2**20:.2f} MiB + state {m[1] / 2**20:.2f} MiB" for r, m in enumerate(memory)
            )
            print(f"  CP={cp}: prefill {prefill * 1e3:9.1f} ms   decode {rate:8.2f} tok/s   {per_rank}")
        one, many = results[1], results[world]
        print(
            f"  CP={world} / CP=1: prefill {one[0] / many[0]:.2f}x faster, decode {many[1] / one[1]:.2f}x; "
            f"largest per-rank attention KV {many[2][:, 0].max() / one[2][:, 0].max():.2f}x of CP=1; "
            f"tokens identical: {np.array_equal(outputs[1], outputs[world])}"
        )


def cache_bytes(ops, model, ids: np.ndarray, new_tokens: int):
    """(attention K/V bytes, Gated DeltaNet state bytes) this rank holds after one prefill into the
    static cache ``generate`` would allocate for ``new_tokens`` more positions."""
    batch, width = ids.shape
    dtype = ops.param_dtype(model)
    cache = make_cache("static", ops, batch, width + new_tokens)
    positions = np.tile(np.arange(width), (batch, 1))
    with ops.no_grad():
        model(
            ops.asarray(ids, "int64"),
            position_ids=ops.asarray(positions, "int64"),
            attention_mask=ops.asarray(prefill_mask(np.ones_like(ids), cache.max_length, dtype), dtype),
            past_key_values=cache,
            logits_to_keep=1,
        )
    kv = sum(_nbytes(t) for store in (cache.keys, cache.values) for t in store.values())
    state = sum(_nbytes(t) for store in (cache.conv_states, cache.recurrent_states) for t in store.values())
    return kv, state


def _nbytes(tensor) -> int:
    return int(tensor.nbytes)


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start
