"""``hyper-gen bench router``: two demo-model workers behind a real sglang-router, both policies, and the
router's overhead with one worker; what is checked is the table, not the numbers."""

import re

import pytest


@pytest.mark.slow
@pytest.mark.distributed
def test_bench_router_prints_both_policies_and_the_overhead(cli):
    args = ["bench", "router", "--workers", "2", "--groups", "2", "--samples", "4", "--max-tokens", "4"]
    result = cli(args + ["--overhead-requests", "4"])
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    out = result.stdout
    for pattern in (
        r"^host: ",
        r"^demo model, 2 workers \(torch\), 2 prompts x 4 samples of 4 tokens",
        r"^  cache_aware\s+[\d.]+%\s+[\d.]+\s+[\d.]+\s+\d+%/\d+%$",
        r"^  round_robin\s+[\d.]+%\s+[\d.]+\s+[\d.]+\s+\d+%/\d+%$",
        r"^  1 worker, one-token completions: [\d.]+ ms through the router, [\d.]+ ms direct: [+-][\d.]+ ms",
    ):
        assert re.search(pattern, out, re.M), (pattern, out)
