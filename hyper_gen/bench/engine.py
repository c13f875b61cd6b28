"""``hyper-gen bench engine``: the paged engine as a rollout engine, each result next to its anchor.

On a random-weight Qwen3.5 checkpoint (``--shape``, default mid: hidden 512, 8 layers, hybrid), one
backend at a time, in one run:

- ``prefix``: 32 requests sharing one 512-token system prompt, each with its own 32-token tail and 32
  new tokens, all submitted at once: tokens/s and time-to-first-token p50 with prefix caching on vs
  the same engine with it off.
- ``memory``: 64 requests with prompts of 16..1024 tokens (8 new tokens each): the peak bytes of the
  blocks in use vs the peak bytes of the live tokens' K/V (states are per row on both sides and
  counted in both), and what a ragged right-aligned cache (every row as long as the longest) held.
- ``chunked``: 16 rows decoding when one 4096-token prompt arrives: the running rows' inter-token
  latency p50 / p99 (the prompt is prefilled ``max_num_batched_tokens`` at a time between steps).
- ``grpo``: 16 prompts x n=8 (a GRPO group each): engine tokens/s vs ``hyper_gen.generate(...,
  num_return_sequences=8)`` on the same batch, and vs HF ``generate``.
- ``step``: a decode step through the paged cache vs generate()'s dynamic cache, at batch 1 and 16
  (what paging costs a step), and where an engine step's time goes.

Greedy throughout; the host (CPU, ISA, threads) is printed, since ratios move between hosts.
"""

from __future__ import annotations

import time

import numpy as np

from hyper_gen.generation import generate
from hyper_gen.host import describe_host
from hyper_gen.models.loading import load_model

from .models import SHAPES, make_checkpoint

SCENARIOS = ("prefix", "memory", "chunked", "grpo", "step")


def add_parser(sub):
    from .arguments import CACHE_DIR, add_command, backend_list, positive

    parser = add_command(sub, "engine", "paged engine: prefix caching, memory, chunked prefill, GRPO, step cost")
    parser.add_argument("--shape", default="mid", choices=sorted(SHAPES), help="checkpoint shape")
    parser.add_argument("--backends", type=backend_list, default="torch", help="backends, one at a time")
    parser.add_argument(
        "--scenarios", default=",".join(SCENARIOS), help=f"comma-separated, from {', '.join(SCENARIOS)}"
    )
    parser.add_argument(
        "--max-num-batched-tokens", type=positive, default=2048, help="the engine's per-step token budget"
    )
    parser.add_argument("--block-size", type=positive, default=16, help="positions per KV block")
    parser.add_argument("--cache-dir", default=CACHE_DIR, help="where the random-weight checkpoint is written once")
    return parser


def _greedy(n, **kw):
    from hyper_gen.engine import SamplingParams

    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, **kw)


def _engine(model, args, **kw):
    from hyper_gen.engine import Engine

    settings = dict(max_batch_size=64, block_size=args.block_size, max_num_batched_tokens=args.max_num_batched_tokens)
    settings.update(kw)
    return Engine(model, **settings)


def _timed_requests(engine, requests):
    """Submit every (prompt, params) at once; (wall s, new tokens, TTFTs, per-request token times)."""
    start = time.perf_counter()
    streams = [engine.submit(p, params) for p, params in requests]
    ttft, times, tokens = [], [], 0
    for stream in streams:
        stamps = []
        for chunk in stream:
            if chunk.token_ids:
                stamps.append(time.perf_counter())
        times.append(stamps)
        ttft.append(stamps[0] - start)
        tokens += len(stream.result().outputs[0].token_ids)
    return time.perf_counter() - start, tokens, ttft, times


def prefix(model, args, vocab, rng):
    system = rng.integers(10, vocab, 512).tolist()
    requests = [(system + rng.integers(10, vocab, 32).tolist(), _greedy(32)) for _ in range(32)]
    rows = []
    for caching in (False, True):
        with _engine(model, args, enable_prefix_caching=caching) as engine:
            engine.submit(rng.integers(10, vocab, 8).tolist(), _greedy(2)).result()  # warm-up, no shared prefix
            wall, tokens, ttft, _ = _timed_requests(engine, requests)
            hits = engine.stats()["prefix_cache_hits"]
        rows.append((caching, tokens / wall, float(np.median(ttft)), hits))
    (_, off_rate, off_ttft, _), (_, on_rate, on_ttft, hits) = rows
    print(f"prefix: 32 x (512 shared + 32 own) tokens, 32 new each; prefix-cached tokens {hits}")
    print(f"  caching off: {off_rate:8.1f} tok/s  TTFT p50 {off_ttft * 1e3:8.1f} ms")
    print(f"  caching on:  {on_rate:8.1f} tok/s  TTFT p50 {on_ttft * 1e3:8.1f} ms")
    print(f"  -> throughput {on_rate / off_rate:.2f}x (bar 3x), TTFT p50 {off_ttft / on_ttft:.2f}x lower (bar 5x)")


def memory(model, args, vocab, rng):
    lengths = rng.integers(16, 1025, 64)
    requests = [(rng.integers(10, vocab, int(n)).tolist(), _greedy(8)) for n in lengths]
    with _engine(model, args, enable_prefix_caching=False) as engine:
        batch, peaks = engine._batch, {"used": 0, "live": 0, "ragged": 0}
        decode = batch.decode
        per_token, per_block = batch.layout.bytes_per_token(), engine.stats()["bytes_per_block"]
        states = batch.layout.bytes_per_state()

        def measured():
            used = batch.kv.stats()["blocks_used"] * per_block + len(batch.rows) * states
            live = int(batch.lengths.sum()) * per_token + len(batch.rows) * states
            ragged = len(batch.rows) * int(batch.lengths.max(initial=0)) * per_token + len(batch.rows) * states
            for key, value in (("used", used), ("live", live), ("ragged", ragged)):
                peaks[key] = max(peaks[key], value)
            return decode()

        batch.decode = measured
        wall, tokens, _, _ = _timed_requests(engine, requests)
    mib = 1 << 20
    print(f"memory: 64 requests, prompts {lengths.min()}..{lengths.max()} tokens, 8 new each ({wall:.1f} s)")
    print(f"  peak bytes of blocks in use: {peaks['used'] / mib:8.2f} MiB")
    ratio = peaks["used"] / peaks["live"]
    print(f"  peak bytes of live tokens:   {peaks['live'] / mib:8.2f} MiB  -> {ratio:.3f}x (bar 1.15x)")
    print(f"  a ragged cache's peak:       {peaks['ragged'] / mib:8.2f} MiB  -> {peaks['ragged'] / peaks['live']:.2f}x")


def chunked(model, args, vocab, rng):
    with _engine(model, args) as engine:
        rows = [engine.submit(rng.integers(10, vocab, 16).tolist(), _greedy(96)) for _ in range(16)]
        next(iter(rows[0]))
        time.sleep(0.3)  # the rows are decoding
        start = time.perf_counter()
        long = engine.submit(rng.integers(10, vocab, 4096).tolist(), _greedy(2))
        stamps = []
        for stream in rows:
            stamps.append([time.perf_counter() for chunk in stream if chunk.token_ids])
        long_s = long.result().outputs and time.perf_counter() - start
    # gaps of the tokens the rows received after the long prompt arrived
    gaps = np.concatenate([np.diff([t for t in s]) for s in stamps])
    ttft = long_s
    print(
        f"chunked prefill: 16 rows decoding, one 4096-token prompt arrives (max_num_batched_tokens "
        f"{args.max_num_batched_tokens})"
    )
    print(
        f"  running rows' inter-token latency p50 {np.median(gaps) * 1e3:.1f} ms, p99 "
        f"{np.percentile(gaps, 99) * 1e3:.1f} ms -> p99 {np.percentile(gaps, 99) / np.median(gaps):.2f}x p50 (bar 3x)"
    )
    print(f"  the long prompt's request took {ttft:.2f} s")


def grpo(model, args, vocab, rng, hf_model=None):
    prompts = [rng.integers(10, vocab, 64).tolist() for _ in range(16)]
    new = 32
    with _engine(model, args, max_batch_size=128) as engine:
        engine.submit(prompts[0][:8], _greedy(2)).result()
        wall, tokens, _, _ = _timed_requests(engine, [(p, _greedy(new, n=8)) for p in prompts])
        tokens = 16 * 8 * new
    start = time.perf_counter()
    generate(model, np.asarray(prompts), max_new_tokens=new, num_return_sequences=8, eos_token_id=None, do_sample=False)
    gen_s = time.perf_counter() - start
    print(f"grpo: 16 prompts x n=8, 64 prompt tokens, {new} new each ({tokens} tokens)")
    print(f"  engine:                      {tokens / wall:8.1f} tok/s")
    print(f"  generate(num_return_seq=8):  {tokens / gen_s:8.1f} tok/s  -> engine {gen_s / wall:.2f}x")
    if hf_model is not None:
        import torch

        with torch.no_grad():
            start = time.perf_counter()
            hf_model.generate(
                torch.tensor(prompts),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                num_return_sequences=8,
                num_beams=1,
            )
            hf_s = time.perf_counter() - start
        print(f"  HF generate:                 {tokens / hf_s:8.1f} tok/s  -> engine {hf_s / wall:.2f}x")


def _time_decodes(batch) -> list:
    """Record how long each of the batch's decode forwards takes (seconds, appended to the list returned)."""
    decode, timings = batch.decode, []

    def timed():
        start = time.perf_counter()
        out = decode()
        timings.append(time.perf_counter() - start)
        return out

    batch.decode = timed
    return timings


def step(model, args, vocab, rng):
    print("step: one decode step, paged engine vs generate()'s dynamic cache (prompt 256, 64 new)")
    for rows in (1, 16):
        prompts = [rng.integers(10, vocab, 256).tolist() for _ in range(rows)]
        with _engine(model, args) as engine:
            timings = _time_decodes(engine._batch)
            _timed_requests(engine, [(p, _greedy(64)) for p in prompts])
        start = time.perf_counter()
        generate(
            model,
            np.asarray(prompts),
            max_new_tokens=64,
            eos_token_id=None,
            do_sample=False,
            cache_implementation="dynamic",
        )
        gen_total = time.perf_counter() - start
        start = time.perf_counter()
        generate(
            model,
            np.asarray(prompts),
            max_new_tokens=1,
            eos_token_id=None,
            do_sample=False,
            cache_implementation="dynamic",
        )
        gen_step = (gen_total - (time.perf_counter() - start)) / 63
        paged = float(np.median(timings[1:]))
        print(
            f"  batch {rows:2d}: paged forward {paged * 1e3:7.2f} ms, generate step {gen_step * 1e3:7.2f} ms "
            f"-> paging costs {paged / gen_step - 1:+.1%} (bar +10%)"
        )


def run_engine(args):
    scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = [s for s in scenarios if s not in SCENARIOS]
    if unknown:
        raise SystemExit(f"hyper-gen bench engine: --scenarios {unknown[0]!r} is not one of {', '.join(SCENARIOS)}")
    path = make_checkpoint(args.shape, args.cache_dir)
    vocab = SHAPES[args.shape]["vocab_size"]
    print(describe_host())
    print(f"shape {args.shape}; block_size {args.block_size}; max_num_batched_tokens {args.max_num_batched_tokens}")
    for backend in args.backends.split(","):
        print(f"== {backend}")
        model = load_model(path, backend=backend, dtype="float32")
        for name in scenarios:
            rng = np.random.default_rng(0)
            if name == "grpo":
                hf = None
                if backend == "torch":
                    from transformers import AutoModelForCausalLM

                    hf = AutoModelForCausalLM.from_pretrained(path, dtype="float32").eval()
                grpo(model, args, vocab, rng, hf)
            else:
                globals()[name](model, args, vocab, rng)


__all__ = ["add_parser", "run_engine"]
