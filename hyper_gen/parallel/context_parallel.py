"""Context parallelism's communication, written once over ``Ops`` for every backend.

``hyper_gen.parallel.cp_plan`` says which positions each rank holds; this module moves the tensors
a context-parallel forward exchanges: the prefill's K|V gather, the Gated DeltaNet conv halo and
recurrent-state relay, the decode step's log-sum-exp merge of every rank's partial attention, the
rows whose logits are returned, and each rank's K/V slice in the cache. Everything runs on one
collective, all-gather (MindSpore's CPU backend has no other that fits), and every merge is the
same arithmetic on the same gathered tensor on every rank, so every rank holds the same bits.
A port keeps only what differs by framework: its attention cores and, for torch, Ulysses'
all-to-all (``hyper_gen.backends.torch.context_parallel``).
"""

from __future__ import annotations

from typing import Callable, List, Optional, Tuple

from hyper_gen.ops import Ops, Tensor
from hyper_gen.parallel.cp_plan import CPLayout, CPPlan


def _narrow(x: Tensor, axis: int, start: int, stop: int) -> Tensor:
    """``x[start:stop]`` along ``axis`` (basic slicing: the same view on every framework)."""
    return x[(slice(None),) * (axis % x.ndim) + (slice(start, stop),)]


class ContextParallel:
    """The context-parallel group of a model: its plan, the backend's ops, its communication
    group (None: the world group)."""

    def __init__(self, plan: CPPlan, ops: Ops, group=None):
        self.plan = plan
        self.ops = ops
        self.group = group

    def gather_stacked(self, x: Tensor) -> Tensor:
        """Every rank's ``x`` (same shape everywhere) stacked along a new leading axis, in rank order."""
        return self.ops.all_gather(x.reshape((1,) + tuple(x.shape)), axis=0, group=self.group)

    def gather(self, x: Tensor) -> List[Tensor]:
        """Every rank's ``x`` (same shape everywhere), in rank order."""
        stacked = self.gather_stacked(x)
        return [stacked[r] for r in range(self.plan.cp)]

    def gather_sequence(self, x: Tensor, layout: CPLayout, axis: int) -> Tensor:
        """The whole sequence along ``axis`` from every rank's prefill slice of it: the slices are
        padded to the longest for the all-gather and their real positions concatenated in rank order."""
        axis %= x.ndim
        pad = layout.longest - x.shape[axis]
        if pad:
            shape = list(x.shape)
            shape[axis] = pad
            x = self.ops.concat([x, self.ops.zeros(shape, self.ops.dtype_name(x))], axis)
        parts = [
            _narrow(part, axis, 0, layout.length_of(r)) for r, part in enumerate(self.gather(x)) if layout.length_of(r)
        ]
        return parts[0] if len(parts) == 1 else self.ops.concat(parts, axis)

    def step(self, cache, seq: int) -> "CPStep":
        """The step of a forward of ``seq`` new positions: at the prefill (an empty or no cache) a
        new layout, kept on the cache for the decode steps; after it one token per row."""
        past = cache.seq_length if cache is not None else 0
        if past == 0:
            layout = self.plan.layout(seq)
            if cache is not None:
                cache.cp_layout = layout
            return CPStep(self, layout, decode=False)
        layout = getattr(cache, "cp_layout", None)
        if layout is None or seq != 1:
            raise ValueError(
                f"a context-parallel model takes a prefill (an empty cache) or one token per row after it, got "
                f"{seq} tokens after {past} cached positions"
                + ("" if layout is not None else " in a cache it did not prefill")
            )
        return CPStep(self, layout, decode=True)


class CPStep:
    """One forward of a context-parallel model: the prompt's layout and whether this forward is
    the sharded prefill (``sharded``: this rank computes only its slice), a replicated one (a
    prompt of fewer chunks than ranks, a cacheless one-token call) or a decode step."""

    def __init__(self, cp: ContextParallel, layout: CPLayout, decode: bool):
        self.cp = cp
        self.ops = cp.ops
        self.layout = layout
        self.rank = cp.plan.rank
        self.decode = decode
        self.sharded = layout.sharded and not decode
        self.start, self.stop = layout.slice_of(self.rank)

    def local_positions(self, *xs):
        """(B, S, ...) inputs (None passes) cut to this rank's positions in a sharded prefill."""
        return [x if x is None or not self.sharded else _narrow(x, 1, self.start, self.stop) for x in xs]

    # ------------------------------------------------------------------ attention's K/V

    def store_prefill(self, cache, layer_idx: int, key: Tensor, value: Tensor) -> None:
        """This rank's slice of the prompt's K/V (B, H, S, D) into the cache (static: a buffer with
        room for the decode tokens on the owner); nothing for an empty slice of a dynamic cache."""
        if cache is None:
            return
        (b, h, _, d), dv, dtype = key.shape, value.shape[-1], self.ops.dtype_name(key)
        if not self.sharded:  # replicated prefill: K/V of every position, keep this rank's
            kept = self.stop > self.start
            key, value = (_narrow(t, 2, self.start, self.stop) if kept else None for t in (key, value))
        if cache.is_static:
            capacity = self.layout.static_capacity(self.rank, cache.max_length)
            if capacity == 0:
                return
            keys, values = self.ops.zeros((b, h, capacity, d), dtype), self.ops.zeros((b, h, capacity, dv), dtype)
            if key is not None:
                self.ops.write_slice(keys, 2, 0, key)
                self.ops.write_slice(values, 2, 0, value)
            cache.keys[layer_idx], cache.values[layer_idx] = keys, values
        elif key is not None:
            cache.keys[layer_idx], cache.values[layer_idx] = key, value

    def decode_keys(self, cache, layer_idx: int, key: Tensor, value: Tensor, mask: Tensor):
        """The new token's K/V appended on the owner; (keys, values, mask columns) this rank attends
        over, or (None, None, None) when it holds none."""
        if self.rank == self.layout.owner:
            local = cache.seq_length - self.start
            if cache.is_static:
                self.ops.write_slice(cache.keys[layer_idx], 2, local, key)
                self.ops.write_slice(cache.values[layer_idx], 2, local, value)
            elif layer_idx in cache.keys:
                cache.keys[layer_idx] = self.ops.concat([cache.keys[layer_idx], key], 2)
                cache.values[layer_idx] = self.ops.concat([cache.values[layer_idx], value], 2)
            else:
                cache.keys[layer_idx], cache.values[layer_idx] = key, value
        if layer_idx not in cache.keys:
            return None, None, None
        keys, values = cache.keys[layer_idx], cache.values[layer_idx]
        return keys, values, _narrow(mask, -1, self.start, self.start + keys.shape[2])

    def merge_attention(self, out: Tensor, lse: Tensor) -> Tensor:
        """Every rank's partial attention (output normalised over its keys (..., D), log-sum-exp of
        its scores (..., 1)) merged over the stacked ranks at once: a handful of kernels per decode
        layer whatever cp is, the same on every rank."""
        ops = self.ops
        parts = self.cp.gather_stacked(ops.concat([out, lse], -1))  # (cp, ..., D + 1)
        d = out.shape[-1]
        lses = parts[..., d:]
        weights = ops.exp(lses - ops.max(lses, axis=0, keepdims=True))
        return ops.sum(weights * parts[..., :d], axis=0) / ops.sum(weights, axis=0)

    # ------------------------------------------------------------------ Gated DeltaNet

    def conv_halo(self, tail: Tensor, axis: int) -> Tuple[Optional[Tensor], Tensor]:
        """A sharded prefill's causal conv: ``tail`` is this rank's last kernel-1 pre-conv
        positions along ``axis`` (left-padded with zeros to kernel-1 if its slice is shorter).
        One all-gather of every rank's tail gives (the halo: the previous rank's tail, None on
        rank 0; the conv state after the whole prompt: its last kernel-1 positions). The slices
        before the last are whole chunks (>= kernel-1 positions), so the previous tail is whole."""
        axis %= tail.ndim
        keep = tail.shape[axis]
        tails = self.cp.gather(tail)
        layout = self.layout
        real = [
            _narrow(t, axis, keep - min(keep, layout.length_of(r)), keep)
            for r, t in enumerate(tails)
            if layout.length_of(r)
        ]
        history = real[0] if len(real) == 1 else self.ops.concat(real, axis)
        history = _narrow(history, axis, history.shape[axis] - keep, history.shape[axis])
        return (None if self.rank == 0 else tails[self.rank - 1]), history

    def relay_state(self, scan: Callable, placeholder: Tensor):
        """A sharded prefill's chunked delta rule, its state relayed in rank order: rank r runs
        ``scan(state)`` -> (out, final state) from rank r-1's final state; after each rank's turn
        one all-gather hands its state on (the last gives every rank the whole prompt's state).
        ``placeholder``: a zero state of the right shape for the ranks not on their turn."""
        state = out = None
        for turn in range(self.cp.plan.cp):
            if turn == self.rank:
                out, state = scan(state)
            state = self.cp.gather(state if turn == self.rank else placeholder)[turn]
        return out, state

    # ------------------------------------------------------------------ logits

    def gather_rows(self, hidden: Tensor, logits_to_keep: int) -> Tensor:
        """After a sharded prefill: the (B, kept, H) rows of the (B, s, H) slices whose logits are
        returned, the same on every rank (the last one comes from the rank holding the last position)."""
        if logits_to_keep == 1:
            return self.cp.gather(_narrow(hidden, 1, hidden.shape[1] - 1, hidden.shape[1]))[self.layout.last_rank]
        hidden = self.cp.gather_sequence(hidden, self.layout, axis=1)
        if logits_to_keep and logits_to_keep < hidden.shape[1]:
            hidden = _narrow(hidden, 1, hidden.shape[1] - logits_to_keep, hidden.shape[1])
        return hidden
