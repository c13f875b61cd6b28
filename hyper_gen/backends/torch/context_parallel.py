"""What torch's context parallelism adds to the backend-neutral one (``hyper_gen.parallel.
context_parallel``): Ulysses' all-to-all, which MindSpore's CPU collectives do not offer."""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist


def all_to_all(group, parts: list, shapes: list) -> list:
    """Ulysses' exchange: ``parts[j]`` goes to rank j; rank i's piece for this rank, of shape
    ``shapes[i]``, comes back in rank order (one all_to_all_single of the flattened pieces, with
    uneven split sizes, which gloo and NCCL both support)."""
    sizes = [int(np.prod(shape)) for shape in shapes]
    send = torch.cat([p.reshape(-1) for p in parts])
    received = send.new_empty(sum(sizes))
    dist.all_to_all_single(received, send, sizes, [p.numel() for p in parts], group=group)
    return [piece.view(shape) for piece, shape in zip(received.split(sizes), shapes)]
