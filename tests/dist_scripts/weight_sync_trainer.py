"""A trainer process pushing weights to ``hyper-gen serve`` as SGLang's trainers do (slime, AReaL).

stdin: {"url", "master_port", "group_name", "checkpoint": a folder whose safetensors are pushed,
"weight_version", "load_format": [optional: "flattened_bucket" sends one bucket], "world_size":
[optional, default 2: the trainer and the server's ranks, at rank_offset 1 on], "silent": [optional:
announce the update, broadcast nothing, and report what the server answers (a timeout) and what a
second update on the group gets (its group is gone), then leave],
"poison": [optional: first the good update with its first tensor NaN, expected a 400],
"bad": [optional extra announced updates expected to be 400s: {"names", "dtypes",
"shapes"} overrides of the good one, broadcast all the same]}; stdout: one JSON object with each
HTTP answer ({"init", "bad": [...], "update", "destroy"}: [status, body]). The trainer is rank 0 of
the gloo group, hosting the rendezvous; each POST runs on a thread while this thread joins /
broadcasts, as the HTTP call only returns once the server has received everything.
"""

import glob
import http.client
import json
import os
import sys
import threading
from urllib.parse import urlparse

import torch
from safetensors.torch import load_file

from hyper_gen.backends.torch.weight_group import join


def post(url, path, body):
    parsed = urlparse(url)
    conn = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=300)
    try:
        conn.request("POST", path, body=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        return [response.status, json.loads(response.read() or b"null")]
    finally:
        conn.close()


def in_background(url, path, body):
    out = {}
    thread = threading.Thread(target=lambda: out.update(answer=post(url, path, body)))
    thread.start()
    return thread, out


def main():
    job = json.load(sys.stdin)
    url, name = job["url"], job["group_name"]
    tensors = {}
    for file in sorted(glob.glob(os.path.join(job["checkpoint"], "*.safetensors"))):
        tensors.update(load_file(file))
    init = {
        "master_address": "127.0.0.1",
        "master_port": job["master_port"],
        "rank_offset": 1,
        "world_size": job.get("world_size", 2),
        "group_name": name,
        "backend": "gloo",
    }
    thread, out = in_background(url, "/init_weights_update_group", init)
    group = join("127.0.0.1", job["master_port"], 0, init["world_size"], name, "gloo", timeout_s=60)
    thread.join()
    result = {"init": out["answer"], "bad": []}
    names = sorted(tensors)
    update = {
        "names": names,
        "dtypes": [str(tensors[n].dtype).replace("torch.", "") for n in names],
        "shapes": [list(tensors[n].shape) for n in names],
        "group_name": name,
        "weight_version": job["weight_version"],
    }
    if job.get("silent"):  # the server's every rank gives up on the broadcasts, and leaves the group
        result["update"] = post(url, "/update_weights_from_distributed", update)
        result["again"] = post(url, "/update_weights_from_distributed", update)
        group.destroy()
        print(json.dumps(result))
        return
    for override in job.get("bad", []):
        body = dict(update, **override)
        thread, out = in_background(url, "/update_weights_from_distributed", body)
        try:  # what the trainer announced is what it broadcasts (the server drains it)
            for n, dtype, shape in zip(body["names"], body["dtypes"], body["shapes"]):
                buffer = torch.zeros(shape, dtype=getattr(torch, dtype))
                group.broadcast(buffer, 60, n)
        except (TimeoutError, AttributeError, TypeError, RuntimeError) as exc:
            print(f"broadcast of a bad update stopped: {exc}", file=sys.stderr)
        thread.join()
        result["bad"].append(out["answer"])
    if job.get("poison"):  # the good announcement, its first tensor NaN: refused as it arrives, nothing written
        thread, out = in_background(url, "/update_weights_from_distributed", update)
        for i, n in enumerate(names):
            group.broadcast(torch.full_like(tensors[n], float("nan")) if i == 0 else tensors[n].contiguous(), 60, n)
        thread.join()
        result["poisoned"] = out["answer"]
    if job.get("load_format"):
        update["load_format"] = job["load_format"]
    thread, out = in_background(url, "/update_weights_from_distributed", update)
    if job.get("load_format") == "flattened_bucket":  # SGLang's bucket: one broadcast of them all, in order
        group.broadcast(torch.cat([tensors[n].flatten() for n in names]), 60, "the bucket")
    else:
        for n in names:
            group.broadcast(tensors[n].contiguous(), 60, n)
    thread.join()
    result["update"] = out["answer"]
    result["destroy"] = post(url, "/destroy_weights_update_group", {"group_name": name})
    group.destroy()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
