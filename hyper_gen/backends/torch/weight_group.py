"""A weight-update group between a trainer and this server: SGLang's ``/init_weights_update_group``.

The trainer's rank 0 and the server's ranks (``rank_offset`` on) meet at ``tcp://master_address:
master_port``, the trainer hosting the store, as the helper SGLang's, slime's and OpenRLHF's
trainers call does it (a TCP rendezvous, the store prefixed by the group's name, a process group
made by torch's ``_new_process_group_helper``), so a trainer written for SGLang joins unchanged.
The group is its own: no default process group is needed, and a tensor-parallel engine's own
group is untouched. Then each ``/update_weights_from_distributed`` receives the trainer's
broadcasts (from group rank 0, in the order of ``names``) into fresh buffers of the announced
dtype and shape. Every wait is bounded by ``timeout_s``: the rendezvous, the group's creation and
each broadcast; a timeout is a ``TimeoutError`` naming what was waited for.

``join`` (the trainer's side as well as the server's: tests and examples use it too), ``dtype_of``.
"""

from __future__ import annotations

import datetime
import math
from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

BACKENDS = ("gloo", "nccl", "hccl")

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "double": torch.float64,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "bool": torch.bool,
}


def dtype_of(text: str) -> torch.dtype:
    """``"bfloat16"`` / ``"torch.bfloat16"`` -> torch.bfloat16; a ValueError for any other word."""
    key = text[len("torch.") :] if isinstance(text, str) and text.startswith("torch.") else text
    if key not in _DTYPES:
        raise ValueError(f"unknown dtype {text!r}: one of {sorted(_DTYPES)} (torch.<dtype> too)")
    return _DTYPES[key]


def is_floating(text: str) -> bool:
    return dtype_of(text).is_floating_point


class WeightGroup:
    """One process's membership of a weight-update group (see the module docstring)."""

    def __init__(self, group, rank: int, world_size: int, name: str, backend: str, device):
        self.group, self.rank, self.world_size, self.name = group, rank, world_size, name
        self.backend, self.device = backend, device

    def broadcast(self, tensor: torch.Tensor, timeout_s: float, what: str) -> None:
        """``tensor`` from group rank 0 to every member (in place), bounded by ``timeout_s``."""
        work = dist.broadcast(tensor, src=0, group=self.group, async_op=True)
        try:
            done = work.wait(timeout=datetime.timedelta(seconds=timeout_s))
        except RuntimeError as exc:  # gloo: a timeout or a peer gone
            raise TimeoutError(f"{what}: no broadcast from the trainer within {timeout_s:g}s ({exc})") from None
        if done is False:
            raise TimeoutError(f"{what}: no broadcast from the trainer within {timeout_s:g}s")

    def receive(
        self,
        specs: Sequence[Tuple[str, str, Sequence[int]]],
        timeout_s: float,
        flattened: bool = False,
        arrived: Optional[Callable[[tuple], None]] = None,
    ) -> List[tuple]:
        """``[(name, tensor)]``: each ``(name, dtype, shape)`` received from rank 0, in order: one broadcast
        per tensor, or with ``flattened`` (SGLang's ``load_format="flattened_bucket"``: one dtype) one
        broadcast of them all flattened and concatenated in that order, split back here. ``arrived``:
        called with each ``(name, tensor)`` once it is here (the caller checks it meanwhile)."""
        if flattened:
            sizes = [math.prod(shape) for _, _, shape in specs]
            bucket = torch.empty(sum(sizes), dtype=dtype_of(specs[0][1]), device=self.device)
            self.broadcast(bucket, timeout_s, f"group {self.name!r}, a flattened bucket of {len(specs)} tensors")
            pieces = torch.split(bucket, sizes)
            out = [(name, piece.view(tuple(shape))) for (name, _, shape), piece in zip(specs, pieces)]
            for item in out if arrived is not None else ():
                arrived(item)
            return out
        out = []
        for name, dtype, shape in specs:
            tensor = torch.empty(tuple(shape), dtype=dtype_of(dtype), device=self.device)
            self.broadcast(tensor, timeout_s, f"group {self.name!r}, tensor {name!r}")
            out.append((name, tensor))
            if arrived is not None:
                arrived(out[-1])
        return out

    def destroy(self) -> None:
        try:
            dist.destroy_process_group(self.group)
        except Exception:  # already gone (a peer left, a timeout broke it): nothing left to free
            pass


def join(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str = "gloo",
    timeout_s: float = 300.0,
    device=None,
) -> WeightGroup:
    """Join (rank 0: host) the group ``group_name`` at ``master_address:master_port``; a
    ``TimeoutError`` when the other members do not come within ``timeout_s``."""
    from torch.distributed.distributed_c10d import _new_process_group_helper, _world
    from torch.distributed.rendezvous import rendezvous

    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    timeout = datetime.timedelta(seconds=timeout_s)
    where = f"tcp://{master_address}:{master_port}"
    try:
        store, _, _ = next(rendezvous(where, rank, world_size, timeout=timeout))
        store.set_timeout(timeout)
        store = dist.PrefixStore(group_name, store)
        group, _ = _new_process_group_helper(
            world_size, rank, [], backend, store, group_name=group_name, timeout=timeout
        )
    except (RuntimeError, dist.DistStoreError) as exc:  # DistStoreError: a timeout; RuntimeError: refused, reset
        raise TimeoutError(
            f"group {group_name!r}: the trainer did not join at {where} within {timeout_s:g}s "
            f"(rank {rank} of {world_size}): {exc}"
        ) from None
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    if device is None:
        device = torch.device("cpu")
    return WeightGroup(group, rank, world_size, group_name, backend, device)
