"""``generate()`` refusing bad input given on ONE rank of a split model: every rank raises, within
seconds, before any forward, and the next call on the same model returns the tokens it gave before.
One torchrun and one msrun launch:

- tests/dist_scripts/generate_refusals_torch.py: the native torch Qwen3.5 loaded ``tp=2`` (a
  model-parallel group), an HF Qwen3.5 sharded by FSDP2 ``fully_shard`` (step-synced: collective
  forwards, each rank its own batch), and a multi-rank Engine's ``submit`` on rank 1;
- tests/dist_scripts/generate_refusals_mindspore.py: the native MindSpore Qwen3.5 loaded ``tp=2``.

Refused on rank 1 only (a wrong attention_mask shape, an id outside the vocabulary, a bad config
value, an unknown option, too many rows, stop_strings without the tokenizer): rank 1 raises its own
error; rank 0 a ValueError naming rank 1 (tensor parallel: "refused the input of rank(s) [1]"; FSDP:
RankFailed carrying rank 1's message). Valid on both ranks but different (num_return_sequences,
stop_strings, logits_processor, synced_gpus): on a model-parallel group every rank raises the same
ValueError naming the fields and rank 1; on FSDP each rank's own call is legitimate and runs.
Before this, a rank that refused its input raised alone, and its peer went on into a forward: a
"Connection reset" desync or a wait for the collective timeout, and synced_gpus on one rank only
crashed the job.
"""

import json
import re

import pytest
from launch import msrun, script, torchrun
from qwen_checkpoints import make_checkpoint

JOB_TIMEOUT_S = 120
REFUSAL_S = 5  # a rank with good input raises this soon after its peer refused its own

# refused on rank 1 only: (rank 1's error type, what its message says)
REFUSED = {
    "mask_shape": ("ValueError", "attention_mask shape (3, 7) != input_ids shape (3, 8)"),
    "oov": ("ValueError", "input_ids[2, 7] = 100 is not a token id of the model's vocabulary of 97 tokens"),
    "config": ("ValueError", "top_k must be >= 0, got -1"),
    "unknown_kwarg": ("TypeError", "unknown generation option(s) ['max_new_tokenz']"),
    "rows": ("ValueError", "num_return_sequences=65536 = 196608 rows, more than hyper_gen.config.MAX_ROWS"),
    "stop_tokenizer": ("ValueError", "stop_strings=['@@@@'] needs the tokenizer"),
}
# valid on both ranks, different on rank 1: the fields a model-parallel group names
DIFFERS = {
    "n_differs": "do_sample, seed, num_return_sequences",
    "stop_differs": "stop_strings",
    "processor_differs": "logits_processor",
    "synced_differs": "synced_gpus",
}
TP_REFUSAL = "generate() refused the input of rank(s) [1] of the 2-rank model group before any forward"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("generate_refusals"), "dense")


@pytest.fixture(scope="module")
def torch_job(checkpoint):
    """{(rank, check, label): {key: value}} from one 2-rank torchrun job."""
    result = torchrun([script("generate_refusals_torch.py"), checkpoint], timeout=JOB_TIMEOUT_S)
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
    """The same shape of dict from one 2-worker msrun job."""
    logs = tmp_path_factory.mktemp("generate_refusals_ms") / "logs"
    # refusals and the tokens after them, not decode speed: PyNative (compiling each batch size was most of the job)
    job = [script("generate_refusals_mindspore.py"), checkpoint]
    result = msrun(job, log_dir=str(logs), timeout=JOB_TIMEOUT_S, env={"HYPER_GEN_MINDSPORE_JIT": "0"})
    assert result.returncode == 0, result.worker_logs[-6000:]
    lines = {}
    for line in result.worker_logs.splitlines():
        if line.startswith("REFUSAL "):
            item = json.loads(line[len("REFUSAL ") :])
            lines[(item.pop("rank"), item.pop("check"), item.pop("label"))] = item
    for rank in (0, 1):
        assert f"rank {rank}: done" in result.worker_logs, result.worker_logs[-6000:]
    return lines


def _both(job, check, label):
    for rank in (0, 1):
        assert (rank, check, label) in job, f"no '{check} {label}' line from rank {rank}: {sorted(job)}"
    return job[(0, check, label)], job[(1, check, label)]


def _check_tp(job):
    for label, (kind, said) in REFUSED.items():
        rank0, rank1 = _both(job, "tp", label)
        assert rank1["type"] == kind and said in rank1["message"], (label, rank1)
        assert rank0["type"] == "ValueError" and rank0["message"].startswith(TP_REFUSAL), (label, rank0)
        assert max(float(rank0["seconds"]), float(rank1["seconds"])) < REFUSAL_S, (label, rank0, rank1)
    for label, fields in DIFFERS.items():
        for values in _both(job, "tp", label):
            assert values["type"] == "InconsistentInputs", (label, values)  # a ValueError
            assert values["message"].startswith(f"generate() was called with different {fields} on rank(s) [1]")
            assert float(values["seconds"]) < REFUSAL_S
    for label in (*REFUSED, *DIFFERS):  # the ranks are still paired: the next call gives the same tokens
        for values in _both(job, "tp_after", label):
            assert str(values["same"]) == "True", (label, values)
    for values in _both(job, "tp_single", "greedy"):  # and those are the unsplit model's
        assert str(values["same"]) == "True"
    submit = job[(1, "engine", "submit")]  # only rank 0 of a multi-rank engine takes requests
    assert submit["type"] == "RuntimeError" and float(submit["seconds"]) < REFUSAL_S, submit


@pytest.mark.distributed
def test_torch_tp_refusal_on_one_rank_raises_on_every_rank(torch_job):
    _check_tp(torch_job)


@pytest.mark.distributed
def test_torch_fsdp_refusal_on_one_rank_raises_on_every_rank(torch_job):
    for label, (kind, said) in REFUSED.items():
        rank0, rank1 = _both(torch_job, "fsdp", label)
        assert rank1["type"] == kind and said in rank1["message"], (label, rank1)
        assert rank0["type"] == "RankFailed", (label, rank0)  # a ValueError
        assert rank0["message"].startswith("generate() failed on rank 1 before generating"), (label, rank0)
        assert said in rank0["message"], (label, rank0)  # rank 1's own message
        assert max(float(rank0["seconds"]), float(rank1["seconds"])) < REFUSAL_S, (label, rank0, rank1)
    for label in DIFFERS:  # each data-parallel rank's own (valid) call
        for values in _both(torch_job, "fsdp", label):
            assert values["type"] == "None", (label, values)
    for label in (*REFUSED, *DIFFERS):
        for values in _both(torch_job, "fsdp_after", label):
            assert values["same"] == "True", (label, values)


@pytest.mark.distributed
def test_mindspore_tp_refusal_on_one_rank_raises_on_every_rank(mindspore_job):
    _check_tp(mindspore_job)
