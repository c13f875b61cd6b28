"""``hyper_gen.score`` on sharded models, in real 2-rank jobs: one torchrun and one msrun launch.

- tests/dist_scripts/score_sharded_torch.py: the native torch Qwen3.5 loaded ``tp=2`` and an HF
  Qwen3.5 sharded by FSDP2 ``fully_shard``;
- tests/dist_scripts/score_sharded_mindspore.py: the native MindSpore Qwen3.5 loaded ``tp=2`` and
  the ZeRO-3-style stub (every forward all-gathers its weights, ``collective_forward = True``).

Tensor parallel: every rank returns the same bytes, equal to score() on the whole model (float64
within 1e-12; float32 within tests/test_tp_torch.py's 1e-3, the chunked delta rule's float32
rounding); ``prompt_top_logprobs`` (the server's ``prompt_logprobs``) the same. Collective-forward
models: each rank scores its own batch (of its own size), equal to HF's log-softmax of an unsharded
copy (float64, 1e-12) and bit-equal to score() on it. Bad input on one rank only: every rank
raises within seconds (the bad rank its own error, the others one naming it), and the next call
works: no rank is left waiting in a collective.
"""

import json
import re

import pytest
from launch import msrun, script, torchrun
from qwen_checkpoints import make_checkpoint

JOB_TIMEOUT_S = 180
FLOAT64 = 1e-12
FLOAT32 = 1e-3  # TP vs one device, as tests/test_tp_torch.py bounds the logits
PROMPT_FAILURE_S = 5  # a rank with good input raises this soon after its peer refused its own


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("score_sharded"), "dense")


@pytest.fixture(scope="module")
def torch_job(checkpoint):
    """{(rank, check, label): {key: value}} from one 2-rank torchrun job."""
    result = torchrun([script("score_sharded_torch.py"), checkpoint], timeout=JOB_TIMEOUT_S)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    lines = {}
    for rank, check, label, rest in re.findall(r"^rank (\d): (\w+) (\S+) (.*)$", result.stdout, re.M):
        if "message=" in rest:  # free text: everything after it
            head, message = rest.split("message=", 1)
            values = dict(re.findall(r"(\w+)=(\S+)", head), message=message)
        else:
            values = dict(re.findall(r"(\w+)=(\S+)", rest))
        lines[(int(rank), check, label)] = values
    for rank in (0, 1):
        assert (rank, "done", "all") in lines, result.stdout[-4000:]
    return lines


@pytest.fixture(scope="module")
def mindspore_job(checkpoint, tmp_path_factory):
    """{(rank, check): values} from one 2-worker msrun job."""
    logs = tmp_path_factory.mktemp("score_sharded_ms") / "logs"
    result = msrun([script("score_sharded_mindspore.py"), checkpoint], log_dir=str(logs), timeout=JOB_TIMEOUT_S)
    assert result.returncode == 0, result.worker_logs[-6000:]
    rows = {}
    for line in result.worker_logs.splitlines():
        if line.startswith("SCORE "):
            item = json.loads(line[len("SCORE ") :])
            rows[(item.pop("rank"), item.pop("check"))] = item
    for rank in (0, 1):
        assert f"rank {rank}: done" in result.worker_logs, result.worker_logs[-6000:]
    return rows


def _torch(job, check, label):
    for rank in (0, 1):
        assert (rank, check, label) in job, f"no '{check} {label}' line from rank {rank}: {sorted(job)}"
    return job[(0, check, label)], job[(1, check, label)]


def _ms(job, check):
    for rank in (0, 1):
        assert (rank, check) in job, f"no '{check}' report from rank {rank}: {sorted(job)}"
    return job[(0, check)], job[(1, check)]


# ---------------------------------------------------------------------------------------- torch


@pytest.mark.distributed
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_torch_tp_score_equals_single_device_on_every_rank(torch_job, dtype):
    for side in ("left", "right"):  # left: with prompt_lengths
        ranks = _torch(torch_job, "tp", f"{dtype}/{side}")
        assert ranks[0]["digest"] == ranks[1]["digest"]  # the very same bytes on both ranks
        for values in ranks:
            assert values["dtype"] == dtype and values["shape"] == "3x70"
            assert values["zeros_equal"] == "True"
            assert float(values["maxdiff"]) <= (FLOAT64 if dtype == "float64" else FLOAT32), values
    top = _torch(torch_job, "tp_top", dtype)
    assert top[0]["digest"] == top[1]["digest"]
    for values in top:
        assert values["ids_equal"] == values["ranks_equal"] == "True"
        assert max(float(values["chosen"]), float(values["values"])) <= (FLOAT64 if dtype == "float64" else FLOAT32)


@pytest.mark.distributed
def test_torch_tp_bad_input_on_one_rank_raises_on_every_rank(torch_job):
    rank0, rank1 = _torch(torch_job, "tp_error", "oov")
    assert rank1["type"] == "ValueError" and "sequences[1, 69] = 100 is not a token id" in rank1["message"]
    assert rank0["type"] == "ValueError"
    assert rank0["message"].startswith("score() refused the input of rank(s) [1] of the 2-rank model group")
    for values in (rank0, rank1):
        assert float(values["seconds"]) < PROMPT_FAILURE_S
    for values in _torch(torch_job, "tp_error", "mismatch"):  # a different, valid prompt on rank 1
        assert values["type"] == "InconsistentInputs"  # a ValueError whose fields name what differs
        assert values["message"].startswith("score() was called with different input_ids on rank(s) [1]")
    for values in _torch(torch_job, "tp_after", "errors"):  # the ranks are still paired
        assert float(values["maxdiff"]) <= FLOAT32


@pytest.mark.distributed
@pytest.mark.parametrize("label", ["own", "same"])
def test_torch_fsdp_score_equals_hf_log_softmax_on_every_rank(torch_job, label):
    """own: each rank its own batch (2 and 3 rows); same: one batch on both ranks."""
    ranks = _torch(torch_job, "fsdp", label)
    for values in ranks:
        assert values["dtype"] == "float64" and values["zeros_equal"] == "True"
        assert float(values["vs_hf"]) <= FLOAT64, values
        assert float(values["vs_unsharded"]) == 0.0, values  # score() on the unsharded copy, bit for bit
    if label == "own":
        assert (ranks[0]["shape"], ranks[1]["shape"]) == ("2x8", "3x8")
    else:
        assert ranks[0]["digest"] == ranks[1]["digest"]


@pytest.mark.distributed
def test_torch_fsdp_bad_input_on_one_rank_raises_on_every_rank(torch_job):
    rank0, rank1 = _torch(torch_job, "fsdp_error", "oov")
    assert rank1["type"] == "ValueError" and "sequences[0, 7] = 100 is not a token id" in rank1["message"]
    assert rank0["type"] == "RankFailed"
    assert rank0["message"].startswith("score() failed on rank 1 before the forward")
    assert "sequences[0, 7] = 100 is not a token id" in rank0["message"]  # rank 1's own message
    for values in (rank0, rank1):
        assert float(values["seconds"]) < PROMPT_FAILURE_S
    for values in _torch(torch_job, "fsdp_after", "errors"):
        assert float(values["vs_hf"]) <= FLOAT64


# ------------------------------------------------------------------------------------ MindSpore


@pytest.mark.distributed
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_mindspore_tp_score_equals_single_device_on_every_rank(mindspore_job, dtype):
    tolerance = FLOAT64 if dtype == "float64" else FLOAT32
    for side in ("left", "right"):
        ranks = _ms(mindspore_job, f"tp-{dtype}-{side}")
        assert ranks[0]["digest"] == ranks[1]["digest"]
        for values in ranks:
            assert values["dtype"] == dtype and values["shape"] == [3, 70] and values["zeros_equal"]
            assert values["maxdiff"] <= tolerance, values
    top = _ms(mindspore_job, f"tp-top-{dtype}")
    assert top[0]["digest"] == top[1]["digest"]
    for values in top:
        assert values["ids_equal"] and values["ranks_equal"]
        assert max(values["chosen"], values["values"]) <= tolerance, values


@pytest.mark.distributed
def test_mindspore_tp_bad_input_on_one_rank_raises_on_every_rank(mindspore_job):
    rank0, rank1 = _ms(mindspore_job, "tp-error-oov")
    assert rank1["type"] == "ValueError" and "sequences[1, 69] = 100 is not a token id" in rank1["message"]
    assert rank0["type"] == "ValueError"
    assert rank0["message"].startswith("score() refused the input of rank(s) [1] of the 2-rank model group")
    assert max(rank0["seconds"], rank1["seconds"]) < PROMPT_FAILURE_S
    for values in _ms(mindspore_job, "tp-error-mismatch"):
        assert values["type"] == "InconsistentInputs"  # a ValueError whose fields name what differs
        assert values["message"].startswith("score() was called with different input_ids on rank(s) [1]")
    for values in _ms(mindspore_job, "tp-after-errors"):
        assert values["maxdiff"] <= FLOAT32


@pytest.mark.distributed
def test_mindspore_zero3_score_per_rank_batch(mindspore_job):
    rank0, rank1 = _ms(mindspore_job, "zero3-own")
    assert rank0["shape"] == [2, 4] and rank1["shape"] == [3, 6]  # each rank its own batch
    assert rank0["exact"] and rank1["exact"]  # equal to score() on the unsharded twin
    rank0, rank1 = _ms(mindspore_job, "zero3-error-oov")
    assert rank1["type"] == "ValueError" and "sequences[0, 5] = 67 is not a token id" in rank1["message"]
    assert rank0["type"] == "RankFailed" and rank0["message"].startswith("score() failed on rank 1 before the forward")
    assert "sequences[0, 5] = 67 is not a token id" in rank0["message"]
    assert max(rank0["seconds"], rank1["seconds"]) < PROMPT_FAILURE_S
    assert all(values["exact"] for values in _ms(mindspore_job, "zero3-after-errors"))
