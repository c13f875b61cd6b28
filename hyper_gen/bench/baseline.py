"""``hyper-gen bench engine --baseline PATH``: the same scenario run by another checkout, side by side.

For each (backend, scenario) this tree has measured, the checkout at PATH runs it too, in a
subprocess: the same python, ``PYTHONPATH=PATH`` and ``PATH`` as its working directory (so
``python -m hyper_gen.bench`` and every ``hyper_gen`` import come from PATH, not from this tree nor
the installed package), one backend, one scenario, the same flags. Its numbers come back as the
``bench-engine-json:`` lines of ``--json``; a checkout from before ``--json`` existed is read from
the lines it prints instead (``OLD_OUTPUT``: the five scenarios it had, in the format they kept
until ``--json`` came). Only the flags PATH's ``bench/engine.py`` mentions are passed on. A
scenario PATH does not know, a run that fails or times out, or output it cannot read is "n/a",
with the reason, and the run goes on.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import os
import re
import subprocess
import sys
from typing import Dict, List, Optional, Tuple

JSON_PREFIX = "bench-engine-json: "
ENGINE_SOURCE = os.path.join("hyper_gen", "bench", "engine.py")

_NUM = r"([-+]?(?:\d+(?:\.\d*)?(?:[eE][-+]?\d+)?|nan|inf))"

# what a checkout without --json printed, scenario -> [(pattern, labels of its groups)]; the labels
# are those the scenarios of this tree return (engine.py), so the two sides line up
OLD_OUTPUT = {
    "prefix": [
        (rf"prefix-cached tokens {_NUM}", ["prefix-cached tokens"]),
        (rf"caching off:\s+{_NUM} tok/s\s+TTFT p50\s+{_NUM} ms", ["tok/s caching off", "TTFT p50 ms caching off"]),
        (rf"caching on:\s+{_NUM} tok/s\s+TTFT p50\s+{_NUM} ms", ["tok/s caching on", "TTFT p50 ms caching on"]),
    ],
    "memory": [
        (rf"peak bytes of blocks in use:\s+{_NUM} MiB", ["peak MiB blocks in use"]),
        (rf"peak bytes of live tokens:\s+{_NUM} MiB\s+->\s+{_NUM}x", ["peak MiB live tokens", "blocks in use / live"]),
        (rf"a ragged cache's peak:\s+{_NUM} MiB", ["peak MiB ragged cache"]),
    ],
    "chunked": [
        (rf"its first token after {_NUM} s", ["long prompt's first token s"]),
        (rf"inter-token latency p50 {_NUM} ms, p99 {_NUM} ms", ["ITL p50 ms", "ITL p99 ms"]),
    ],
    "grpo": [
        (rf"engine:\s+{_NUM} tok/s", ["engine tok/s"]),
        (rf"generate\(num_return_seq=8\):\s+{_NUM} tok/s", ["generate(n=8) tok/s"]),
        (rf"HF generate:\s+{_NUM} tok/s", ["HF generate tok/s"]),
    ],
    "step": [
        (
            rf"batch\s+{rows}: engine step\s+{_NUM} ms, generate step\s+{_NUM} ms",
            [f"{side} step ms b{rows}" for side in ("engine", "generate")],
        )
        for rows in (1, 16)
    ],
}


def checkout(text: str) -> str:
    """An argparse type: a directory holding a hyper_gen checkout with ``bench engine`` scenarios."""
    path = os.path.abspath(os.path.expanduser(text))
    source = os.path.join(path, ENGINE_SOURCE)
    if not os.path.isfile(os.path.join(path, "hyper_gen", "__init__.py")) or not os.path.isfile(source):
        raise argparse.ArgumentTypeError(f"{text!r} is not a hyper_gen checkout (no {ENGINE_SOURCE} there)")
    if declared_scenarios(source) is None:
        raise argparse.ArgumentTypeError(f"{text!r}: its {ENGINE_SOURCE} declares no SCENARIOS")
    return path


def declared_scenarios(source_path: str) -> Optional[Tuple[str, ...]]:
    """The ``SCENARIOS = (...)`` tuple of a checkout's bench/engine.py, read without importing it."""
    try:
        with open(source_path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), source_path)
    except (OSError, SyntaxError, ValueError):
        return None
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "SCENARIOS" for t in node.targets):
            try:
                value = ast.literal_eval(node.value)
            except ValueError:
                return None
            return tuple(value) if isinstance(value, (tuple, list)) else None
    return None


def parse_output(stdout: str, scenario: str) -> Dict[str, float]:
    """The metrics of ``scenario`` in a bench engine run's stdout: its ``--json`` line, else what
    ``OLD_OUTPUT`` reads from the printed lines (empty when neither is there)."""
    for line in stdout.splitlines():
        if line.startswith(JSON_PREFIX):
            record = json.loads(line[len(JSON_PREFIX) :])
            if record.get("scenario") == scenario:
                return {k: float(v) for k, v in record["metrics"].items()}
    metrics = {}
    for pattern, labels in OLD_OUTPUT.get(scenario, []):
        found = re.search(pattern, stdout)
        if found:
            metrics.update(zip(labels, (float(group) for group in found.groups())))
    return metrics


class Baseline:
    """The checkout at ``path``, run one scenario at a time beside this tree's."""

    def __init__(self, path: str, timeout: float):
        self.path, self.timeout = path, timeout
        source = os.path.join(path, ENGINE_SOURCE)
        with open(source, encoding="utf-8") as f:
            self.source = f.read()
        self.scenarios = declared_scenarios(source) or ()
        self.revision = _revision(path)

    def describe(self) -> str:
        kind = "--json" if self.knows("--json") else "its printed lines (no --json there)"
        return f"baseline: {self.path} ({self.revision}), read from {kind}"

    def knows(self, flag: str) -> bool:
        return f'"{flag}"' in self.source

    def argv(self, scenario: str, backend: Optional[str], flags: List[Tuple[str, str]]) -> List[str]:
        argv = [sys.executable, "-m", "hyper_gen.bench", "engine", "--scenarios", scenario]
        if backend is not None:
            argv += ["--backends", backend]
        for flag, value in flags:
            if self.knows(flag):
                argv += [flag, value]
        return argv + (["--json"] if self.knows("--json") else [])

    def run(self, scenario: str, backend: Optional[str], flags) -> Tuple[Optional[Dict[str, float]], str]:
        """(its metrics, "") or (None, why not)."""
        if scenario not in self.scenarios:
            return None, f"its bench engine has no {scenario!r} scenario"
        env = dict(os.environ, PYTHONPATH=self.path)
        try:
            done = subprocess.run(
                self.argv(scenario, backend, flags),
                cwd=self.path,
                env=env,
                capture_output=True,
                text=True,
                timeout=self.timeout,
            )
        except subprocess.TimeoutExpired:
            return None, f"timed out after {self.timeout:g} s (--baseline-timeout)"
        if done.returncode != 0:
            lines = [line for line in done.stderr.splitlines() if line.strip()]
            return None, f"exit {done.returncode}: {lines[-1].strip() if lines else 'no message'}"
        metrics = parse_output(done.stdout, scenario)
        return (metrics, "") if metrics else (None, "no numbers found in its output")

    def compare(self, scenario: str, backend: Optional[str], flags, mine: Dict[str, float]) -> None:
        """Run ``scenario`` at the baseline and print its numbers beside ``mine``."""
        sys.stdout.flush()  # this tree's lines out before the baseline's run, which takes a while
        theirs, why = self.run(scenario, backend, flags)
        if theirs is None:
            print(f"  baseline: n/a ({why})", flush=True)
            return
        title = f"beside the baseline ({self.revision})"
        print(f"  {title:38s}{'this tree':>12s}{'baseline':>12s}{'this/base':>11s}")
        for label in list(mine) + [k for k in theirs if k not in mine]:
            new, old = mine.get(label), theirs.get(label)
            ratio = f"{new / old:10.2f}x" if _finite(new) and _finite(old) and old else f"{'n/a':>11s}"
            print(f"    {label:36s}{_cell(new)}{_cell(old)}{ratio}", flush=True)


def _finite(value) -> bool:
    return value is not None and math.isfinite(value)


def _cell(value) -> str:
    return f"{'n/a':>12s}" if value is None else f"{value:12.4g}"


def _revision(path: str) -> str:
    try:
        done = subprocess.run(
            ["git", "-C", path, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        return "revision unknown"
    return done.stdout.strip() if done.returncode == 0 and done.stdout.strip() else "revision unknown"


__all__ = ["Baseline", "JSON_PREFIX", "checkout", "parse_output"]
