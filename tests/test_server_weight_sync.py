"""Weights pushed to ``hyper-gen serve`` by a trainer in another process, as SGLang's trainers push
them: ``/init_weights_update_group`` + ``/update_weights_from_distributed`` (a separate torch process,
``dist_scripts/weight_sync_trainer.py``, joins the group over gloo and broadcasts a second
checkpoint's weights), ``/destroy_weights_update_group``, ``/update_weights_from_tensor`` (base64
safetensors); the group calls on a torchrun TP=2 server too (both ranks join at ``rank_offset +
rank``, receive every broadcast and keep their shard). After an update ``/generate`` answers what
plain ``generate()`` answers on the pushed checkpoint, with the new ``weight_version``; every bad
request is a 400 naming its field and changes nothing; every wait for the trainer is bounded.
"""

import base64
import json
import os
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest
from demo_task import DEMO_MODEL_DIR, make_prompts
from launch import REPO, _env, free_port, script
from test_server import Server, serve_cmd
from test_server_sglang import Http, ok

MAX_TOKENS = 12
TIMEOUT_S = 4  # the server's bound on every wait for the trainer (HYPER_GEN_WEIGHT_SYNC_TIMEOUT_S)


def expected(backend, model, prompts):
    job = {"backend": backend, "model": model, "prompts": prompts, "max_tokens": MAX_TOKENS}
    result = subprocess.run(
        [sys.executable, script("serve_expected_logprobs.py")],
        input=json.dumps(job),
        capture_output=True,
        text=True,
        timeout=180,
        env=_env(),
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr
    return [r["tokens"] for r in json.loads(result.stdout)]


def second_checkpoint(folder, seed=1):
    """The demo checkpoint with every weight redrawn around its own (another seed's model)."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(DEMO_MODEL_DIR, folder)
    rng = np.random.default_rng(seed)
    tensors = load_file(os.path.join(folder, "model.safetensors"))
    changed = {n: (t + 0.5 * t.std() * rng.standard_normal(t.shape)).astype(t.dtype) for n, t in tensors.items()}
    save_file(changed, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    return str(folder)


@pytest.fixture(scope="module")
def ids():
    from hyper_gen.jobs.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(DEMO_MODEL_DIR)
    return [tokenizer.encode(p) for p, _ in make_prompts(3, seed=7)]


@pytest.fixture(scope="module")
def pushed(tmp_path_factory):
    return second_checkpoint(tmp_path_factory.mktemp("ckpt") / "seed1")


def _server(backend):
    env = dict(_env(), HYPER_GEN_WEIGHT_SYNC_TIMEOUT_S=str(TIMEOUT_S))
    return Server(serve_cmd(backend, "--max-batch-size", "4", "--served-model-name", "demo"), env=env)


@pytest.fixture(scope="module")
def torch_server():
    server = _server("torch")
    yield server, Http(server.url)
    status = server.stop(signal.SIGTERM)
    assert status == 0, server.log
    assert "Traceback" not in server.log, server.log


def generated(http, ids):
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": MAX_TOKENS, "temperature": 0}}
    out = ok(http.post("/generate", body))
    return [o["output_ids"] for o in out], {o["meta_info"]["weight_version"] for o in out}


def trainer(url, checkpoint, version, bad=(), load_format=None, **more):
    job = {
        **more,
        "load_format": load_format,
        "url": url,
        "master_port": free_port(),
        "group_name": "rl",
        "checkpoint": checkpoint,
        "weight_version": version,
        "bad": list(bad),
    }
    result = subprocess.run(
        [sys.executable, script("weight_sync_trainer.py")],
        input=json.dumps(job),
        capture_output=True,
        text=True,
        timeout=300,
        env=_env(),
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_distributed_update_from_a_trainer_process(torch_server, ids, pushed):
    server, http = torch_server
    before, versions = generated(http, ids)
    assert before == expected("torch", DEMO_MODEL_DIR, ids) and versions == {"default"}
    from safetensors.numpy import load_file

    tensors = load_file(os.path.join(pushed, "model.safetensors"))
    names = sorted(tensors)
    shapes = [list(tensors[n].shape) for n in names]
    bad = [
        {"shapes": [[3, 3]] + shapes[1:]},  # disagrees with the model's parameter
        {"names": ["model.no_such.weight"] + names[1:]},  # a name the model lacks
        {"dtypes": ["int32"] + ["float32"] * (len(names) - 1)},  # a dtype it can't take
    ]
    out = trainer(server.url, pushed, "step-1", bad, poison=True)
    assert ok(out["init"])["success"]
    status, body = out["poisoned"]  # received whole, refused by the check as it arrived: nothing written
    assert status == 400 and body["error"]["param"] == "names" and "non-finite" in body["error"]["message"], body
    for (status, body), param in zip(out["bad"], ["shapes.0", "names.0", "dtypes.0"]):
        assert status == 400 and body["error"]["param"] == param, body
        assert "not applied" in body["error"]["message"]
    assert ok(out["update"])["success"], out
    assert ok(out["destroy"])["success"]
    after, versions = generated(http, ids)
    assert versions == {"step-1"} and ok(http.get("/get_weight_version")) == {"weight_version": "step-1"}
    assert after == expected("torch", pushed, ids)
    assert after != before


def test_flattened_bucket_update_and_its_one_dtype(torch_server, ids, tmp_path):
    """SGLang's ``load_format: "flattened_bucket"``: one broadcast of every tensor flattened in order."""
    server, http = torch_server
    third = second_checkpoint(tmp_path / "seed2", seed=2)
    out = trainer(server.url, third, "bucket-1", load_format="flattened_bucket")
    assert ok(out["update"])["success"] and ok(out["destroy"])["success"], out
    after, versions = generated(http, ids)
    assert versions == {"bucket-1"} and after == expected("torch", third, ids)
    mixed = {
        "names": ["model.norm.weight", "lm_head.weight"],
        "dtypes": ["float32", "bfloat16"],
        "shapes": [[1], [1]],
        "group_name": "rl",
        "load_format": "flattened_bucket",
    }
    status, body = http.post("/update_weights_from_distributed", mixed)
    assert status == 400 and body["error"]["param"] == "dtypes" and "one dtype" in body["error"]["message"], body
    status, body = http.post("/update_weights_from_distributed", dict(mixed, load_format="npz"))
    assert status == 400 and body["error"]["param"] == "load_format", body
    assert ok(http.get("/get_weight_version")) == {"weight_version": "bucket-1"}


def _safetensors_body(folder, version, **change):
    from safetensors.numpy import load_file, save

    tensors = load_file(os.path.join(folder, "model.safetensors"))
    tensors.update(change)
    return {"serialized_named_tensors": [base64.b64encode(save(tensors)).decode()], "weight_version": version}


def test_bad_group_requests_are_400s_and_waits_are_bounded(torch_server):
    _, http = torch_server
    version = ok(http.get("/get_weight_version"))
    good = {"master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1, "world_size": 2}
    for change, param in [
        ({"rank_offset": 0}, "rank_offset"),
        ({"world_size": 1}, "world_size"),
        ({"backend": "mpi"}, "backend"),
        ({"master_port": "x"}, "master_port"),
        ({"master_port": 70000}, "master_port"),
    ]:
        status, body = http.post("/init_weights_update_group", dict(good, **change))
        assert status == 400 and body["error"]["param"] == param, body
    update = {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[128]], "group_name": "nope"}
    status, body = http.post("/update_weights_from_distributed", update)
    assert status == 400 and body["error"]["param"] == "group_name" and "nope" in body["error"]["message"]
    status, body = http.post("/destroy_weights_update_group", {"group_name": "nope"})
    assert status == 400 and body["error"]["param"] == "group_name"
    status, body = http.post("/update_weights_from_distributed", dict(update, dtypes=[]))
    assert status == 400 and body["error"]["param"] == "dtypes"
    # no trainer comes: the join gives up after the server's bound, naming what it waited for
    status, body = http.post("/init_weights_update_group", dict(good, backend="gloo", group_name="alone"))
    assert status == 500 and "timed out" in body["error"]["message"] and "'alone'" in body["error"]["message"]
    assert ok(http.get("/get_weight_version")) == version


def test_update_from_tensor(torch_server, ids):
    _, http = torch_server
    status, body = http.post("/update_weights_from_tensor", {"serialized_named_tensors": ["gAR9lC4="]})
    assert (
        status == 400
        and body["error"]["param"] == "serialized_named_tensors.0"
        and "pickle" in body["error"]["message"]
    )
    wrong = _safetensors_body(DEMO_MODEL_DIR, "x", **{"model.norm.weight": np.ones(5, np.float32)})
    status, body = http.post("/update_weights_from_tensor", wrong)
    assert status == 400 and body["error"]["param"] == "serialized_named_tensors.0" and "model.norm.weight" in str(body)
    extra = _safetensors_body(DEMO_MODEL_DIR, "x", **{"model.extra.weight": np.ones(5, np.float32)})
    status, body = http.post("/update_weights_from_tensor", extra)
    assert status == 400 and "model.extra.weight" in body["error"]["message"]
    status, body = http.post("/update_weights_from_tensor", {"serialized_named_tensors": ["not base64!"]})
    assert status == 400 and body["error"]["param"] == "serialized_named_tensors.0"
    assert ok(http.get("/get_weight_version"))["weight_version"] != "x"
    assert ok(http.post("/update_weights_from_tensor", _safetensors_body(DEMO_MODEL_DIR, "from-tensor")))["success"]
    after, versions = generated(http, ids)
    assert versions == {"from-tensor"} and after == expected("torch", DEMO_MODEL_DIR, ids)


def test_mindspore_server_takes_tensors_and_refuses_a_torch_group(ids, pushed):
    server = _server("mindspore")
    try:
        http = Http(server.url)
        good = {"master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1, "world_size": 2}
        status, body = http.post("/init_weights_update_group", dict(good, backend="gloo"))
        assert status == 400 and body["error"]["param"] == "backend", body
        assert "cannot join" in body["error"]["message"] and "/update_weights_from_tensor" in body["error"]["message"]
        assert ok(http.post("/update_weights_from_tensor", _safetensors_body(pushed, "ms-1")))["success"]
        after, versions = generated(http, ids)
        assert versions == {"ms-1"} and after == expected("mindspore", pushed, ids)
    finally:
        status = server.stop(signal.SIGTERM)
    assert status == 0, server.log
    assert "Traceback" not in server.log, server.log


@pytest.mark.distributed
@pytest.mark.slow
def test_tp2_server_joins_receives_and_keeps_its_shards(ids, pushed, tmp_path):
    """A torchrun TP=2 server: both ranks join the trainer's group of three (ranks 1 and 2), take every
    broadcast, and write their own shards at one boundary: greedy tokens then equal one-device
    generate() on the pushed checkpoint (rank 1's half of every sharded layer included). A trainer that
    never broadcasts is a bounded 500 and leaves no rank in the group; a bad update is drained on every
    rank (the trainer is not left hanging) and changes nothing; per tensor and flattened bucket."""
    from test_server_dist import _torchrun_serve, _worker_pids

    env = dict(_env(), HYPER_GEN_WEIGHT_SYNC_TIMEOUT_S=str(TIMEOUT_S))
    server = Server(_torchrun_serve("--max-batch-size", "4"), timeout=240, env=env)
    try:
        http = Http(server.url)
        before, versions = generated(http, ids)
        assert before == expected("torch", DEMO_MODEL_DIR, ids) and versions == {"default"}
        good = {"master_address": "127.0.0.1", "master_port": free_port(), "group_name": "g"}
        for change, param in [
            ({"rank_offset": 1, "world_size": 2}, "world_size"),
            ({"rank_offset": 2, "world_size": 3}, "rank_offset"),
        ]:
            status, body = http.post("/init_weights_update_group", dict(good, **change))
            assert status == 400 and body["error"]["param"] == param and "2 rank(s)" in body["error"]["message"], body
        status, body = http.post("/init_weights_update_group", dict(good, rank_offset=1, world_size=3))
        assert status == 500 and "timed out" in body["error"]["message"], body  # no trainer came: bounded

        silent = trainer(server.url, pushed, "never", world_size=3, silent=True)
        assert ok(silent["init"])["success"]
        status, body = silent["update"]
        assert status == 500 and "timed out" in body["error"]["message"] and "destroyed" in body["error"]["message"]
        status, body = silent["again"]  # gone on rank 0 (and, as the next join shows, on rank 1)
        assert status == 400 and body["error"]["param"] == "group_name", body

        from safetensors.numpy import load_file

        names = sorted(load_file(os.path.join(pushed, "model.safetensors")))
        bad = [{"names": ["model.no_such.weight"] + names[1:]}]
        out = trainer(server.url, pushed, "tp-1", bad, world_size=3)
        assert ok(out["init"])["success"], out
        ((status, body),) = out["bad"]
        assert status == 400 and body["error"]["param"] == "names.0" and "received and dropped" in str(body), body
        assert ok(out["update"])["success"] and ok(out["destroy"])["success"], out
        after, versions = generated(http, ids)
        assert versions == {"tp-1"} and after == expected("torch", pushed, ids) and after != before

        third = second_checkpoint(tmp_path / "seed3", seed=3)
        out = trainer(server.url, third, "tp-2", world_size=3, load_format="flattened_bucket")
        assert ok(out["update"])["success"] and ok(out["destroy"])["success"], out
        after, versions = generated(http, ids)
        assert versions == {"tp-2"} and after == expected("torch", third, ids)
        os.kill(_worker_pids(server.proc.pid)[0], signal.SIGTERM)  # rank 0 stops; rank 1 follows it out
        assert server.proc.wait(90) == 0, server.log
    finally:
        server.kill()
    assert "Traceback" not in server.log, server.log
