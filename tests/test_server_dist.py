"""A 2-rank torchrun TP=2 server: rank 0 listens, rank 1 follows its engine's steps; greedy
answers equal single-device generate; stopping rank 0 (SIGTERM), or the launcher, ends both."""

import json
import os
import signal
import sys
import time

import pytest
from demo_task import DEMO_MODEL_DIR, make_prompts
from launch import free_port
from test_server import Server, curl, expected

pytestmark = pytest.mark.distributed


def _torchrun_serve(*extra):
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        f"--master_port={free_port()}",
        "-m",
        "hyper_gen",
        "serve",
        "--tp",
        "2",
        "--port",
        "0",
        "--served-model-name",
        "demo",
        *extra,
    ]


def _worker_pids(parent: int) -> dict:
    """{rank: pid} of ``parent``'s child processes started by torchrun."""
    ranks = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid != parent:
                continue
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(e.split(b"=", 1) for e in f.read().split(b"\0") if b"=" in e)
        except OSError:
            continue
        if b"RANK" in env:
            ranks[int(env[b"RANK"])] = int(pid)
    return ranks


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie has exited
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture(scope="module")
def tokenizer():
    from hyper_gen.jobs.tokenizer import load_tokenizer

    return load_tokenizer(DEMO_MODEL_DIR)


def test_tp2_server_answers_like_one_device_and_stops_with_rank_0(tokenizer):
    prompts = [p for p, _ in make_prompts(4, seed=5)]
    want = [
        tokenizer.decode(t, skip_special_tokens=True)
        for t in expected("torch", [tokenizer.encode(p) for p in prompts], 12)
    ]
    server = Server(_torchrun_serve(), timeout=240)
    try:
        client = server.client()
        out = client.completions.create(model="demo", prompt=prompts, max_tokens=12, temperature=0)
        assert [c.text for c in out.choices] == want
        parts = client.completions.create(model="demo", prompt=prompts[0], max_tokens=12, temperature=0, stream=True)
        assert "".join(p.choices[0].text for p in parts) == want[0]
        chat = client.chat.completions.create(
            model="demo", messages=[{"role": "user", "content": prompts[1]}], max_tokens=12, temperature=0
        )
        assert chat.choices[0].message.content == want[1]
        assert json.loads(curl(server.url + "/health").stdout)["status"] == "ok"
        workers = _worker_pids(server.proc.pid)
        assert sorted(workers) == [0, 1], workers
        os.kill(workers[0], signal.SIGTERM)  # rank 0 stops; rank 1 follows it out
        assert server.proc.wait(90) == 0, server.log
        assert not any(_alive(p) for p in workers.values())
        assert "hyper-gen serve: stopped" in server.log and "Traceback" not in server.log, server.log
    finally:
        server.kill()


def test_sigint_to_the_launcher_ends_every_rank():
    server = Server(_torchrun_serve(), timeout=240)
    try:
        workers = _worker_pids(server.proc.pid)
        assert sorted(workers) == [0, 1], workers
        os.killpg(server.proc.pid, signal.SIGINT)  # Ctrl-C in the terminal: every process of the job
        server.proc.wait(90)
        deadline = time.monotonic() + 30
        while any(_alive(p) for p in workers.values()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_alive(p) for p in workers.values()), server.log
        assert "hyper-gen serve: stopped" in server.log, server.log
    finally:
        server.kill()
