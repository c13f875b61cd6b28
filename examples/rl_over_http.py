"""RL over HTTP: a torch trainer process driving ``hyper-gen serve`` as slime / AReaL drive SGLang.

Two processes: ``hyper-gen serve`` (started here) and this trainer. The trainer generates through
``POST /generate`` with token ids, takes a training step (a stand-in here: a seeded perturbation
of the weights, so the new policy visibly differs), and pushes its weights over a gloo group with
``/init_weights_update_group`` + ``/update_weights_from_distributed`` while a long rollout is in
flight: the rollout is aborted at the update (``/pause_generation`` mode abort), answers its
tokens so far, and is resumed with ``input_ids + output_ids`` on the new weights; every answer says
which ``weight_version`` produced it.

    python examples/rl_over_http.py [--backend gloo] [--steps 2]
"""

from __future__ import annotations

import argparse
import glob
import http.client
import json
import os
import re
import socket
import subprocess
import sys
import threading
from urllib.parse import urlparse

import torch
from safetensors.torch import load_file

from hyper_gen.backends.torch.weight_group import join
from hyper_gen.demo import demo_model_path


class Client:
    def __init__(self, url):
        parsed = urlparse(url)
        self.host, self.port = parsed.hostname, parsed.port

    def post(self, path, body=None, stream=False):
        conn = http.client.HTTPConnection(self.host, self.port, timeout=300)
        data = json.dumps(body or {}).encode()
        conn.request("POST", path, body=data, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        if stream:
            return conn, response
        out = json.loads(response.read() or b"null")
        conn.close()
        if response.status != 200:
            raise RuntimeError(f"{path}: {response.status} {out}")
        return out

    def get(self, path):
        conn = http.client.HTTPConnection(self.host, self.port, timeout=60)
        conn.request("GET", path)
        out = json.loads(conn.getresponse().read())
        conn.close()
        return out


def start_server():
    cmd = [
        sys.executable,
        "-m",
        "hyper_gen",
        "serve",
        "--backend",
        "torch",
        "--port",
        "0",
        "--served-model-name",
        "demo",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        match = re.search(r"hyper-gen serve: (http://\S+)/v1 ", line)
        if match:
            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()  # keep the pipe drained
            return proc, match.group(1)
    raise RuntimeError(f"the server did not start (exit status {proc.wait()})")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def in_background(fn, *args):
    out = {}
    thread = threading.Thread(target=lambda: out.update(value=fn(*args)))
    thread.start()
    return thread, out


def push(client, group, weights, version):
    """The trainer's side of ``/update_weights_from_distributed``: announce, then broadcast each tensor."""
    names = sorted(weights)
    body = {
        "names": names,
        "dtypes": [str(weights[n].dtype).replace("torch.", "") for n in names],
        "shapes": [list(weights[n].shape) for n in names],
        "group_name": "rl",
        "weight_version": version,
    }
    thread, out = in_background(client.post, "/update_weights_from_distributed", body)
    for name in names:
        group.broadcast(weights[name].contiguous(), 120, name)
    thread.join()
    return out["value"]


def rollout_across_update(client, group, prompt, weights, version, max_new):
    """A long greedy rollout aborted by the weight update, then resumed on the new weights."""
    body = {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True},
        "rid": f"rollout-{version}",
        "stream": True,
    }
    conn, response = client.post("/generate", body, stream=True)
    last, paused = None, False
    for raw in response:
        line = raw.decode().strip()
        if line == "data: [DONE]":
            break
        if line.startswith("data: "):
            last = json.loads(line[6:])
            if not paused and len(last["output_ids"]) >= 4:
                paused = True
                client.post("/pause_generation", {"mode": "abort"})  # the rollout answers what it has
    conn.close()
    partial = last["output_ids"]
    assert last["meta_info"]["finish_reason"]["type"] == "abort", last["meta_info"]
    old_version = last["meta_info"]["weight_version"]
    push(client, group, weights, version)
    client.post("/continue_generation")
    rest = dict(body["sampling_params"], max_new_tokens=max_new - len(partial))
    resumed = client.post("/generate", {"input_ids": prompt + partial, "sampling_params": rest})
    return partial, old_version, resumed


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=200)
    args = parser.parse_args()
    torch.manual_seed(0)
    weights = {}
    for file in sorted(glob.glob(os.path.join(demo_model_path(), "*.safetensors"))):
        weights.update(load_file(file))
    proc, url = start_server()
    client = Client(url)
    try:
        port = free_port()
        init = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2}
        thread, out = in_background(
            client.post, "/init_weights_update_group", dict(init, group_name="rl", backend="gloo")
        )
        group = join("127.0.0.1", port, 0, 2, "rl", "gloo", timeout_s=120)
        thread.join()
        print("joined:", out["value"]["message"])
        prompt = list(range(3, 40))
        first = client.post(
            "/generate", {"input_ids": prompt, "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
        )
        print(f"generate: {len(first['output_ids'])} ids, weight_version {first['meta_info']['weight_version']}")
        assert first["meta_info"]["weight_version"] == "default"
        for step in range(1, args.steps + 1):
            with torch.no_grad():  # the training step's stand-in
                weights = {n: w + 0.2 * w.std() * torch.randn_like(w) for n, w in weights.items()}
            version = f"step-{step}"
            partial, old, resumed = rollout_across_update(client, group, prompt, weights, version, args.max_new_tokens)
            new = resumed["meta_info"]["weight_version"]
            total = len(partial) + len(resumed["output_ids"])
            print(f"step {step}: rollout aborted at {len(partial)} tokens ({old}), resumed to {total} ({new})")
            assert new == version and total == args.max_new_tokens
            assert client.get("/get_weight_version") == {"weight_version": version}
        client.post("/destroy_weights_update_group", {"group_name": "rl"})
        group.destroy()
        print("ok")
    finally:
        proc.terminate()
        proc.wait(60)


if __name__ == "__main__":
    main()
