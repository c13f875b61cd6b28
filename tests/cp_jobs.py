"""One msrun job of a MindSpore context-parallel script (tests/dist_scripts/cp_*mindspore.py) and
the lines its ranks print, ``rank R: <check> <label> [width=W ]...``, keyed for the tests."""

import re

from launch import msrun, script
from qwen_checkpoints import make_checkpoint

CHECKPOINTS = {"dense": ("dense", {}), "moe": ("moe", {"fused_experts": True})}


def run_job(tmp_path_factory, name: str, nproc: int, line: re.Pattern, env: dict = None):
    """Run ``name`` on ``nproc`` workers over the tiny dense and MoE checkpoints: ({(rank, check,
    label, width or None): rest of the line}, the worker logs), after checking every rank finished.
    ``env``: variables set for the job."""
    root = tmp_path_factory.mktemp(name.removesuffix(".py"))
    paths = {label: make_checkpoint(root, kind, **kwargs) for label, (kind, kwargs) in CHECKPOINTS.items()}
    result = msrun(
        [script(name)] + [f"{label}={path}" for label, path in paths.items()],
        log_dir=str(root / "logs"),
        nproc=nproc,
        timeout=600,
        env=env,
    )
    assert result.returncode == 0, result.worker_logs[-6000:]
    for rank in range(nproc):
        assert f"rank {rank}: done" in result.worker_logs, result.worker_logs[-6000:]
    lines = {}
    for rank, check, label, rest in line.findall(result.worker_logs):
        width = re.match(r"width=(\d+) ", rest)
        lines[(int(rank), check, label, int(width.group(1)) if width else None)] = rest
    return lines, result.worker_logs


def job_line(job, rank, check, label, width=None):
    """The rest of one rank's line, failing with the log's tail when the rank did not print it."""
    lines, text = job
    key = (rank, check, label, width)
    assert key in lines, f"no '{check} {label} width={width}' line from rank {rank}:\n{text[-3000:]}"
    return lines[key]
