"""The tensor-parallel sum of a row-parallel partial output (attention's o_proj, Gated DeltaNet's
out_proj, the MLP's down_proj, the vocab-parallel embedding), written once over ``Ops``: one
all-reduce over the tp group, the identity at tp 1."""

from __future__ import annotations

from hyper_gen.ops import Ops, Tensor


class RankSum:
    def __init__(self, ops: Ops, tp: int, group=None):
        self.ops = ops
        self.tp = tp
        self.group = group  # None: the world group

    def __call__(self, x: Tensor) -> Tensor:
        return x if self.tp == 1 else self.ops.all_reduce(x, group=self.group)
