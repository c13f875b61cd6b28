"""The C++ kernel that attends over a paged K/V cache in place (``backends/torch/paged_kernel.py``).

Against the same attention in plain float64 ops: float64 to rounding, float32 and bfloat16 to their
precision; and, bit for bit, a query's output does not depend on anything but its own vector and the
K/V it attends: not the rows beside it, not the other queries of its chunk, not the thread count,
and a position computed inside a prefill chunk equals the same position decoded alone.
"""

import pytest
import torch

from hyper_gen.backends.torch import paged_kernel


def _case(dtype, rows=5, heads=8, kv_heads=2, dim=64, blocks=40, block=8, width=70, steps=1, seed=0):
    gen = torch.Generator().manual_seed(seed)
    cache_k = torch.randn(blocks, block, kv_heads, dim, generator=gen).to(dtype)
    cache_v = torch.randn(blocks, block, kv_heads, dim, generator=gen).to(dtype)
    query = torch.randn(rows, heads, steps, dim, generator=gen).to(dtype)
    slots = torch.randint(0, blocks * block, (rows, width), generator=gen)
    # causal: query s attends the row's first (width - steps + s + 1) slots; row 1 is short
    lengths = (width - steps + 1 + torch.arange(steps)).repeat(rows, 1)
    lengths[1] = torch.arange(1, steps + 1) + 19
    return query, cache_k, cache_v, slots, lengths


def test_the_kernel_is_built_here():
    # CI and this suite run where a compiler is: the in-place path must be the one tested
    assert paged_kernel.available(), paged_kernel.describe()


@pytest.mark.parametrize("steps", [1, 37])
@pytest.mark.parametrize("dtype, tolerance", [(torch.float64, 1e-12), (torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
def test_attention_over_the_named_slots(dtype, tolerance, steps):
    query, cache_k, cache_v, slots, lengths = _case(dtype, steps=steps)
    got = paged_kernel.paged_attention(query, cache_k, cache_v, slots, lengths, 0.125)
    want = paged_kernel.reference(query, cache_k, cache_v, slots, lengths, 0.125, torch.float64)
    assert got.dtype == dtype and got.shape == (5, 8, steps, 64)
    assert (got.double() - want).abs().max().item() < tolerance


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_querys_output_depends_on_nothing_but_its_own_columns(dtype):
    query, cache_k, cache_v, slots, lengths = _case(dtype, rows=6, width=90, steps=21)
    together = paged_kernel.paged_attention(query, cache_k, cache_v, slots, lengths, 0.1)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = paged_kernel.paged_attention(query, cache_k, cache_v, slots, lengths, 0.1)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(together, one_thread)
    for row in range(6):
        for step in (0, 5, 20):  # alone, decoded: one query over exactly its columns, in a narrower table
            n = int(lengths[row, step])
            alone = paged_kernel.paged_attention(
                query[row : row + 1, :, step : step + 1], cache_k, cache_v, slots[row : row + 1, :n],
                torch.tensor([[n]]), 0.1,
            )  # fmt: skip
            assert torch.equal(alone, together[row : row + 1, :, step : step + 1]), (row, step)


def test_a_static_cache_is_read_through_a_strided_view():
    """generate()'s static cache (B, H_kv, L, D) read without a copy: its (B, L, H_kv, D) view, slot = b * L + l."""
    gen = torch.Generator().manual_seed(1)
    b, kv, length, d = 3, 2, 50, 32
    keys, values = (torch.randn(b, kv, length, d, generator=gen, dtype=torch.float64) for _ in range(2))
    query = torch.randn(b, 4, 1, d, generator=gen, dtype=torch.float64)
    slots = torch.arange(b * length).view(b, length)
    lengths = torch.tensor([[50], [10], [1]])
    view_k, view_v = keys.permute(0, 2, 1, 3), values.permute(0, 2, 1, 3)
    got = paged_kernel.paged_attention(query, view_k, view_v, slots, lengths, 0.3)
    want = paged_kernel.reference(query, view_k.contiguous(), view_v.contiguous(), slots, lengths, 0.3)
    assert torch.allclose(got, want, rtol=0, atol=1e-12)


def test_a_query_of_no_columns_is_zero():
    query, cache_k, cache_v, slots, lengths = _case(torch.float32, steps=3)
    lengths[2] = 0  # a padding query
    got = paged_kernel.paged_attention(query, cache_k, cache_v, slots, lengths, 0.1)
    assert not got[2].any() and got[0].any()


def test_inputs_that_disagree_are_refused():
    query, cache_k, cache_v, slots, lengths = _case(torch.float32)
    with pytest.raises(RuntimeError, match="query heads must be a multiple"):
        paged_kernel.paged_attention(query[:, :7], cache_k, cache_v, slots, lengths, 0.1)
    with pytest.raises(RuntimeError, match="share a dtype"):
        paged_kernel.paged_attention(query.double(), cache_k, cache_v, slots, lengths, 0.1)
    with pytest.raises(RuntimeError, match="slots must be int64"):
        paged_kernel.paged_attention(query, cache_k, cache_v, slots.int(), lengths, 0.1)
    with pytest.raises(RuntimeError, match="every slot must lie in the cache"):
        paged_kernel.paged_attention(query, cache_k, cache_v, slots + 10_000, lengths, 0.1)
    with pytest.raises(RuntimeError, match="lengths must lie"):
        paged_kernel.paged_attention(query, cache_k, cache_v, slots, lengths + 1, 0.1)
