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
- ``grpo``: 16 prompts x n=8 sampled (a GRPO group each): engine tokens/s vs ``hyper_gen.generate(...,
  num_return_sequences=8)`` on the same batch, and vs HF ``generate``.
- ``step``: a decode step through the paged cache vs generate()'s dynamic cache, at batch 1 and 16
  (what paging costs a step), and where an engine step's time goes.

Greedy throughout; the host (CPU, ISA, threads) is printed, since ratios move between hosts.
"""

from __future__ import annotations

import gc
import threading
import time

import numpy as np

from hyper_gen.generation import generate
from hyper_gen.host import describe_host
from hyper_gen.kv_cache.manager import DEFAULT_STATE_SNAPSHOT_BLOCKS
from hyper_gen.models.loading import load_model

from .models import SHAPES, make_checkpoint

SCENARIOS = ("prefix", "memory", "chunked", "grpo", "step")


def scenario_list(text: str) -> str:
    """An argparse type: a comma-separated list of SCENARIOS."""
    import argparse

    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in SCENARIOS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"{(unknown or [text])[0]!r} is not one of {', '.join(SCENARIOS)}")
    return ",".join(names)


def add_parser(sub):
    from .arguments import CACHE_DIR, add_command, backend_list, positive

    parser = add_command(sub, "engine", "the paged engine: prefix cache, memory, chunked prefill, GRPO")
    parser.add_argument("--shape", default="mid", choices=sorted(SHAPES), help="checkpoint shape")
    parser.add_argument("--backends", type=backend_list, default="torch", help="backends, one at a time")
    parser.add_argument(
        "--scenarios",
        type=scenario_list,
        default=",".join(SCENARIOS),
        help=f"comma-separated, from {', '.join(SCENARIOS)}",
    )
    parser.add_argument(
        "--max-num-batched-tokens", type=positive, default=2048, help="the engine's per-step token budget"
    )
    parser.add_argument("--block-size", type=positive, default=16, help="positions per KV block")
    parser.add_argument(
        "--state-snapshot-blocks",
        type=positive,
        default=DEFAULT_STATE_SNAPSHOT_BLOCKS,
        help="blocks between Gated DeltaNet state snapshots (where a hybrid prefix hit may end)",
    )
    parser.add_argument(
        "--cache-memory-bytes",
        type=positive,
        default=1 << 30,
        help="each engine's KV pool (the scenarios need ~130 MiB on the mid shape)",
    )
    parser.add_argument("--cache-dir", default=CACHE_DIR, help="where the random-weight checkpoint is written once")
    return parser


def _greedy(max_tokens, **kw):
    from hyper_gen.engine import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **kw)


def _engine(model, args, **changes):
    """An engine with the flags' settings and ``changes`` (EngineConfig's field names)."""
    from hyper_gen.engine import Engine, EngineConfig

    config = EngineConfig(
        max_num_seqs=64,
        block_size=args.block_size,
        max_num_batched_tokens=args.max_num_batched_tokens,
        state_snapshot_blocks=args.state_snapshot_blocks,
        kv_cache_memory_bytes=args.cache_memory_bytes,
    )
    return Engine(model, config=config.replace(**changes))


def _stamped(stream, stamps: list) -> None:
    """Append the arrival time of each of ``stream``'s chunks that carries tokens."""
    for chunk in stream:
        if chunk.token_ids:
            stamps.append(time.perf_counter())


def _timed_requests(engine, requests):
    """Submit every (prompt, params) at once, each stream read on its own thread (so a chunk is
    stamped when it arrives): (wall s, new tokens, TTFTs, per-request chunk arrival times)."""
    start = time.perf_counter()
    streams = [engine.submit(p, params) for p, params in requests]
    times = [[] for _ in streams]
    readers = [threading.Thread(target=_stamped, args=(s, t)) for s, t in zip(streams, times)]
    for reader in readers:
        reader.start()
    for reader in readers:
        reader.join()
    wall = time.perf_counter() - start
    tokens = sum(len(c.token_ids) for s in streams for c in s.result().outputs)
    return wall, tokens, [t[0] - start for t in times], times


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
        runner, kv, peaks = engine._runner, engine._scheduler.kv, {"used": 0, "live": 0, "ragged": 0}
        decode = runner.decode
        per_token, per_block = runner.layout.bytes_per_token(), engine.stats()["bytes_per_block"]
        states = runner.layout.bytes_per_state()

        def measured(order, lengths):
            rows = len(order)
            used = kv.stats()["blocks_used"] * per_block + rows * states
            live = int(lengths.sum()) * per_token + rows * states
            ragged = rows * int(lengths.max(initial=0)) * per_token + rows * states
            for key, value in (("used", used), ("live", live), ("ragged", ragged)):
                peaks[key] = max(peaks[key], value)
            return decode(order, lengths)

        runner.decode = measured
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
        stamps = [[] for _ in rows]
        readers = [threading.Thread(target=_stamped, args=(s, t)) for s, t in zip(rows, stamps)]
        for reader in readers:
            reader.start()
        while len(stamps[0]) < 8:  # the rows are decoding
            time.sleep(0.01)
        arrived = time.perf_counter()
        long = engine.submit(rng.integers(10, vocab, 4096).tolist(), _greedy(2))
        first = []
        _stamped(long, first)
        for reader in readers:
            reader.join()
    # the gaps between the rows' tokens from the long prompt's arrival to its first token, and after
    gaps = np.concatenate([np.diff([t for t in s if t >= arrived]) for s in stamps])
    p50, p99 = np.median(gaps), np.percentile(gaps, 99)
    print(
        f"chunked prefill: 16 rows decoding, one 4096-token prompt arrives (max_num_batched_tokens "
        f"{args.max_num_batched_tokens}); its first token after {first[0] - arrived:.2f} s"
    )
    print(
        f"  running rows' inter-token latency p50 {p50 * 1e3:.1f} ms, p99 {p99 * 1e3:.1f} ms -> "
        f"p99 {p99 / p50:.2f}x p50 (bar 3x); longest gap {gaps.max() * 1e3:.0f} ms"
    )


GRPO_PROMPTS, GRPO_N, GRPO_NEW = 16, 8, 32


def _grpo_prompts(vocab):
    rng = np.random.default_rng(0)
    return [rng.integers(10, vocab, 64).tolist() for _ in range(GRPO_PROMPTS)]


def hf_grpo_s(path, vocab) -> float:
    """Seconds of HF ``generate`` on the GRPO batch (greedy, every row to GRPO_NEW tokens): the anchor."""
    import torch  # the HF anchor's framework, here: `import hyper_gen.bench` imports none
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype="float32").eval()
    with torch.no_grad():
        start = time.perf_counter()
        hf.generate(
            torch.tensor(_grpo_prompts(vocab)),
            max_new_tokens=GRPO_NEW,
            min_new_tokens=GRPO_NEW,
            do_sample=True,
            top_k=0,
            num_return_sequences=GRPO_N,
        )
        return time.perf_counter() - start


def grpo(model, args, vocab, rng, hf_s=None):
    from hyper_gen.engine import SamplingParams

    prompts = _grpo_prompts(vocab)
    tokens = GRPO_PROMPTS * GRPO_N * GRPO_NEW
    with _engine(model, args, max_num_seqs=GRPO_PROMPTS * GRPO_N) as engine:
        engine.submit(prompts[0][:8], _greedy(2)).result()
        sampled = [SamplingParams(max_tokens=GRPO_NEW, n=GRPO_N, temperature=1.0, seed=i) for i in range(len(prompts))]
        wall, _, _, _ = _timed_requests(engine, list(zip(prompts, sampled)))
    start = time.perf_counter()
    generate(
        model, np.asarray(prompts), max_new_tokens=GRPO_NEW, num_return_sequences=GRPO_N, eos_token_id=None,
        do_sample=True, top_k=0, seed=0,
    )  # fmt: skip
    gen_s = time.perf_counter() - start
    print(f"grpo: {GRPO_PROMPTS} prompts x n={GRPO_N}, 64 prompt tokens, {GRPO_NEW} new each ({tokens} tokens)")
    print(f"  engine:                      {tokens / wall:8.1f} tok/s")
    print(f"  generate(num_return_seq=8):  {tokens / gen_s:8.1f} tok/s  -> engine {gen_s / wall:.2f}x")
    if hf_s is not None:
        print(f"  HF generate:                 {tokens / hf_s:8.1f} tok/s  -> engine {hf_s / wall:.2f}x")


def _engine_step_s(model, args, prompts, steps: int = 32) -> float:
    """Median seconds of one engine step (a decode of every row, token choice included) once every
    prompt is prefilled, the engine stepped on this thread as generate() runs on it."""
    engine = _engine(model, args).start(background=False)
    for prompt in prompts:
        engine.submit(prompt, _greedy(steps + 8))
    while engine.stats()["waiting"] or engine._scheduler.waiting or engine._runner.prefills:
        engine.step()
    timings = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        timings.append(time.perf_counter() - start)
    engine.shutdown()
    return float(np.median(timings))


def _generate_step_s(model, prompts, steps: int = 32) -> float:
    """Seconds of one generate() decode step (dynamic cache): (steps + 1 tokens - 1 token) / steps."""
    ids = np.asarray(prompts)
    best = []
    for new in (steps + 1, 1):
        runs = []
        for _ in range(2):
            start = time.perf_counter()
            generate(model, ids, max_new_tokens=new, eos_token_id=None, do_sample=False, cache_implementation="dynamic")
            runs.append(time.perf_counter() - start)
        best.append(min(runs))
    return (best[0] - best[1]) / steps


def step(model, args, vocab, rng):
    print("step: one decode step (256-token prompts), the paged engine's vs generate()'s with a dynamic cache")
    if hasattr(model, "decode_compile_after"):  # MindSpore: both steps compiled from the first, as generate's
        model.decode_compile_after = 1  # static-cache steps are; the comparison is of the caches
    for rows in (1, 16):
        prompts = [rng.integers(10, vocab, 256).tolist() for _ in range(rows)]
        paged, plain = _engine_step_s(model, args, prompts), _generate_step_s(model, prompts)
        print(
            f"  batch {rows:2d}: engine step {paged * 1e3:7.2f} ms, generate step {plain * 1e3:7.2f} ms "
            f"-> paging costs {paged / plain - 1:+.1%} (bar +10%)"
        )


def run_engine(args):
    scenarios = args.scenarios.split(",")
    path = make_checkpoint(args.shape, args.cache_dir)
    vocab = SHAPES[args.shape]["vocab_size"]
    print(describe_host())
    print(
        f"shape {args.shape}; block_size {args.block_size}; max_num_batched_tokens {args.max_num_batched_tokens}; "
        f"state_snapshot_blocks {args.state_snapshot_blocks}"
    )
    hf_s = hf_grpo_s(path, vocab) if "grpo" in scenarios else None
    for backend in args.backends.split(","):
        print(f"== {backend}")
        model = load_model(path, backend=backend, dtype="float32")
        for name in scenarios:
            gc.collect()  # what the scenario before left is not collected inside this one's timings
            rng = np.random.default_rng(0)
            if name == "grpo":
                grpo(model, args, vocab, rng, hf_s)
            else:
                globals()[name](model, args, vocab, rng)


__all__ = ["add_parser", "run_engine"]
