"""examples/rl_over_http.py end to end: a torch trainer process and ``hyper-gen serve`` as two
processes; weights pushed over gloo mid-rollout, the rollout aborted and resumed, versions checked."""

import subprocess
import sys

from launch import REPO, _env


def test_rl_over_http_example():
    result = subprocess.run(
        [sys.executable, f"{REPO}/examples/rl_over_http.py", "--steps", "2", "--max-new-tokens", "64"],
        capture_output=True,
        text=True,
        env=_env(),
        cwd=REPO,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "resumed to 64 (step-2)" in result.stdout and result.stdout.rstrip().endswith("ok"), result.stdout
