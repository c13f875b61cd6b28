"""Context parallelism in torch (``hyper_gen.parallel.cp_plan``): the group's collectives and one
forward's step (which rank prefills which chunks, the K|V and halo gathers, the decode merge)."""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from hyper_gen.parallel.cp_plan import CPLayout, CPPlan

# ------------------------------------------------------------------------- context parallelism


class ContextParallel:
    """The context-parallel group of a model (``hyper_gen.parallel.cp_plan``): its plan, its
    torch.distributed group (None: the world group) and the all-gather everything here uses."""

    def __init__(self, plan: CPPlan, group=None):
        self.plan = plan
        self.group = group

    def gather(self, x: torch.Tensor) -> list:
        """Every rank's ``x`` (same shape everywhere), in rank order."""
        parts = [torch.empty_like(x) for _ in range(self.plan.cp)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return parts

    def gather_sequence(self, x: torch.Tensor, layout: CPLayout, axis: int) -> torch.Tensor:
        """The whole sequence along ``axis`` from every rank's prefill slice of it: the slices are
        padded to the longest for the all-gather and their real positions concatenated in order."""
        pad = layout.longest - x.shape[axis]
        if pad:
            shape = list(x.shape)
            shape[axis] = pad
            x = torch.cat([x, x.new_zeros(shape)], dim=axis)
        parts = self.gather(x)
        return torch.cat([p.narrow(axis, 0, layout.length_of(r)) for r, p in enumerate(parts)], dim=axis)

    def all_to_all(self, parts: list, shapes: list) -> list:
        """Ulysses' exchange: ``parts[j]`` goes to rank j; rank i's piece for this rank, of shape
        ``shapes[i]``, comes back in rank order (one all_to_all_single of the flattened pieces, with
        uneven split sizes, which gloo and NCCL both support)."""
        sizes = [int(np.prod(shape)) for shape in shapes]
        send = torch.cat([p.reshape(-1) for p in parts])
        received = send.new_empty(sum(sizes))
        dist.all_to_all_single(received, send, sizes, [p.numel() for p in parts], group=self.group)
        return [piece.view(shape) for piece, shape in zip(received.split(sizes), shapes)]


class CPStep:
    """One forward of a context-parallel model: the prompt's layout and whether this forward is
    the sharded prefill (``sharded``: this rank computes only its slice), a replicated one (a
    prompt shorter than the ranks' chunks, a cacheless one-token call) or a decode step."""

    def __init__(self, cp: ContextParallel, layout: CPLayout, decode: bool):
        self.cp = cp
        self.layout = layout
        self.rank = cp.plan.rank
        self.decode = decode
        self.sharded = layout.sharded and not decode
        self.start, self.stop = layout.slice_of(self.rank)

    def store_prefill(self, cache, layer_idx: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """This rank's slice of the prompt's K/V into the cache (static: a buffer with room for
        the decode tokens on the owner); nothing for an empty slice of a dynamic cache."""
        if cache is None:
            return
        if not self.sharded:  # replicated prefill: K/V of every position, keep this rank's
            key, value = key[:, :, self.start : self.stop], value[:, :, self.start : self.stop]
        if cache.is_static:
            capacity = self.layout.static_capacity(self.rank, cache.max_length)
            if capacity == 0:
                return
            b, h, n, d = key.shape
            keys, values = key.new_zeros(b, h, capacity, d), value.new_zeros(b, h, capacity, value.shape[-1])
            keys[:, :, :n], values[:, :, :n] = key, value
            cache.keys[layer_idx], cache.values[layer_idx] = keys, values
        elif key.shape[2]:
            cache.keys[layer_idx], cache.values[layer_idx] = key, value

    def decode_keys(self, cache, layer_idx: int, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor):
        """The new token's K/V appended on the owner; (keys, values, mask columns) this rank attends
        over, or (None, None, None) when it holds none."""
        layout, rank = self.layout, self.rank
        if rank == layout.owner:
            local = cache.seq_length - self.start
            if cache.is_static:
                cache.keys[layer_idx][:, :, local : local + 1] = key
                cache.values[layer_idx][:, :, local : local + 1] = value
            elif layer_idx in cache.keys:
                cache.keys[layer_idx] = torch.cat([cache.keys[layer_idx], key], dim=2)
                cache.values[layer_idx] = torch.cat([cache.values[layer_idx], value], dim=2)
            else:
                cache.keys[layer_idx], cache.values[layer_idx] = key, value
        if layer_idx not in cache.keys:
            return None, None, None
        keys, values = cache.keys[layer_idx], cache.values[layer_idx]
        return keys, values, mask[..., self.start : self.start + keys.shape[2]]

    def merge_attention(self, out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
        """Every rank's partial attention (output normalised over its keys, log-sum-exp of its
        scores) merged in rank order: the same arithmetic on the same gathered values on every rank."""
        parts = self.cp.gather(torch.cat([out, lse], dim=-1))
        lses = [p[..., -1:] for p in parts]
        top = lses[0]
        for part in lses[1:]:
            top = torch.maximum(top, part)
        weights = [(part - top).exp() for part in lses]
        total, merged = weights[0], weights[0] * parts[0][..., :-1]
        for weight, part in zip(weights[1:], parts[1:]):
            total = total + weight
            merged = merged + weight * part[..., :-1]
        return merged / total

    def gather_rows(self, hidden: torch.Tensor, logits_to_keep: int) -> torch.Tensor:
        """After a sharded prefill: the rows whose logits are returned, the same on every rank
        (the last one comes from the rank holding the last position)."""
        if logits_to_keep == 1:
            return self.cp.gather(hidden[:, -1:])[self.layout.last_rank]
        hidden = self.cp.gather_sequence(hidden, self.layout, axis=1)
        return hidden[:, -logits_to_keep:] if logits_to_keep else hidden
