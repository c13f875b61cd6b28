"""``Engine.update_weights`` on a TP=2 engine (issue 26): one real launch per backend, torchrun (gloo)
and msrun, of tests/dist_scripts/engine_tp_update.py on two tiny Qwen3.5 checkpoints of the same
shape (random seeds 0 and 1), every update called on both ranks with the full tensors.

After the update the engine's greedy tokens equal single-device generate() on a fresh load of the
second checkpoint, and rank 0's outputs carry its weight_version (a request running through the
update too). A NaN on rank 1 only, a conversion failing on rank 1 only, a differing version and a
tensor rank 1 leaves out are each a ValueError on both ranks naming rank 1 and what was wrong, and
the model keeps its weights (the same tokens after). A trainer that never calls does not hang its
peers: rank 0's call fails naming rank 1 once rank 1's engine.update_timeout_s passes, and rank 1's
lone call fails with TimeoutError. A last update, between pause("keep") and resume(), brings the
first checkpoint's tokens back, and one more goes to a second engine stepped by rank 0's caller
(start(background=False)).
"""

import json
import re

import pytest
from launch import msrun, script, torchrun
from qwen_checkpoints import make_checkpoint

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp_update")
    return make_checkpoint(root, "dense", seed=0), make_checkpoint(root, "dense", seed=1)


def _results(log):
    found = {}
    for rank in (0, 1):
        match = re.search(rf"rank {rank}: RESULT (.+)", log)
        assert match, log[-6000:]
        found[rank] = json.loads(match.group(1))
    return found[0], found[1]


def _check(r0, r1):
    refs_old, refs_new = r0["ref_old"], r0["ref_new"]
    assert r0["refs_differ"], (refs_old, refs_new)
    assert r0["tokens_old"] == [refs_old, [None, None]], r0
    # applied on both ranks: the second checkpoint's tokens, the version on every output and rank
    for rank, r in enumerate((r0, r1)):
        assert r["new"][:3] == ["ok", r0["count"], 1], (rank, r["new"])
    assert r0["running"] == [1, 40], r0["running"]
    assert r0["tokens_new"] == [refs_new, [1, 1]], r0
    # refused on both ranks, naming rank 1 and the error; nothing written anywhere
    refused = {
        "nan": ["rank 1", "'model.layers.0.mlp.down_proj.weight' has non-finite values (1 NaN"],
        "convert": ["rank 1", "RuntimeError: injected conversion failure"],
        "version": ["rank 1", "version=40 differs from rank 0's version=4"],
        "names": ["rank 1", "names differ", "'model.layers.2.mlp.up_proj.weight'"],
    }
    for label, words in refused.items():
        for rank, r in enumerate((r0, r1)):
            kind, message, version = r[label][:3]
            assert kind == "ValueError" and version == 1, (label, rank, r[label])
            assert "no rank wrote its weights" in message and all(w in message for w in words), (label, message)
            assert "rank 0:" not in message, (label, message)  # rank 0 converted fine
    for label in ("after_nan", "after_convert", "after_mismatch"):
        assert r0[label] == [refs_new, [1, 1]], (label, r0[label])
    # bounded waits: rank 1's trainer skips one update, then calls one rank 0 never makes
    kind, message, version, seconds = r0["missed"]
    assert kind == "ValueError" and version == 1 and seconds < 30, r0["missed"]
    assert "rank 1: update_weights was not called on rank 1 within 2 s" in message, message
    assert r1["warned"], r1
    kind, late, version, seconds = r1["late"]
    assert kind == "ValueError" and late == message and seconds < 1, r1["late"]  # rank 0's error, at once
    kind, message, version, seconds = r1["alone"]
    assert kind == "TimeoutError" and "rank 0 applied no update within 2 s" in message, r1["alone"]
    assert 1.5 < seconds < 15 and version == 1, r1["alone"]
    # and the engine goes on: the first checkpoint's weights again
    for rank, r in enumerate((r0, r1)):
        assert r["old"][:3] == ["ok", r0["count"], 7], (rank, r["old"])
    assert r0["tokens_old_again"] == [refs_old, [7, 7]] and r0["held"] == [7, 30], r0
    # an engine stepped by rank 0's caller: the update between two steps, in a plan of its own
    for rank, r in enumerate((r0, r1)):
        assert r["stepped"][:3] == ["ok", r0["count"], 8], (rank, r["stepped"])
    assert r0["stepped_running"] == 8 and r0["stepped_new"] == [refs_new[0], 8], r0


def test_torch_tp2_update_weights_on_every_rank(checkpoints, tmp_path):
    old, new = checkpoints
    result = torchrun([script("engine_tp_update.py"), "torch", old, new, str(tmp_path)], timeout=240)
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-6000:]
    r0, r1 = _results(log)
    print(f"torch TP=2 update job: {r0['seconds']} s on rank 0")
    _check(r0, r1)


def test_mindspore_tp2_update_weights_on_every_rank(checkpoints, tmp_path):
    old, new = checkpoints
    args = [script("engine_tp_update.py"), "mindspore", old, new, str(tmp_path)]
    result = msrun(args, log_dir=str(tmp_path / "logs"), timeout=300)
    log = result.worker_logs
    assert result.returncode == 0, (result.stdout + log)[-6000:]
    r0, r1 = _results(log)
    print(f"MindSpore TP=2 update job: {r0['seconds']} s on rank 0")
    _check(r0, r1)
