"""Every Python snippet in README.md runs as written, and prints what its comments say.

A snippet whose first line names a launcher (``# torchrun --nproc_per_node 2 ...``) runs under
torchrun with that many ranks, and also under msrun where that line names it too (the program picks
its framework from the launcher), its output read from msrun's worker logs. ``print(...)  # <expected>``
comments are checked against the output, so the README's claims are tested, not only its syntax.
"""

import os
import re
import subprocess
import sys

import pytest
from launch import REPO, _env, msrun, torchrun

README = os.path.join(REPO, "README.md")


def _python_blocks():
    with open(README, encoding="utf-8") as f:
        text = f.read()
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


BLOCKS = _python_blocks()


def _expected_prints(code):
    """The text after ``# `` on each print line whose comment quotes a value."""
    found = []
    for line in code.splitlines():
        match = re.match(r"\s*print\(.*\)\s+#\s+(\[.*\]|'.*'|\".*\")\s*$", line)
        if match:
            found.append(match.group(1))
    return found


def test_readme_has_python_snippets():
    assert len(BLOCKS) >= 3


SINGLE = [i for i, b in enumerate(BLOCKS) if "torchrun --nproc_per_node" not in b]

# Runs each snippet file given as ``__main__`` with globals of its own, in turn, in this one process
# (its stdout / stderr to files beside it, a traceback and exit status 1 where it raised): a fresh
# process per snippet paid 30 s of torch / transformers imports each on 2 cores.
RUNNER = r"""
import contextlib, runpy, sys, traceback
for script in sys.argv[1:]:
    with open(script + ".out", "w") as out, open(script + ".err", "w") as err:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                runpy.run_path(script, run_name="__main__")
                code = 0
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            except BaseException:
                traceback.print_exc()
                code = 1
            sys.stdout.flush()
    with open(script + ".rc", "w") as f:
        f.write(str(code))
"""


@pytest.fixture(scope="module")
def snippet_runs(tmp_path_factory):
    """{index: (exit status, stdout, stderr)} of every single-process snippet, run one after another
    in one fresh process, each from its own file in the folder it runs in."""
    folder = tmp_path_factory.mktemp("snippets")
    scripts = []
    for index in SINGLE:
        scripts.append(folder / f"snippet_{index}.py")
        scripts[-1].write_text(BLOCKS[index])
    result = subprocess.run(
        [sys.executable, "-c", RUNNER, *map(str, scripts)],
        capture_output=True,
        text=True,
        timeout=300 + 60 * len(scripts),
        env=_env(),
        cwd=folder,
    )
    runs = {}
    for index, script in zip(SINGLE, scripts):
        rc = script.with_name(script.name + ".rc")
        if not rc.exists():  # the process died in (or before) this snippet
            runs[index] = (result.returncode, result.stdout, result.stderr)
            continue
        out, err = script.with_name(script.name + ".out"), script.with_name(script.name + ".err")
        runs[index] = (int(rc.read_text()), out.read_text(), err.read_text() + result.stderr)
    return runs


@pytest.mark.parametrize("index", SINGLE)
def test_python_snippet_runs_as_written(index, snippet_runs):
    code = BLOCKS[index]
    returncode, stdout, stderr = snippet_runs[index]
    assert returncode == 0, code + "\n----\n" + stderr[-3000:]
    for expected in _expected_prints(code):
        assert expected in stdout, (expected, stdout[-2000:])


@pytest.mark.distributed
@pytest.mark.parametrize("index", [i for i, b in enumerate(BLOCKS) if "torchrun --nproc_per_node" in b])
def test_launcher_snippet_runs_under_torchrun(index, tmp_path):
    code = BLOCKS[index]
    ranks = int(re.search(r"torchrun --nproc_per_node (\d+)", code).group(1))
    script = tmp_path / f"snippet_{index}.py"
    script.write_text(code)
    result = torchrun([str(script)], nproc=ranks, timeout=300)
    assert result.returncode == 0, code + "\n----\n" + result.stdout[-3000:] + result.stderr[-3000:]
    for expected in _expected_prints(code):
        assert result.stdout.count(expected) == ranks, (expected, result.stdout[-2000:])


@pytest.mark.distributed
@pytest.mark.parametrize("index", [i for i, b in enumerate(BLOCKS) if "msrun --worker_num" in b.splitlines()[0]])
def test_launcher_snippet_runs_under_msrun(index, tmp_path):
    code = BLOCKS[index]
    ranks = int(re.search(r"msrun --worker_num=(\d+)", code.splitlines()[0]).group(1))
    script = tmp_path / f"snippet_{index}.py"
    script.write_text(code)
    result = msrun([str(script)], log_dir=str(tmp_path / "logs"), nproc=ranks, timeout=300)
    assert result.returncode == 0, code + "\n----\n" + result.worker_logs[-4000:]
    for expected in _expected_prints(code):
        assert result.worker_logs.count(expected) == ranks, (expected, result.worker_logs[-2000:])
