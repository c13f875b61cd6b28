"""``hyper-gen bench rl``: what an RL framework pays to drive ``hyper-gen serve`` over HTTP, each
next to its anchor, in one run.

- ``weights``: the trainer pushes every tensor of a random-weight checkpoint (``--sync-shape``,
  default the 0.8B shape) with SGLang's ``/update_weights_from_distributed`` over gloo, as slime and
  AReaL do: this process is the trainer (group rank 0), a real ``hyper-gen serve`` the other rank.
  The anchor is a bare ``torch.distributed`` broadcast of the same tensors to a plain receiving process
  (one broadcast per tensor, then a barrier: when the receiver holds them all). The update's time is
  split as the trainer sees it: HTTP and checks (from the POST to its first broadcast returning),
  the broadcasts, and the apply (from the last broadcast to the answer: the all-or-nothing
  ``update_weights`` at a step boundary). Both ways SGLang takes: one broadcast per tensor, and
  ``load_format: "flattened_bucket"`` (one broadcast of them all). The bar is at most 1.5x the bare
  broadcast.
- ``generate``: the same token-id requests (``--requests``, ``--max-tokens`` each, ``ignore_eos``, greedy)
  through SGLang's ``/generate`` and through ``/v1/completions`` (prompts as token ids,
  ``return_token_ids``), ``--concurrency`` clients at a time, on a server of ``--serve-shape``: output
  tokens/s of each. The bar is ``/generate`` no slower.

The host (CPU, ISA, threads) is printed; run it on an idle machine.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import threading
import time
from types import SimpleNamespace
from typing import List

import numpy as np

from hyper_gen.host import describe_host

from .models import SHAPES, make_checkpoint
from .serve import _ServerProcess, free_port, post_json, run_clients

PARTS = ("weights", "generate")


def _server(path: str, backend: str, max_batch_size: int = 32):
    """``hyper-gen serve`` on ``path`` in its own process (serve.py's), until ``stop``."""
    return _ServerProcess(SimpleNamespace(backend=backend, max_batch_size=max_batch_size, model=path))


def _served_checkpoint(shape: str, cache_dir: str) -> str:
    """The random checkpoint of ``shape`` with a tokenizer beside it (``hyper-gen serve`` loads one; the
    byte-level BPE of bench/tokenizer.py, at most 32k ids: the weights part sends no text)."""
    from .tokenizer import bench_tokenizer

    path = make_checkpoint(shape, cache_dir)
    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
        bench_tokenizer(cache_dir, min(SHAPES[shape]["vocab_size"], 32000)).save_pretrained(path)
    return path


def _tensors(path: str) -> dict:
    from safetensors.torch import load_file

    tensors = {}
    for file in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        tensors.update(load_file(file))
    return {name: tensors[name].contiguous() for name in sorted(tensors)}


def _join(port: int, rank: int, name: str):
    """A gloo weight-update group of two (the torch adapter's; gloo needs no model)."""
    from hyper_gen import registry

    return registry.adapter("torch").join_weight_group(None, "127.0.0.1", port, rank, 2, name, "gloo", 300)


RECEIVER = r"""
import json, sys
import torch.distributed as dist
from hyper_gen.bench.rl_server import _join
job = json.load(sys.stdin)
group = _join(job["port"], 1, "bare")
for _ in range(job["repeats"]):
    group.receive(job["specs"], 300, job["flattened"])
    dist.barrier(group=group.group)
group.destroy()
"""


def _sends(tensors: dict, flattened: bool) -> list:
    """What the trainer broadcasts, in order: each tensor, or one bucket of them all (built beforehand)."""
    if not flattened:
        return list(tensors.items())
    import torch

    return [("the bucket", torch.cat([t.flatten() for t in tensors.values()]))]


def _bare_broadcasts(tensors: dict, repeats: int, flattened: bool) -> List[float]:
    """Seconds of each bare broadcast of every tensor to a receiving process (until its barrier)."""
    import torch.distributed as dist

    port = free_port()
    specs = [[n, str(t.dtype).replace("torch.", ""), list(t.shape)] for n, t in tensors.items()]
    receiver = subprocess.Popen([sys.executable, "-c", RECEIVER], stdin=subprocess.PIPE, text=True)
    receiver.stdin.write(json.dumps({"port": port, "repeats": repeats, "specs": specs, "flattened": flattened}))
    receiver.stdin.close()
    group = _join(port, 0, "bare")
    sends, times = _sends(tensors, flattened), []
    for _ in range(repeats):
        start = time.perf_counter()
        for name, tensor in sends:
            group.broadcast(tensor, 300, name)
        dist.barrier(group=group.group)
        times.append(time.perf_counter() - start)
    group.destroy()
    receiver.wait(120)
    return times


def _post_into(server, body: dict, version: str, done: dict) -> None:
    """One update's POST (on its own thread: it answers once the broadcasts are received and applied)."""
    done["answer"] = post_json(server.address, "/update_weights_from_distributed", dict(body, weight_version=version))
    done["at"] = time.perf_counter()


def _pushes(server, tensors: dict, repeats: int, flattened: bool) -> List[tuple]:
    """(total, HTTP + checks, broadcasts, apply) seconds of each ``/update_weights_from_distributed``."""
    port = free_port()
    init = {
        "master_address": "127.0.0.1",
        "master_port": port,
        "rank_offset": 1,
        "world_size": 2,
        "group_name": "bench",
        "backend": "gloo",
    }
    answer = {}
    thread = threading.Thread(
        target=lambda: answer.update(init=post_json(server.address, "/init_weights_update_group", init))
    )
    thread.start()
    group = _join(port, 0, "bench")
    thread.join()
    names = list(tensors)
    body = {
        "names": names,
        "dtypes": [str(tensors[n].dtype).replace("torch.", "") for n in names],
        "shapes": [list(tensors[n].shape) for n in names],
        "group_name": "bench",
    }
    if flattened:
        body["load_format"] = "flattened_bucket"
    sends, out = _sends(tensors, flattened), []
    for version in range(repeats):
        done = {}
        start = time.perf_counter()
        thread = threading.Thread(target=_post_into, args=(server, body, f"bench-{version}", done))
        thread.start()
        first = None
        for name, tensor in sends:
            group.broadcast(tensor, 300, name)
            first = time.perf_counter() if first is None else first
        last = time.perf_counter()
        thread.join()
        if not done.get("answer", {}).get("success"):
            raise RuntimeError(f"/update_weights_from_distributed failed: {done.get('answer')}")
        out.append((done["at"] - start, first - start, last - first, done["at"] - last))
    post_json(server.address, "/destroy_weights_update_group", {"group_name": "bench"})
    group.destroy()
    return out


def weights(args) -> dict:
    path = _served_checkpoint(args.sync_shape, args.cache_dir)
    tensors = _tensors(path)
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    print(
        f"weights: {len(tensors)} tensors, {size / 2**20:.0f} MiB ({args.sync_shape} shape) over gloo, "
        f"best of {args.repeats}"
    )
    server = _server(path, "torch")
    metrics = {}
    try:
        for flattened in (False, True):
            bare = min(_bare_broadcasts(tensors, args.repeats, flattened))
            total, http, broadcasts, apply = min(_pushes(server, tensors, args.repeats, flattened))
            how = "one flattened bucket" if flattened else "one broadcast per tensor"
            print(f"  {how}:")
            print(f"    bare torch.distributed broadcast: {bare:8.3f} s ({size / bare / 2**30:.2f} GiB/s)")
            print(
                f"    /update_weights_from_distributed: {total:8.3f} s -> {total / bare:.2f}x the bare broadcast "
                "(bar 1.5x)"
            )
            print(f"      HTTP + checks {http:.3f} s, broadcasts {broadcasts:.3f} s, apply {apply:.3f} s")
            key = "bucket" if flattened else "per tensor"
            metrics.update({f"{key} bare s": bare, f"{key} update s": total, f"{key} apply s": apply})
    finally:
        server.stop()
    return metrics


def _rate(server, path: str, bodies: List[dict], concurrency: int) -> float:
    """Output tokens/s of ``bodies`` posted to ``path``, ``concurrency`` at a time."""

    def send(body):
        answer = post_json(server.address, path, body)
        return answer["meta_info"]["completion_tokens"] if path == "/generate" else answer["usage"]["completion_tokens"]

    wall, counts = run_clients(bodies, send, concurrency)
    return sum(counts) / wall


def generate_endpoints(args) -> dict:
    path = _served_checkpoint(args.serve_shape, args.cache_dir)
    vocab = SHAPES[args.serve_shape]["vocab_size"]
    rng = np.random.default_rng(0)
    prompts = [rng.integers(10, vocab, int(rng.integers(16, 64))).tolist() for _ in range(args.requests)]
    native = [
        {"input_ids": p, "sampling_params": {"max_new_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True}}
        for p in prompts
    ]
    openai = [
        {
            "model": "bench",
            "prompt": p,
            "max_tokens": args.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        for p in prompts
    ]
    print(
        f"generate: {args.requests} token-id requests of {args.max_tokens} tokens ({args.serve_shape} shape), "
        f"{args.concurrency} clients, /generate vs /v1/completions (alternating, best of {args.repeats})"
    )
    server = _server(path, args.backend, max(args.concurrency, 1))
    try:
        post_json(server.address, "/generate", dict(native[0], sampling_params={"max_new_tokens": 2}))  # warm-up
        rates = {"/generate": [], "/v1/completions": []}
        for _ in range(args.repeats):
            rates["/generate"].append(_rate(server, "/generate", native, args.concurrency))
            rates["/v1/completions"].append(_rate(server, "/v1/completions", openai, args.concurrency))
    finally:
        server.stop()
    native_rate, openai_rate = max(rates["/generate"]), max(rates["/v1/completions"])
    print(f"  /v1/completions: {openai_rate:8.1f} tok/s")
    print(f"  /generate:       {native_rate:8.1f} tok/s -> {native_rate / openai_rate:.2f}x (bar: no slower)")
    return {"generate tok/s": native_rate, "completions tok/s": openai_rate}


def part_list(text: str) -> str:
    """An argparse type: a comma-separated list of PARTS."""
    import argparse

    names = [name for name in text.split(",") if name]
    unknown = [name for name in names if name not in PARTS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"{(unknown or [text])[0]!r} is not one of {', '.join(PARTS)}")
    return ",".join(names)


def add_parser(sub):
    from .arguments import CACHE_DIR, add_command, positive

    parser = add_command(sub, "rl", "RL server: weight sync vs bare broadcast, /generate")
    parser.add_argument(
        "--parts", type=part_list, default="weights,generate", help=f"comma-separated, from {', '.join(PARTS)}"
    )
    parser.add_argument("--sync-shape", default="0.8b", choices=sorted(SHAPES), help="weights: checkpoint shape")
    parser.add_argument("--serve-shape", default="mid", choices=sorted(SHAPES), help="generate: checkpoint shape")
    parser.add_argument("--backend", default="torch", choices=["torch", "mindspore"], help="generate: the server's")
    parser.add_argument("--requests", type=positive, default=32, help="generate: requests per endpoint")
    parser.add_argument("--max-tokens", type=positive, default=32, help="generate: tokens each request generates")
    parser.add_argument("--concurrency", type=positive, default=8, help="generate: clients at a time")
    parser.add_argument("--repeats", type=positive, default=2, help="timed runs of each; the best is kept")
    parser.add_argument("--cache-dir", default=CACHE_DIR, help="where the random-weight checkpoints are written once")
    return parser


def run_rl(args) -> None:
    parts = args.parts.split(",")
    print(describe_host())
    if "weights" in parts:
        weights(args)
    if "generate" in parts:
        generate_endpoints(args)


__all__ = ["add_parser", "run_rl"]
