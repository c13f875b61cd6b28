"""Tensor-parallel native torch Qwen3.5: TP=2 under torchrun gives the single-device tokens.

One 2-rank torchrun job (tests/dist_scripts/tp_torch.py) runs every multi-rank check on four tiny
checkpoints, in float32 and float64; the single-process tests cover the errors raised before
any process group or weight is touched, and the collective-traffic formula.
"""

import re

import pytest
from launch import script, torchrun
from qwen_checkpoints import make_checkpoint

from hyper_gen.models.checkpoint import Checkpoint
from hyper_gen.models.loading import load_model
from hyper_gen.models.qwen3_5 import Qwen3_5Config
from hyper_gen.models.qwen3_5.tp_traffic import collective_bytes_per_decode_step, decode_step_collectives
from hyper_gen.parallel.tp_plan import TPPlan

# label -> (kind, make_checkpoint keywords). kv1: one KV head for two ranks (replicated K/V)
CHECKPOINTS = {
    "dense": ("dense", {}),
    "moe": ("moe", {}),
    "moe_fused_tied": ("moe", {"fused_experts": True, "tie_word_embeddings": True}),
    "kv1_tied": ("dense", {"tie_word_embeddings": True, "text_overrides": {"num_key_value_heads": 1}}),
}
DTYPES = ("float32", "float64")


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tp_torch")


@pytest.fixture(scope="module")
def paths(checkpoint_dir):
    return {label: make_checkpoint(checkpoint_dir, kind, **kwargs) for label, (kind, kwargs) in CHECKPOINTS.items()}


@pytest.fixture(scope="module")
def job(paths):
    """{(rank, check, label/dtype): rest of the line} from one 2-rank torchrun job, plus the raw text."""
    result = torchrun([script("tp_torch.py")] + [f"{label}={path}" for label, path in paths.items()], timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = {}
    for rank, check, label, rest in re.findall(r"^rank (\d): (\w+) (\S+) (.*)$", result.stdout, re.M):
        lines[(int(rank), check, label)] = rest
    return lines, result.stdout


def _line(job, rank, check, label):
    lines, text = job
    assert (rank, check, label) in lines, f"no '{check} {label}' line from rank {rank}:\n{text[-3000:]}"
    return lines[(rank, check, label)]


RUNS = [(label, dtype) for label in CHECKPOINTS for dtype in DTYPES]


@pytest.mark.distributed
@pytest.mark.parametrize("label,dtype", RUNS)
def test_tp_model_attributes_and_shard_reads(job, label, dtype):
    for rank in (0, 1):
        attributes = _line(job, rank, "attributes", f"{label}/{dtype}")
        assert attributes == (
            f"group=None vocab_parallel=True vocab_size=97 plan=TPPlan(tp=2, rank={rank}) single_is_local=True"
        )
        reads = _line(job, rank, "reads", f"{label}/{dtype}")
        split_read_whole, full_slices = re.match(r"split_read_whole=(\[.*?\]) full_slices=(\[.*\])", reads).groups()
        assert split_read_whole == "[]"  # a split weight is never read whole
        # every slice is less than its tensor, except K/V replicated when there are fewer KV heads than ranks
        allowed = {f"model.layers.{i}.self_attn.{p}_proj.weight" for i in (1, 3) for p in "kv"}
        assert set(eval(full_slices)) <= (allowed if label == "kv1_tied" else set())


@pytest.mark.distributed
@pytest.mark.parametrize("label,dtype", RUNS)
def test_tp_logits_match_single_device(job, label, dtype):
    """Prefill of a left-padded batch (a 70-token prompt: two delta-rule chunks) + 4 decode
    steps, static and dynamic cache, gathered TP logits vs the whole model on one rank.

    float64: equal to 1e-9. float32: the chunked delta rule turns float32 rounding into ~1e-4 at
    prefill on one device too (against the float64 model), so TP's float32 error against float64
    must be within twice the single device's own (or 1e-4), and TP vs single within 1e-3."""
    for rank in (0, 1):
        line = _line(job, rank, "logits", f"{label}/{dtype}")
        diff, tp_error, single_error = (
            float(v) for v in re.match(r"maxdiff=(\S+) tp_vs_f64=(\S+) single_vs_f64=(\S+)", line).groups()
        )
        print(
            f"TP=2 vs single device {label}/{dtype} rank {rank}: max abs logit diff {diff:.3e} "
            f"(vs float64: TP {tp_error:.3e}, single {single_error:.3e})"
        )
        if dtype == "float64":
            assert diff <= 1e-9
        else:
            assert diff <= 1e-3 and tp_error <= max(2 * single_error, 1e-4)


@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["greedy", "seeded"])
@pytest.mark.parametrize("label,dtype", RUNS)
def test_tp_generate_gives_single_device_tokens_on_every_rank(job, label, dtype, mode):
    tokens = []
    for rank in (0, 1):
        equal, rank_tokens = re.match(r"equal=(\w+) tokens=(.*)", _line(job, rank, mode, f"{label}/{dtype}")).groups()
        assert equal == "True", f"rank {rank}: TP tokens differ from single-device ones: {rank_tokens}"
        tokens.append(rank_tokens)
    assert tokens[0] == tokens[1]
    assert len(eval(tokens[0])[0]) == 70 + 8  # the long prompt and all 8 new tokens


@pytest.mark.distributed
@pytest.mark.parametrize("label,dtype", RUNS)
def test_counted_collectives_per_decode_step_match_the_formula(job, label, dtype):
    for rank in (0, 1):
        assert _line(job, rank, "traffic", f"{label}/{dtype}").startswith("match=True")


@pytest.mark.distributed
def test_tp_other_than_the_world_size_is_a_clear_error(job):
    _, text = job
    for rank in (0, 1):
        assert f"rank {rank}: world ValueError: tp=4 but the job has 2 ranks" in text, text[-3000:]


@pytest.mark.distributed
def test_mismatched_input_raises_on_every_rank_without_hanging(job):
    _, text = job
    for rank in (0, 1):
        assert re.search(rf"rank {rank}: mismatch ValueError: .*different input_ids.*rank\(s\) \[1\]", text), text[
            -3000:
        ]
    after = re.findall(r"rank (\d): after-mismatch tokens=(.*)", text)
    assert len(after) == 2 and after[0][1] == after[1][1]  # the ranks are still in step


# ------------------------------------------------------------------------ single-process errors


@pytest.fixture
def no_weight_reads(monkeypatch):
    def refuse(self, name, *args, **kwargs):
        raise AssertionError(f"weight {name!r} was read")

    monkeypatch.setattr(Checkpoint, "get", refuse)
    monkeypatch.setattr(Checkpoint, "get_slice", refuse)


@pytest.fixture
def single_process(monkeypatch):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)


def test_tp_that_does_not_divide_the_heads_fails_before_any_weight_is_read(paths, no_weight_reads, single_process):
    with pytest.raises(ValueError, match="tp=3 does not divide num_attention_heads=4"):
        load_model(paths["dense"], backend="torch", tp=3)
    from hyper_gen.backends.torch.models import qwen3_5

    with pytest.raises(ValueError, match="tp=3 does not divide num_attention_heads=4"):
        qwen3_5.load(Checkpoint(paths["moe"]), "float32", plan=TPPlan(3, 1))
    # 4 ranks split the 4 query heads and replicate the 2 KV heads, but cannot split 2 DeltaNet key heads
    with pytest.raises(ValueError, match="tp=4 does not divide linear_num_key_heads=2"):
        qwen3_5.load(Checkpoint(paths["moe"]), "float32", plan=TPPlan(4, 0))


def test_tp_plan_without_a_process_group_is_refused(paths, no_weight_reads, single_process):
    from hyper_gen.backends.torch.models import qwen3_5

    refusal = "plan tp=2 but the world group has 1 rank(s): launch 2 processes (torchrun --nproc_per_node 2)"
    with pytest.raises(ValueError, match=re.escape(refusal)):
        qwen3_5.load(Checkpoint(paths["dense"]), "float32", plan=TPPlan(2, 1))
    with pytest.raises(TypeError, match="plan must be a hyper_gen.parallel.tp_plan.TPPlan"):
        qwen3_5.load(Checkpoint(paths["dense"]), "float32", plan=(2, 1))


def test_tp2_in_a_single_process_is_a_clear_error(paths, no_weight_reads, single_process):
    with pytest.raises(ValueError, match=r"tp=2 needs 2 processes launched together \(torchrun --nproc_per_node 2"):
        load_model(paths["dense"], backend="torch", tp=2)


@pytest.mark.parametrize("tp", [0, -1, 2.0, "2", True, None])
def test_bad_tp_values(paths, tp):
    with pytest.raises(ValueError, match="tp must be an int >= 1"):
        load_model(paths["dense"], backend="torch", tp=tp)


# ------------------------------------------------------------------------------ traffic formula


def test_collective_bytes_per_decode_step_formula(paths):
    config = Qwen3_5Config.from_dict(Checkpoint(paths["dense"]).config)  # hidden 32, 4 layers, vocab 97
    assert decode_step_collectives(config, batch=3, tp=2, dtype_bytes=4) == {
        "all_reduce": (9, 3 * 32 * 4),
        "all_gather": (1, 3 * 49 * 4),
    }
    # (1 + 2 * 4) * B*H*4 * 2*(2-1)/2  +  B * 98 * 4 * (2-1)/2
    assert collective_bytes_per_decode_step(config, 3, 2, 4) == 9 * 384 + 588
    # tp=4: vocab padded to 100, ring factors 2*3/4 and 3/4
    assert collective_bytes_per_decode_step(config, 1, 4, 2) == 9 * 64 * 1.5 + 100 * 2 * 0.75
    assert collective_bytes_per_decode_step(config, 8, 1, 4) == 0.0
    with pytest.raises(ValueError, match="tp must be an int >= 1"):
        collective_bytes_per_decode_step(config, 1, 0, 4)


def test_tp_ranks_default_to_their_own_accelerator(monkeypatch):
    import hyper_gen.backends.torch.devices as adapter

    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(adapter, "default_device", lambda: "npu")
    assert adapter.rank_device() == "npu:1"
    assert adapter.distributed_backend(adapter.rank_device()) == "hccl"
    monkeypatch.setattr(adapter, "default_device", lambda: "cpu")
    assert adapter.rank_device() == "cpu" and adapter.distributed_backend("cpu") == "gloo"
