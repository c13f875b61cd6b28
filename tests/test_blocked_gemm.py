"""torch projections over contiguous column blocks of the (out, in) weight
(hyper_gen.backends.torch.blocked_gemm): the products ``x @ w`` gives, the block width kept only
where the timing says it is faster, and a model loaded with blocks generating what HF does."""

import pytest
import torch
from hf_greedy import assert_generates_what_hf_does
from qwen_checkpoints import make_checkpoint

from hyper_gen.backends.torch import blocked_gemm
from hyper_gen.models.loading import load_model


@pytest.fixture(autouse=True)
def fresh_choices(monkeypatch):
    monkeypatch.setattr(blocked_gemm, "_CHOSEN", {})
    monkeypatch.delenv("HYPER_GEN_TORCH_BLOCKED_GEMM", raising=False)


@pytest.mark.parametrize("rows", [(1,), (5,), (2, 1), (3, 7)])
@pytest.mark.parametrize("out, width", [(96, 32), (768, 256)])
def test_blocked_product_is_the_whole_product(rows, out, width):
    torch.manual_seed(0)
    weight = torch.randn(out, 80, dtype=torch.float64)  # (out, in), the checkpoint's layout
    x = torch.randn(*rows, 80, dtype=torch.float64)
    reference = x @ weight.t()
    got = blocked_gemm.blocked(x.float(), weight.float(), width)
    assert got.shape == (*rows, out)
    torch.testing.assert_close(got.double(), reference, rtol=1e-5, atol=1e-5)
    # float64 through the same code is the reference to rounding: the blocks are the same sums
    torch.testing.assert_close(blocked_gemm.blocked(x, weight, width), reference, rtol=1e-12, atol=1e-12)


def fake_timer(blocked_prefill: float, blocked_one_row: float):
    """Seconds by (rows, width): the whole product 1.0 at prefill and 0.1 for one row; width 512
    ``blocked_prefill`` / ``blocked_one_row``; other widths slower than whole."""
    calls = []

    def timer(rows, inner, out, width):
        calls.append((rows, width))
        if width == 0:
            return 1.0 if rows > 1 else 0.1
        if width == 512:
            return blocked_prefill if rows > 1 else blocked_one_row
        return 2.0

    return timer, calls


def test_block_width_keeps_blocks_only_when_faster_at_prefill_and_not_slower_for_one_row():
    timer, _ = fake_timer(0.5, 0.1)
    assert blocked_gemm.block_width(1024, 3072, timer) == 512
    blocked_gemm._CHOSEN.clear()
    timer, _ = fake_timer(0.9, 0.1)  # not faster by the margin
    assert blocked_gemm.block_width(1024, 3072, timer) == 0
    blocked_gemm._CHOSEN.clear()
    timer, _ = fake_timer(0.5, 0.2)  # a batch-1 decode step would pay twice the time
    assert blocked_gemm.block_width(1024, 3072, timer) == 0


def test_block_width_is_timed_once_per_shape_and_only_for_large_divisible_weights():
    timer, calls = fake_timer(0.5, 0.1)
    assert blocked_gemm.block_width(1024, 3072, timer) == 512
    count = len(calls)
    assert blocked_gemm.block_width(1024, 3072, timer) == 512
    assert len(calls) == count  # cached
    assert blocked_gemm.candidates(3072) == (256, 512, 1024)
    assert blocked_gemm.candidates(3000) == ()
    assert blocked_gemm.block_width(1024, 3000, timer) == 0  # no width divides it
    assert blocked_gemm.block_width(64, 96, timer) == 0  # too small to matter
    assert blocked_gemm.block_width(1024, 248320, timer) == 0  # a large vocabulary's head stays whole
    assert len(calls) == count


def test_block_width_can_be_turned_off_and_rejects_a_bad_switch(monkeypatch):
    timer, calls = fake_timer(0.5, 0.1)
    monkeypatch.setenv("HYPER_GEN_TORCH_BLOCKED_GEMM", "0")
    assert blocked_gemm.block_width(1024, 3072, timer) == 0
    assert not calls
    monkeypatch.setenv("HYPER_GEN_TORCH_BLOCKED_GEMM", "yes")
    with pytest.raises(ValueError, match="HYPER_GEN_TORCH_BLOCKED_GEMM must be 0 or 1, got 'yes'"):
        blocked_gemm.block_width(1024, 3072, timer)


def test_project_blocks_only_weights_stored_for_it():
    blocked_gemm._CHOSEN[(80, 96)] = 32
    x = torch.randn(4, 80)
    kept = torch.randn(96, 80).t()  # (in, out) view of (out, in) memory: what ``stored`` keeps
    torch.testing.assert_close(blocked_gemm.project(x, kept), x @ kept, rtol=1e-5, atol=1e-5)
    assert blocked_gemm.project(x, kept.contiguous()) is None  # (in, out) memory: the whole product
    assert blocked_gemm.project(x.double(), kept.double()) is None  # float64 stays F.linear's
    assert blocked_gemm.project(x, torch.randn(96, 81).t()[:80]) is None  # an unchosen shape
    assert blocked_gemm.stored(kept) is kept
    assert blocked_gemm.stored(torch.randn(90, 80).t()).is_contiguous()  # not chosen: (in, out)


def test_a_model_with_blocked_projections_generates_what_hf_does(tmp_path, monkeypatch):
    """Every projection whose width has a divisor among the widths runs blocked; the logits stay
    HF's within float32 rounding and greedy decoding picks the same tokens."""
    monkeypatch.setattr(blocked_gemm, "WIDTHS", (16, 32))
    monkeypatch.setattr(blocked_gemm, "MIN_ELEMENTS", 0)
    monkeypatch.setattr(blocked_gemm, "_seconds", lambda rows, inner, out, width: 0.5 if width else 1.0)
    ran = []
    whole_product = blocked_gemm.blocked

    def counted(x, weight, width):
        ran.append(tuple(weight.shape))
        return whole_product(x, weight, width)

    monkeypatch.setattr(blocked_gemm, "blocked", counted)
    path = make_checkpoint(tmp_path, "dense")
    assert_generates_what_hf_does(load_model(path, backend="torch", dtype="float32"), path)
    assert len(set(ran)) >= 4  # q|k|v, o, q|k|v|z, gate|up and down widths all divide by 16
