"""``hyper-gen bench engine``: the issue-43 scenarios (long, mixed, text) run and print their rows, and
``--baseline`` runs a scenario from another checkout and prints it beside this tree's, or says why not.

Tiny sizes (the ``tiny`` shape, 2 rows, 64-token contexts, short text streams): what is checked is the
table, not the numbers. The baseline checkouts here are fakes whose ``python -m hyper_gen.bench``
prints canned output, so no second framework import is paid."""

import json
import math
import re
import textwrap

import pytest

from hyper_gen.bench.baseline import JSON_PREFIX, parse_output
from hyper_gen.bench.engine import SCENARIOS

TINY = ["--shape", "tiny", "--rows", "2", "--context", "64", "--new-tokens", "8", "--max-num-batched-tokens", "32"]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("bench-engine-checkpoints"))


def _records(stdout):
    return [json.loads(line[len(JSON_PREFIX) :]) for line in stdout.splitlines() if line.startswith(JSON_PREFIX)]


def test_new_scenarios_print_their_rows(cli, cache_dir):
    args = ["bench", "engine", "--scenarios", "long,mixed,text", "--text-lengths", "16,64", "--json"]
    result = cli(args + TINY + ["--cache-dir", cache_dir])
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert out.count("host: ") == 1, out
    for pattern in (
        r"^== text \(no model\)$",
        r"^text: output processing \(IncrementalText, stop strings \['\\n\\n'\], the demo tokenizer\) per token$",
        r"^\s+16 tokens:\s+[\d.]+ us/token \(4 streams\)$",
        r"^\s+64 tokens:\s+[\d.]+ us/token \(1 stream\) -> [\d.]+x that at 16 \(bar 1\.2x\)$",
        r"^== torch$",
        r"^long: 2 rows x 64-token prompts decoding 8 tokens; median decode step$",
        r"^  engine step\s+[\d.]+ ms, generate\(\) static-cache step\s+[\d.]+ ms -> [\d.]+x \(bar 1\.05x\)$",
        r"^mixed: 2 rows decoding 96 tokens each while one 64-token prompt is chunked in "
        r"\(max_num_batched_tokens 32\)$",
        r"^  whole workload: 194 tokens in [\d.]+ s ->\s+[\d.]+ tok/s$",
        r"^  running rows' inter-token latency p50 [\d.]+ ms, p99 [\d.]+ ms$",
    ):
        assert re.search(pattern, out, re.M), (pattern, out)
    records = {(r["backend"], r["scenario"]): r["metrics"] for r in _records(out)}
    assert list(records) == [(None, "text"), ("torch", "long"), ("torch", "mixed")]
    assert list(records[None, "text"]) == ["us/token at 16", "us/token at 64", "64/16 per token"]
    assert list(records["torch", "long"]) == ["engine step ms", "generate static step ms", "engine/generate"]
    assert list(records["torch", "mixed"]) == ["tok/s", "ITL p50 ms", "ITL p99 ms"]
    assert all(v > 0 and math.isfinite(v) for metrics in records.values() for v in metrics.values()), records


def test_a_baseline_that_is_not_a_checkout_is_one_line_exit_2(cli, tmp_path):
    result = cli(["bench", "engine", "--baseline", tmp_path])
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines == [
        f"hyper-gen bench engine: error: argument --baseline: '{tmp_path}' is not a hyper_gen checkout "
        "(no hyper_gen/bench/engine.py there)"
    ], result.stderr


def test_the_new_scenarios_are_listed_and_checked():
    assert {"long", "mixed", "structured", "text"} <= set(SCENARIOS)


def _fake_checkout(root, scenarios, main_body):
    """A directory that passes for a hyper_gen checkout: its ``python -m hyper_gen.bench`` runs ``main_body``."""
    bench = root / "hyper_gen" / "bench"
    bench.mkdir(parents=True)
    (root / "hyper_gen" / "__init__.py").write_text("")
    (bench / "__init__.py").write_text("")
    flags = '"--text-lengths", "--json"' if "json" in main_body else '"--shape"'
    (bench / "engine.py").write_text(f"SCENARIOS = {scenarios!r}\nFLAGS = ({flags})\n")
    (bench / "__main__.py").write_text("import json, os, sys\n" + textwrap.dedent(main_body))
    return root


def test_baseline_numbers_are_printed_beside_this_trees(cli, tmp_path):
    # a checkout with --json: it is run from its own folder, gets the flags it knows, answers in JSON
    body = """
        here = os.path.realpath(os.environ["PYTHONPATH"])
        assert os.path.realpath(os.getcwd()) == here, (os.getcwd(), here)
        assert "--text-lengths" in sys.argv and "--rows" not in sys.argv, sys.argv
        assert sys.argv[sys.argv.index("--scenarios") + 1] == "text" and sys.argv[-1] == "--json", sys.argv
        metrics = {"us/token at 16": 2.0, "us/token at 32": 4.0, "32/16 per token": 2.0}
        print("bench-engine-json: " + json.dumps({"backend": None, "scenario": "text", "metrics": metrics}))
    """
    fake = _fake_checkout(tmp_path / "json", ("prefix", "text"), body)
    result = cli(["bench", "engine", "--scenarios", "text", "--text-lengths", "16,32", "--baseline", fake])
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert re.search(rf"^baseline: {re.escape(str(fake))} \(revision unknown\), read from --json$", out, re.M), out
    assert re.search(r"^  beside the baseline \(revision unknown\)\s+this tree\s+baseline\s+this/base$", out, re.M)
    for label, theirs in (("us/token at 16", 2), ("us/token at 32", 4), ("32/16 per token", 2)):
        assert re.search(rf"^    {re.escape(label)}\s+[\d.e+-]+\s+{theirs}\s+[\d.]+x$", out, re.M), (label, out)


def test_a_baseline_without_the_scenario_or_failing_reads_na(cli, tmp_path):
    old = _fake_checkout(tmp_path / "old", ("prefix", "step"), "sys.exit(3)")
    result = cli(["bench", "engine", "--scenarios", "text", "--text-lengths", "16,32", "--baseline", old])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "  baseline: n/a (its bench engine has no 'text' scenario)" in result.stdout.splitlines(), result.stdout
    failing = _fake_checkout(tmp_path / "failing", ("text",), "print('boom', file=sys.stderr); sys.exit(3)")
    result = cli(["bench", "engine", "--scenarios", "text", "--text-lengths", "16,32", "--baseline", failing])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "  baseline: n/a (exit 3: boom)" in result.stdout.splitlines(), result.stdout


# what a checkout from before --json printed (837b08c's format), and the numbers read from it
OLD_STDOUT = """\
host: AMD EPYC; ISA avx2+fma; 2 cores available
== torch
prefix: 32 x (512 shared + 32 own) tokens, 32 new each; prefix-cached tokens 15872
  caching off:    812.3 tok/s  TTFT p50   1234.5 ms
  caching on:    2101.0 tok/s  TTFT p50    210.1 ms
  -> throughput 2.59x (bar 3x), TTFT p50 5.88x lower (bar 5x)
memory: 64 requests, prompts 17..1017 tokens, 8 new each (12.3 s)
  peak bytes of blocks in use:    70.25 MiB
  peak bytes of live tokens:      68.50 MiB  -> 1.026x (bar 1.15x)
  a ragged cache's peak:         130.00 MiB  -> 1.90x
chunked prefill: 16 rows decoding, one 4096-token prompt arrives (max_num_batched_tokens 2048); \
its first token after 1.25 s
  running rows' inter-token latency p50 30.5 ms, p99 412.0 ms -> p99 13.51x p50 (bar 3x); longest gap 430 ms
grpo: 16 prompts x n=8, 64 prompt tokens, 32 new each (4096 tokens)
  engine:                        1500.0 tok/s
  generate(num_return_seq=8):    1200.0 tok/s  -> engine 1.25x
  HF generate:                    300.0 tok/s  -> engine 5.00x
step: one decode step (256-token prompts), the paged engine's vs generate()'s with a dynamic cache
  batch  1: engine step   12.50 ms, generate step   11.00 ms -> paging costs +13.6% (bar +10%)
  batch 16: engine step   40.00 ms, generate step   38.00 ms -> paging costs +5.3% (bar +10%)
"""


def test_a_baseline_without_json_is_read_from_its_printed_lines():
    assert parse_output(OLD_STDOUT, "prefix") == {
        "prefix-cached tokens": 15872,
        "tok/s caching off": 812.3,
        "TTFT p50 ms caching off": 1234.5,
        "tok/s caching on": 2101.0,
        "TTFT p50 ms caching on": 210.1,
    }
    assert parse_output(OLD_STDOUT, "memory") == {
        "peak MiB blocks in use": 70.25,
        "peak MiB live tokens": 68.5,
        "blocks in use / live": 1.026,
        "peak MiB ragged cache": 130.0,
    }
    assert parse_output(OLD_STDOUT, "chunked") == {
        "long prompt's first token s": 1.25,
        "ITL p50 ms": 30.5,
        "ITL p99 ms": 412.0,
    }
    assert parse_output(OLD_STDOUT, "grpo") == {
        "engine tok/s": 1500.0,
        "generate(n=8) tok/s": 1200.0,
        "HF generate tok/s": 300.0,
    }
    assert parse_output(OLD_STDOUT, "step") == {
        "engine step ms b1": 12.5,
        "generate step ms b1": 11.0,
        "engine step ms b16": 40.0,
        "generate step ms b16": 38.0,
    }
    assert parse_output(OLD_STDOUT, "long") == {}


def test_structured_scenario_prints_free_and_held_steps(cli, cache_dir):
    result = cli(["bench", "engine", "--scenarios", "structured", "--json"] + TINY + ["--cache-dir", cache_dir])
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert re.search(r"^structured: a decode step \(64-token prompts\) with every row held to a JSON schema", out, re.M)
    for rows in (1, 16):
        line = rf"^  batch {rows:2d}: free\s+[\d.]+ tok/s, JSON schema\s+[\d.]+ tok/s -> the schema costs [\d.]+x"
        assert re.search(line, out, re.M), out
    (record,) = _records(out)
    assert list(record["metrics"]) == ["free tok/s b1", "schema tok/s b1", "free tok/s b16", "schema tok/s b16"]
