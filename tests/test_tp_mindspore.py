"""Tensor-parallel MindSpore Qwen3.5: TP=2 under msrun gives the single-device results.

One msrun launch (2 workers, about a minute) runs tests/dist_scripts/tp_mindspore.py on three
tiny checkpoints: dense (tied embeddings: the LM-head block doubles as the embedding), MoE (the
fused expert layout) and the dense model cut to a single KV head (fewer KV heads than ranks: both
ranks keep it). Each rank builds the TP=2 shard and the whole model in the same process and
reports; the tests below assert on that report. The vocabulary (97) is odd, so the second rank's
block is zero-padded to 49 columns and generate() trims it after the gather.

float64 collectives on MindSpore CPU: AllReduce has no float64 kernel (TypeError) and AllGather
rounds float64 to float32, so the float64 model sums its row-parallel outputs by moving the float64
bits as int32 words; its logits then match one device to ~1e-13 (the bar is 1e-9).
"""

import json
import os
import shutil

import pytest
from launch import msrun, script
from qwen_checkpoints import TINY_TEXT_CONFIG, make_checkpoint

KINDS = ("dense", "moe", "one_kv_head")
FULL_KINDS = ("dense", "moe")  # also float32, sampling, the split errors and the collective volume
VOCAB = TINY_TEXT_CONFIG["vocab_size"]


def _one_kv_head(source, target):
    """``source`` with num_key_value_heads=1: k_proj / v_proj keep their first head's rows."""
    from safetensors.numpy import load_file, save_file

    os.makedirs(target, exist_ok=True)
    with open(os.path.join(source, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    config["num_key_value_heads"] = 1
    with open(os.path.join(target, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f)
    tensors = load_file(os.path.join(source, "model.safetensors"))
    for name, tensor in tensors.items():
        if name.endswith(("k_proj.weight", "v_proj.weight")):
            tensors[name] = tensor[: config["head_dim"]].copy()
    save_file(tensors, os.path.join(target, "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(os.path.join(source, "generation_config.json"), target)
    return target


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """(kind, check) -> {rank: reported values}, from one 2-worker msrun job."""
    root = tmp_path_factory.mktemp("tp_mindspore")
    dense = make_checkpoint(root, "dense", tie_word_embeddings=True)
    paths = {
        "dense": dense,
        "moe": make_checkpoint(root, "moe", fused_experts=True),
        "one_kv_head": _one_kv_head(dense, os.path.join(root, "dense-one-kv-head")),
    }
    result = msrun(
        [script("tp_mindspore.py")] + [f"{kind}={path}" for kind, path in paths.items()],
        log_dir=str(root / "logs"),
        timeout=600,
    )
    assert result.returncode == 0, result.worker_logs[-6000:]
    rows = {}
    for line in result.worker_logs.splitlines():
        if line.startswith("TP "):
            item = json.loads(line[3:])
            rows.setdefault((item["kind"], item["check"]), {})[item.pop("rank")] = item
    for rank in (0, 1):
        assert f"rank {rank}: done" in result.worker_logs, result.worker_logs[-6000:]
    return rows


def _both(report, kind, check):
    ranks = report[(kind, check)]
    assert sorted(ranks) == [0, 1], (kind, check, ranks)
    return ranks[0], ranks[1]


@pytest.mark.distributed
@pytest.mark.parametrize("kind", KINDS)
def test_float64_logits_match_single_device(report, kind):
    """Prefill of a left-padded batch (a 70-token prompt: two delta-rule chunks) + 3 decode steps."""
    for rank, item in enumerate(_both(report, kind, "logits-float64")):
        print(
            f"{kind} rank {rank}: float64 max |TP - single| = {item['max_abs_diff']:.3e} "
            f"(max |logit| {item['max_abs_logit']:.2f})"
        )
        assert item["max_abs_diff"] <= 1e-9, item
        assert item["shard_width"] == item["expected_width"] == 49  # padded vocab 98 / 2
        assert item["padding_zero"]


@pytest.mark.distributed
@pytest.mark.parametrize("kind", FULL_KINDS)
def test_float32_logits_close_to_single_device(report, kind):
    for rank, item in enumerate(_both(report, kind, "logits-float32")):
        print(
            f"{kind} rank {rank}: float32 max |TP - single| = {item['max_abs_diff']:.3e} "
            f"(max |logit| {item['max_abs_logit']:.2f})"
        )
        assert item["max_abs_diff"] <= 1e-4 * max(1.0, item["max_abs_logit"]), item


@pytest.mark.distributed
@pytest.mark.parametrize("kind", KINDS)
def test_generate_gives_the_single_device_tokens(report, kind):
    """generate() on the TP model (vocab-sharded logits gathered and trimmed) vs the whole model:
    greedy and seeded sampling, left-padded batch with a prompt longer than 64 tokens. float64
    must match exactly; float32 may differ only after a near tie (top-2 gap < 1e-4)."""
    checks = [check for (k, check) in report if k == kind and check.startswith("generate-")]
    expected = {"generate-greedy-float64"} | (
        {"generate-seeded-float64", "generate-greedy-float32", "generate-seeded-float32"}
        if kind in FULL_KINDS
        else set()
    )
    assert set(checks) == expected
    for check in checks:
        for item in _both(report, kind, check):
            if item["equal"]:
                continue
            assert check.endswith("float32") and item["tie_gap"] < 1e-4, (check, item)


@pytest.mark.distributed
@pytest.mark.parametrize("kind", KINDS)
def test_both_ranks_return_identical_outputs(report, kind):
    for k, check in report:
        if k == kind and check.startswith("generate-"):
            first, second = _both(report, kind, check)
            assert first["tokens"] == second["tokens"], check
            assert len(first["tokens"]) == 3 and len(first["tokens"][0]) == 70 + 8


@pytest.mark.distributed
@pytest.mark.parametrize("kind", KINDS)
def test_each_rank_reads_only_its_slices(report, kind):
    """No split weight is read whole; the ranks' slices add up to the whole split weights once."""
    first, second = _both(report, kind, "reads")
    attention_layers = [i for i, t in enumerate(TINY_TEXT_CONFIG["layer_types"]) if t == "full_attention"]
    replicated_kv = sorted(f"model.layers.{i}.self_attn.{p}_proj.weight" for i in attention_layers for p in "kv")
    for item in (first, second):
        assert item["unsplit_full_reads"] == (replicated_kv if kind == "one_kv_head" else [])
        assert item["replicated_elements"] == item["total_replicated_elements"]
    if kind == "one_kv_head":  # the single KV head is read by both ranks
        head = TINY_TEXT_CONFIG["head_dim"] * TINY_TEXT_CONFIG["hidden_size"]
        replicated_kv = 2 * head * TINY_TEXT_CONFIG["layer_types"].count("full_attention")
        assert first["split_elements"] + second["split_elements"] == first["total_split_elements"] + replicated_kv
    else:
        assert first["split_elements"] + second["split_elements"] == first["total_split_elements"]


@pytest.mark.distributed
@pytest.mark.parametrize("kind", FULL_KINDS)
def test_bad_plans_fail_before_any_weight_is_read(report, kind):
    for item in _both(report, kind, "tp3"):
        assert item["error"] == "tp=3 does not divide num_attention_heads=4" and item["reads"] == 0
    for rank, item in enumerate(_both(report, kind, "wrong-rank")):
        assert item["error"] == f"plan rank={1 - rank} but this process is rank {rank} of the world group"
        assert item["reads"] == 0


@pytest.mark.distributed
@pytest.mark.parametrize("kind", KINDS)
def test_model_declares_its_split(report, kind):
    for rank, item in enumerate(_both(report, kind, "attributes")):
        assert item == {
            "kind": kind,
            "check": "attributes",
            "parallel_group": None,
            "has_group": True,
            "vocab_parallel": True,
            "vocab_size": VOCAB,
            "plan": [2, rank],
            "single_parallel": False,
        }


@pytest.mark.distributed
@pytest.mark.parametrize("kind", FULL_KINDS)
def test_collective_volume(report, kind):
    """Per forward: one all-reduce per mixer, one per MLP, one for the embedding; float32 uses
    AllReduce of (B, S, hidden), float64 the exact AllGather of its bits (same bytes sent)."""
    layers, hidden, batch = TINY_TEXT_CONFIG["num_hidden_layers"], TINY_TEXT_CONFIG["hidden_size"], 3
    per_forward = 2 * layers + 1
    for item in _both(report, kind, "decode-step-bytes"):
        assert item["collectives"] == {
            "all_reduce": [per_forward, per_forward * batch * hidden * 4],
            "all_gather": [0, 0],
        }
    for dtype, collective in (("float32", "all_reduce"), ("float64", "all_gather")):
        for item in _both(report, kind, f"logits-{dtype}"):
            assert item["collectives"][collective][0] == per_forward * item["forwards"]


def test_split_errors_without_msrun(tmp_path):
    """In one process: a tp that does not divide the heads fails before any read, and a TP shard
    without a matching communication group fails with the group named."""
    from hyper_gen.backends.mindspore import configure
    from hyper_gen.backends.mindspore.models import qwen3_5
    from hyper_gen.models.checkpoint import Checkpoint
    from hyper_gen.parallel.tp_plan import TPPlan

    configure("CPU")
    path = make_checkpoint(tmp_path, "moe")

    class Counting(Checkpoint):
        reads = 0

        def _read(self, *args):
            Counting.reads += 1
            return super()._read(*args)

    with pytest.raises(ValueError, match=r"tp=3 does not divide num_attention_heads=4"):
        qwen3_5.load(Counting(path), "float32", plan=TPPlan(3, 1))
    with pytest.raises(ValueError, match=r"tp=4 does not divide linear_num_key_heads=2"):
        qwen3_5.load(Counting(path), "float32", plan=TPPlan(4, 0))
    with pytest.raises(ValueError, match=r"plan tp=2 but the world group has 1 rank"):
        qwen3_5.load(Counting(path), "float32", plan=TPPlan(2, 0))
    with pytest.raises(TypeError, match="plan must be a hyper_gen.parallel.tp_plan.TPPlan"):
        qwen3_5.load(Counting(path), "float32", plan=2)
    assert Counting.reads == 0
