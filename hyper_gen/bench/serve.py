"""``hyper-gen bench serve``: the HTTP server under 1, 8 and 32 concurrent streaming clients, next
to the same requests run as sequential ``generate`` calls and as one static left-padded batch.

One real server (``python -m hyper_gen serve``, its own process) on the bundled demo model by
default; each client (a thread, plain ``http.client``) sends its share of the requests one
after another and reads the server-sent events. Every request asks for exactly
``--max-tokens`` tokens (``ignore_eos``), so every row generates the same work. Reported:
completion tokens/s over the wall time, and time to first token (from sending the request to
its first text) p50 / p99. ``generate`` rows: the sequential calls' TTFT is each call's own
prefill (no queueing), the static batch's is its one prefill. Then the offline JSONL comparison
(in-flight batching vs fixed micro-batches), where ``hyper_gen.bench.offline`` provides it.
"""

from __future__ import annotations

import http.client
import json
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


def _prompts(count: int, seed: int = 0) -> List[str]:
    rng = np.random.default_rng(seed)
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


def _stream_one(address, prompt: str, max_tokens: int):
    """(seconds to the first text, seconds to the end, completion tokens) of one streamed request."""
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
    first, tokens = None, 0
    for line in response:
        if not line.startswith(b"data: "):
            continue
        payload = line[6:].strip()
        if payload == b"[DONE]":
            break
        event = json.loads(payload)
        if event.get("choices") and event["choices"][0].get("text") and first is None:
            first = time.perf_counter() - start
        if event.get("usage"):
            tokens = event["usage"]["completion_tokens"]
    conn.close()
    return first if first is not None else time.perf_counter() - start, time.perf_counter() - start, tokens


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
    """(tokens/s, TTFTs) of ``prompts`` sent by ``concurrency`` clients, each one at a time."""
    _stream_one(address, prompts[0], 2)  # warm-up
    wall, results = run_clients(prompts, lambda prompt: _stream_one(address, prompt, max_tokens), concurrency)
    return sum(r[2] for r in results) / wall, [r[0] for r in results]


def _against_generate(model, tokenizer, prompts, max_tokens: int, batched: bool):
    config = GenerationConfig(max_new_tokens=max_tokens, min_new_tokens=max_tokens, eos_token_id=None, pad_token_id=0)
    groups = [prompts] if batched else [[p] for p in prompts]
    generate(
        model,
        tokenizer(prompts[:1], return_tensors="np")["input_ids"],
        config.replace(max_new_tokens=2, min_new_tokens=2),
    )
    ttfts, tokens = [], 0
    start = time.perf_counter()
    for group in groups:
        batch = tokenizer(group, padding=True, return_tensors="np")
        began, first = time.perf_counter(), []

        def on_tokens(step, token_ids, finished, first=first, began=began):
            if not first:
                first.append(time.perf_counter() - began)

        generate(model, batch["input_ids"], config, attention_mask=batch["attention_mask"], on_tokens=on_tokens)
        ttfts += first * len(group)
        tokens += max_tokens * len(group)
    return tokens / (time.perf_counter() - start), ttfts


def _row(name: str, rate: float, ttfts) -> str:
    p50, p99 = (np.percentile(np.asarray(ttfts) * 1e3, q) for q in (50, 99))
    return f"  {name:34s}{rate:12.1f}{p50:12.1f}{p99:12.1f}"


def _offline(args) -> None:
    run = offline.run_offline_comparison
    for spread, lengths in offline.JOBS:
        print(run(args.model, backend=args.backend, spread=spread, lengths=lengths))


def run_serve_bench(args) -> None:
    levels = list(args.concurrency)
    prompts = _prompts(args.requests)
    print(host_line())
    print(
        f"{args.model or 'demo model'}, {args.backend}, {args.requests} requests of "
        f"{args.max_tokens} tokens each (ignore_eos), "
        f"prompts of {min(map(len, prompts))}-{max(map(len, prompts))} characters, server --max-batch-size "
        f"{args.max_batch_size}"
    )
    server = _ServerProcess(args)
    try:
        rows = [
            (f"server, {c} concurrent client{'s' if c > 1 else ''}",)
            + _against_server(server.address, prompts, args.max_tokens, c)
            for c in levels
        ]
    finally:
        server.stop()
    path = args.model or demo_model_path()
    model = load_model(path, backend=args.backend)
    tokenizer = load_tokenizer(path)
    rows.append(("generate, sequential calls",) + _against_generate(model, tokenizer, prompts, args.max_tokens, False))
    rows.append(
        (f"generate, one static batch of {len(prompts)}",)
        + _against_generate(model, tokenizer, prompts, args.max_tokens, True)
    )
    print(f"  {'':34s}{'tokens/s':>12s}{'TTFT p50 ms':>12s}{'TTFT p99 ms':>12s}")
    for name, rate, ttfts in rows:
        print(_row(name, rate, ttfts))
    if not args.skip_offline:
        _offline(args)


def add_parser(sub) -> None:
    serve = add_command(sub, "serve", "the HTTP server at 1/8/32 clients vs plain generate")
    serve.add_argument("--backend", default="torch", choices=["torch", "mindspore"], help="the server's framework")
    serve.add_argument("--model", default=None, help="checkpoint folder (default: the bundled demo model)")
    serve.add_argument("--requests", type=positive, default=64, help="requests per concurrency level")
    serve.add_argument("--max-tokens", type=positive, default=32, help="tokens each request generates (ignore_eos)")
    serve.add_argument(
        "--concurrency", type=positive_list, default="1,8,32", help="comma-separated numbers of concurrent clients"
    )
    serve.add_argument("--max-batch-size", type=positive, default=32, help="the server's --max-batch-size")
    serve.add_argument(
        "--skip-offline", action="store_true", help="leave out the offline JSONL comparison (default: run it)"
    )
