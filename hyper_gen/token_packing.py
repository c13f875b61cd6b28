"""The real tokens of a left-padded prefill, packed, over ``Ops``: the model ports run the row-wise
work of every layer (norms, projections, MLP / experts, residual adds) on the N real rows only, and
just the sequence mixers' cores (rotary + attention, conv + delta rule) on the B * S padded rows,
with zeros at the padding: what HF's masked Gated DeltaNet input projects to, and keys the attention
mask hides. A batch of mixed-length prompts then costs its tokens, not B x S. Both directions are
one row gather (exact copies), with indices made once on the host.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from hyper_gen.ops import Ops, Tensor


class TokenPacking:
    def __init__(self, ops: Ops, mask: np.ndarray):
        self.ops = ops
        self.batch, self.seq = mask.shape
        real = mask != 0
        self.leading_padding = [self.seq - int(n) for n in real.sum(axis=1)]  # per row
        self.pack_index = np.flatnonzero(real.reshape(-1))
        self.count = int(self.pack_index.size)
        # padded row -> its packed row, or the zero row appended after the N packed ones
        self.unpack_index = np.full(real.size, self.count, np.int64)
        self.unpack_index[self.pack_index] = np.arange(self.count)

    @classmethod
    def of(cls, ops: Ops, prompt_mask: Optional[Tensor]) -> Optional["TokenPacking"]:
        """The packing of a prefill with this (B, S) prompt mask; None when there is no padding
        to skip (no mask, one position, or every position real)."""
        if prompt_mask is None or prompt_mask.shape[1] == 1:
            return None
        mask = ops.to_numpy(prompt_mask)
        return None if mask.all() else cls(ops, mask)

    def pack(self, x: Tensor) -> Tensor:
        """(B, S, C) or (B * S, C) -> (N, C): the real positions' rows, in order."""
        return self.ops.take(x.reshape(-1, x.shape[-1]), self.pack_index, 0)

    def unpack(self, x: Tensor) -> Tensor:
        """(N, C) -> (B * S, C), zeros at the padding."""
        zero = self.ops.zeros((1, x.shape[-1]), self.ops.dtype_name(x))
        return self.ops.take(self.ops.concat([x, zero], 0), self.unpack_index, 0)

    def unpack_batch(self, x: Tensor) -> Tensor:
        """(N, C) -> (B, S, C), zeros at the padding."""
        return self.unpack(x).reshape(self.batch, self.seq, -1)


class PackedGroup:
    """One group of a grouped step: ``batch`` rows of ``seq`` positions, left-padded (``mask``),
    whose real positions are rows ``[offset, offset + count)`` of the step's packed tokens. It packs
    and unpacks like ``TokenPacking`` (``leading_padding`` for the left-padded delta rule); the
    engine sets what the group's sequence mixers read: ``cache``, ``mask`` (additive attention
    mask), ``positions``; a port sets its own per-group tensors (rotary ``cos`` / ``sin``)."""

    def __init__(self, mask: np.ndarray, offset: int):
        self.batch, self.seq = mask.shape
        real = (mask != 0).reshape(-1)
        self.padded = not real.all()
        self.leading_padding = [self.seq - int(n) for n in (mask != 0).sum(axis=1)]
        self.pack_index = np.flatnonzero(real)
        self.count = int(self.pack_index.size)
        self.offset = offset
        self.rows = np.full(real.size, -1, np.int64)  # padded position -> step's packed row (-1: padding)
        self.rows[self.pack_index] = offset + np.arange(self.count)
        self.cache = self.mask = self.positions = None

    def pack(self, x: Tensor, ops: Ops) -> Tensor:
        """(batch, seq, C) -> (count, C): the real positions' rows, in order."""
        flat = x.reshape(-1, x.shape[-1])
        return flat if not self.padded else ops.take(flat, self.pack_index, 0)


class GroupedPacking:
    """A step that runs several groups of rows in one forward (decoding rows, fresh prompt chunks,
    chunks after a past): the row-wise work of every layer runs once over the ``count`` packed
    tokens of all groups, each group's sequence mixers on its own (batch, seq) rows. ``map`` is the
    one way between the two layouts. ``keep``: the packed rows whose logits the forward returns."""

    def __init__(self, ops: Ops, masks, keep: np.ndarray):
        self.ops = ops
        self.groups = []
        offset = 0
        for mask in masks:
            self.groups.append(PackedGroup(mask, offset))
            offset += self.groups[-1].count
        self.count = offset
        self.keep = keep

    def map(self, x: Tensor, mixer) -> Tensor:
        """(count, C) -> each group's (batch, seq, C) through ``mixer(group, rows)`` (zeros at its
        padding) -> its (batch, seq, C') outputs packed back, (count, C')."""
        ops = self.ops
        padded = any(g.padded for g in self.groups)
        source = ops.concat([x, ops.zeros((1, x.shape[-1]), ops.dtype_name(x))], 0) if padded else x
        outs = []
        for group in self.groups:
            rows = np.where(group.rows < 0, self.count, group.rows)
            out = mixer(group, ops.take(source, rows, 0).reshape(group.batch, group.seq, -1))
            outs.append(group.pack(out, ops))
        return outs[0] if len(outs) == 1 else ops.concat(outs, 0)


def grouped_step(cache) -> Optional[GroupedPacking]:
    """The ``GroupedPacking`` a grouped forward is given as its cache, else None."""
    return cache if isinstance(cache, GroupedPacking) else None
