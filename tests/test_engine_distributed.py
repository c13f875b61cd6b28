"""The engine across ranks: a real torchrun TP=2 job on the demo model (tests/dist_scripts/engine_tp.py).
Rank 0's outputs equal single-device generate with requests arriving mid-run; the other rank follows
rank 0's steps and leaves when rank 0 shuts down."""

import json
import re

import pytest
from launch import script, torchrun


@pytest.mark.distributed
def test_engine_tp2_rank0_equals_single_device_generate():
    result = torchrun([script("engine_tp.py")], timeout=240)
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-4000:]
    found = re.search(r"rank 0: RESULT (.+)", log)
    assert found, log[-4000:]
    checks = json.loads(found.group(1))
    assert checks["greedy"] == [True] * 8, checks
    assert checks["seeded"] and checks["unseeded"] and checks["after_cancel"], checks
    assert checks["grammar"] == [True, True], checks  # every rank masks alike: rank 0's = generate()'s
    assert json.loads(checks["grammar_text"][0])["n"] >= 0 and re.fullmatch(
        "[0-9]{3} (yes|no)", checks["grammar_text"][1]
    )
    assert checks["stop"] == " 654" and checks["cancel"] == "abort", checks
    assert re.search(r"rank 1: FOLLOWER", log), log[-4000:]
