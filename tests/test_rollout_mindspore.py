"""Step-synced generate on MindSpore under msrun: a ZeRO-3-style model (issue 11, the MindSpore half).

The model (tests/zero3_mindspore.py) keeps half of every weight's rows on each of 2 ranks and
all-gathers them inside every forward, declaring ``collective_forward = True``; its twin holds the
whole weights and runs no collective. Each rank has its own left-padded prompts, and rank 0's
rows reach EOS 8 steps before rank 1's (greedy): without step-syncing, rank 1's next forward
waits in an all-gather rank 0 never joins.

One msrun job (tests/dist_scripts/rollout_ms_synced.py, about 20 s) reports every synced check.
Two more (rollout_ms_timeouts.py, about 22 s each, a 5 s collective timeout; one case per job, as
a timed-out MindSpore CPU collective leaves the job's communication unusable) show the failures
only the collective timeout ends: ``synced_gpus=False`` on the same run, and a rank raising
inside a forward.
"""

import json

import pytest
from launch import msrun, script
from zero3_mindspore import PROMPTS

SYNC_TIMEOUT_S = 20  # the job's collective timeout: a failure must reach every rank well before it
PROMPT_FAILURE_S = 8  # "promptly": a failed rank's peers raise within this, not after a timeout


def _reports(result):
    rows = {}
    for line in result.worker_logs.splitlines():
        if line.startswith("ROLLOUT "):
            item = json.loads(line[len("ROLLOUT ") :])
            rows.setdefault(item["check"], {})[item.pop("rank")] = item
    return rows


def _msrun(name, tmp, timeout_s, timeout, *args):
    """msrun of dist script ``name`` with the collective timeout ``timeout_s`` (launch.msrun's
    environment is a copy of this process's)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HYPER_GEN_TIMEOUT_S", str(timeout_s))
        return msrun([script(name)] + list(args), log_dir=str(tmp / "logs"), timeout=timeout)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """check -> {rank: reported values}, from one 2-worker msrun job."""
    result = _msrun("rollout_ms_synced.py", tmp_path_factory.mktemp("rollout_ms"), SYNC_TIMEOUT_S, 240)
    assert result.returncode == 0, result.worker_logs[-6000:]
    for rank in (0, 1):
        assert f"rank {rank}: done" in result.worker_logs, result.worker_logs[-6000:]
    return _reports(result)


def _both(report, check):
    ranks = report[check]
    assert sorted(ranks) == [0, 1], (check, ranks)
    return ranks[0], ranks[1]


def _steps(item, rank):
    """How many tokens this rank generated for its longest row (its step count)."""
    return max(len(row) - len(p) for row, p in zip(_unpadded(item["tokens"]), PROMPTS[rank]))


def _unpadded(rows):
    """Rows as [prompt | generated]: the output pads with 0 on the right, and no row here ends in a 0."""
    out = []
    for row in rows:
        row = list(row)
        while row and row[-1] == 0:
            row.pop()
        out.append(row)
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("check", ["greedy", "greedy-unshard", "greedy-after-errors"])
def test_greedy_tokens_equal_the_unsharded_twin_on_each_ranks_prompts(report, check):
    for rank, item in enumerate(_both(report, check)):
        assert item["tokens"] == item["alone"], (rank, item)
        assert len(item["tokens"]) == len(PROMPTS[rank])


@pytest.mark.distributed
@pytest.mark.parametrize("check", ["greedy", "greedy-unshard", "greedy-after-errors"])
def test_the_early_rank_keeps_stepping_with_dummy_forwards(report, check):
    """Rank 0 is done after 4 tokens, rank 1 after 12: rank 0 makes 3 cached decode steps, then
    8 one-token dummy forwards (no cache), so both ranks call forward 12 times and their
    all-gathers pair up; rank 1 never makes a dummy step."""
    first, second = _both(report, check)
    early, late = _steps(first, 0), _steps(second, 1)
    assert (early, late) == (4, 12), (early, late)
    assert late - early >= 3  # several steps earlier
    assert first["calls"] == {"prefill": 1, "decode": early - 1, "dummy": late - early}
    assert second["calls"] == {"prefill": 1, "decode": late - 1}
    assert first["order"] == ["prefill"] + ["decode"] * (early - 1) + ["dummy"] * (late - early)
    assert len(first["order"]) == len(second["order"])
    for rank, item in enumerate((first, second)):
        print(f"{check}: rank {rank} forwards {item['calls']} in {item['seconds']} s")


@pytest.mark.distributed
@pytest.mark.parametrize("check", ["seeded", "seeded-unshard", "samples"])
def test_seeded_sampling_equals_the_twin_on_the_concatenated_batch(report, check):
    """Seeded noise is keyed by the global row: rank 1's rows draw as rows 2, 3, 4 of the twin
    run on both ranks' prompts together (different widths: compare up to this rank's width);
    with 2 samples per prompt ("samples"), as rows 4..9 of the twin's 10."""
    samples = 2 if check == "samples" else 1
    for rank, item in enumerate(_both(report, check)):
        assert len(item["tokens"]) == samples * len(PROMPTS[rank])
        width = len(item["tokens"][0])
        for mine, together in zip(item["tokens"], item["together"]):
            assert together[:width] == mine, (rank, item)
            assert set(together[width:]) <= {0}, (rank, item)
    # the offset matters: run alone (rows 0, 1, 2), rank 1 would have drawn other tokens
    assert _both(report, check)[1]["tokens"] != _both(report, check)[1]["alone"]


@pytest.mark.distributed
def test_unshard_params_gathers_the_weights_once(report):
    """unshard_params=True: the model's unshard() gathers each weight once for the call, and its
    forwards gather nothing; without it every forward (dummy steps too) gathers every weight."""
    for check in ("greedy", "seeded"):
        for item in _both(report, check):
            assert item["gathers"] == item["weights"] * sum(item["calls"].values()), item
        for item in _both(report, f"{check}-unshard"):
            assert item["gathers"] == item["weights"], item
        per_call = [report[check][r]["gathers"] for r in (0, 1)]
        once = [report[f"{check}-unshard"][r]["gathers"] for r in (0, 1)]
        print(f"{check}: all-gathers per generate {per_call} -> {once} with unshard_params=True")


@pytest.mark.distributed
def test_bad_input_on_one_rank_fails_both_before_any_forward(report):
    """Rank 1 has a token id outside the vocabulary: it raises its ValueError, rank 0 a ValueError
    naming rank 1 and its message, both at once (before any forward, so no all-gather waits)."""
    first, second = _both(report, "bad-token")
    assert second["error_type"] == "ValueError" and "is not a token id of the model's vocabulary" in second["message"]
    assert first["is_value_error"] and first["error_type"] == "RankFailed", first
    assert "failed on rank 1 before generating" in first["message"] and second["message"] in first["message"]
    for item in (first, second):
        assert item["calls"] == {} and item["gathers"] == 0, item
        assert item["seconds"] < PROMPT_FAILURE_S, item
    print(f"bad token on rank 1: rank 0 raised after {first['seconds']} s, rank 1 after {second['seconds']} s")


@pytest.mark.distributed
def test_a_rank_raising_between_forwards_stops_both_at_that_step(report):
    """Rank 1's logits processor raises at step 3 (rank 0's rows are finishing there): rank 0
    raises a ValueError naming rank 1 and the message at the same step's exchange."""
    first, second = _both(report, "processor-raises")
    assert second["error_type"] == "ValueError" and second["message"] == "rank 1's logits processor gave up at step 3"
    assert first["is_value_error"] and first["error_type"] == "RankFailed", first
    assert "failed on rank 1 during generation" in first["message"] and second["message"] in first["message"]
    for item in (first, second):
        assert item["calls"] == {"prefill": 1, "decode": 3}, item
        assert item["seconds"] < PROMPT_FAILURE_S, item


TIMEOUT_S = 5  # the collective timeout of the two jobs below


def _timeout_case(tmp_path, case):
    """{rank: report} of one rollout_ms_timeouts.py job (a job per case: after a MindSpore CPU
    collective timed out, the job's next collectives fail too)."""
    result = _msrun("rollout_ms_timeouts.py", tmp_path, TIMEOUT_S, 150, case, str(tmp_path))
    assert result.returncode == 0, result.worker_logs[-6000:]
    return _both(_reports(result), case)


@pytest.mark.distributed
def test_unsynced_ranks_leave_the_late_rank_waiting_until_the_collective_timeout(tmp_path):
    """synced_gpus=False on the same model and prompts: rank 0 returns after its 4th token, and
    rank 1's next forward waits in an all-gather nobody joins until MS_CPU_COMM_OP_TIMEOUT (5 s)
    fails it: what step-syncing prevents (with MindSpore's default 30 s, or HCCL's on Ascend, longer)."""
    first, second = _timeout_case(tmp_path, "unsynced")
    assert first["error_type"] is None and first["calls"] == {"prefill": 1, "decode": 3}, first
    assert second["error_type"] == "RuntimeError" and "AllGather" in second["message"], second
    assert second["calls"] == {"prefill": 1, "decode": 4}, second  # stuck in the 4th decode step's gather
    assert TIMEOUT_S - 0.5 <= second["seconds"] <= 3 * TIMEOUT_S, second
    print(f"unsynced: rank 0 returned in {first['seconds']} s; rank 1 failed after {second['seconds']} s")


@pytest.mark.distributed
def test_a_rank_raising_inside_a_forward_fails_its_peer_within_the_collective_timeout(tmp_path):
    """Step-synced, but the model declares no vocab_size: rank 1's bad token id raises inside its
    prefill (after the forward's all-gathers), so no exchange can report it; rank 0 waits at the
    step's exchange until the collective timeout, which names itself, once (not twice)."""
    first, second = _timeout_case(tmp_path, "forward-raises")
    assert second["error_type"] == "RuntimeError" and "input_indices" in second["message"], second
    assert second["seconds"] < PROMPT_FAILURE_S, second
    assert first["error_type"] == "TimeoutError" and f"MS_CPU_COMM_OP_TIMEOUT={TIMEOUT_S} s" in first["message"]
    assert first["calls"] == second["calls"] == {"prefill": 1}, (first, second)
    assert TIMEOUT_S - 0.5 <= first["seconds"] <= 1.8 * TIMEOUT_S, first
    print(f"forward raises on rank 1: rank 0 timed out after {first['seconds']} s")
