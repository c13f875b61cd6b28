"""Attention over the paged pool, piece by piece (``Ops.paged_attention``): the same numbers as
attention over each row's whole gathered history, with rows of very different lengths in one
forward and no row reading another's padding.

The engine runs torch's attention in pieces of ``paged_columns`` columns; here the pieces are made
small (16 columns) so a tiny model's short prompts span many of them: decode rows, fresh prompt
chunks and chunks after a past all cross piece boundaries. In float64 the engine's tokens are
generate()'s (a static cache, one softmax over every column) and its logprobs (float32, vLLM's
default) generate()'s raw ones to float32 rounding.
"""

import numpy as np
import pytest
from qwen_checkpoints import make_checkpoint

from hyper_gen import generate, load_model
from hyper_gen.engine import Engine, SamplingParams
from hyper_gen.engine.kv_store import attention_pieces

VOCAB = 97


def test_pieces_leave_out_the_rows_a_piece_holds_only_padding_of():
    read = np.arange(2 * 40).reshape(2, 40)
    mask = np.full((2, 1, 1, 40), -1e30)
    mask[0, ..., :40] = 0  # row 0 attends every column
    mask[1, ..., :5] = 0  # row 1 its first 5 and its own (the last)
    mask[1, ..., 39] = 0

    class Host:  # numpy stands in for a framework: the plan only converts arrays
        @staticmethod
        def asarray(array, dtype=None):
            return np.asarray(array)

    pieces = attention_pieces(Host, read, mask, 16, "float32")
    assert [p.shape for p in pieces] == [(2, 16), (1, 16), (2, 8)]
    assert pieces[0].rows is None and pieces[1].rows.tolist() == [0] and pieces[2].rows is None
    assert pieces[1].slots.tolist() == list(range(16, 32))
    assert pieces[2].mask.shape == (2, 1, 1, 8)


def _logprob_gap(got, want):
    return max(abs(a - b) for a, b in zip(got, want))


@pytest.mark.parametrize("path", ["pieces", "in_place"])
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_engine_reads_the_pool_in_pieces_with_generates_numbers(tmp_path, kind, path, one_torch_thread):
    """Steps past one piece attend in pieces, or (the C++ kernel, where it is built: always on torch
    CPU here) read the pool in place, decode rows and prefill chunks alike, never through a piece."""
    model = load_model(make_checkpoint(tmp_path, kind, "float32"), backend="torch", dtype="float64")
    rng = np.random.default_rng(3)
    prompts = [rng.integers(8, VOCAB, n).tolist() for n in (150, 4, 61, 17, 230)]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=0)
    engine = Engine(model, block_size=16, max_num_batched_tokens=48, enable_prefix_caching=False)
    runner = engine._runner
    assert runner.paged_columns and runner.in_place  # torch attends piece by piece / in place
    runner.paged_columns = 16
    runner.in_place = path == "in_place"
    calls, whole, in_place = [], [], []
    attend, kernel = runner.ops.paged_attention, runner.ops.in_place_attention
    runner.ops.paged_attention = lambda q, k, v, pieces, partial: (
        (calls.append((q.shape[2], len(pieces))) or whole.extend(p.blocks is not None for p in pieces))
        or attend(q, k, v, pieces, partial)
    )
    runner.ops.in_place_attention = lambda q, k, v, slots, lengths, scale: (
        in_place.append((q.shape[2], tuple(slots.shape))) or kernel(q, k, v, slots, lengths, scale)
    )
    with engine:
        outs = [s.result(timeout=300) for s in [engine.submit(p, params) for p in prompts]]
    if path == "pieces":
        assert any(s == 1 and n > 2 for s, n in calls) and any(s > 1 and n > 2 for s, n in calls), calls
        assert any(whole) and not all(whole)  # pieces of whole blocks, and of slots (rows of other lengths)
        assert not in_place
    else:
        assert not calls, calls
        assert any(s == 1 and rows > 1 and width > 200 for s, (rows, width) in in_place), in_place
        assert any(s > 1 for s, _ in in_place), in_place  # prefill chunks after a past
    for prompt, out in zip(prompts, outs):
        ref = generate(
            model, [prompt], max_new_tokens=10, eos_token_id=None, output_logprobs=True,
            return_dict_in_generate=True,
        )  # fmt: skip
        want = ref.sequences[0, len(prompt) :].tolist()
        assert out.outputs[0].token_ids == want
        got = [entry["logprob"] for entry in out.outputs[0].logprobs]
        assert _logprob_gap(got, ref.raw_logprobs[0].tolist()) < 1e-6


def test_a_piece_of_whole_blocks_names_them():
    """Columns that lie block by block in the pool (column c at offset c % block_size) copy as whole
    blocks; a block of only masked columns reads the null block; anything else copies slot by slot."""
    from hyper_gen.engine.kv_store import _whole_blocks

    table = [3, 5, 2]
    slots = np.array([table[p // 4] * 4 + p % 4 for p in range(10)])[None]
    seen = np.ones((1, 10), dtype=bool)
    assert _whole_blocks(slots, seen, 0, 4).tolist() == [[3, 5, 2]]
    assert _whole_blocks(slots[:, 4:], seen[:, 4:], 4, 4).tolist() == [[5, 2]]
    padded, attended = slots.copy(), seen.copy()
    padded[:, 8:], attended[:, 8:] = 0, False  # the null slot, masked
    assert _whole_blocks(padded, attended, 0, 4).tolist() == [[3, 5, 0]]
    stray = slots.copy()
    stray[0, 9] = 7 * 4 + 1  # a column in another block
    assert _whole_blocks(stray, seen, 0, 4) is None
    assert _whole_blocks(slots[:, 2:], seen[:, 2:], 2, 4) is None  # a piece that starts inside a block


def test_in_place_columns_are_each_rows_attended_slots_in_order():
    """A chunk of 3 after a past: row 0's 4 past slots, row 1's 2 (then padding to the widest past),
    then each row's own 3 columns (row 1's first is padding), causal: query s attends the past and
    its own valid columns up to s; they are the columns the step's mask (``_Rows.mask``) shows."""
    from hyper_gen.engine.kv_store import NULL_SLOT, in_place_columns
    from hyper_gen.engine.runner import _Rows

    read = np.array([[10, 11, 12, 13, 20, 21, 22], [30, 31, 0, 0, 0, 41, 42]])
    past = np.array([[1, 1, 1, 1], [1, 1, 0, 0]], dtype=bool)
    new = np.array([[1, 1, 1], [0, 1, 1]], dtype=bool)
    slots, lengths = in_place_columns(read, past, new)
    assert slots.tolist() == [[10, 11, 12, 13, 20, 21, 22], [30, 31, 41, 42, NULL_SLOT, NULL_SLOT, NULL_SLOT]]
    assert lengths.tolist() == [[5, 6, 7], [0, 3, 4]]
    mask = _Rows(np.zeros((2, 3), dtype=np.int64), None, past, new, read, False).mask("float32")
    for row in range(2):
        for s in range(3):
            if new[row, s]:  # the slots the mask shows this query, in column order
                shown = read[row][mask[row, 0, s] == 0].tolist()
                assert shown == slots[row, : lengths[row, s]].tolist(), (row, s)
