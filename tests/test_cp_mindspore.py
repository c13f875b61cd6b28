"""Context-parallel MindSpore Qwen3.5: CP=2 under msrun gives the single-device results.

One 2-worker msrun job (tests/dist_scripts/cp_mindspore.py; the model run whole on rank 0 only, its
outputs shared) runs the checks of tests/test_cp_torch.py on the tiny dense checkpoint in float32
and float64 and the tiny MoE one in float64, with MindSpore's CPU collectives
(AllGather only; float64 travels as raw bits): model forwards on static and dynamic caches (each
rank's cache holding only its slice), generate() greedy / seeded / dynamic cache on left-padded
batches of 70- and 200-token rows with a 3-token row, and prompts of 1 and 129 tokens.
MindSpore's float64 model runs the delta rule in float64, so its logits match one device to
~1e-14 (the bar is 1e-9). tp x cp meshes: tests/test_cp_tp_mindspore.py.
"""

import re

import pytest
from cp_jobs import job_line, run_job
from qwen_checkpoints import make_checkpoint

# (label, dtype) pairs the job runs: MoE in float64 only (its experts run per position, outside every
# CP exchange; float32's CP exchanges are the dense model's)
RUNS = [("dense", "float32"), ("dense", "float64"), ("moe", "float64")]
WIDTHS = (70, 200)
GENERATE_RUNS = [(name, width) for width in (70, 200, 1, 129) for name in ("greedy", "seeded")]
GENERATE_RUNS += [("dynamic", width) for width in WIDTHS]
LINE = re.compile(r"^rank (\d): (\w+) (\S+) (.*)$", re.M)


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    # PyNative one-token blocks: compiling them for every batch size and dtype on both ranks was
    # ~60% of this job; the compiled blocks are PyNative's bit for bit
    # (test_mindspore_compiled_decode.py) and run under context parallelism in test_cp_tp_mindspore.py
    return run_job(tmp_path_factory, "cp_mindspore.py", 2, LINE, env={"HYPER_GEN_MINDSPORE_JIT": "0"})


def _line(job, rank, check, label, width=None):
    return job_line(job, rank, check, label, width)


@pytest.mark.distributed
@pytest.mark.parametrize("label,dtype", RUNS)
def test_cp_model_attributes(job, label, dtype):
    for rank in (0, 1):
        assert _line(job, rank, "attributes", f"{label}/{dtype}") == (
            f"group=None vocab_parallel=False cp_plan=CPPlan(cp=2, rank={rank}, chunk=64) tp_plan=TPPlan(tp=1, rank=0)"
        )


@pytest.mark.distributed
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("label,dtype", RUNS)
def test_cp_logits_match_single_device(job, label, dtype, width):
    for rank in (0, 1):
        diff = float(re.match(r"width=\d+ maxdiff=(\S+)", _line(job, rank, "logits", f"{label}/{dtype}", width))[1])
        print(f"CP=2 vs one device {label}/{dtype} width {width} rank {rank}: max abs logit diff {diff:.3e}")
        assert diff <= (1e-9 if dtype == "float64" else 1e-3)


@pytest.mark.distributed
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("label,dtype", RUNS)
def test_each_rank_caches_only_its_slice(job, label, dtype, width):
    for rank in (0, 1):
        line = _line(job, rank, "kvshard", f"{label}/{dtype}", width)
        assert "ok=True" in line, line
        static_length = int(re.search(r"\('StaticCache', (\d+),", line)[1])
        first = 64 if width == 70 else 128
        assert static_length == (first if rank == 0 else width - first + 3), line


@pytest.mark.distributed
@pytest.mark.parametrize("name,width", GENERATE_RUNS)
@pytest.mark.parametrize("label,dtype", RUNS)
def test_cp_generate_gives_single_device_tokens_on_every_rank(job, label, dtype, name, width):
    """Rank 0 compares with the model run whole; rank 1's tokens are rank 0's."""
    tokens = set()
    for rank in (0, 1):
        line = _line(job, rank, name, f"{label}/{dtype}", width)
        equal, rank_tokens = re.match(r"width=\d+ equal=(\S+) tokens=(.*)", line).groups()
        assert equal == ("True" if rank == 0 else "-"), f"rank {rank}: CP tokens differ from one device's: {line}"
        tokens.add(rank_tokens)
    assert len(tokens) == 1


@pytest.mark.distributed
def test_mismatched_input_raises_on_every_rank_without_hanging(job):
    _, text = job
    for rank in (0, 1):
        assert re.search(rf"rank {rank}: mismatch ValueError: .*different input_ids.*rank\(s\) \[1\]", text), text[
            -3000:
        ]
    after = re.findall(r"rank (\d): after-mismatch tokens=(.*)", text)
    assert len(after) == 2 and after[0][1] == after[1][1]


@pytest.mark.distributed
def test_cp_other_than_the_world_size_is_a_clear_error(job):
    _, text = job
    for rank in (0, 1):
        assert f"rank {rank}: world ValueError: tp=1 x cp=4 needs 4 ranks but the job has 2" in text, text[-3000:]


def test_cp_outside_a_job_of_tp_times_cp_ranks_is_a_clear_error(tmp_path):
    from hyper_gen.backends.mindspore.models import qwen3_5
    from hyper_gen.models.checkpoint import Checkpoint
    from hyper_gen.parallel.cp_plan import CPPlan

    path = make_checkpoint(tmp_path, "dense")  # tp x cp: tests/test_cp_tp_mindspore.py
    with pytest.raises(
        ValueError, match=r"tp=1 x cp=2 needs 2 ranks \(tp \* cp\) but this process is rank 0 of a 1-rank"
    ):
        qwen3_5.load(Checkpoint(path), "float32", cp_plan=CPPlan(2, 0))
