"""The backend-neutral context-parallel step (hyper_gen.parallel.context_parallel) on every rank
of a simulated group: each rank's all-gather returns what every rank would contribute, so the
merge, halo, relay and gathers are checked against the one-device float64 answer in one process.
(The real multi-process runs: tests/test_cp_torch.py and tests/test_cp_mindspore.py.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hyper_gen.backends.torch.ops import TorchOps
from hyper_gen.parallel.context_parallel import ContextParallel
from hyper_gen.parallel.cp_plan import CPPlan


class SimulatedGroup(TorchOps):
    """Ops whose all-gather stacks ``contributions(x, rank)`` of every rank, in rank order."""

    def __init__(self, cp: int, contribution):
        super().__init__("cpu")
        self.cp, self.contribution = cp, contribution

    def all_gather(self, x, axis=0, group=None):
        return torch.cat([self.contribution(x, r) for r in range(self.cp)], dim=axis)


def _rng():
    return np.random.default_rng(7)


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_merged_partial_attention_is_the_one_device_softmax(cp):
    rng = _rng()
    q = torch.from_numpy(rng.standard_normal((2, 3, 1, 8)))
    keys = torch.from_numpy(rng.standard_normal((2, 3, 10 * cp, 8)))
    values = torch.from_numpy(rng.standard_normal((2, 3, 10 * cp, 8)))
    bounds = [0, 3, 11, 19, 40][:cp] + [10 * cp]

    def partial(rank):
        scores = q @ keys[:, :, bounds[rank] : bounds[rank + 1]].transpose(-1, -2)
        top = scores.amax(-1, keepdim=True)
        weights = (scores - top).exp()
        total = weights.sum(-1, keepdim=True)
        out = (weights @ values[:, :, bounds[rank] : bounds[rank + 1]]) / total
        return torch.cat([out, top + total.log()], -1)

    ops = SimulatedGroup(cp, lambda x, r: partial(r)[None])
    expected = torch.softmax(q @ keys.transpose(-1, -2), -1) @ values
    for rank in range(cp):
        step = ContextParallel(CPPlan(cp, rank), ops).step(None, 200)
        own = partial(rank)
        merged = step.merge_attention(own[..., :-1], own[..., -1:])
        torch.testing.assert_close(merged, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("width", [129, 200, 256])
def test_conv_halo_and_the_whole_prompts_conv_state(width):
    cp, keep = 3, 3
    sequence = torch.arange(width, dtype=torch.float64).reshape(1, 1, width)  # (B, C, positions)
    layout = CPPlan(cp, 0).layout(width)
    assert layout.sharded

    def tail_of(rank):
        start, stop = layout.slice_of(rank)
        piece = sequence[..., start:stop][..., -keep:]
        return torch.nn.functional.pad(piece, (keep - piece.shape[-1], 0))

    ops = SimulatedGroup(cp, lambda x, r: tail_of(r)[None])
    for rank in range(cp):
        step = ContextParallel(CPPlan(cp, rank), ops).step(None, width)
        halo, history = step.conv_halo(tail_of(rank), axis=-1)
        start = layout.slice_of(rank)[0]
        assert (halo is None) == (rank == 0)
        if halo is not None:
            assert torch.equal(halo, sequence[..., start - keep : start])
        assert torch.equal(history, sequence[..., -keep:])


def test_the_state_is_relayed_in_rank_order():
    cp = 3
    finals = {r: torch.full((2,), float(r + 1)) for r in range(cp)}
    seen = {}

    def contribution(x, r):  # on rank r's turn, what it hands on (the turn's entry is the one kept)
        return finals[r][None]

    for rank in range(cp):
        step = ContextParallel(CPPlan(cp, rank), SimulatedGroup(cp, contribution)).step(None, 200)

        def scan(state, rank=rank):
            seen[rank] = None if state is None else state.clone()
            return "out", finals[rank]

        out, state = step.relay_state(scan, torch.zeros(2))
        assert out == "out" and torch.equal(state, finals[cp - 1])
    assert seen[0] is None and torch.equal(seen[1], finals[0]) and torch.equal(seen[2], finals[1])


@pytest.mark.parametrize("logits_to_keep", [0, 1, 5])
def test_gather_rows_gives_every_rank_the_same_last_rows(logits_to_keep):
    cp, width = 2, 150
    hidden = torch.arange(2 * width * 4, dtype=torch.float64).reshape(2, width, 4)
    layout = CPPlan(cp, 0).layout(width)

    def contribution(x, r):
        start, stop = layout.slice_of(r)
        if x.shape[2] == 1:  # (1, B, 1, H): the last row of rank r's slice
            return hidden[:, stop - 1 : stop][None]
        piece = hidden[:, start:stop]
        return torch.nn.functional.pad(piece, (0, 0, 0, layout.longest - piece.shape[1]))[None]

    expected = hidden[:, -logits_to_keep:] if logits_to_keep else hidden
    for rank in range(cp):
        step = ContextParallel(CPPlan(cp, rank), SimulatedGroup(cp, contribution)).step(None, width)
        start, stop = layout.slice_of(rank)
        assert torch.equal(step.gather_rows(hidden[:, start:stop], logits_to_keep), expected)


def test_a_continuation_of_more_than_one_token_is_refused():
    class Cache:
        seq_length = 4

    with pytest.raises(ValueError, match="in a cache it did not prefill"):
        ContextParallel(CPPlan(2, 0), TorchOps()).step(Cache(), 1)


@pytest.mark.parametrize("cp", [2, 3])
def test_merged_partial_attention_on_mindspore_ops(cp):
    """The same merge through MindSporeOps: the one-device float64 softmax."""
    import mindspore as ms

    from hyper_gen.backends.mindspore.ops import MindSporeOps

    class SimulatedMindSporeGroup(MindSporeOps):
        def all_gather(self, x, axis=0, group=None):
            return ms.ops.concat([ms.Tensor(parts[r][None]) for r in range(cp)], axis)

    rng = _rng()
    q, keys, values = (rng.standard_normal(shape) for shape in ((2, 3, 1, 8), (2, 3, 10 * cp, 8), (2, 3, 10 * cp, 8)))
    bounds = np.linspace(0, 10 * cp, cp + 1).astype(int)
    parts = []
    for rank in range(cp):
        scores = q @ keys[:, :, bounds[rank] : bounds[rank + 1]].swapaxes(-1, -2)
        top = scores.max(-1, keepdims=True)
        weights = np.exp(scores - top)
        total = weights.sum(-1, keepdims=True)
        out = weights @ values[:, :, bounds[rank] : bounds[rank + 1]] / total
        parts.append(np.concatenate([out, top + np.log(total)], -1))
    scores = q @ keys.swapaxes(-1, -2)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    expected = probs / probs.sum(-1, keepdims=True) @ values
    for rank in range(cp):
        step = ContextParallel(CPPlan(cp, rank), SimulatedMindSporeGroup()).step(None, 200)
        own = ms.Tensor(parts[rank])
        merged = step.merge_attention(own[..., :-1], own[..., -1:]).asnumpy()
        np.testing.assert_allclose(merged, expected, rtol=1e-12, atol=1e-12)
