"""Every Python snippet in README.md runs as written, and prints what its comments say.

A snippet whose first line names a launcher (``# torchrun --nproc_per_node 2 ...``) runs under
torchrun with that many ranks. ``print(...)  # <expected>`` comments are checked against the
output, so the README's claims are tested, not only its syntax.
"""

import os
import re
import subprocess
import sys

import pytest
from launch import REPO, _env, torchrun

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


@pytest.mark.parametrize("index", [i for i, b in enumerate(BLOCKS) if "torchrun --nproc_per_node" not in b])
def test_python_snippet_runs_as_written(index, tmp_path):
    code = BLOCKS[index]
    script = tmp_path / f"snippet_{index}.py"
    script.write_text(code)
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=_env(), cwd=tmp_path
    )
    assert result.returncode == 0, code + "\n----\n" + result.stderr[-3000:]
    for expected in _expected_prints(code):
        assert expected in result.stdout, (expected, result.stdout[-2000:])


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
