"""Multi-rank behaviour of the core, in real 2-process jobs (torchrun/gloo and msrun)."""

import re

import pytest
from launch import msrun, script, torchrun


def _check(text):
    for rank in (0, 1):
        assert re.search(f"rank {rank}: ValueError: .*different input_ids", text), text[-3000:]
        assert f"rank {rank}: config ValueError" in text, text[-3000:]
        for name in ("greedy", "seeded"):
            assert f"rank {rank}: vocab-parallel {name} equal=True" in text, text[-3000:]
    tokens = re.findall(r"rank (\d): vocab-parallel seeded equal=True tokens=(.*)", text)
    assert len({t for _, t in tokens}) == 1  # both ranks hold the same tokens


@pytest.mark.distributed
def test_torchrun_consistency_and_vocab_gather():
    result = torchrun([script("consistency.py"), "torch"], timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    _check(result.stdout)


@pytest.mark.distributed
def test_msrun_consistency_and_vocab_gather(tmp_path):
    result = msrun([script("consistency.py"), "mindspore"], log_dir=str(tmp_path), timeout=300)
    assert result.returncode == 0, result.worker_logs[-4000:]
    _check(result.worker_logs)
