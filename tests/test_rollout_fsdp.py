"""Rollouts from the model as the trainer sharded it, in real torchrun jobs on CPU (gloo).

- tests/dist_scripts/rollout_fsdp.py (2 ranks): an HF Qwen3.5 under FSDP2, different prompts per
  rank, rank 0 done after 3 tokens and rank 1 after up to 16: greedy equal to HF generate on an
  unsharded copy, seeded sampling equal to one process running both ranks' prompts, n samples with
  logprobs, ``unshard_params`` gathering once, errors on one rank raised on every rank, and the
  same job without step sync failing at a short collective timeout;
- tests/dist_scripts/rollout_tp.py: ``parallelize_module`` TP=2 (2 ranks) and the 2-D (dp, tp) mesh
  on 4 ranks, FSDP2 over TP included;
- examples/rollout_fsdp.py and ``hyper-gen bench rollout`` run.

Each job has a timeout (nothing can hang CI); the scripts print one line per check and never raise
on a failed comparison (a rank stopping early would leave the others waiting in a collective).
"""

import re

import pytest
from launch import REPO, script, torchrun

JOB_TIMEOUT_S = 240


def _run(args, nproc):
    result = torchrun(args, nproc=nproc, timeout=JOB_TIMEOUT_S)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    lines = {}
    for rank, check, label, rest in re.findall(r"^rank (\d): (\w+) (\S+) (.*)$", result.stdout, re.M):
        lines[(int(rank), check, label)] = rest
    return lines, result.stdout


def _line(job, rank, check, label):
    lines, text = job
    assert (rank, check, label) in lines, f"no '{check} {label}' line from rank {rank}:\n{text[-4000:]}"
    return lines[(rank, check, label)]


def _lengths(line):
    return eval(re.search(r"lengths=(\[[^\]]*\])", line).group(1))


def _seconds(line):
    return float(re.search(r"seconds=([\d.]+)", line).group(1))


@pytest.fixture(scope="module")
def fsdp_job():
    return _run([script("rollout_fsdp.py")], nproc=2)


@pytest.fixture(scope="module")
def tp_job():
    return _run([script("rollout_tp.py")], nproc=2)


@pytest.fixture(scope="module")
def mesh_job():
    return _run([script("rollout_tp.py")], nproc=4)


@pytest.mark.distributed
@pytest.mark.parametrize("label", ["auto", "unshard", "explicit"])
def test_fsdp_greedy_equals_hf_generate_on_an_unsharded_copy(fsdp_job, label):
    for rank in (0, 1):
        assert _line(fsdp_job, rank, "greedy", label).startswith("OK "), _line(fsdp_job, rank, "greedy", label)
    # rank 0 stops after 3 tokens while rank 1 goes on, its rows ending at different steps (EOS, cap)
    rank0, rank1 = _lengths(_line(fsdp_job, 0, "greedy", label)), _lengths(_line(fsdp_job, 1, "greedy", label))
    assert max(rank0) == 3 and max(rank1) == 16 and min(rank1) < 16
    assert _seconds(_line(fsdp_job, 1, "greedy", label)) < 30


@pytest.mark.distributed
@pytest.mark.parametrize("label", ["auto", "unshard"])
def test_fsdp_seeded_sampling_equals_one_process_running_both_ranks_prompts(fsdp_job, label):
    for rank in (0, 1):
        assert _line(fsdp_job, rank, "seeded", label).startswith("OK "), _line(fsdp_job, rank, "seeded", label)


@pytest.mark.distributed
def test_fsdp_n_samples_with_logprobs(fsdp_job):
    assert _line(fsdp_job, 0, "samples", "n=3").startswith("OK tokens=OK logprobs=OK shape=(6, 3)")
    assert _line(fsdp_job, 1, "samples", "n=3").startswith("OK tokens=OK logprobs=OK shape=(9, 16)")


@pytest.mark.distributed
def test_unshard_params_all_gathers_each_layer_once_per_call(fsdp_job):
    for rank in (0, 1):
        per_forward = int(_line(fsdp_job, rank, "allgathers", "per_forward").split("=")[1])
        once = int(_line(fsdp_job, rank, "allgathers", "unshard").split("=")[1])
        assert per_forward == 16 * 4  # 16 forwards (rank 0: dummy steps) x 4 decoder layers
        assert once <= 5  # each layer once, and the root


@pytest.mark.distributed
@pytest.mark.parametrize("label", ["oov", "processor", "processor_unshard"])
def test_an_error_on_one_rank_is_raised_on_every_rank_naming_it(fsdp_job, label):
    failing, waiting = _line(fsdp_job, 1, "error", label), _line(fsdp_job, 0, "error", label)
    expected = "ValueError" if label == "oov" else "RuntimeError"
    assert failing.startswith(f"type={expected} "), failing
    assert waiting.startswith("type=RankFailed "), waiting  # RankFailed is a ValueError
    assert "failed on rank 1" in waiting and failing.split("message=")[1] in waiting
    assert _seconds(waiting) < 10 and _seconds(failing) < 10


@pytest.mark.distributed
def test_the_sharded_model_works_after_the_errors(fsdp_job):
    for rank in (0, 1):
        assert _line(fsdp_job, rank, "after_errors", "greedy") == "OK"


@pytest.mark.distributed
def test_without_step_sync_the_unfinished_rank_waits_in_fsdp_all_gather(fsdp_job):
    """synced_gpus=False: rank 0 returns after 3 tokens; rank 1's next forward waits in FSDP's
    all-gather for it until the group's 3 s timeout (the hang the step sync prevents)."""
    assert _line(fsdp_job, 0, "unsynced", "synced_gpus=False").startswith("type=None ")
    stuck = _line(fsdp_job, 1, "unsynced", "synced_gpus=False")
    assert not stuck.startswith("type=None ") and "Timed out" in stuck, stuck
    assert 2.5 < _seconds(stuck) < 15
    for rank in (0, 1):
        assert _line(fsdp_job, rank, "done", "all") == "ok"


@pytest.mark.distributed
@pytest.mark.parametrize("label", ["local", "dtensor"])
def test_tp2_parallelize_module_greedy_and_seeded(tp_job, label):
    for rank in (0, 1):
        assert "tp_group_size=2" in _line(tp_job, rank, "setup", "dp0")
        assert _line(tp_job, rank, "greedy", label).startswith("OK "), _line(tp_job, rank, "greedy", label)
        assert _line(tp_job, rank, "seeded", label).startswith("OK "), _line(tp_job, rank, "seeded", label)


@pytest.mark.distributed
def test_tp2_samples_and_errors(tp_job):
    for rank in (0, 1):
        assert _line(tp_job, rank, "samples", "n=3").startswith("OK shape=(6, 16)")
    assert _line(tp_job, 1, "error", "processor").startswith("type=RuntimeError ")
    assert "failed on rank 1" in _line(tp_job, 0, "error", "processor")


@pytest.mark.distributed
def test_tp_vocabulary_the_degree_does_not_divide_is_a_value_error_everywhere(tp_job, mesh_job):
    for job, ranks in ((tp_job, 2), (mesh_job, 4)):
        for rank in range(ranks):
            line = _line(job, rank, "error", "uneven_vocab")
            assert line.startswith("type=ValueError ") and "97 rows is sharded over 2 ranks" in line, line
            assert _line(job, rank, "done", "all") == "ok"


@pytest.mark.distributed
@pytest.mark.parametrize("label", ["local", "dtensor", "fsdp_tp", "fsdp_tp_unshard"])
def test_2d_mesh_each_dp_group_gets_its_own_prompts_tokens(mesh_job, label):
    for rank in range(4):
        group = "dp0" if rank < 2 else "dp1"
        assert "tp_group_size=2 world=4" in _line(mesh_job, rank, "setup", group)
        for check in ("greedy", "seeded"):
            line = _line(mesh_job, rank, check, label)
            assert line.startswith("OK "), (rank, check, line)
    assert max(_lengths(_line(mesh_job, 0, "greedy", label))) == 3
    assert max(_lengths(_line(mesh_job, 2, "greedy", label))) == 16


@pytest.mark.distributed
def test_2d_mesh_samples_and_errors(mesh_job):
    for rank in range(4):
        shape = "(6, 3)" if rank < 2 else "(9, 16)"
        assert _line(mesh_job, rank, "samples", "n=3").startswith(f"OK shape={shape}")
        line = _line(mesh_job, rank, "error", "processor")
        if rank == 3:
            assert line.startswith("type=RuntimeError ")
        else:
            assert line.startswith("type=RankFailed ") and "failed on rank 3" in line, line


@pytest.mark.distributed
def test_example_rollout_fsdp_runs():
    result = torchrun(
        [f"{REPO}/examples/rollout_fsdp.py", "--samples", "2", "--max-new-tokens", "8"], timeout=JOB_TIMEOUT_S
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = re.findall(r"^rank (\d): rev \d+ = ", result.stdout, re.M)
    assert len(rows) == 7 * 2, result.stdout  # 7 prompts over 2 ranks, 2 samples each
    assert set(rows) == {"0", "1"}
    logprobs = re.findall(r" logprob=\s*(\S+) raw_logprob=", result.stdout)
    assert len(logprobs) == 7 * 2 and all(float(x) <= 0 for x in logprobs), result.stdout
    assert "done: 7 prompts over 2 ranks, 2 samples each" in result.stdout


@pytest.mark.distributed
def test_bench_rollout_runs():
    args = ["-m", "hyper_gen", "bench", "rollout", "--hidden", "64", "--vocab", "512", "--prompts", "2"]
    result = torchrun(args + ["--samples", "2", "--new-tokens", "8", "--prompt-len", "8"], timeout=JOB_TIMEOUT_S)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "host: " in result.stdout
    methods = ("hyper_gen synced, cache ", "hyper_gen synced, cache, unshard_params", "fixed-iteration, no cache")
    for method in methods + ("HF generate synced_gpus=True",):
        assert re.search(rf"^{re.escape(method)}.*\d+%/\d+%", result.stdout, re.M), (method, result.stdout[-3000:])
    assert "EOS schedule not followed" not in result.stdout


def test_plain_modules_are_not_sharded():
    torch = pytest.importorskip("torch")
    from hyper_gen.backends.torch import sharding

    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    assert sharding.collective_forward(model) is False
    assert sharding.find_parallelism(model) is None
    assert sharding._outermost_fsdp(model) == []
    with sharding.parameters_unsharded(model):  # nothing to gather
        pass
