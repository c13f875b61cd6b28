"""The ops protocol for torch (CPU, CUDA, and Ascend NPU through torch_npu)."""

from __future__ import annotations

import contextlib
import functools

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from hyper_gen.parallel import hyperparallel

from . import launch, paged_kernel

_DTYPES = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
    "int32": torch.int32,
    "int64": torch.int64,
    "bool": torch.bool,
}
_NAMES = {v: k for k, v in _DTYPES.items()}
_REDUCE = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def dtype_name(dtype: torch.dtype) -> str:
    """The name ("float32", ...) of a torch dtype."""
    return _NAMES[dtype]


def torch_dtype(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {name!r}")
    return _DTYPES[name]


# the engine's attention reads the pool in pieces of this many columns (docs/kv_cache.md): small
# enough that a piece's K/V stay in cache between the gather and the attention that reads them
PAGED_COLUMNS = 1024


def _piece_of(pool, piece):
    """(rows, columns, H, D) of a piece's K or V: whole blocks copied as runs where it names them."""
    n, t = piece.shape
    if piece.blocks is None:
        return pool.index_select(0, piece.slots).view(n, t, *pool.shape[1:])
    blocks = pool.view(-1, piece.block_size, *pool.shape[1:]).index_select(0, piece.blocks)
    return blocks.view(n, -1, *pool.shape[1:])[:, :t]


class TorchOps:
    """Torch ops bound to one device."""

    name = "torch"
    thread_safe = True  # concurrent generate() calls on one model run side by side
    paged_columns = PAGED_COLUMNS

    def __init__(self, device="cpu"):
        self.device = torch.device(device)

    def is_tensor(self, x):
        return isinstance(x, torch.Tensor)

    def asarray(self, array, dtype=None):
        array = np.asarray(array)
        tensor = torch.from_numpy(np.ascontiguousarray(array))
        target = torch_dtype(dtype) if dtype else None
        return tensor.to(device=self.device, dtype=target)

    def to_numpy(self, x):
        x = x.detach()
        if x.dtype == torch.bfloat16:
            x = x.float()
        return x.cpu().numpy()

    def dtype_name(self, x):
        return _NAMES[x.dtype]

    def cast(self, x, dtype):
        return x.to(torch_dtype(dtype))

    def zeros(self, shape, dtype):
        return torch.zeros(tuple(shape), dtype=torch_dtype(dtype), device=self.device)

    def param_dtype(self, model):
        for param in model.parameters() if isinstance(model, torch.nn.Module) else ():
            if param.dtype.is_floating_point:  # an attribute: HyperParallel's DTensor refuses the method
                return _NAMES[param.dtype]
        return "float32"

    def concat(self, xs, axis):
        return torch.cat(list(xs), dim=axis)

    def where(self, cond, a, b):
        return torch.where(cond, a, b)

    def argmax(self, x, axis=-1):
        return torch.argmax(x, dim=axis)

    def max(self, x, axis=-1, keepdims=True):
        return torch.amax(x, dim=axis, keepdim=keepdims)

    def sum(self, x, axis=-1, keepdims=False):
        return torch.sum(x, dim=axis, keepdim=keepdims)

    def exp(self, x):
        return torch.exp(x)

    def topk(self, x, k):
        return torch.topk(x, k, dim=-1)

    def sort(self, x, descending=False):
        return torch.sort(x, dim=-1, descending=descending)

    def cumsum(self, x, axis=-1):
        return torch.cumsum(x, dim=axis)

    def softmax(self, x, axis=-1):
        return torch.softmax(x, dim=axis)

    def take_along_axis(self, x, indices, axis=-1):
        return torch.gather(x, axis, indices)

    def scatter(self, x, indices, values, axis=-1):
        return x.scatter(axis, indices, values)

    def take(self, x, indices, axis=0):
        if isinstance(indices, torch.Tensor):  # already on the device (a table kept across steps)
            return torch.index_select(x, axis, indices)
        return torch.index_select(x, axis, torch.as_tensor(np.asarray(indices, dtype=np.int64), device=x.device))

    def log_softmax(self, x, axis=-1):
        return torch.log_softmax(x, dim=axis)

    def multinomial(self, probs):
        # exactly HF's draw, so the RNG stream matches HF under torch.manual_seed
        return torch.multinomial(probs, num_samples=1).squeeze(1)

    def write_slice(self, buf, axis, start, value):
        buf.narrow(axis, start, value.shape[axis]).copy_(value)

    def _index(self, rows, device):
        return torch.as_tensor(np.asarray(rows, dtype=np.int64).reshape(-1), device=device)

    def buffer(self, shape, dtype):
        return self.zeros(shape, dtype)

    def write_rows(self, buf, rows, values):
        buf.index_copy_(0, self._index(rows, buf.device), values.to(buf.dtype))

    def gather_slots(self, pool, slots):
        b, t = np.shape(slots)
        return pool.index_select(0, self._index(slots, pool.device)).view(b, t, *pool.shape[1:]).transpose(1, 2)

    def write_slots(self, pool, slots, values):
        b, h, s, d = values.shape
        pool.index_copy_(0, self._index(slots, pool.device), values.transpose(1, 2).reshape(b * s, h, d))

    def paged_attention(self, query, pool_k, pool_v, pieces, partial):
        """Attention over the pool a piece of columns at a time: each piece's rows read only its
        slots (a bounded gather, not every row's whole history), and rows with no position in a
        piece skip it (no padding); the pieces' outputs merge by their log-sum-exp."""
        b, h, s, d = query.shape
        outs, lses = [], []
        for piece in pieces:
            q = query if piece.rows is None else query.index_select(0, piece.rows)
            k, v = (_piece_of(pool, piece).transpose(1, 2) for pool in (pool_k, pool_v))
            out, lse = partial(q, k, v, piece.mask)
            out = out.to(lse.dtype)
            if piece.rows is not None:
                out = out.new_zeros((b, h, s, out.shape[-1])).index_copy_(0, piece.rows, out)
                lse = lse.new_full((b, h, s, 1), float("-inf")).index_copy_(0, piece.rows, lse)
            outs.append(out)
            lses.append(lse)
        weights = torch.softmax(torch.stack(lses), dim=0)
        return (torch.stack(outs) * weights).sum(0).to(query.dtype)

    @functools.cached_property
    def in_place_attention_kernel(self) -> bool:
        """Whether ``in_place_attention`` runs here: the C++ kernel, on CPU, built (``paged_kernel``)."""
        return self.device.type == "cpu" and paged_kernel.available()

    def in_place_attention(self, query, pool_k, pool_v, slots, lengths, scale):
        """Attention over the pool slots ``slots`` (B, T) names, read in place (``paged_kernel``)."""
        return paged_kernel.paged_attention(query, pool_k, pool_v, slots, lengths, scale)

    def no_grad(self):
        return torch.no_grad()

    def release_memory(self):
        # CPU tensors go back to the allocator (and large ones to the OS) when dropped; CUDA and
        # torch_npu cache them until asked
        if self.device.type in ("cuda", "npu"):
            getattr(torch, self.device.type).empty_cache()

    def is_distributed(self, x):
        return isinstance(x, DTensor) or hyperparallel.is_dtensor(x)

    def full_tensor(self, x):
        return x.full_tensor() if self.is_distributed(x) else x

    # collectives -----------------------------------------------------------------------
    def rank(self, group=None):
        return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0

    def world_size(self, group=None):
        return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1

    def all_gather(self, x, axis=0, group=None):
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size(group))]
        with _naming_timeouts("all_gather"):
            dist.all_gather(parts, x, group=group)
        return torch.cat(parts, dim=axis)

    def all_reduce(self, x, op="sum", group=None):
        x = x.clone()
        with _naming_timeouts("all_reduce"):
            dist.all_reduce(x, op=_REDUCE[op], group=group)
        return x

    def broadcast(self, x, src=0, group=None):
        x = x.contiguous().clone()
        with _naming_timeouts("broadcast"):
            dist.broadcast(x, src=src, group=group)
        return x


@contextlib.contextmanager
def _naming_timeouts(collective: str):
    """A collective that timed out (gloo: "Timed out waiting ...") as a TimeoutError naming the
    timeout and what it means, instead of the transport's message alone."""
    try:
        yield
    except RuntimeError as error:  # torch.distributed.DistBackendError is one
        if "timed out" not in str(error).lower():
            raise
        rank = dist.get_rank() if dist.is_initialized() else 0
        raise TimeoutError(
            f"torch.distributed {collective} on rank {rank} waited longer than the collective timeout, "
            f"{launch.timeout_description()}: another rank of the group stalled, died or is running "
            f"something else ({str(error).splitlines()[0]})"
        ) from error
