"""``hyper-gen bench rl``: both parts run on the tiny shape (a real server, a real gloo group with this
bench as the trainer) and print their rows; what is checked is the table, not the numbers."""

import re

import pytest


@pytest.mark.slow
def test_bench_rl_prints_weight_sync_and_endpoint_rows(cli, tmp_path):
    args = ["bench", "rl", "--sync-shape", "tiny", "--serve-shape", "tiny", "--requests", "4", "--max-tokens", "4"]
    result = cli(args + ["--repeats", "1", "--concurrency", "2", "--cache-dir", str(tmp_path)])
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    out = result.stdout
    for pattern in (
        r"^host: ",
        r"^weights: \d+ tensors, \d+ MiB \(tiny shape\) over gloo, best of 1$",
        r"^  one broadcast per tensor:$",
        r"^  one flattened bucket:$",
        r"^    bare torch\.distributed broadcast:\s+[\d.]+ s \([\d.]+ GiB/s\)$",
        r"^    /update_weights_from_distributed:\s+[\d.]+ s -> [\d.]+x the bare broadcast \(bar 1\.5x\)$",
        r"^      HTTP \+ checks [\d.]+ s, broadcasts [\d.]+ s, apply [\d.]+ s$",
        r"^  /v1/completions:\s+[\d.]+ tok/s$",
        r"^  /generate:\s+[\d.]+ tok/s -> [\d.]+x \(bar: no slower\)$",
    ):
        assert re.search(pattern, out, re.M), (pattern, out)


def test_bench_rl_refuses_an_unknown_part_in_one_line(cli):
    result = cli(["bench", "rl", "--parts", "weights,bogus"])
    assert result.returncode == 2
    assert "argument --parts: 'bogus' is not one of weights, generate" in result.stderr
