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
- ``long``: 16 rows each with a 4096-token prompt decoding 64 tokens: the engine's median decode step
  (stepped on this thread, over 64 steps of all 16 rows once every prompt is prefilled) vs
  generate()'s static-cache step on the same batch (the median gap between its ``on_tokens`` calls: a
  difference of two runs would carry the noise of a 65k-token prefill into a 64-step figure).
- ``mixed``: ``chunked``'s workload (16 rows decoding 96 tokens each while a 4096-token prompt is
  chunked in) as one workload: tokens/s of every token generated over the wall time from the first
  submission to the last token, and the running rows' inter-token latency p50 / p99.
- ``structured``: the cost of structured outputs: the engine's median decode step with every row held to a
  JSON schema (a string field too long to close within the steps, so every step masks a wide choice)
  vs the same rows free, at batch 1 and 16; the tokenizer is a 32k byte-level BPE (bench/tokenizer.py).
- ``text``: output processing per generated token (``IncrementalText`` with the stop string "\\n\\n",
  the demo model's tokenizer, random ids that cannot form the stop) over streams of 256 and 16,384
  tokens, the same number of tokens at each length; no model.

``--rows`` and ``--context`` size ``long`` and ``mixed``, ``--new-tokens`` ``long``, ``--text-lengths``
``text`` (small values for a smoke run); the other scenarios keep the sizes above.

``--baseline PATH`` runs each scenario again from another checkout (``git worktree add PATH REV``)
in a subprocess and prints its numbers beside this tree's with the ratio (bench/baseline.py: how,
and what reads as n/a); ``--json`` prints each scenario's numbers as one ``bench-engine-json:`` line,
which is what a baseline run is read from.

Greedy throughout; the host (CPU, ISA, threads) is printed, since ratios move between hosts.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import threading
import time

import numpy as np

from hyper_gen.generation import generate
from hyper_gen.host import describe_host
from hyper_gen.jobs.errors import UsageError
from hyper_gen.kv_cache.manager import DEFAULT_STATE_SNAPSHOT_BLOCKS
from hyper_gen.models.loading import load_model

from .baseline import JSON_PREFIX, Baseline, checkout
from .models import SHAPES, make_checkpoint

SCENARIOS = ("prefix", "memory", "chunked", "grpo", "step", "long", "mixed", "structured", "text")
WITHOUT_MODEL = ("text",)  # run once, before any backend's model is loaded


def scenario_list(text: str) -> str:
    """An argparse type: a comma-separated list of SCENARIOS, or ``all`` (each of them, in order)."""
    import argparse

    if text.strip() == "all":
        return ",".join(SCENARIOS)
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in SCENARIOS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"{(unknown or [text])[0]!r} is not one of {', '.join(SCENARIOS)}")
    return ",".join(names)


def add_parser(sub):
    from .arguments import CACHE_DIR, add_command, backend_list, positive, positive_list

    parser = add_command(sub, "engine", "the paged engine: prefix cache, memory, chunked prefill, GRPO")
    parser.add_argument("--shape", default="mid", choices=sorted(SHAPES), help="checkpoint shape")
    parser.add_argument("--backends", type=backend_list, default="torch", help="backends, one at a time")
    parser.add_argument(
        "--scenarios",
        type=scenario_list,
        default="all",
        help=f"comma-separated, from {', '.join(SCENARIOS)}; all: each of them",
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
    parser.add_argument("--rows", type=positive, default=16, help="long and mixed: rows decoding together")
    parser.add_argument(
        "--context", type=positive, default=4096, help="long: each row's prompt; mixed: the prompt chunked in (tokens)"
    )
    parser.add_argument("--new-tokens", type=positive, default=64, help="long: tokens each row decodes")
    parser.add_argument(
        "--text-lengths",
        type=positive_list,
        default="256,16384",
        help="text: generated tokens per stream, comma-separated; the others are compared with the first",
    )
    parser.add_argument(
        "--baseline",
        type=checkout,
        default=None,
        metavar="PATH",
        help="another checkout of hyper_gen (git worktree add PATH REV): each scenario is run from it too, "
        "in a subprocess, and printed beside this tree's",
    )
    parser.add_argument(
        "--baseline-timeout", type=positive, default=3600, help="seconds one baseline scenario may take"
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="also print each scenario's numbers as one JSON line (what a baseline run is read from)",
    )
    return parser


# the flags a baseline run gets (those its bench/engine.py mentions): all but --baseline's own and --json
FORWARDED = (
    ("--shape", "shape"),
    ("--max-num-batched-tokens", "max_num_batched_tokens"),
    ("--block-size", "block_size"),
    ("--state-snapshot-blocks", "state_snapshot_blocks"),
    ("--cache-memory-bytes", "cache_memory_bytes"),
    ("--cache-dir", "cache_dir"),
    ("--rows", "rows"),
    ("--context", "context"),
    ("--new-tokens", "new_tokens"),
    ("--text-lengths", "text_lengths"),
)


def _forwarded(args) -> list:
    flags = []
    for flag, dest in FORWARDED:
        value = getattr(args, dest)
        flags.append((flag, ",".join(map(str, value)) if isinstance(value, tuple) else str(value)))
    return flags


def _greedy(max_tokens, **kw):
    from hyper_gen.engine import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **kw)


def _engine(model, args, tokenizer=None, **changes):
    """An engine with the flags' settings and ``changes`` (EngineConfig's field names)."""
    from hyper_gen.engine import Engine, EngineConfig

    config = EngineConfig(
        max_num_seqs=64,
        block_size=args.block_size,
        max_num_batched_tokens=args.max_num_batched_tokens,
        state_snapshot_blocks=args.state_snapshot_blocks,
        kv_cache_memory_bytes=args.cache_memory_bytes,
    )
    return Engine(model, tokenizer, config=config.replace(**changes))


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
    return {
        "prefix-cached tokens": hits,
        "tok/s caching off": off_rate,
        "TTFT p50 ms caching off": off_ttft * 1e3,
        "tok/s caching on": on_rate,
        "TTFT p50 ms caching on": on_ttft * 1e3,
    }


def memory(model, args, vocab, rng):
    lengths = rng.integers(16, 1025, 64)
    requests = [(rng.integers(10, vocab, int(n)).tolist(), _greedy(8)) for n in lengths]
    with _engine(model, args, enable_prefix_caching=False) as engine:
        runner, kv, peaks = engine._runner, engine._scheduler.kv, {"used": 0, "live": 0, "ragged": 0}
        forward = runner.forward
        per_token, per_block = runner.layout.bytes_per_token(), engine.stats()["bytes_per_block"]
        states = runner.layout.bytes_per_state()

        def measured(groups):
            lengths = np.concatenate([g.positions[:, 0] for g in groups if g.order is not None] or [np.zeros(0)])
            rows = len(lengths)
            used = kv.stats()["blocks_used"] * per_block + rows * states
            live = int(lengths.sum()) * per_token + rows * states
            ragged = rows * int(lengths.max(initial=0)) * per_token + rows * states
            for key, value in (("used", used), ("live", live), ("ragged", ragged)):
                peaks[key] = max(peaks[key], value)
            return forward(groups)

        runner.forward = measured
        wall, tokens, _, _ = _timed_requests(engine, requests)
    mib = 1 << 20
    print(f"memory: 64 requests, prompts {lengths.min()}..{lengths.max()} tokens, 8 new each ({wall:.1f} s)")
    print(f"  peak bytes of blocks in use: {peaks['used'] / mib:8.2f} MiB")
    ratio = peaks["used"] / peaks["live"]
    print(f"  peak bytes of live tokens:   {peaks['live'] / mib:8.2f} MiB  -> {ratio:.3f}x (bar 1.15x)")
    print(f"  a ragged cache's peak:       {peaks['ragged'] / mib:8.2f} MiB  -> {peaks['ragged'] / peaks['live']:.2f}x")
    return {
        "peak MiB blocks in use": peaks["used"] / mib,
        "peak MiB live tokens": peaks["live"] / mib,
        "blocks in use / live": ratio,
        "peak MiB ragged cache": peaks["ragged"] / mib,
    }


ROW_PROMPT, ROW_NEW = 16, 96  # chunked / mixed: each decoding row's prompt and new tokens


def _decode_while_prefilling(model, args, vocab, rng, rows: int, context: int) -> dict:
    """``rows`` rows decoding ROW_NEW tokens each; once the first has 8, a ``context``-token prompt
    (2 new tokens) arrives and is chunked in. Returns the wall time from the first submission to the
    last token, every token generated, the rows' gaps between tokens from that arrival on, and the
    long prompt's time to its first token."""
    with _engine(model, args) as engine:
        start = time.perf_counter()
        streams = [engine.submit(rng.integers(10, vocab, ROW_PROMPT).tolist(), _greedy(ROW_NEW)) for _ in range(rows)]
        stamps = [[] for _ in streams]
        readers = [threading.Thread(target=_stamped, args=(s, t)) for s, t in zip(streams, stamps)]
        for reader in readers:
            reader.start()
        while len(stamps[0]) < 8:  # the rows are decoding
            time.sleep(0.01)
        arrived = time.perf_counter()
        arrival = engine.submit(rng.integers(10, vocab, context).tolist(), _greedy(2))
        first = []
        _stamped(arrival, first)
        for reader in readers:
            reader.join()
        wall = time.perf_counter() - start
        tokens = sum(len(c.token_ids) for s in streams + [arrival] for c in s.result().outputs)
    # the gaps between the rows' tokens from the long prompt's arrival to its first token, and after
    gaps = [np.diff([t for t in s if t >= arrived]) for s in stamps]
    gaps = np.concatenate(gaps) if gaps else np.zeros(0)
    return dict(wall=wall, tokens=tokens, gaps=gaps, first=first[0] - arrived)


def _p50_p99(gaps):
    """(p50, p99) of ``gaps``; NaN when the rows finished before the long prompt arrived (tiny runs)."""
    if not len(gaps):
        return math.nan, math.nan
    return float(np.median(gaps)), float(np.percentile(gaps, 99))


def chunked(model, args, vocab, rng):
    run = _decode_while_prefilling(model, args, vocab, rng, rows=16, context=4096)
    gaps = run["gaps"]
    p50, p99 = _p50_p99(gaps)
    print(
        f"chunked prefill: 16 rows decoding, one 4096-token prompt arrives (max_num_batched_tokens "
        f"{args.max_num_batched_tokens}); its first token after {run['first']:.2f} s"
    )
    print(
        f"  running rows' inter-token latency p50 {p50 * 1e3:.1f} ms, p99 {p99 * 1e3:.1f} ms -> "
        f"p99 {p99 / p50:.2f}x p50 (bar 3x); longest gap {(gaps.max() if len(gaps) else math.nan) * 1e3:.0f} ms"
    )
    return {"long prompt's first token s": run["first"], "ITL p50 ms": p50 * 1e3, "ITL p99 ms": p99 * 1e3}


def mixed(model, args, vocab, rng):
    run = _decode_while_prefilling(model, args, vocab, rng, rows=args.rows, context=args.context)
    p50, p99 = _p50_p99(run["gaps"])
    rate = run["tokens"] / run["wall"]
    print(
        f"mixed: {args.rows} rows decoding {ROW_NEW} tokens each while one {args.context}-token prompt is chunked in "
        f"(max_num_batched_tokens {args.max_num_batched_tokens})"
    )
    print(f"  whole workload: {run['tokens']} tokens in {run['wall']:.2f} s -> {rate:8.1f} tok/s")
    print(f"  running rows' inter-token latency p50 {p50 * 1e3:.1f} ms, p99 {p99 * 1e3:.1f} ms")
    return {"tok/s": rate, "ITL p50 ms": p50 * 1e3, "ITL p99 ms": p99 * 1e3}


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
    metrics = {"engine tok/s": tokens / wall, "generate(n=8) tok/s": tokens / gen_s}
    if hf_s is not None:
        print(f"  HF generate:                 {tokens / hf_s:8.1f} tok/s  -> engine {hf_s / wall:.2f}x")
        metrics["HF generate tok/s"] = tokens / hf_s
    return metrics


def _engine_step_s(model, args, prompts, steps: int = 32, max_tokens=None, tokenizer=None, **params) -> float:
    """Median seconds of one engine step (a decode of every row, token choice included) once every
    prompt is prefilled, the engine stepped on this thread as generate() runs on it. ``max_tokens``
    (default ``steps + 8``) must leave every row decoding through the timed steps, counting the
    tokens the first rows decode while the others are still being prefilled. ``params``: more
    ``SamplingParams`` fields for every request (``tokenizer``: the engine's, where they need one)."""
    engine = _engine(model, args, tokenizer).start(background=False)
    for prompt in prompts:
        engine.submit(prompt, _greedy(steps + 8 if max_tokens is None else max_tokens, **params))
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


def _generate_static_step_s(model, prompts, new: int) -> float:
    """Median seconds of one generate() decode step with a static cache: the gaps between its
    ``on_tokens`` calls (each after a step, the prefill's token first) over one run of ``new`` tokens."""
    stamps = []
    generate(
        model, np.asarray(prompts), max_new_tokens=new, eos_token_id=None, do_sample=False,
        cache_implementation="static", on_tokens=lambda *_: stamps.append(time.perf_counter()),
    )  # fmt: skip
    return float(np.median(np.diff(stamps)))


@contextlib.contextmanager
def _compiled_from_first(model):
    """MindSpore: decode steps compiled from the first, as generate's static-cache steps are (the
    comparison is of the caches); put back after, for the scenarios that follow."""
    if not hasattr(model, "decode_compile_after"):
        yield
        return
    saved, model.decode_compile_after = model.decode_compile_after, 1
    try:
        yield
    finally:
        model.decode_compile_after = saved


def step(model, args, vocab, rng):
    print("step: one decode step (256-token prompts), the paged engine's vs generate()'s with a dynamic cache")
    metrics = {}
    with _compiled_from_first(model):
        for rows in (1, 16):
            prompts = [rng.integers(10, vocab, 256).tolist() for _ in range(rows)]
            paged, plain = _engine_step_s(model, args, prompts), _generate_step_s(model, prompts)
            print(
                f"  batch {rows:2d}: engine step {paged * 1e3:7.2f} ms, generate step {plain * 1e3:7.2f} ms "
                f"-> paging costs {paged / plain - 1:+.1%} (bar +10%)"
            )
            metrics.update({f"engine step ms b{rows}": paged * 1e3, f"generate step ms b{rows}": plain * 1e3})
    return metrics


STRUCTURED_SCHEMA = {
    "type": "object",
    "properties": {"notes": {"type": "string", "minLength": 100000}},
    "required": ["notes"],
    "additionalProperties": False,
}


def structured(model, args, vocab, rng):
    from .tokenizer import bench_tokenizer

    tokenizer = bench_tokenizer(args.cache_dir, vocab)
    print("structured: a decode step (64-token prompts) with every row held to a JSON schema vs free")
    metrics = {}
    with _compiled_from_first(model):
        for rows in (1, 16):
            prompts = [rng.integers(10, vocab, 64).tolist() for _ in range(rows)]
            free = _engine_step_s(model, args, prompts, tokenizer=tokenizer)
            held = _engine_step_s(
                model, args, prompts, tokenizer=tokenizer, structured_outputs={"json": STRUCTURED_SCHEMA}
            )
            print(
                f"  batch {rows:2d}: free {rows / free:8.1f} tok/s, JSON schema {rows / held:8.1f} tok/s "
                f"-> the schema costs {held / free:.2f}x the free step (goal at most 1.10x)"
            )
            metrics.update({f"free tok/s b{rows}": rows / free, f"schema tok/s b{rows}": rows / held})
    return metrics


def long(model, args, vocab, rng):
    from hyper_gen.inputs import ModelLimits

    rows, context, new = args.rows, args.context, args.new_tokens
    # the first rows decode while the later ones are prefilled: room for that beyond the timed steps
    prefill_steps = math.ceil(rows * context / max(1, args.max_num_batched_tokens - rows)) + rows
    max_tokens = new + prefill_steps + 8
    limit = ModelLimits.of(model).context
    if limit is not None and context + max_tokens > limit:
        raise UsageError(
            f"engine: long needs {context + max_tokens} positions ({context} prompt + {max_tokens}), "
            f"the {args.shape} checkpoint has {limit} (max_position_embeddings): lower --context"
        )
    prompts = [rng.integers(10, vocab, context).tolist() for _ in range(rows)]
    with _compiled_from_first(model):
        paged = _engine_step_s(model, args, prompts, steps=new, max_tokens=max_tokens)
        static = _generate_static_step_s(model, prompts, new)
    print(f"long: {rows} rows x {context}-token prompts decoding {new} tokens; median decode step")
    print(
        f"  engine step {paged * 1e3:8.2f} ms, generate() static-cache step {static * 1e3:8.2f} ms "
        f"-> {paged / static:.2f}x (bar 1.05x)"
    )
    return {"engine step ms": paged * 1e3, "generate static step ms": static * 1e3, "engine/generate": paged / static}


TEXT_STOPS = ["\n\n"]


def _stopless_ids(tokenizer, stops) -> np.ndarray:
    """The token ids that decode to text without any stop string's first character (so no stream
    of them ends early) and are not special (those decode to nothing)."""
    special = set(tokenizer.all_special_ids)
    firsts = {stop[0] for stop in stops}
    ids = [
        i
        for i in range(len(tokenizer))
        if i not in special and not firsts & set(tokenizer.decode([i], skip_special_tokens=True))
    ]
    return np.asarray(ids)


def _text_stream_s(tokenizer, stops, ids) -> float:
    """Seconds to process ``ids`` as the engine does a choice's tokens: one ``update`` with the
    choice's whole (growing) token list per token, then ``finish``."""
    from hyper_gen.engine.detokenize import IncrementalText

    start = time.perf_counter()
    output, seen = IncrementalText(tokenizer, stops), []
    for token in ids:
        seen.append(token)
        if output.update(seen)[1]:
            raise RuntimeError("a stop string appeared in ids drawn to avoid one")
    output.finish()
    return time.perf_counter() - start


def text(args, rng):
    from transformers import AutoTokenizer

    from hyper_gen.demo import demo_model_path

    tokenizer = AutoTokenizer.from_pretrained(demo_model_path())
    ids = _stopless_ids(tokenizer, TEXT_STOPS)
    lengths, most = args.text_lengths, max(args.text_lengths)
    _text_stream_s(tokenizer, TEXT_STOPS, rng.choice(ids, min(lengths)).tolist())  # warm-up
    print(f"text: output processing (IncrementalText, stop strings {TEXT_STOPS!r}, the demo tokenizer) per token")
    metrics, first = {}, None
    for length in lengths:
        streams = max(1, most // length)  # the same number of tokens at every length
        seconds = sum(_text_stream_s(tokenizer, TEXT_STOPS, rng.choice(ids, length).tolist()) for _ in range(streams))
        per_token = seconds / (streams * length)
        first = per_token if first is None else first
        line = f"  {length:6d} tokens: {per_token * 1e6:9.3f} us/token ({streams} stream{'s' if streams > 1 else ''})"
        metrics[f"us/token at {length}"] = per_token * 1e6
        if length != lengths[0]:
            line += f" -> {per_token / first:.2f}x that at {lengths[0]} (bar 1.2x)"
            metrics[f"{length}/{lengths[0]} per token"] = per_token / first
        print(line)
    return metrics


def run_engine(args):
    scenarios = args.scenarios.split(",")
    baseline = Baseline(args.baseline, args.baseline_timeout) if args.baseline else None
    print(describe_host())
    print(
        f"shape {args.shape}; block_size {args.block_size}; max_num_batched_tokens {args.max_num_batched_tokens}; "
        f"state_snapshot_blocks {args.state_snapshot_blocks}"
    )
    if baseline is not None:
        print(baseline.describe())
    flags = _forwarded(args)

    def report(backend, name, metrics):
        if args.json:
            print(JSON_PREFIX + json.dumps({"backend": backend, "scenario": name, "metrics": metrics}), flush=True)
        if baseline is not None:
            baseline.compare(name, backend, flags, metrics)

    for name in [s for s in scenarios if s in WITHOUT_MODEL]:
        print(f"== {name} (no model)")
        report(None, name, globals()[name](args, np.random.default_rng(0)))
    with_model = [s for s in scenarios if s not in WITHOUT_MODEL]
    if not with_model:
        return
    path = make_checkpoint(args.shape, args.cache_dir)
    vocab = SHAPES[args.shape]["vocab_size"]
    hf_s = hf_grpo_s(path, vocab) if "grpo" in with_model else None
    for backend in args.backends.split(","):
        print(f"== {backend}")
        model = load_model(path, backend=backend, dtype="float32")
        for name in with_model:
            gc.collect()  # what the scenario before left is not collected inside this one's timings
            rng = np.random.default_rng(0)
            if name == "grpo":
                metrics = grpo(model, args, vocab, rng, hf_s)
            else:
                metrics = globals()[name](model, args, vocab, rng)
            report(backend, name, metrics)


__all__ = ["add_parser", "run_engine"]
