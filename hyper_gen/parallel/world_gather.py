"""A subgroup's AllGather run as one AllGather over the whole world, over ``Ops``: for a runtime
whose collectives on a subgroup are missing or wrong (MindSpore's CPU AllGather and Broadcast:
docs/architecture.md, "MindSpore on CPU"). Every rank of the world must call it, members or not;
the tensors may differ in shape from rank to rank, so each rank first gathers its shape and pads
to the largest, and a member's part is cut back to its own shape afterwards."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from hyper_gen.ops import Ops, Tensor


def gather_over_world(ops: Ops, x: Tensor, members: Sequence[int]) -> Tensor:
    """The ``members``' (world ranks, in group rank order) ``x`` stacked along axis 0 in that order;
    a 0-d ``x`` counts as one element."""
    if x.ndim == 0:
        x = x.reshape(1)
    shapes = ops.to_numpy(ops.all_gather(ops.asarray(np.asarray([x.shape], np.int32))))  # (world, ndim)
    top = tuple(int(n) for n in shapes.max(0))
    for axis, n in enumerate(top):  # pad to the largest shape anyone gathers now
        if x.shape[axis] < n:
            pad = list(x.shape)
            pad[axis] = n - x.shape[axis]
            x = ops.concat([x, ops.zeros(pad, ops.dtype_name(x))], axis)
    gathered = ops.all_gather(x)
    parts = []
    for rank in members:
        part = gathered[rank * top[0] : (rank + 1) * top[0]]
        if tuple(shapes[rank]) != top:
            part = part[tuple(slice(0, int(n)) for n in shapes[rank])]
        parts.append(part)
    return parts[0] if len(parts) == 1 else ops.concat(parts, 0)
