"""``hyper-gen bench router``: N ``hyper-gen serve`` workers behind sglang-router, ``cache_aware`` vs
``round_robin``, on the GRPO shape (groups of samples sharing their prompt), and the router's own
cost per request with one worker.

The workload: ``--groups`` prompts of about ``--prompt-len`` tokens, ``--samples`` seeded samples of
each (``n=1`` requests, as a rollout sends them through a router), ``--max-tokens`` tokens each
(``ignore_eos``: the same work in every run), sent by ``--concurrency`` clients in group order.
Reported per policy: the prefix-cache hit rate summed over the workers (prompt tokens found cached
/ looked up, from each worker's ``/metrics``, caches flushed before each run), completion tokens/s
over the wall time, and how many requests each worker served. ``cache_aware`` sends a group's
samples to the worker that holds its prompt, so every sample but the first is a hit; ``round_robin``
spreads them, so each worker computes the prompt once per group. With one worker: mean latency of
a one-token completion through the router and straight to the worker (the difference is the
router's overhead per request). Needs the ``router`` extra (``pip install 'hyper_gen[router]'``).
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import subprocess
import sys
import time
import urllib.request
from typing import List

import numpy as np

from .arguments import add_command, backend_list, non_negative, positive
from .serve import _ServerProcess, free_port, host_line, post_json, run_clients

POLICIES = ("cache_aware", "round_robin")


def _metric(address, name: str) -> float:
    with urllib.request.urlopen(f"http://{address[0]}:{address[1]}/metrics", timeout=30) as response:
        text = response.read().decode()
    match = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


class _Router:
    """sglang-router in front of ``workers`` with ``policy``; ``address`` once it routes a request."""

    def __init__(self, workers, policy: str, timeout_s: float = 120):
        self.port = free_port()
        self.address = ("127.0.0.1", self.port)
        cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(self.port)]
        cmd += ["--worker-urls", *[f"http://{w.address[0]}:{w.address[1]}" for w in workers]]
        cmd += ["--policy", policy, "--log-level", "warn", "--prometheus-port", str(free_port())]
        cmd += ["--prometheus-host", "127.0.0.1"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit("hyper-gen bench router: sglang-router stopped:\n" + self.proc.stderr.read())
            try:
                post_json(self.address, "/v1/completions", {"model": "bench", "prompt": "rev 1 =", "max_tokens": 1})
                return
            except (OSError, RuntimeError):
                time.sleep(0.5)
        self.stop()
        raise SystemExit("hyper-gen bench router: sglang-router did not route a request")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def _group_prompts(groups: int, prompt_len: int, seed: int = 0) -> List[str]:
    """One prompt per group, ``prompt_len`` characters of digits (a token each on the demo model)."""
    rng = np.random.default_rng(seed)
    return ["rev " + "".join(rng.choice(list("0123456789"), prompt_len)) + " =" for _ in range(groups)]


def _run(address, prompts: List[str], samples: int, max_tokens: int, concurrency: int):
    """(seconds, completion tokens) of every (prompt, sample) request sent by ``concurrency`` clients."""

    def send(item):
        prompt, sample = item
        body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "seed": sample}
        return post_json(address, "/v1/completions", body)["usage"]["completion_tokens"]

    wall, counts = run_clients([(p, s) for p in prompts for s in range(samples)], send, concurrency)
    return wall, sum(counts)


def _policy_row(workers, policy: str, args) -> str:
    for worker in workers:  # every run starts from empty prefix caches
        post_json(worker.address, "/flush_cache", {})
    router = _Router(workers, policy)
    try:
        names = ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total")
        before = [[_metric(w.address, n) for n in names] for w in workers]
        prompts = _group_prompts(args.groups, args.prompt_len)
        seconds, tokens = _run(router.address, prompts, args.samples, args.max_tokens, args.concurrency)
        after = [[_metric(w.address, n) for n in names] for w in workers]
    finally:
        router.stop()
    hits = sum(a[0] - b[0] for a, b in zip(after, before))
    queries = sum(a[1] - b[1] for a, b in zip(after, before))
    shares = "/".join(f"{(a[1] - b[1]) / max(queries, 1):.0%}" for a, b in zip(after, before))
    return f"  {policy:14s}{hits / max(queries, 1):>14.1%}{tokens / seconds:>12.1f}{seconds:>10.2f}   {shares}"


def _latency(address, requests: int) -> float:
    """Mean seconds of a one-token greedy completion, one request at a time."""
    body = {"model": "bench", "prompt": "rev 12345 =", "max_tokens": 1, "temperature": 0}
    post_json(address, "/v1/completions", body)
    start = time.perf_counter()
    for _ in range(requests):
        post_json(address, "/v1/completions", body)
    return (time.perf_counter() - start) / requests


def _workers(args, count: int) -> list:
    backends = args.backends.split(",")
    workers = []
    try:
        for i in range(count):
            options = argparse.Namespace(
                backend=backends[i % len(backends)], model=args.model, max_batch_size=args.max_batch_size
            )
            workers.append(_ServerProcess(options))
    except BaseException:
        for worker in workers:
            worker.stop()
        raise
    return workers


def run_router_bench(args) -> None:
    if importlib.util.find_spec("sglang_router") is None:
        raise SystemExit("hyper-gen bench router needs sglang-router: pip install 'hyper_gen[router]'")
    print(host_line())
    print(
        f"{args.model or 'demo model'}, {args.workers} workers ({args.backends}), {args.groups} prompts x "
        f"{args.samples} samples of {args.max_tokens} tokens (ignore_eos), prompts of {args.prompt_len} digits, "
        f"{args.concurrency} concurrent clients, sglang-router"
    )
    workers = _workers(args, args.workers)
    try:
        print(
            f"  {'policy':14s}{'prefix hits':>14s}{'tokens/s':>12s}{'seconds':>10s}   share of prompt tokens per worker"
        )
        for policy in POLICIES:
            print(_policy_row(workers, policy, args), flush=True)
        if args.overhead_requests:
            one = workers[:1]
            router = _Router(one, "round_robin")
            try:
                via = _latency(router.address, args.overhead_requests)
                direct = _latency(one[0].address, args.overhead_requests)
            finally:
                router.stop()
            print(
                f"  1 worker, one-token completions: {via * 1e3:.2f} ms through the router, {direct * 1e3:.2f} ms "
                f"direct: {(via - direct) * 1e3:+.2f} ms per request"
            )
    finally:
        for worker in workers:
            worker.stop()


def add_parser(sub) -> None:
    bench = add_command(sub, "router", "N serve workers behind sglang-router: cache_aware vs round_robin")
    bench.add_argument("--workers", type=positive, default=2, help="hyper-gen serve workers")
    bench.add_argument(
        "--backends",
        type=backend_list,
        default="torch",
        help="the workers' frameworks, cycled over them: torch, mindspore or torch,mindspore (a mixed fleet)",
    )
    bench.add_argument("--model", default=None, help="checkpoint folder (default: the bundled demo model)")
    bench.add_argument("--groups", type=positive, default=8, help="prompts (GRPO groups)")
    bench.add_argument("--samples", type=positive, default=8, help="seeded samples of each prompt")
    bench.add_argument("--prompt-len", type=positive, default=160, help="digits in each prompt")
    bench.add_argument("--max-tokens", type=positive, default=16, help="tokens each sample generates (ignore_eos)")
    bench.add_argument("--concurrency", type=positive, default=16, help="concurrent clients")
    bench.add_argument("--max-batch-size", type=positive, default=32, help="each worker's --max-batch-size")
    bench.add_argument(
        "--overhead-requests", type=non_negative, default=32, help="one-token requests timed for the overhead (0: skip)"
    )
