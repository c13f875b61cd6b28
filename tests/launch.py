"""Launch real multi-process jobs from pytest: torchrun (gloo) and msrun, each on its own free port."""

import glob
import os
import socket
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(REPO, "tests"), REPO, env.get("PYTHONPATH", "")])
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("GLOG_v", "3")  # MindSpore: errors only, so worker logs hold what the program printed
    return env


def torchrun(args, nproc=2, timeout=300, stdin=None, cwd=None):
    """CompletedProcess of ``torchrun --nproc_per_node N args...`` (stdout+stderr in .stdout)."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        f"--master_port={free_port()}",
    ] + list(args)
    return subprocess.run(
        cmd, input=stdin, capture_output=True, text=True, timeout=timeout, env=_env(), cwd=cwd or REPO
    )


def msrun(args, log_dir, nproc=2, timeout=300, stdin=None, cwd=None, env=None):
    """CompletedProcess of ``msrun ... args``; each worker's log is appended to .stdout. ``env``:
    variables set for this job on top of the test environment."""
    cmd = [
        "msrun",
        f"--worker_num={nproc}",
        f"--local_worker_num={nproc}",
        f"--master_port={free_port()}",
        "--join=True",
        f"--log_dir={log_dir}",
    ] + list(args)
    result = subprocess.run(
        cmd,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(_env(), **(env or {})),
        cwd=cwd or REPO,
    )
    logs = ""
    for path in sorted(glob.glob(os.path.join(log_dir, "worker_*.log"))):
        with open(path, encoding="utf-8", errors="replace") as f:
            logs += f"\n==== {os.path.basename(path)}\n" + f.read()
    result.worker_logs = logs
    return result


def script(name):
    return os.path.join(REPO, "tests", "dist_scripts", name)
