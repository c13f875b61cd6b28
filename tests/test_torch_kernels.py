"""The torch projections' kernels (hyper_gen.backends.torch.kernels): each product is ``x @ w``
(against float64), the timing rule keeps a kernel only where it is faster, the choice is the
model's plan (recorded, pinned, never changed after load), a weight changed in place is packed
again, and a model whose projections all run one kernel generates what HF does."""

import gc
import glob
import json
import os

import numpy as np
import pytest
import torch
from hf_greedy import assert_generates_what_hf_does
from qwen_checkpoints import TINY_TEXT_CONFIG, make_checkpoint
from safetensors.numpy import load_file

from hyper_gen.backends.torch import kernels as K
from hyper_gen.config import GenerationConfig
from hyper_gen.generation import generate
from hyper_gen.kernel_plan import KernelPlan
from hyper_gen.models.loading import load_model
from hyper_gen.models.weight_update import update_weights


@pytest.fixture(autouse=True)
def own_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("HYPER_GEN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("HYPER_GEN_TORCH_ONEDNN_GEMM_MB", raising=False)
    monkeypatch.delenv("HYPER_GEN_KERNELS", raising=False)


def planned(kernel: str, budget=1 << 30) -> K.TorchKernels:
    """Kernels whose every (80, 96) weight runs ``kernel`` (a pinned plan of that one shape)."""
    kernels = K.TorchKernels(KernelPlan("torch", "test", "pinned", {K.plan_key(80, 96): kernel}), budget)
    kernels.by_shape[(80, 96)] = kernel
    return kernels


def test_this_torch_build_has_the_onednn_kernels():
    assert K.onednn_available()  # the CPU wheels CI installs: a missing kernel must fail here, not skip


@pytest.mark.parametrize("rows", [(1,), (5,), (2, 1), (3, 7), (64,)])
@pytest.mark.parametrize("kernel", ["blocked:32", "blocked:256", "onednn"])
def test_each_kernel_is_the_product(rows, kernel):
    torch.manual_seed(0)
    weight = torch.randn(768, 80, dtype=torch.float64)  # (out, in), the checkpoint's layout
    x = torch.randn(*rows, 80, dtype=torch.float64)
    reference = x @ weight.t()
    if kernel == "onednn":
        got = K.packed_product(x.float(), K.pack(weight.float()))
    else:
        width = int(kernel.split(":")[1])
        got = K.blocked(x.float(), weight.float(), width)
        # float64 through the same code is the reference to rounding: the blocks are the same sums
        torch.testing.assert_close(K.blocked(x, weight, width), reference, rtol=1e-12, atol=1e-12)
    assert got.shape == (*rows, 768) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), reference, rtol=1e-5, atol=1e-4)


def test_a_packed_row_does_not_depend_on_the_other_rows():
    torch.manual_seed(1)
    packed = K.pack(torch.randn(1536, 512))
    x = torch.randn(16, 512)
    whole = K.packed_product(x, packed)
    for row in (0, 7, 15):
        assert torch.equal(K.packed_product(x[row : row + 1], packed), whole[row : row + 1])


def fake_timer(times: dict):
    """Seconds by (kernel, rows): 1.0 at prefill / decode rows and 0.1 for one row unless given."""
    calls = []

    def timer(rows, inner, out, kernel):
        calls.append((rows, kernel, out))
        return times.get((kernel, rows), 1.0 if rows > 1 else 0.1)

    return timer, calls


def test_blocks_are_kept_only_when_faster_at_prefill_and_not_slower_for_one_row(monkeypatch):
    monkeypatch.setattr(K, "onednn_available", lambda: False)
    for width in (256, 1024):
        assert K.measure(1024, 3072, fake_timer({(f"blocked:{width}", 64): 2.0})[0]) == "plain"
    timer, _ = fake_timer({("blocked:512", 64): 0.5, ("blocked:256", 64): 2.0, ("blocked:1024", 64): 2.0})
    assert K.measure(1024, 3072, timer) == "blocked:512"
    timer, _ = fake_timer({("blocked:512", 64): 0.9})  # not faster by the margin
    assert K.measure(1024, 3072, timer) == "plain"
    timer, _ = fake_timer({("blocked:512", 64): 0.5, ("blocked:512", 1): 0.2})  # batch-1 decode: twice the time
    assert K.measure(1024, 3072, timer) == "plain"
    timer, calls = fake_timer({})
    assert K.measure(1024, 248320, timer) == "plain"  # a large vocabulary's head is never blocked
    assert not any(kernel.startswith("blocked") for _, kernel, _ in calls)


def test_onednn_is_kept_only_when_faster_at_prefill_and_decode_rows_and_not_slower_for_one_row():
    fast = {("onednn", 64): 0.5, ("onednn", 16): 0.5, ("onednn", 1): 0.1}
    assert K.measure(1024, 3072, fake_timer(fast)[0]) == "onednn"
    for slow in ({("onednn", 64): 0.95}, {("onednn", 16): 0.95}, {("onednn", 1): 0.12}):
        assert K.measure(1024, 3072, fake_timer({**fast, **slow})[0]) == "plain", slow
    # against the blocks where they won, and a wide head timed on a slice of its columns
    timer, _ = fake_timer({**fast, ("blocked:512", 64): 0.4})
    assert K.measure(1024, 3072, timer) == "blocked:512"
    timer, calls = fake_timer(fast)
    assert K.measure(1024, 248320, timer) == "onednn"
    assert {out for _, _, out in calls} == {K.SLICE_OUT}


def test_small_or_non_float32_weights_are_not_planned():
    kernels = K.TorchKernels(KernelPlan("torch", "test", "pinned", {}))  # pinned and empty: a lookup would raise
    assert kernels.kernel_for(torch.zeros(64, 96)) == "plain"
    assert kernels.kernel_for(torch.zeros(1024, 1024, dtype=torch.float64)) == "plain"
    assert kernels.kernel_for(torch.zeros(4, 1024, 1024)) == "plain"  # the experts' stacked matrices
    with pytest.raises(ValueError, match="has no kernel for 'matmul 1024x1024 float32'"):
        kernels.kernel_for(torch.zeros(1024, 1024))
    assert kernels.used_plan().choices == {}


def test_a_pinned_plan_that_cannot_run_is_a_value_error():
    bad = KernelPlan("torch", "test", "pinned", {K.plan_key(1024, 1000): "blocked:256"}, "plan.json")
    with pytest.raises(ValueError, match="256 must divide 1000"):
        K.TorchKernels(bad).kernel_for(torch.zeros(1024, 1000))
    with pytest.raises(ValueError, match="'tiled:4' is not a torch kernel"):
        K.TorchKernels(KernelPlan("torch", "test", "pinned", {"matmul 4x4 float32": "tiled:4"}, "plan.json"))


def test_each_kernel_projects_what_x_at_w_gives_and_keeps_its_layout():
    x = torch.randn(4, 80)
    w_t = torch.randn(96, 80).t()  # the (in, out) view of (out, in) memory, as loaded
    for kernel in ("plain", "blocked:32", "onednn"):
        kernels = planned(kernel)
        w = kernels.layout(w_t)
        assert w.t().is_contiguous() == (kernel != "plain")  # blocks and oneDNN read the (out, in) memory
        torch.testing.assert_close(kernels.project(x, w), x @ w, rtol=1e-5, atol=1e-5)
    onednn = planned("onednn")
    torch.testing.assert_close(onednn.project(x.double(), w_t.double()), x.double() @ w_t.double())  # float64: plain
    assert onednn.bytes == 0
    trained = torch.nn.Parameter(torch.randn(80, 96))
    torch.testing.assert_close(onednn.project(x, trained), x @ trained)  # grad mode on a weight being trained
    assert onednn.bytes == 0
    with torch.no_grad():
        onednn.project(x, trained)
    assert onednn.bytes == 80 * 96 * 4


def test_a_weight_changed_in_place_is_packed_again():
    """An optimizer step between two rollouts updates the weight in place: the next product must
    use the new values, not the copy packed before."""
    kernels = planned("onednn")
    x = torch.randn(3, 80)
    w = torch.nn.Parameter(torch.randn(80, 96))
    with torch.no_grad():
        before = kernels.project(x, w)
        w.mul_(-2.0)
        after = kernels.project(x, w)
        torch.testing.assert_close(after, x @ w, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(after, -2.0 * before, rtol=1e-5, atol=1e-5)
        w.copy_(torch.zeros(80, 96))
        assert torch.equal(kernels.project(x, w), torch.zeros(3, 96))


def test_copies_stay_within_the_budget_and_go_with_their_weight():
    one = 80 * 96 * 4
    kernels = planned("onednn", budget=2 * one)
    x = torch.randn(2, 80)
    kept = [torch.randn(80, 96) for _ in range(3)]
    results = [kernels.project(x, w) for w in kept]
    assert kernels.bytes == 2 * one and len(kernels.refused) == 1  # the third runs plain
    torch.testing.assert_close(results[2], x @ kept[2])
    del kept[0], results
    gc.collect()
    assert kernels.bytes == one  # a freed weight's copy is freed with it


def test_an_inference_tensor_runs_plain():
    """A weight made under torch.inference_mode has no version counter (an in-place change could
    not be seen), so it is never packed."""
    kernels = planned("onednn")
    with torch.inference_mode():
        w = torch.randn(80, 96)
        x = torch.randn(3, 80)
        assert torch.equal(kernels.project(x, w), x @ w)
    assert kernels.bytes == 0


def forced(monkeypatch, kernel):
    """Every projection of the tiny models planned, and timed as ``kernel`` winning."""
    monkeypatch.setattr(K, "MIN_ELEMENTS", 0)
    monkeypatch.setattr(K, "measure", lambda inner, out: kernel if out % 16 == 0 or kernel == "onednn" else "plain")


@pytest.mark.parametrize("kernel", ["blocked:16", "onednn"])
def test_a_model_whose_projections_all_run_one_kernel_generates_what_hf_does(tmp_path, monkeypatch, kernel):
    forced(monkeypatch, kernel)
    ran = []
    original = K.blocked if kernel != "onednn" else K.packed_product
    monkeypatch.setattr(
        K, "blocked" if kernel != "onednn" else "packed_product", lambda *a: ran.append(1) or original(*a)
    )
    path = make_checkpoint(tmp_path, "dense")
    model = load_model(path, backend="torch", dtype="float32")
    assert_generates_what_hf_does(model, path)
    assert ran
    shapes = set(model.kernel_plan.choices)
    assert {"matmul 32x192 float32", "matmul 64x32 float32", "matmul 48x32 float32"} <= shapes  # q|k|v, o, down
    assert all(v in (kernel, "plain") for v in model.kernel_plan.choices.values())


@pytest.mark.parametrize("kind", ["dense", "moe"])
@pytest.mark.parametrize("kernel", ["blocked:16", "onednn"])
def test_update_weights_reaches_every_kernel(tmp_path, monkeypatch, kernel, kind):
    """A full update after a generate (the oneDNN copies packed from the old weights) gives bitwise
    the logits of a fresh load of the new checkpoint: the write bumps each weight's version, so the
    packed copies are remade (a write through ``.data`` would not, and the model would project with
    the old weights); fused projections are written piece by piece into their columns."""
    forced(monkeypatch, kernel)
    old, new = make_checkpoint(tmp_path, kind), make_checkpoint(tmp_path, kind, seed=1)
    ids = torch.from_numpy(np.random.default_rng(4).integers(3, TINY_TEXT_CONFIG["vocab_size"], (2, 9)))
    config = GenerationConfig(max_new_tokens=4, eos_token_id=None, return_dict_in_generate=True, output_logits=True)
    model = load_model(old, backend="torch", dtype="float32")
    before = generate(model, ids, config)
    tensors = {}
    for name in sorted(glob.glob(os.path.join(new, "*.safetensors"))):
        tensors.update(load_file(name))
    assert update_weights(model, {k: torch.from_numpy(v) for k, v in tensors.items()}) == len(tensors)
    after, fresh = (
        generate(model, ids, config),
        generate(load_model(new, backend="torch", dtype="float32"), ids, config),
    )
    assert all(torch.equal(x, y) for x, y in zip(after.logits, fresh.logits))
    assert not all(torch.equal(x, y) for x, y in zip(after.logits, before.logits))
    assert set(model.kernel_plan.choices.values()) <= {kernel, "plain"} and kernel in model.kernel_plan.choices.values()


def test_the_plan_is_recorded_once_and_a_saved_plan_pins_the_same_logits(tmp_path, monkeypatch):
    """auto writes the host's plan on first load; a second load reads it (nothing timed); a saved
    plan, pinned, gives bitwise the same logits; plain runs no planned kernel."""
    monkeypatch.setattr(K, "MIN_ELEMENTS", 0)
    timed = []

    def measure(inner, out):
        timed.append((inner, out))
        return "onednn" if (inner + out) % 3 else "blocked:16" if out % 16 == 0 else "plain"

    monkeypatch.setattr(K, "measure", measure)
    path = make_checkpoint(tmp_path, "moe")
    first = load_model(path, backend="torch", kernels="auto")
    assert timed and len(timed) == len(set(timed)) == len(first.kernel_plan.choices)
    count = len(timed)
    second = load_model(path, backend="torch")  # the default is auto
    assert len(timed) == count and second.kernel_plan.choices == first.kernel_plan.choices
    assert first.kernel_plan.mode == "auto" and "matmul" in str(first.kernel_plan)

    plan_file = tmp_path / "plan.json"
    first.kernel_plan.save(plan_file)
    assert json.loads(plan_file.read_text())["choices"] == first.kernel_plan.choices
    pinned = load_model(path, backend="torch", kernels=str(plan_file))
    assert pinned.kernel_plan.mode == "pinned" and len(timed) == count
    ids = torch.from_numpy(np.random.default_rng(3).integers(3, TINY_TEXT_CONFIG["vocab_size"], (2, 9)))
    config = GenerationConfig(max_new_tokens=4, eos_token_id=None, return_dict_in_generate=True, output_logits=True)
    a, b = generate(first, ids, config), generate(pinned, ids, config)
    assert all(torch.equal(x, y) for x, y in zip(a.logits, b.logits))
    plain = load_model(path, backend="torch", kernels="plain")
    assert plain.kernel_plan.mode == "plain" and set(plain.kernel_plan.choices) == set()
    assert len(timed) == count


def test_a_model_loaded_under_inference_mode_generates(tmp_path, monkeypatch):
    forced(monkeypatch, "onednn")
    path = make_checkpoint(tmp_path, "dense")
    reference = load_model(path, backend="torch", dtype="float32", kernels="plain")
    with torch.inference_mode():
        model = load_model(path, backend="torch", dtype="float32")
    ids = torch.from_numpy(np.random.default_rng(2).integers(3, TINY_TEXT_CONFIG["vocab_size"], (2, 7)))
    config = GenerationConfig(max_new_tokens=5, eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        out = generate(model, ids, config)
    assert out.tolist() == generate(reference, ids, config).tolist()
