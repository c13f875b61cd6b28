"""The C++ kernel that attends over the paged pool in place (``backends/torch/paged_kernel.py``).

Against the same attention in plain float64 ops: float64 to rounding, float32 and bfloat16 to their
precision; and, bit for bit, a row's output alone equals its output beside other rows of other
lengths (each row's sums run in an order fixed by the row alone), whatever the thread count.
"""

import pytest
import torch

from hyper_gen.backends.torch import paged_kernel


def _case(dtype, rows=5, heads=8, kv_heads=2, dim=64, slots=300, width=70, seed=0):
    gen = torch.Generator().manual_seed(seed)
    pool_k = torch.randn(slots, kv_heads, dim, generator=gen).to(dtype)
    pool_v = torch.randn(slots, kv_heads, dim, generator=gen).to(dtype)
    query = torch.randn(rows, heads, 1, dim, generator=gen).to(dtype)
    table = torch.randint(1, slots, (rows, width), generator=gen)
    table[1, 20:-1] = -1  # a short row: its padding, then its own column
    table[3, :] = -1
    table[3, 0] = 7  # a row of one column
    return query, pool_k, pool_v, table


def test_the_kernel_is_built_here():
    # CI and this suite run where a compiler is: the in-place path must be the one tested
    assert paged_kernel.available(), paged_kernel.describe()


@pytest.mark.parametrize("dtype, tolerance", [(torch.float64, 1e-12), (torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
def test_paged_decode_is_attention_over_the_named_slots(dtype, tolerance):
    query, pool_k, pool_v, slots = _case(dtype)
    got = paged_kernel.paged_decode(query, pool_k, pool_v, slots, 0.125)
    want = paged_kernel.reference(query, pool_k, pool_v, slots, 0.125, torch.float64)
    assert got.dtype == dtype and got.shape == (5, 8, 1, 64)
    assert (got.double() - want).abs().max().item() < tolerance


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_output_does_not_depend_on_the_other_rows_or_threads(dtype):
    query, pool_k, pool_v, slots = _case(dtype, rows=6, width=90)
    together = paged_kernel.paged_decode(query, pool_k, pool_v, slots, 0.1)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = paged_kernel.paged_decode(query, pool_k, pool_v, slots, 0.1)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(together, one_thread)
    for row in range(6):
        attended = slots[row][slots[row] >= 0][None]
        alone = paged_kernel.paged_decode(query[row : row + 1], pool_k, pool_v, attended, 0.1)
        assert torch.equal(alone, together[row : row + 1]), row


def test_grouped_query_heads_read_their_own_kv_head():
    query, pool_k, pool_v, slots = _case(torch.float64, heads=6, kv_heads=3, dim=40)
    got = paged_kernel.paged_decode(query, pool_k, pool_v, slots, 0.2)
    want = paged_kernel.reference(query, pool_k, pool_v, slots, 0.2)
    assert torch.allclose(got, want, rtol=0, atol=1e-12)


def test_shapes_that_disagree_are_refused():
    query, pool_k, pool_v, slots = _case(torch.float32)
    with pytest.raises(RuntimeError, match="query heads must be a multiple"):
        paged_kernel.paged_decode(query[:, :7], pool_k, pool_v, slots, 0.1)
    with pytest.raises(RuntimeError, match="share a dtype"):
        paged_kernel.paged_decode(query.double(), pool_k, pool_v, slots, 0.1)
    with pytest.raises(RuntimeError, match="slots must be int64"):
        paged_kernel.paged_decode(query, pool_k, pool_v, slots.int(), 0.1)
