"""n samples, logprobs, scores and stop strings from a native TP=2 model equal one device's, on torch
(torchrun) and MindSpore (msrun); and seeded rollouts are the same on both backends."""

import json
import subprocess
import sys

import numpy as np
import pytest
from launch import REPO, _env, msrun, script, torchrun

SCRIPT = script("rollout_native_tp.py")


def _result(text):
    lines = [line for line in text.splitlines() if line.startswith("RESULT ")]
    assert lines, text[-3000:]
    return json.loads(lines[-1][len("RESULT ") :])


# the script at tp=1 for each backend given, one after another in one process (a process per backend
# paid its framework imports twice over on 2 cores); rank 0 of each prints its RESULT line in turn
SINGLE = r"""
import runpy, sys
script, backends = sys.argv[1], sys.argv[2:]
for backend in backends:
    sys.argv = [script, "1", backend]
    runpy.run_path(script, run_name="__main__")
"""


@pytest.fixture(scope="module")
def single():
    backends = ("torch", "mindspore")
    result = subprocess.run(
        [sys.executable, "-c", SINGLE, SCRIPT, *backends],
        capture_output=True,
        text=True,
        timeout=300,
        env=_env(),
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == len(backends), result.stdout[-3000:]
    return {backend: json.loads(line[len("RESULT ") :]) for backend, line in zip(backends, lines)}


def _same(tp2, one):
    assert tp2["sequences"] == one["sequences"]
    assert tp2["generated"] == one["generated"] and tp2["scores"] == one["scores"]
    for name in ("logprobs", "raw_logprobs"):
        assert np.abs(np.array(tp2[name]) - np.array(one[name])).max() < 1e-9


def test_seeded_rollouts_are_the_same_on_both_backends(single):
    assert single["torch"]["sequences"] == single["mindspore"]["sequences"]
    assert len(single["torch"]["sequences"]) == 6  # 2 prompts x 3 samples
    stopped = [n for n in single["torch"]["generated"] if n < 8]
    assert stopped  # a stop string or EOS ended some row early


@pytest.mark.distributed
def test_torch_tp2_rollout_outputs_equal_one_device(single):
    result = torchrun([SCRIPT, "2", "torch"])
    assert result.returncode == 0, result.stdout[-3000:]
    _same(_result(result.stdout), single["torch"])


@pytest.mark.distributed
def test_mindspore_tp2_rollout_outputs_equal_one_device(single, tmp_path):
    result = msrun([SCRIPT, "2", "mindspore"], log_dir=str(tmp_path))
    assert result.returncode == 0, result.stdout[-3000:] + result.worker_logs[-3000:]
    _same(_result(result.worker_logs), single["mindspore"])
