"""Rollouts from a model sharded by HyperParallel itself: its torch ``fully_shard`` in a real 2-rank
torchrun job on CPU (gloo), tests/dist_scripts/rollout_hyperparallel.py; its MindSpore ``hsdp`` cell
in a 2-rank msrun job, tests/dist_scripts/rollout_hyperparallel_mindspore.py.

HyperParallel is not on the package index: README.md's second command installs it from
``$HYPERPARALLEL_SRC`` (tests/hyperparallel_install.py). Without it these tests skip, saying how to
install it, and fail under CI (``CI=true``)."""

import re

import pytest
from hyperparallel_install import require_hyperparallel
from launch import REPO, msrun, script, torchrun

JOB_TIMEOUT_S = 300


@pytest.fixture(scope="module", autouse=True)
def _hyperparallel_installed():  # module scope: before the jobs (module fixtures) launch
    require_hyperparallel()


@pytest.fixture(scope="module")
def job():
    result = torchrun([script("rollout_hyperparallel.py")], nproc=2, timeout=JOB_TIMEOUT_S)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    lines = {}
    for rank, check, label, rest in re.findall(r"^rank (\d): (\w+) (\S+) (.*)$", result.stdout, re.M):
        lines[(int(rank), check, label)] = rest
    return lines, result.stdout


def _line(job, rank, check, label):
    lines, text = job
    assert (rank, check, label) in lines, f"no '{check} {label}' line from rank {rank}:\n{text[-4000:]}"
    return lines[(rank, check, label)]


@pytest.mark.distributed
def test_the_model_is_sharded_by_hyperparallel(job):
    for rank in (0, 1):
        assert _line(job, rank, "setup", "type") == "HSDPQwen3_5ForCausalLM hyper_parallel.core.dtensor"


@pytest.mark.distributed
@pytest.mark.parametrize("reshard", ["reshard", "keep"])
@pytest.mark.parametrize("synced", ["None", "True"])
@pytest.mark.parametrize("skip", ["False", "True"])
def test_greedy_equals_hf_generate_on_an_unsharded_copy(job, reshard, synced, skip):
    """Every way of calling it (the issue's table: synced_gpus None / True, with and without
    SkipDTensorDispatch), reshard_after_forward True and False; rank 0 stops after 3 tokens while
    rank 1's rows run on to 16 or their EOS: no hang, HF's tokens on both ranks."""
    label = f"{reshard}-synced={synced}-skip={skip}"
    assert _line(job, 0, "greedy", label) == "OK lengths=[3, 3]"
    assert _line(job, 1, "greedy", label) == "OK lengths=[6, 16, 16]"


@pytest.mark.distributed
@pytest.mark.parametrize("label", ["auto", "unshard"])
def test_seeded_sampling_equals_one_process_on_the_concatenated_batch(job, label):
    for rank in (0, 1):
        assert _line(job, rank, "seeded", label) == "OK"


@pytest.mark.distributed
def test_n_samples_with_logprobs(job):
    assert _line(job, 0, "samples", "n=3") == "OK shape=(6, 3)"
    assert _line(job, 1, "samples", "n=3") == "OK shape=(9, 16)"


@pytest.mark.distributed
def test_stop_strings_end_rows_as_one_process_does(job):
    """A stop string one of rank 1's rows emits ends that row early while the others (and rank 0)
    run on: the tokens of one process on the unsharded copy, on both ranks."""
    assert _line(job, 0, "stop", "strings") == "OK lengths=[3, 3]"
    verdict, lengths = _line(job, 1, "stop", "strings").split(" ", 1)
    assert verdict == "OK" and lengths != "lengths=[6, 16, 16]", lengths  # a row ended at the stop string


@pytest.mark.distributed
def test_unshard_params_gathers_one_round_and_leaves_the_model_sharded(job):
    for rank in (0, 1):
        round_ = int(_line(job, rank, "allgathers", "forward").split("=")[1])
        per_forward = int(_line(job, rank, "allgathers", "per_forward").split("=")[1].split()[0])
        once = int(_line(job, rank, "allgathers", "unshard").split("=")[1].split()[0])
        assert round_ > 0 and per_forward == 16 * round_  # 16 forwards (rank 0: dummy steps)
        assert once == round_
        assert _line(job, rank, "after", "unshard") == "OK"  # DTensor parameters, settings restored
        assert _line(job, rank, "after", "raised") == "OK type=RuntimeError"


@pytest.mark.distributed
def test_a_bad_input_on_one_rank_is_raised_on_every_rank(job):
    failing, waiting = _line(job, 1, "error", "oov"), _line(job, 0, "error", "oov")
    assert failing.startswith("type=ValueError ") and "is not a token id" in failing
    assert waiting.startswith("type=RankFailed ") and "failed on rank 1" in waiting
    for rank in (0, 1):
        assert _line(job, rank, "after_errors", "greedy") == "OK"
        assert _line(job, rank, "done", "all") == "ok"


@pytest.mark.distributed
def test_example_rollout_hyperparallel_runs():
    result = torchrun(
        [f"{REPO}/examples/rollout_hyperparallel.py", "--samples", "2", "--max-new-tokens", "8"], timeout=JOB_TIMEOUT_S
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = re.findall(r"^rank (\d): rev (\d+) = '(\d*)'", result.stdout, re.M)
    assert len(rows) == 7 * 2 and {rank for rank, _, _ in rows} == {"0", "1"}, result.stdout
    assert sum(answer == number[::-1] for _, number, answer in rows) >= 10  # the demo model mostly reverses
    assert "done: 7 prompts over 2 ranks, 2 samples each" in result.stdout


@pytest.fixture(scope="module")
def mindspore_job(tmp_path_factory):
    """tests/dist_scripts/rollout_hyperparallel_mindspore.py under msrun: HyperParallel's ``hsdp`` on
    the native MindSpore demo model (parameters kept whole: its sharded forward has no CPU kernel)."""
    result = msrun([script("rollout_hyperparallel_mindspore.py")], log_dir=str(tmp_path_factory.mktemp("hp") / "logs"))
    assert result.returncode == 0, result.worker_logs[-6000:]
    lines = {}
    for rank, check, label, rest in re.findall(r"^rank (\d): (\w+) (\S+) (.*)$", result.worker_logs, re.M):
        lines[(int(rank), check, label)] = rest
    return lines, result.worker_logs


@pytest.mark.distributed
def test_mindspore_hsdp_cells_are_recognised_and_step_synced(mindspore_job):
    for rank in (0, 1):
        assert _line(mindspore_job, rank, "setup", "type") == "HSDPQwen3_5ForCausalLM collective_forward=True"
    for label in ("auto", "synced", "unshard"):
        # rank 0's row ends at its EOS after 3 tokens, but it steps with rank 1 through all 9 forwards
        assert _line(mindspore_job, 0, "greedy", label) == "OK forwards=9 tokens=3"
        assert _line(mindspore_job, 1, "greedy", label) == "OK forwards=9 tokens=9"
    assert _line(mindspore_job, 0, "greedy", "unsynced") == "OK forwards=3 tokens=3"


@pytest.mark.distributed
def test_mindspore_bad_input_on_one_rank_is_raised_on_every_rank(mindspore_job):
    assert _line(mindspore_job, 1, "error", "oov").startswith("type=ValueError ")
    waiting = _line(mindspore_job, 0, "error", "oov")
    assert waiting.startswith("type=RankFailed ") and "failed on rank 1" in waiting
    for rank in (0, 1):
        assert _line(mindspore_job, rank, "done", "all") == "ok"


@pytest.mark.distributed
def test_vocab_sharded_logits_come_back_whole(job):
    """HyperParallel's tensor parallelism (``shard_module``) on the output layer: its logits are a
    vocab-sharded HyperParallel DTensor, which refuses even the slice that keeps the last position;
    generate makes them whole first and gives HF's tokens on an unsharded copy, on both ranks."""
    for rank in (0, 1):
        assert _line(job, rank, "tp", "logits") == "hyper_parallel.core.dtensor placements=[Shard(dim=2)]"
        assert _line(job, rank, "tp", "greedy") == "OK lengths=[6, 8, 8]"


@pytest.mark.distributed
def test_an_uneven_vocab_split_is_a_value_error_on_every_rank(job):
    """97 output rows on 2 ranks: HyperParallel keeps 48 a rank and the logits come back 96 wide
    (a token could never be chosen): every rank raises a ValueError naming both widths."""
    for rank in (0, 1):
        line = _line(job, rank, "tp", "uneven")
        assert line.startswith("type=ValueError "), line
        assert "logits are 96 wide but its vocab_size is 97" in line, line
