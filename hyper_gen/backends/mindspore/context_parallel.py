"""Context parallelism of the MindSpore model ports (``hyper_gen.parallel.cp_plan``; the torch
port does the same, step for step), on AllGather alone: the group and its collective
(``ContextParallel``), and one forward's layout and steps (``CPStep``): the prompt's K/V slices in
the cache, the decode token's K/V on the owner and the log-sum-exp merge of the ranks' partial
attention."""

from __future__ import annotations

from mindspore import Tensor, mint, ops

from hyper_gen.backends.mindspore.ops import MindSporeOps
from hyper_gen.backends.mindspore.primitives import sum_last
from hyper_gen.parallel.cp_plan import CPLayout, CPPlan


class ContextParallel:
    """The context-parallel group of a model: its plan, its communication group (None: the world
    group) and the one collective everything here uses, AllGather (float64 travels as raw bits:
    ``MindSporeOps.all_gather``)."""

    def __init__(self, plan: CPPlan, group=None):
        self.plan = plan
        self.group = group
        self.ops = MindSporeOps()

    def gather(self, x: Tensor) -> list:
        """Every rank's ``x`` (same shape everywhere), in rank order."""
        stacked = self.gather_stacked(x)
        return [stacked[r] for r in range(self.plan.cp)]

    def gather_stacked(self, x: Tensor) -> Tensor:
        """Every rank's ``x`` (same shape everywhere) stacked along a new leading axis, in rank order."""
        return self.ops.all_gather(x.reshape((1,) + tuple(x.shape)), axis=0, group=self.group)

    def gather_sequence(self, x: Tensor, layout: CPLayout, axis: int) -> Tensor:
        """The whole sequence along ``axis`` from every rank's slice of it (padded to the longest
        for the all-gather, the real positions concatenated in rank order)."""
        pad = layout.longest - x.shape[axis]
        if pad:
            shape = list(x.shape)
            shape[axis] = pad
            x = ops.concat([x, ops.zeros(tuple(shape), x.dtype)], axis)
        parts = [
            mint.narrow(p, axis, 0, layout.length_of(r)) for r, p in enumerate(self.gather(x)) if layout.length_of(r)
        ]
        return parts[0] if len(parts) == 1 else ops.concat(parts, axis)


class CPStep:
    """One forward of a context-parallel model: the prompt's layout, and whether this forward is
    the sharded prefill (this rank computes only its slice), a replicated one (a prompt of fewer
    chunks than ranks, a cacheless one-token call) or a decode step."""

    def __init__(self, cp: ContextParallel, layout: CPLayout, decode: bool):
        self.cp = cp
        self.layout = layout
        self.rank = cp.plan.rank
        self.decode = decode
        self.sharded = layout.sharded and not decode
        self.start, self.stop = layout.slice_of(self.rank)

    def store_prefill(self, cache, layer_idx: int, key: Tensor, value: Tensor) -> None:
        """This rank's slice of the prompt's K/V (B, H, S, D) into the cache (static: a buffer with
        room for the decode tokens on the owner); nothing for an empty slice of a dynamic cache."""
        (b, h, _, d), dtype = key.shape, key.dtype
        if not self.sharded:  # replicated prefill: K/V of every position, keep this rank's
            key, value = (t[:, :, self.start : self.stop] if self.stop > self.start else None for t in (key, value))
        if cache.is_static:
            capacity = self.layout.static_capacity(self.rank, cache.max_length)
            if capacity == 0:
                return
            keys, values = ops.zeros((b, h, capacity, d), dtype), ops.zeros((b, h, capacity, d), dtype)
            if key is not None:
                self.cp.ops.write_slice(keys, 2, 0, key)
                self.cp.ops.write_slice(values, 2, 0, value)
            cache.keys[layer_idx], cache.values[layer_idx] = keys, values
        elif key is not None:
            cache.keys[layer_idx], cache.values[layer_idx] = key, value

    def decode_keys(self, cache, layer_idx: int, key: Tensor, value: Tensor, mask: Tensor):
        """The new token's K/V appended on the owner; (keys, values, mask columns) this rank attends
        over, or (None, None, None) when it holds none."""
        if self.rank == self.layout.owner:
            if cache.is_static:
                self.cp.ops.write_slice(cache.keys[layer_idx], 2, cache.seq_length - self.start, key)
                self.cp.ops.write_slice(cache.values[layer_idx], 2, cache.seq_length - self.start, value)
            elif layer_idx in cache.keys:
                cache.keys[layer_idx] = ops.concat([cache.keys[layer_idx], key], 2)
                cache.values[layer_idx] = ops.concat([cache.values[layer_idx], value], 2)
            else:
                cache.keys[layer_idx], cache.values[layer_idx] = key, value
        if layer_idx not in cache.keys:
            return None, None, None
        keys, values = cache.keys[layer_idx], cache.values[layer_idx]
        return keys, values, mask[..., self.start : self.start + keys.shape[2]]

    def merge_attention(self, out: Tensor, lse: Tensor) -> Tensor:
        """Every rank's partial attention (output over its keys, log-sum-exp of its scores) merged:
        the same ops on the same gathered (cp, ...) tensor on every rank, so the same bits. Over
        the stacked ranks at once: a handful of small kernels per decode layer, not ~6 per rank."""
        parts = self.cp.gather_stacked(ops.concat([out, lse], -1))  # (cp, ..., D + 1)
        d = out.shape[-1]
        lses = parts[..., d:]
        weights = ops.exp(lses - ops.amax(lses, 0, True))
        return (sum_last(weights * parts[..., :d], 0) / sum_last(weights, 0)).reshape(out.shape)

    def gather_rows(self, x: Tensor, b: int, logits_to_keep: int):
        """After a sharded prefill: (rows (B * kept, H), kept) whose logits are returned, the same
        on every rank (the last one comes from the rank holding the last position)."""
        x = x.reshape(b, -1, x.shape[-1])
        if logits_to_keep == 1:
            return self.cp.gather(x[:, -1:])[self.layout.last_rank].reshape(b, -1), 1
        x = self.cp.gather_sequence(x, self.layout, axis=1)
        if logits_to_keep and logits_to_keep < x.shape[1]:
            x = x[:, -logits_to_keep:]
        return x.reshape(-1, x.shape[-1]), x.shape[1]
