"""tp=2 x cp=2 MindSpore Qwen3.5 (4 msrun workers) gives the single-device results.

One 4-worker msrun job (tests/dist_scripts/cp_tp_mindspore.py) loads ``load_model(...,
backend="mindspore", tp=2, cp=2)``, and the whole model on rank 0, which shares its outputs with
the other ranks (only one rank pays for the reference; each compares its own), for the tiny
dense checkpoint in float64 and float32 and the tiny MoE one (fused experts) in float64, and reports
on left-padded batches of a 70-token row with a 3-token row and of a 200-token row with 70- and
3-token rows: generate() greedy and seeded tokens, every step's logits (teacher-forced prefill +
decode) and the cache slices. The mesh is tp innermost (rank = cp_rank * 2 + tp_rank): tp groups
{0, 1}, {2, 3} carry the row-parallel sums and the vocabulary gather, cp groups {0, 2}, {1, 3} the
K|V / conv-halo / state / log-sum-exp all-gathers, generate()'s input check spans all 4 ranks.
The compiled one-token blocks run on the first (dense float64) run only; the others run PyNative.
MindSpore's CPU AllGather runs on the world group only, so the subgroups' all-gathers travel as
world AllGathers (hyper_gen.backends.mindspore.ops); the float32 tp sums use AllReduce on the tp
subgroup.
"""

import re

import pytest
from cp_jobs import job_line, run_job
from qwen_checkpoints import make_checkpoint

RUNS = [("dense", "float64"), ("dense", "float32"), ("moe", "float64")]  # the script's (label, dtype) pairs
WIDTHS = (70, 200)
RANKS = range(4)
NEW_TOKENS = 4
LINE = re.compile(r"^rank (\d): (\S+) (\S+) (.*)$", re.M)


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    return run_job(tmp_path_factory, "cp_tp_mindspore.py", 4, LINE)


def _line(job, rank, check, label, width=None):
    return job_line(job, rank, check, label, width)


@pytest.mark.distributed
@pytest.mark.parametrize("label,dtype", RUNS)
def test_mesh_coordinates_and_groups(job, label, dtype):
    for rank in RANKS:
        tp_rank, cp_rank = rank % 2, rank // 2
        assert _line(job, rank, "attributes", f"{label}/{dtype}") == (
            f"group=None vocab_parallel=False cp_plan=CPPlan(cp=2, rank={cp_rank}, chunk=64) "
            f"tp_plan=TPPlan(tp=2, rank={tp_rank}) tp_group=hyper_gen_tp2xcp2_tp{cp_rank} "
            f"cp_group=hyper_gen_tp2xcp2_cp{tp_rank} vocab=97"
        )


@pytest.mark.distributed
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("label,dtype", RUNS)
def test_every_step_logits_match_single_device(job, label, dtype, width):
    """Each rank's logits against the model run whole on rank 0 (its outputs shared with every rank)."""
    for rank in RANKS:
        line = _line(job, rank, "logits", f"{label}/{dtype}", width)
        steps, diff, kv_ok = re.match(r"width=\d+ steps=(\d+) maxdiff=(\S+) kv_ok=(\w+)", line).groups()
        print(f"tp2 x cp2 vs one device {label}/{dtype} width {width} rank {rank}: max abs logit diff {diff}")
        assert int(steps) == 1 + NEW_TOKENS
        assert float(diff) <= (1e-9 if dtype == "float64" else 1e-3), line
        assert kv_ok == "True", f"rank {rank}'s cache does not hold exactly its cp slice: {line}"


@pytest.mark.distributed
@pytest.mark.parametrize("name", ("greedy", "seeded"))
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("label,dtype", RUNS)
def test_generate_gives_single_device_tokens_on_all_four_ranks(job, label, dtype, width, name):
    """Rank 0 compares with the model run whole; the other ranks' tokens are rank 0's."""
    tokens = set()
    for rank in RANKS:
        line = _line(job, rank, name, f"{label}/{dtype}", width)
        equal, rank_tokens = re.match(r"width=\d+ equal=(\S+) tokens=(.*)", line).groups()
        assert equal == ("True" if rank == 0 else "-"), f"rank {rank}: tp x cp tokens differ from one device's: {line}"
        tokens.add(rank_tokens)
    assert len(tokens) == 1


@pytest.mark.distributed
def test_seeded_sampling_is_not_greedy(job):
    assert _line(job, 0, "seeded", "dense/float64", 200) != _line(job, 0, "greedy", "dense/float64", 200)


@pytest.mark.distributed
def test_input_check_spans_the_whole_mesh(job):
    _, text = job
    for rank in RANKS:
        assert re.search(
            rf"rank {rank}: mismatch ValueError: .*different input_ids.*rank\(s\) \[3\].*4-rank model group", text
        ), text[-3000:]
    after = re.findall(r"rank (\d): after-mismatch tokens=(.*)", text)
    assert len(after) == 4 and len({tokens for _, tokens in after}) == 1


@pytest.mark.distributed
def test_a_mesh_other_than_the_world_is_a_clear_error(job):
    _, text = job
    for rank in RANKS:
        assert f"rank {rank}: world ValueError: tp=2 x cp=4 needs 8 ranks but the job has 4" in text, text[-3000:]
        assert (
            f"rank {rank}: port-world ValueError: tp=2 x cp=4 needs 8 ranks (tp * cp) but this process is rank "
            f"{rank} of a 4-rank world: launch 8 processes (msrun --worker_num=8" in text
        ), text[-3000:]


def test_tp_x_cp_outside_a_job_of_tp_times_cp_ranks_is_a_clear_error(tmp_path):
    from hyper_gen import load_model
    from hyper_gen.backends.mindspore.models import qwen3_5
    from hyper_gen.models.checkpoint import Checkpoint
    from hyper_gen.parallel.cp_plan import CPPlan
    from hyper_gen.parallel.tp_plan import TPPlan

    path = make_checkpoint(tmp_path, "dense")
    with pytest.raises(
        ValueError,
        match=re.escape(
            "tp=2 x cp=2 needs 4 ranks (tp * cp) but this process is rank 0 of a 1-rank world: launch 4 processes "
            "(msrun --worker_num=4 --local_worker_num=4 --join=True app.py) and load with "
            "hyper_gen.load_model(..., backend='mindspore', tp=2, cp=2)"
        ),
    ):
        qwen3_5.load(Checkpoint(path), "float32", plan=TPPlan(2, 0), cp_plan=CPPlan(2, 0))
    with pytest.raises(ValueError, match=r"cp=2 needs 4 processes launched together \(msrun --worker_num 4"):
        load_model(path, backend="mindspore", tp=2, cp=2)
