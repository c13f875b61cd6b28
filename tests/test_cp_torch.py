"""Context-parallel native torch Qwen3.5: CP=2 (and TP=2 x CP=2) under torchrun gives the
single-device results.

One 2-rank torchrun job (tests/dist_scripts/cp_torch.py, cp=2) and one 4-rank job (tp=2 x cp=2)
run every multi-rank check on the tiny dense and MoE checkpoints, float32 and float64: model
forwards (prefill of a left-padded batch of a 70- or 200-token row with a 3-token and a 17-token
row, then teacher-forced decode steps) on static and dynamic caches, each rank's cache holding
only its slice; generate() greedy / seeded / dynamic cache / use_cache=False / num_return_sequences
on those batches and on prompts of 1, 65 and 129 tokens. The same jobs rerun the forwards and
greedy / seeded / dynamic generate() with ``cp_strategy="ulysses"`` (the all-to-all prefill) on the
70- and 200-token batches (at tp=2 on a checkpoint with 8 attention / 4 KV heads; the others are
refused there). The single-process tests cover the errors raised before any process group or
weight is touched.
"""

import re

import pytest
from launch import script, torchrun
from qwen_checkpoints import make_checkpoint

from hyper_gen.models.loading import load_model

CHECKPOINTS = {"dense": ("dense", {}), "moe": ("moe", {})}
# 8 attention / 4 KV heads: 2 / 1 per cp rank under Ulysses even at tp=2 (the others have 1 KV head per tp rank)
WIDE = {"wide": ("dense", {"text_overrides": {"num_attention_heads": 8, "num_key_value_heads": 4}})}
DTYPES = ("float32", "float64")
WIDTHS = (70, 200)
# float32 CP vs one device: MKL rounds the split products differently (1e-4-1e-3 on Intel hosts,
# up to 1.4e-3 on an AMD EPYC for the MoE at tp2 x cp2); float64 is the exactness check
FLOAT32_TOLERANCE = 3e-3
GENERATE_RUNS = [(name, width) for width in (70, 200, 1, 65, 129) for name in ("greedy", "seeded", "dynamic")] + [
    ("recompute", 70),
    ("repeated", 70),
]
LINE = re.compile(r"^rank (\d): (\w+) (\S+) (.*)$", re.M)


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("cp_torch")
    every = {**CHECKPOINTS, **WIDE}
    return {label: make_checkpoint(root, kind, **kwargs) for label, (kind, kwargs) in every.items()}


def _job(paths, nproc, tp):
    result = torchrun(
        [script("cp_torch.py"), str(tp)] + [f"{label}={path}" for label, path in paths.items()],
        nproc=nproc,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = {}
    for rank, check, label, rest in LINE.findall(result.stdout):
        width = re.match(r"width=(\d+) ", rest)
        key = (int(rank), check, label, int(width.group(1)) if width else None)
        lines[key] = rest
    return lines, result.stdout, nproc


@pytest.fixture(scope="module")
def cp2(paths):
    return _job(paths, 2, 1)


@pytest.fixture(scope="module")
def tp2_cp2(paths):
    return _job(paths, 4, 2)


@pytest.fixture(params=["cp2", "tp2_cp2"])
def job(request):
    return request.getfixturevalue(request.param)


def _line(job, rank, check, label, width=None):
    lines, text, _ = job
    key = (rank, check, label, width)
    assert key in lines, f"no '{check} {label} width={width}' line from rank {rank}:\n{text[-3000:]}"
    return lines[key]


def _ranks(job):
    return range(job[2])


@pytest.mark.distributed
@pytest.mark.parametrize("label", CHECKPOINTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_cp_model_attributes(job, label, dtype):
    world = job[2]
    tp = world // 2
    for rank in _ranks(job):
        assert _line(job, rank, "attributes", f"{label}/{dtype}") == (
            f"group=None vocab_parallel=False cp_plan=CPPlan(cp=2, rank={rank // tp}, chunk=64) "
            f"tp_plan=TPPlan(tp={tp}, rank={rank % tp})"
        )


@pytest.mark.distributed
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("label", CHECKPOINTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_cp_logits_match_single_device(job, label, dtype, width):
    """Every position's prefill logits and every decode step's: float64 within 1e-9 (the chunked
    delta rule runs one device's chunks from the relayed state, so it is exact), float32 within FLOAT32_TOLERANCE."""
    for rank in _ranks(job):
        diff = float(re.match(r"width=\d+ maxdiff=(\S+)", _line(job, rank, "logits", f"{label}/{dtype}", width))[1])
        print(f"CP=2 vs one device {label}/{dtype} width {width} rank {rank}: max abs logit diff {diff:.3e}")
        assert diff <= (1e-9 if dtype == "float64" else FLOAT32_TOLERANCE)


@pytest.mark.distributed
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("label", CHECKPOINTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_each_rank_caches_only_its_slice(job, label, dtype, width):
    """Rank 0 (cp) holds positions [0, 64) / [0, 128); the last rank the rest plus the decode tokens."""
    tp = job[2] // 2
    for rank in _ranks(job):
        line = _line(job, rank, "kvshard", f"{label}/{dtype}", width)
        assert "ok=True" in line, line
        static_length = int(re.search(r"\('StaticCache', (\d+),", line)[1])
        first = 64 if width == 70 else 128
        assert static_length == (first if rank // tp == 0 else width - first + 4), line


@pytest.mark.distributed
@pytest.mark.parametrize("name,width", GENERATE_RUNS)
@pytest.mark.parametrize("label", CHECKPOINTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_cp_generate_gives_single_device_tokens_on_every_rank(job, label, dtype, name, width):
    """Rank 0 compares with the model run whole; the other ranks' tokens are rank 0's."""
    tokens = set()
    for rank in _ranks(job):
        line = _line(job, rank, name, f"{label}/{dtype}", width)
        equal, rank_tokens = re.match(r"width=\d+ equal=(\S+) tokens=(.*)", line).groups()
        assert equal == ("True" if rank == 0 else "-"), f"rank {rank}: CP tokens differ from one device's: {line}"
        tokens.add(rank_tokens)
    assert len(tokens) == 1


@pytest.mark.distributed
def test_mismatched_input_raises_on_every_rank_without_hanging(job):
    _, text, world = job
    for rank in range(world):
        assert re.search(rf"rank {rank}: mismatch ValueError: .*different input_ids.*rank\(s\) \[1\]", text), text[
            -3000:
        ]
    after = re.findall(r"rank (\d): after-mismatch tokens=(.*)", text)
    assert len(after) == world and len({tokens for _, tokens in after}) == 1  # the ranks are still in step


@pytest.mark.distributed
def test_cp_other_than_the_world_size_is_a_clear_error(cp2):
    _, text, _ = cp2
    for rank in (0, 1):
        assert f"rank {rank}: world ValueError: tp=1 x cp=4 needs 4 ranks but the job has 2" in text, text[-3000:]


# ----------------------------------------------------- cp_strategy="ulysses": all-to-all prefill


def _ulysses_labels(job):
    """The checkpoints Ulysses loads on: every one at cp=2 alone; at tp=2 the one with 2 KV heads
    per tp rank (the others have 1, which cp=2 cannot split)."""
    return list(CHECKPOINTS) + list(WIDE) if job[2] == 2 else list(WIDE)


@pytest.mark.distributed
@pytest.mark.parametrize("dtype", DTYPES)
def test_ulysses_loads_or_refuses_an_indivisible_head_split(job, dtype):
    tp = job[2] // 2
    for rank in _ranks(job):
        for label in list(CHECKPOINTS) + list(WIDE):
            line = _line(job, rank, "load", f"{label}/{dtype}/ulysses")
            if label in _ulysses_labels(job):
                assert line == f"cp_plan=CPPlan(cp=2, rank={rank // tp}, chunk=64, strategy='ulysses')", line
            else:
                assert re.match(
                    r"ValueError: cp_strategy='ulysses' splits the heads over the cp=2 ranks, but there are 1 KV heads "
                    r"per tensor-parallel rank .*use cp_strategy='allgather'",
                    line,
                ), line


@pytest.mark.distributed
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_ulysses_matches_single_device(job, dtype, width):
    """Prefill logits of every position and every decode step's (static and dynamic caches):
    float64 within 1e-9, float32 within FLOAT32_TOLERANCE; each rank caches only its slice; greedy, seeded and
    dynamic-cache generate() give the single-device tokens on every rank."""
    for label in _ulysses_labels(job):
        tokens = {name: set() for name in ("greedy", "seeded", "dynamic")}
        for rank in _ranks(job):
            tag = f"{label}/{dtype}/ulysses"
            diff = float(re.match(r"width=\d+ maxdiff=(\S+)", _line(job, rank, "logits", tag, width))[1])
            print(f"Ulysses CP=2 vs one device {tag} width {width} rank {rank}: max abs logit diff {diff:.3e}")
            assert diff <= (1e-9 if dtype == "float64" else FLOAT32_TOLERANCE)
            assert _line(job, rank, "kvshard", tag, width) == f"width={width} ok=True"
            for name in tokens:
                line = _line(job, rank, name, tag, width)
                equal, rank_tokens = re.match(r"width=\d+ equal=(\S+) tokens=(.*)", line).groups()
                assert equal == ("True" if rank == 0 else "-"), f"rank {rank} {name}: Ulysses tokens differ: {line}"
                tokens[name].add(rank_tokens)
        assert all(len(seen) == 1 for seen in tokens.values())


# ------------------------------------------------------------------------ single-process errors


@pytest.mark.parametrize("strategy", ["ring", "", "ULYSSES", None, 1])
def test_bad_cp_strategy_values(paths, strategy):
    with pytest.raises(ValueError, match=r"cp_strategy must be one of \('allgather', 'ulysses'\), got"):
        load_model(paths["dense"], backend="torch", cp=2, cp_strategy=strategy)


def test_ulysses_is_refused_on_mindspore(paths):
    with pytest.raises(ValueError, match=r"cp_strategy='ulysses' needs an all-to-all, which MindSpore's CPU"):
        load_model(paths["dense"], backend="mindspore", cp=2, cp_strategy="ulysses")


def test_ulysses_heads_not_divisible_by_cp_fail_before_joining(paths, single_process):
    with pytest.raises(ValueError, match=r"there are 1 KV heads per tensor-parallel rank \(2 attention, 1 KV\)"):
        load_model(paths["dense"], backend="torch", tp=2, cp=2, cp_strategy="ulysses")
    with pytest.raises(ValueError, match=r"there are 4 attention heads .* not divisible by cp=3"):
        load_model(paths["dense"], backend="torch", cp=3, cp_strategy="ulysses")


def test_cp_strategy_cli_flag():
    import argparse

    from hyper_gen.cli.common import add_model_flags

    parser = argparse.ArgumentParser()
    add_model_flags(parser)
    assert parser.parse_args([]).cp_strategy == "allgather"
    assert parser.parse_args(["--cp", "2", "--cp-strategy", "ulysses"]).cp_strategy == "ulysses"
    with pytest.raises(SystemExit):
        parser.parse_args(["--cp-strategy", "ring"])


@pytest.fixture
def single_process(monkeypatch):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("cp", [0, -1, 2.0, "2", True, None])
def test_bad_cp_values(paths, cp):
    with pytest.raises(ValueError, match="cp must be an int >= 1"):
        load_model(paths["dense"], backend="torch", cp=cp)


def test_cp2_in_a_single_process_is_a_clear_error(paths, single_process):
    with pytest.raises(ValueError, match=r"cp=2 needs 2 processes launched together \(torchrun --nproc_per_node 2"):
        load_model(paths["dense"], backend="torch", cp=2)
    with pytest.raises(ValueError, match=r"cp=2 needs 4 processes .*use cp=1 and tp=1 here"):
        load_model(paths["dense"], backend="torch", tp=2, cp=2)


def test_tp_that_does_not_divide_the_heads_fails_before_joining_a_cp_job(paths, single_process):
    with pytest.raises(ValueError, match="tp=3 does not divide num_attention_heads=4"):
        load_model(paths["dense"], backend="torch", tp=3, cp=2)


def test_cp_model_refuses_a_multi_token_continuation(paths):
    """The kernels' own load with a cp plan needs a process group; the forward contract is checked
    on a model built without one (every collective is avoided by the replicated short prefill)."""
    import torch

    from hyper_gen.backends.torch.models import qwen3_5
    from hyper_gen.backends.torch.ops import TorchOps
    from hyper_gen.cache import DynamicCache
    from hyper_gen.models.checkpoint import Checkpoint
    from hyper_gen.parallel.context_parallel import ContextParallel
    from hyper_gen.parallel.cp_plan import CPPlan

    refusal = (
        "tp=1 x cp=2 needs 2 ranks (tp * cp) but this process is rank 0 of a 1-rank world: "
        "launch 2 processes (torchrun --nproc_per_node 2)"
    )
    with pytest.raises(ValueError, match=re.escape(refusal)):
        qwen3_5.load(Checkpoint(paths["dense"]), "float32", cp_plan=CPPlan(2, 0))
    model = qwen3_5.load(Checkpoint(paths["dense"]), "float32")
    model.context_parallel = ContextParallel(CPPlan(2, 0), TorchOps("cpu"))
    model.cp_plan = model.context_parallel.plan
    cache = DynamicCache(TorchOps("cpu"), 1, 8)
    with torch.no_grad():
        model(torch.tensor([[3, 4]]), past_key_values=cache)  # a 2-token prompt: replicated, no collective
        cache.advance(2)
        with pytest.raises(ValueError, match="one token per row after it, got 2 tokens after 2 cached positions"):
            model(torch.tensor([[5, 6]]), past_key_values=cache)
