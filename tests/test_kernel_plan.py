"""The kernel plan (hyper_gen.kernel_plan): which kernel each product shape runs, chosen once per host
(timed, under a lock, cached on disk), plain, or pinned from a recorded file; bad specs named before
any work; and fresh processes on one host giving bitwise the same logits on both backends, under
background CPU load, for a model whose kernels are chosen by timing."""

import json
import multiprocessing
import os
import subprocess
import sys
import time

import pytest
from launch import REPO, _env
from qwen_checkpoints import make_checkpoint

from hyper_gen import kernel_plan
from hyper_gen.kernel_plan import KernelPlan
from hyper_gen.models.loading import load_model


@pytest.fixture(autouse=True)
def own_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("HYPER_GEN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("HYPER_GEN_KERNELS", raising=False)


def test_a_spec_is_auto_plain_or_an_existing_plan_file(tmp_path, monkeypatch):
    assert kernel_plan.check_spec(None) == "auto"
    assert kernel_plan.check_spec("plain") == "plain"
    plan = tmp_path / "plan.json"
    plan.write_text('{"choices": {}}')
    assert kernel_plan.check_spec(plan) == str(plan)  # a PathLike too
    with pytest.raises(ValueError, match=r"kernels must be 'auto', 'plain' or a plan \.json path, got 'fast'"):
        kernel_plan.check_spec("fast")
    with pytest.raises(ValueError, match="no such kernel plan file"):
        kernel_plan.check_spec(str(tmp_path / "missing.json"))
    with pytest.raises(TypeError, match="kernels must be .* got int"):
        kernel_plan.check_spec(3)
    monkeypatch.setenv("HYPER_GEN_KERNELS", "plain")
    assert kernel_plan.check_spec(None) == "plain"
    monkeypatch.setenv("HYPER_GEN_KERNELS", "fastest")
    with pytest.raises(ValueError, match="HYPER_GEN_KERNELS must be .* got 'fastest'"):
        kernel_plan.check_spec(None)


@pytest.mark.parametrize("backend", ["torch", "mindspore"])
def test_load_model_names_a_bad_spec_before_any_work(tmp_path, backend):
    with pytest.raises(ValueError, match="kernels must be"):
        load_model(str(tmp_path / "no-model-here"), backend=backend, kernels="fast")


def test_auto_times_a_shape_once_per_host_and_keeps_it(tmp_path):
    calls = []

    def measure():
        calls.append(1)
        return "fast:1"

    first = KernelPlan.open("auto", "torch", "9.9", 2)
    assert first.mode == "auto" and first.path.startswith(str(tmp_path / "cache" / "kernels"))
    assert first.choose("matmul 8x8", measure) == "fast:1"
    assert first.choose("matmul 8x8", measure) == "fast:1"
    again = KernelPlan.open("auto", "torch", "9.9", 2)  # a later process on this host
    assert again.choose("matmul 8x8", measure) == "fast:1" and len(calls) == 1
    other = KernelPlan.open("auto", "torch", "9.9", 3)  # another thread count is another host key
    assert other.path != first.path and other.choose("matmul 8x8", measure) == "fast:1" and len(calls) == 2
    assert KernelPlan.open("plain", "torch", "9.9", 2).choose("matmul 8x8", measure) == "plain"
    assert len(calls) == 2


def test_a_pinned_plan_runs_what_it_records_and_refuses_what_it_lacks(tmp_path):
    plan = KernelPlan.open("auto", "torch", "9.9", 2)
    plan.choose("matmul 8x8", lambda: "fast:1")
    saved = tmp_path / "plan.json"
    plan.save(saved)
    pinned = KernelPlan.open(str(saved), "torch", "9.9", 2)
    assert pinned.mode == "pinned" and pinned.choose("matmul 8x8", lambda: "other") == "fast:1"
    with pytest.raises(ValueError, match="has no kernel for 'matmul 16x16'; record one with kernels='auto'"):
        pinned.choose("matmul 16x16", lambda: "other")
    with pytest.raises(ValueError, match="is for backend 'torch', not 'mindspore'"):
        KernelPlan.open(str(saved), "mindspore", "2.10", 2)
    with pytest.raises(ValueError, match="'fast:1' is not a torch kernel"):
        pinned.check(lambda kernel: kernel == "plain")
    assert "matmul 8x8: fast:1" in str(pinned) and pinned.used([]).choices == {}


@pytest.mark.parametrize(
    "text, says",
    [
        ("{not json", "is not a readable plan"),
        ('{"choices": []}', "has no 'choices' object"),
        ('{"choices": {"a": 1}}', "str key"),
    ],
)
def test_a_corrupt_plan_file_is_named(tmp_path, text, says):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=says):
        KernelPlan.open(str(path), "torch", "9.9", 2)


def _choose_in_a_process(cache: str, log: str) -> str:
    os.environ["HYPER_GEN_CACHE_DIR"] = cache

    def measure():
        with open(log, "a") as f:
            f.write("timed\n")
        time.sleep(0.5)  # long enough for the other process to reach the lock
        return f"pid:{os.getpid()}"

    return KernelPlan.open("auto", "torch", "9.9", 2).choose("matmul 8x8", measure)


def test_processes_loading_at_once_time_a_shape_once(tmp_path):
    log = str(tmp_path / "timed.log")
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        results = pool.starmap(_choose_in_a_process, [(str(tmp_path / "cache"), log)] * 2)
    assert results[0] == results[1]  # the second read the first's choice
    with open(log) as f:
        assert f.read() == "timed\n"


# a float32 model whose projections are large enough for their kernels to be chosen by timing
TIMED_SHAPES = dict(
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=2,
    layer_types=["linear_attention", "full_attention"],
    num_attention_heads=8,
    head_dim=64,
    linear_num_key_heads=2,
    linear_num_value_heads=8,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
)


def _processes(path, backend, modes, count, cache):
    """``count`` fresh processes, two at a time, each loading under each of ``modes`` in turn, the
    first two beside a busy-looping one (under auto they are the ones that time; later ones read the
    plan they cached): their JSON lines, ``{mode: result}``."""
    env = dict(_env(), HYPER_GEN_CACHE_DIR=cache)
    script = os.path.join(REPO, "tests", "kernel_plan_run.py")
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        results = []
        for _ in range(0, count, 2):
            runs = [
                subprocess.Popen(
                    [sys.executable, script, path, backend, ",".join(modes)],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                    env=env,
                    cwd=REPO,
                )
                for _ in range(2)
            ]
            for run in runs:
                out, err = run.communicate(timeout=600)
                assert run.returncode == 0, err[-3000:]
                results.append(json.loads(out.strip().splitlines()[-1]))
            busy.kill()  # the load only matters while a process times (a core for the rest of the suite)
        return results
    finally:
        busy.kill()
        busy.wait()


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torch", "mindspore"])
def test_fresh_processes_give_bitwise_the_same_logits(tmp_path, backend):
    """Four processes under auto (the first two time the shapes concurrently, under load; the other
    two read the plan they cached), each then loading the plan it ran pinned (beside an empty cache)
    and plain: each mode's logits bitwise equal in every process, the pinned ones auto's."""
    path = make_checkpoint(tmp_path, "dense", text_overrides=TIMED_SHAPES)
    runs = _processes(path, backend, ("auto", "pinned", "plain"), 4, str(tmp_path / "cache"))
    auto = [r["auto"] for r in runs]
    assert len({r["logits"] for r in auto}) == 1, [r["plan"] for r in auto]
    assert all(r["tokens"] == auto[0]["tokens"] and r["plan"] == auto[0]["plan"] for r in auto)
    assert auto[0]["plan"], "no shape of this model was planned: the test would prove nothing"
    pinned = [r["pinned"] for r in runs]
    assert {r["logits"] for r in pinned} == {auto[0]["logits"]} and {r["mode"] for r in pinned} == {"pinned"}
    assert all(r["plan"] == auto[0]["plan"] for r in pinned)
    plain = [r["plain"] for r in runs]
    assert len({r["logits"] for r in plain}) == 1 and all(r["plan"] == {} for r in plain)


def test_a_host_plan_another_version_wrote_to_is_read_around(tmp_path, monkeypatch):
    """The host's cache is shared by every hyper_gen on the host: kernels this version does not run
    (a newer one's) stay in the file and are never run here; a shape of them is timed afresh."""
    monkeypatch.setenv("HYPER_GEN_CACHE_DIR", str(tmp_path))
    newer = KernelPlan.open("auto", "torch", "9.9", 2)
    newer.choose("matmul 8x8", lambda: "fast:1")
    newer.choose("rows 8x8", lambda: "rows:4")
    plan = KernelPlan.open("auto", "torch", "9.9", 2)
    plan.check(lambda kernel: kernel.startswith("fast"))
    assert plan.choices == {"matmul 8x8": "fast:1"}
    assert plan.choose("rows 8x8", lambda: "fast:2") == "fast:2"
    with open(plan.path) as f:
        assert json.load(f)["choices"] == {"matmul 8x8": "fast:1", "rows 8x8": "fast:2"}
