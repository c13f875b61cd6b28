"""torch projections through oneDNN-packed weights (hyper_gen.backends.torch.onednn_gemm): the
products ``x @ w`` gives, the choice kept only where the timing says it is faster, a weight changed
in place packed again, and a model whose projections all run packed generating what HF does."""

import numpy as np
import pytest
import torch
from hf_greedy import assert_generates_what_hf_does
from qwen_checkpoints import TINY_TEXT_CONFIG, make_checkpoint

from hyper_gen.backends.torch import onednn_gemm
from hyper_gen.config import GenerationConfig
from hyper_gen.generation import generate
from hyper_gen.models.loading import load_model


@pytest.fixture(autouse=True)
def fresh_choices(monkeypatch):
    monkeypatch.setattr(onednn_gemm, "_CHOSEN", {})
    monkeypatch.setattr(onednn_gemm, "_SHARED", None)
    monkeypatch.delenv("HYPER_GEN_TORCH_ONEDNN_GEMM_MB", raising=False)


def test_this_torch_build_has_the_onednn_kernels():
    assert onednn_gemm.available()  # the CPU wheels CI installs: a missing kernel must fail here, not skip


@pytest.mark.parametrize("rows", [(1,), (5,), (2, 1), (3, 7), (64,)])
def test_packed_product_is_the_product(rows):
    torch.manual_seed(0)
    weight = torch.randn(768, 80, dtype=torch.float64)  # (out, in), the checkpoint's layout
    x = torch.randn(*rows, 80, dtype=torch.float64)
    reference = x @ weight.t()
    got = onednn_gemm.packed_product(x.float(), onednn_gemm.pack(weight.float()))
    assert got.shape == (*rows, 768) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), reference, rtol=1e-5, atol=1e-4)


def test_a_row_does_not_depend_on_the_other_rows():
    torch.manual_seed(1)
    packed = onednn_gemm.pack(torch.randn(1536, 512))
    x = torch.randn(16, 512)
    whole = onednn_gemm.packed_product(x, packed)
    for row in (0, 7, 15):
        assert torch.equal(onednn_gemm.packed_product(x[row : row + 1], packed), whole[row : row + 1])


def fake_timer(packed_by_rows: dict):
    """Seconds by (rows, kind): the current product 1.0 at every row count, packed as given."""
    calls = []

    def timer(rows, inner, out, kind):
        calls.append((rows, kind, out))
        return packed_by_rows[rows] if kind == "packed" else 1.0

    return timer, calls


def test_packed_kept_only_when_faster_at_prefill_and_decode_rows_and_not_slower_for_one_row():
    timer, _ = fake_timer({64: 0.5, 16: 0.5, 1: 1.0})
    assert onednn_gemm.use_packed(1024, 3072, timer)
    for slow in ({64: 0.95, 16: 0.5, 1: 1.0}, {64: 0.5, 16: 0.95, 1: 1.0}, {64: 0.5, 16: 0.5, 1: 1.2}):
        onednn_gemm._CHOSEN.clear()
        timer, _ = fake_timer(slow)
        assert not onednn_gemm.use_packed(1024, 3072, timer), slow


def test_choice_is_timed_once_per_shape_and_only_for_large_weights(monkeypatch):
    timer, calls = fake_timer({64: 0.5, 16: 0.5, 1: 1.0})
    assert onednn_gemm.use_packed(1024, 3072, timer)
    count = len(calls)
    assert onednn_gemm.use_packed(1024, 3072, timer)
    assert len(calls) == count  # cached
    assert not onednn_gemm.use_packed(64, 96, timer)  # too small to matter
    assert len(calls) == count
    # a large vocabulary's head: timed on a slice of its columns, against the whole product it runs
    assert onednn_gemm.use_packed(1024, 248320, timer)
    assert {(kind, out) for _, kind, out in calls[count:]} == {("packed", 1 << 14), ("whole", 1 << 14)}
    count = len(calls)
    monkeypatch.setenv("HYPER_GEN_TORCH_ONEDNN_GEMM_MB", "0")  # off: nothing timed
    assert not onednn_gemm.use_packed(2048, 3072, timer)
    assert len(calls) == count


@pytest.mark.parametrize("value", ["lots", "-1", "nan"])
def test_a_bad_budget_is_a_value_error_naming_the_variable(monkeypatch, value):
    monkeypatch.setenv("HYPER_GEN_TORCH_ONEDNN_GEMM_MB", value)
    with pytest.raises(ValueError, match=f"HYPER_GEN_TORCH_ONEDNN_GEMM_MB must be a number of MB >= 0, got '{value}'"):
        onednn_gemm.use_packed(1024, 3072, fake_timer({64: 0.5, 16: 0.5, 1: 1.0})[0])


def test_project_packs_only_chosen_float32_weights_not_being_trained():
    onednn_gemm._CHOSEN[(80, 96)] = True
    x = torch.randn(4, 80)
    w = torch.randn(80, 96)
    torch.testing.assert_close(onednn_gemm.project(x, w), x @ w, rtol=1e-5, atol=1e-5)
    assert onednn_gemm.project(x.double(), w.double()) is None  # float64 stays F.linear's
    assert onednn_gemm.project(x, torch.randn(80, 97)) is None  # an unchosen shape
    trained = torch.nn.Parameter(torch.randn(80, 96))
    assert onednn_gemm.project(x, trained) is None  # grad mode on a weight that requires grad
    with torch.no_grad():
        torch.testing.assert_close(onednn_gemm.project(x, trained), x @ trained, rtol=1e-5, atol=1e-5)


def test_a_weight_changed_in_place_is_packed_again():
    """An optimizer step between two rollouts updates the weight in place: the next product must
    use the new values, not the copy packed before."""
    onednn_gemm._CHOSEN[(80, 96)] = True
    x = torch.randn(3, 80)
    w = torch.nn.Parameter(torch.randn(80, 96))
    with torch.no_grad():
        before = onednn_gemm.project(x, w)
        w.mul_(-2.0)
        after = onednn_gemm.project(x, w)
        torch.testing.assert_close(after, x @ w, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(after, -2.0 * before, rtol=1e-5, atol=1e-5)
        w.copy_(torch.zeros(80, 96))
        assert torch.equal(onednn_gemm.project(x, w), torch.zeros(3, 96))


def test_copies_stay_within_the_budget_and_go_with_their_weight():
    onednn_gemm._CHOSEN[(80, 96)] = True
    weights = onednn_gemm.PackedWeights(budget=80 * 96 * 4 * 2)  # room for two
    x = torch.randn(2, 80)
    kept = [torch.randn(80, 96) for _ in range(3)]
    results = [weights.project(x, w) for w in kept]
    assert results[0] is not None and results[1] is not None
    assert results[2] is None  # past the budget: the caller's other products run
    assert weights.bytes == 80 * 96 * 4 * 2
    del kept[0], results
    import gc

    gc.collect()
    assert weights.bytes == 80 * 96 * 4  # a freed weight's copy is freed with it
    assert weights.project(x, torch.randn(80, 96)) is not None


def test_a_model_with_packed_projections_generates_what_hf_does(tmp_path, monkeypatch):
    """Every projection runs through its oneDNN-packed copy; the logits stay HF's within float32
    rounding and greedy decoding picks the same tokens."""
    monkeypatch.setattr(onednn_gemm, "MIN_ELEMENTS", 0)
    monkeypatch.setattr(onednn_gemm, "_seconds", lambda rows, inner, out, kind: 0.5 if kind == "packed" else 1.0)
    ran = []
    product = onednn_gemm.packed_product

    def counted(x, packed):
        ran.append(tuple(packed.shape))
        return product(x, packed)

    monkeypatch.setattr(onednn_gemm, "packed_product", counted)
    path = make_checkpoint(tmp_path, "dense")
    assert_generates_what_hf_does(load_model(path, backend="torch", dtype="float32"), path)
    assert len(set(ran)) >= 5  # q|k|v, o, q|k|v|z, out, gate|up, down and the head


def test_an_inference_tensor_is_left_to_the_other_products():
    """A weight made under torch.inference_mode has no version counter (an in-place change could
    not be seen), so it is never packed; generate still runs (the caller's other products)."""
    onednn_gemm._CHOSEN[(80, 96)] = True
    with torch.inference_mode():
        w = torch.randn(80, 96)
    x = torch.randn(3, 80)
    assert onednn_gemm.project(x, w) is None
    with torch.inference_mode():
        assert onednn_gemm.project(x, w) is None


def test_a_model_loaded_under_inference_mode_generates(tmp_path, monkeypatch):
    monkeypatch.setattr(onednn_gemm, "MIN_ELEMENTS", 0)
    monkeypatch.setattr(onednn_gemm, "_seconds", lambda rows, inner, out, kind: 0.5 if kind == "packed" else 1.0)
    path = make_checkpoint(tmp_path, "dense")
    reference = load_model(path, backend="torch", dtype="float32")
    with torch.inference_mode():
        model = load_model(path, backend="torch", dtype="float32")
    ids = torch.from_numpy(np.random.default_rng(2).integers(3, TINY_TEXT_CONFIG["vocab_size"], (2, 7)))
    config = GenerationConfig(max_new_tokens=5, eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        out = generate(model, ids, config)
    assert out.tolist() == generate(reference, ids, config).tolist()


def test_the_choices_are_described_for_the_benchmarks(monkeypatch):
    from hyper_gen.backends.torch import blocked_gemm
    from hyper_gen.backends.torch.projection import describe_choices

    monkeypatch.setattr(blocked_gemm, "_CHOSEN", {})
    assert describe_choices().startswith("none timed")
    onednn_gemm._CHOSEN.update({(512, 3072): True, (1536, 512): False, (512, 1536): False})
    blocked_gemm._CHOSEN.update({(512, 3072): 0, (1536, 512): 256, (512, 1536): 0})
    assert describe_choices() == "512x1536 MKL, 512x3072 oneDNN, 1536x512 blocked 256"
