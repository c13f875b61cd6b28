"""``hyper-gen bench serve``: the HTTP server under 1, 8 and 32 concurrent streaming clients, next
to the same requests run as sequential ``generate`` calls and as one static left-padded batch.

One real server (``python -m hyper_gen serve``, its own process) on the bundled demo model by
default; each client (a thread, plain ``http.client``) sends its share of the requests one
after another and reads the server-sent events. Every request asks for exactly
``--max-tokens`` tokens (``ignore_eos``), so every row generates the same work. Reported:
completion tokens/s over the wall time, and time to first token (from sending the request to
its first text) p50 / p99, and the median inter-token time a client sees (the gaps between a
stream's chunks after its first). ``generate`` rows: the sequential calls' TTFT is each call's own
prefill (no queueing), the static batch's is its one prefill; their inter-token time is the median
gap between two ``on_tokens`` calls, i.e. ``generate()``'s decode step. At one stream each request
is followed by the same prompt through ``generate`` in this process (so both see the same load on
a shared host), and a line gives the serving overhead: the server's inter-token median over
``generate()``'s decode step on the same checkpoint and dtype (the goal: at most 1.1x).

``--prompt-tokens N`` sends N random token ids per prompt (``prompt`` as a list of ids, so a
guidellm-like 128-token prompt is exactly 128 tokens on any tokenizer); otherwise short text
prompts of the demo task. Then the offline JSONL comparison (in-flight batching vs fixed
micro-batches), where ``hyper_gen.bench.offline`` provides it.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from typing import List

import numpy as np

from hyper_gen.config import GenerationConfig
from hyper_gen.demo import demo_model_path
from hyper_gen.demo.task import prompt_for
from hyper_gen.generation import generate
from hyper_gen.host import describe_host
from hyper_gen.jobs.tokenizer import load_tokenizer
from hyper_gen.models.loading import load_model

from . import offline
from .arguments import add_command, positive, positive_list

READY = re.compile(r"hyper-gen serve: http://([^:/\s]+):(\d+)/v1 ")


def host_line() -> str:
    """The host (CPU model, ISA extensions, cores) and this process's torch threads."""
    try:
        import torch  # here: `import hyper_gen.bench` imports no framework

        threads = torch.get_num_threads()
    except ImportError:
        threads = None
    return describe_host(threads)


def _prompts(count: int, seed: int = 0, tokens: int = 0, vocab: int = 0) -> list:
    """``count`` prompts: ``tokens`` random ids each (below ``vocab``), or, with ``tokens`` 0, demo-task texts."""
    rng = np.random.default_rng(seed)
    if tokens:
        return [rng.integers(3, vocab, tokens).tolist() for _ in range(count)]
    return [prompt_for("".join(rng.choice(list("0123456789"), int(rng.integers(2, 9))))) for _ in range(count)]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a group's rendezvous, a router)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post_json(address, path: str, body: dict, timeout: float = 600) -> dict:
    """POST ``body`` to ``path`` on ``address`` (host, port): the answer's JSON; a RuntimeError unless 200."""
    conn = http.client.HTTPConnection(*address, timeout=timeout)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        data = response.read()
        if response.status != 200:
            raise RuntimeError(f"POST {path}: HTTP {response.status}: {data[:300]!r}")
        return json.loads(data or b"null")
    finally:
        conn.close()


class _ServerProcess:
    def __init__(self, args):
        cmd = [sys.executable, "-m", "hyper_gen", "serve", "--backend", args.backend, "--port", "0"]
        cmd += ["--max-batch-size", str(args.max_batch_size), "--served-model-name", "bench"]
        cmd += ["--dtype", getattr(args, "dtype", None) or "float32"]
        if args.model:
            cmd += ["--model", args.model]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: List[str] = []
        ready = threading.Event()
        self.address = None

        def read():
            for line in self.proc.stdout:
                self.lines.append(line)
                match = READY.search(line)
                if match and self.address is None:
                    self.address = (match.group(1), int(match.group(2)))
                    ready.set()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        ready.wait(300)
        if self.address is None:
            self.stop()
            raise SystemExit("hyper-gen bench serve: the server did not start:\n" + "".join(self.lines))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def _stream_one(address, prompt, max_tokens: int):
    """(seconds to the first text, seconds to the end, completion tokens, the gaps in seconds between
    its chunks after the first) of one streamed request (``prompt``: a text or a list of token ids)."""
    body = {
        "model": "bench",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    conn = http.client.HTTPConnection(*address, timeout=600)
    start = time.perf_counter()
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}: {response.read()[:300]!r}")
    first, tokens, arrivals = None, 0, []
    for line in response:
        if not line.startswith(b"data: "):
            continue
        payload = line[6:].strip()
        if payload == b"[DONE]":
            break
        event = json.loads(payload)
        if event.get("choices") and event["choices"][0].get("text"):
            arrivals.append(time.perf_counter())
            if first is None:
                first = arrivals[-1] - start
        if event.get("usage"):
            tokens = event["usage"]["completion_tokens"]
    conn.close()
    end = time.perf_counter() - start
    return first if first is not None else end, end, tokens, np.diff(arrivals).tolist()


def run_clients(items, call, concurrency: int):
    """``call(item)`` for every item, by ``concurrency`` client threads each taking the next item when
    its last answer is in: (wall seconds, the results in the order they came). The first error stops
    the clients and is raised once they have."""
    queue, results, errors, lock = list(items), [], [], threading.Lock()

    def client():
        while True:
            with lock:
                if not queue or errors:
                    return
                item = queue.pop(0)
            try:
                got = call(item)
            except Exception as exc:  # raised below, once every client has stopped
                errors.append(exc)
                return
            with lock:
                results.append(got)

    start = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    if errors:
        raise errors[0]
    return wall, results


def _against_server(address, prompts, max_tokens: int, concurrency: int):
    """(tokens/s, TTFTs, inter-token gaps) of ``prompts`` sent by ``concurrency`` clients, each one at a time."""
    _stream_one(address, prompts[0], 2)  # warm-up
    wall, results = run_clients(prompts, lambda prompt: _stream_one(address, prompt, max_tokens), concurrency)
    return sum(r[2] for r in results) / wall, [r[0] for r in results], [g for r in results for g in r[3]]


def _batch(tokenizer, group):
    """(ids, mask or None) of ``group``: texts tokenized and left-padded, token-id lists as they are."""
    if isinstance(group[0], list):
        return np.asarray(group, dtype=np.int64), None
    batch = tokenizer(group, padding=True, return_tensors="np")
    return batch["input_ids"], batch["attention_mask"]


def _generation_config(max_tokens: int) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=max_tokens, min_new_tokens=max_tokens, eos_token_id=None, pad_token_id=0)


def _generate_group(model, tokenizer, group, config):
    """(seconds to the first token, the gaps between ``on_tokens`` calls) of one ``generate`` call on ``group``."""
    ids, mask = _batch(tokenizer, group)
    began, times = time.perf_counter(), []
    generate(model, ids, config, attention_mask=mask, on_tokens=lambda *_: times.append(time.perf_counter()))
    return times[0] - began, np.diff(times).tolist()


def _against_generate(model, tokenizer, prompts, max_tokens: int, batched: bool):
    """(tokens/s, TTFTs, decode steps) of ``prompts`` through ``generate``: one call each, or one batch."""
    config = _generation_config(max_tokens)
    groups = [prompts] if batched else [[p] for p in prompts]
    generate(model, _batch(tokenizer, prompts[:1])[0], config.replace(max_new_tokens=2, min_new_tokens=2))
    ttfts, steps = [], []
    start = time.perf_counter()
    for group in groups:
        ttft, gaps = _generate_group(model, tokenizer, group, config)
        ttfts += [ttft] * len(group)
        steps += gaps
    return max_tokens * len(prompts) / (time.perf_counter() - start), ttfts, steps


def _one_stream_beside_generate(address, model, tokenizer, prompts, max_tokens: int):
    """One stream, each request followed by the same prompt through ``generate`` in this process, so
    both see the same load on a shared host: (server row, generate row), each (tokens/s over its own
    time, TTFTs, inter-token gaps)."""
    config = _generation_config(max_tokens)
    _stream_one(address, prompts[0], 2)  # warm-ups
    generate(model, _batch(tokenizer, prompts[:1])[0], config.replace(max_new_tokens=2, min_new_tokens=2))
    served, generated = [], []
    for prompt in prompts:
        served.append(_stream_one(address, prompt, max_tokens))
        began = time.perf_counter()
        generated.append(_generate_group(model, tokenizer, [prompt], config) + (time.perf_counter() - began,))
    server = (
        sum(r[2] for r in served) / sum(r[1] for r in served),
        [r[0] for r in served],
        [g for r in served for g in r[3]],
    )
    local = (
        max_tokens * len(prompts) / sum(r[2] for r in generated),
        [r[0] for r in generated],
        [g for r in generated for g in r[1]],
    )
    return server, local


def _ms(values, q: float) -> float:
    return float(np.percentile(np.asarray(values) * 1e3, q)) if len(values) else float("nan")


def _row(name: str, rate: float, ttfts, gaps) -> str:
    return f"  {name:34s}{rate:12.1f}{_ms(ttfts, 50):12.1f}{_ms(ttfts, 99):12.1f}{_ms(gaps, 50):12.2f}"


def _offline(args) -> None:
    run = offline.run_offline_comparison
    for spread, lengths in offline.JOBS:
        print(run(args.model, backend=args.backend, spread=spread, lengths=lengths))


def _vocab_size(path: str) -> int:
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    return int(config.get("vocab_size") or config.get("text_config", {}).get("vocab_size"))


def run_serve_bench(args) -> None:
    levels = list(args.concurrency)
    path = args.model or demo_model_path()
    prompts = _prompts(args.requests, tokens=args.prompt_tokens, vocab=_vocab_size(path) if args.prompt_tokens else 0)
    unit = "tokens" if args.prompt_tokens else "characters"
    print(host_line())
    print(
        f"{args.model or 'demo model'}, {args.backend}, {args.dtype}, {args.requests} requests of "
        f"{args.max_tokens} tokens each (ignore_eos), "
        f"prompts of {min(map(len, prompts))}-{max(map(len, prompts))} {unit}, server --max-batch-size "
        f"{args.max_batch_size}"
    )
    print(f"  {'':34s}{'tokens/s':>12s}{'TTFT p50 ms':>12s}{'TTFT p99 ms':>12s}{'ITL p50 ms':>12s}", flush=True)
    model = load_model(path, backend=args.backend, dtype=args.dtype)
    tokenizer = load_tokenizer(path)
    server, local = _ServerProcess(args), None
    try:
        for c in levels:
            name = f"server, {c} concurrent client{'s' if c > 1 else ''}"
            if c == 1:
                row, local = _one_stream_beside_generate(server.address, model, tokenizer, prompts, args.max_tokens)
                print(_row(name, *row), flush=True)
                print(_row("generate, the same requests between", *local), flush=True)
                gap, step = _ms(row[2], 50), _ms(local[2], 50)
                print(
                    f"one stream: the server's inter-token median {gap:.2f} ms over generate()'s decode step "
                    f"{step:.2f} ms = {gap / step:.2f}x; TTFT median {_ms(row[1], 50):.1f} ms over generate()'s "
                    f"{_ms(local[1], 50):.1f} ms",
                    flush=True,
                )
            else:
                print(_row(name, *_against_server(server.address, prompts, args.max_tokens, c)), flush=True)
    finally:
        server.stop()
    if local is None:
        print(_row("generate, sequential calls", *_against_generate(model, tokenizer, prompts, args.max_tokens, False)))
    if not args.skip_static_batch:
        row = _against_generate(model, tokenizer, prompts, args.max_tokens, True)
        print(_row(f"generate, one static batch of {len(prompts)}", *row), flush=True)
    if not args.skip_offline:
        _offline(args)


def add_parser(sub) -> None:
    serve = add_command(sub, "serve", "the HTTP server at 1/8/32 clients vs plain generate")
    serve.add_argument("--backend", default="torch", choices=["torch", "mindspore"], help="the server's framework")
    serve.add_argument("--model", default=None, help="checkpoint folder (default: the bundled demo model)")
    serve.add_argument(
        "--dtype",
        default="float32",
        help="the server's and generate()'s dtype: float32 | bfloat16 | ...",
    )
    serve.add_argument(
        "--prompt-tokens",
        type=positive,
        default=None,
        help="random token ids per prompt (default: short demo-task texts)",
    )
    serve.add_argument("--requests", type=positive, default=64, help="requests per concurrency level")
    serve.add_argument("--max-tokens", type=positive, default=32, help="tokens each request generates (ignore_eos)")
    serve.add_argument(
        "--concurrency", type=positive_list, default="1,8,32", help="comma-separated numbers of concurrent clients"
    )
    serve.add_argument("--max-batch-size", type=positive, default=32, help="the server's --max-batch-size")
    serve.add_argument(
        "--skip-static-batch", action="store_true", help="leave out the one-static-batch generate row (default: run it)"
    )
    serve.add_argument(
        "--skip-offline", action="store_true", help="leave out the offline JSONL comparison (default: run it)"
    )
