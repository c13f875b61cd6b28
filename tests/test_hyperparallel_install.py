"""Without HyperParallel its tests skip, saying how to install it, outside CI, and fail under
``CI=true`` (tests/hyperparallel_install.py); the README and ``.ci/run`` install it the same way."""

import os
import re
import subprocess
import sys

import pytest
from hyperparallel_install import DEFAULT_SRC, MISSING, require_hyperparallel
from launch import REPO, _env


def test_installed_runs_the_test():
    assert require_hyperparallel(installed=True, environ={"CI": "true"}) is None


def test_missing_skips_outside_ci_with_the_install_command():
    with pytest.raises(pytest.skip.Exception, match="not on the package index") as info:
        require_hyperparallel(installed=False, environ={})
    assert str(info.value) == MISSING


@pytest.mark.parametrize("value", ["true", "True", "1"])
def test_missing_fails_under_ci(value):
    with pytest.raises(pytest.fail.Exception, match="CI=true") as info:
        require_hyperparallel(installed=False, environ={"CI": value})
    assert MISSING in str(info.value)


def test_the_readme_and_ci_install_it_as_the_message_says():
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    with open(os.path.join(REPO, ".ci", "run"), encoding="utf-8") as f:
        ci = f.read()
    command = MISSING.split(": ", 1)[1]
    assert command in readme  # the README's second command
    assert DEFAULT_SRC in ci and "HYPERPARALLEL_SRC" in ci and "export CI=true" in ci


@pytest.mark.slow
@pytest.mark.parametrize("ci", [False, True], ids=["outside-ci", "ci"])
def test_the_hyperparallel_tests_skip_or_fail_before_launching_anything(ci, tmp_path):
    """The real test module, with ``hyper_parallel`` made unimportable (``sys.modules`` entry None):
    every test skips (or fails under CI) with the install command, without starting a job."""
    (tmp_path / "hide_hyperparallel.py").write_text("import sys\nsys.modules['hyper_parallel'] = None\n")
    env = _env()
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env["PYTHONPATH"]])
    env.pop("CI", None)
    if ci:
        env["CI"] = "true"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "hide_hyperparallel",
            "-o",
            "addopts=",
            "-q",
            "-rsf",
            "-p",
            "no:cacheprovider",
        ]
        + ["tests/test_rollout_hyperparallel.py"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=REPO,
    )
    out = result.stdout + result.stderr
    assert "not on the package index" in out, out[-3000:]
    if ci:
        # (a failure in the module's setup fixture is reported as an error of each test)
        assert result.returncode == 1 and re.search(r"\d+ (failed|errors?)", out) and " passed" not in out, out[-3000:]
    else:
        assert result.returncode == 0 and " skipped" in out and " passed" not in out, out[-3000:]
