"""Library use is quiet: importing the MindSpore backend probes for Ascend, and MindSpore answers a
"no" with two warnings (its plugin's load error included) on every CPU machine. They are dropped
unless the user set ``GLOG_v`` themselves, in which case MindSpore's own setting rules."""

import subprocess
import sys

import pytest
from launch import REPO, _env

PROGRAM = """
import mindspore
from hyper_gen import generate, load_model
from hyper_gen.demo import demo_model_path

model = load_model(demo_model_path(), backend="mindspore")
print(generate(model, [[5, 6, 7]], max_new_tokens=3).asnumpy().tolist(), mindspore.get_context("device_target"))
"""


def _run(glog_v=None):
    env = _env()
    env.pop("GLOG_v", None)  # (the test launcher's default)
    if glog_v is not None:
        env["GLOG_v"] = glog_v
    return subprocess.run(
        [sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=180, env=env, cwd=REPO
    )


@pytest.mark.slow
def test_mindspore_backend_import_prints_nothing_but_the_answer():
    quiet = _run()
    assert quiet.returncode == 0, quiet.stderr[-3000:]
    assert quiet.stdout.startswith("[[5, 6, 7, "), quiet.stdout
    assert "[WARNING]" not in quiet.stderr and "Ascend" not in quiet.stderr, quiet.stderr[-3000:]
    assert quiet.stderr.strip() == "", quiet.stderr[-3000:]
    if quiet.stdout.split()[-1] == "CPU":  # without Ascend, MindSpore's warning is there to be kept
        told = _run(glog_v="2")  # the user asked for warnings: they get MindSpore's
        assert told.returncode == 0, told.stderr[-3000:]
        assert "Backend Ascend is not available" in told.stderr, told.stderr[-3000:]
