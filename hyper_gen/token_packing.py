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
