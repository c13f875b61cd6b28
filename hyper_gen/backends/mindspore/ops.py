"""The ops protocol for MindSpore (CPU here; Ascend through the same calls). Why it casts, writes by
slice assignment and gathers a CPU subgroup over the world: docs/architecture.md, "MindSpore on CPU"."""

from __future__ import annotations

import contextlib

import mindspore as ms
import numpy as np
from mindspore import mint, ops

from hyper_gen.parallel import hyperparallel
from hyper_gen.parallel.world_gather import gather_over_world

from .launch import timeout_description
from .primitives import cast

_DTYPES = {name: getattr(ms, name) for name in ("float16", "bfloat16", "float32", "float64", "int32", "int64")}
_DTYPES["bool"] = ms.bool_
_NAMES = {v: k for k, v in _DTYPES.items()}
_NUMPY = {name: np.dtype(name) for name in _DTYPES if name != "bfloat16"}  # zeros from numpy
_SUM, _SUM_KEEP = ops.ReduceSum(), ops.ReduceSum(keep_dims=True)
_WIDE = (ms.float64, ms.int64)  # 8-byte dtypes the CPU collectives do not carry exactly


def dtype_name(dtype) -> str:
    """The name ("float32", ...) of a MindSpore dtype."""
    return _NAMES[dtype]


def ms_dtype(name: str):
    if name not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {name!r}")
    return _DTYPES[name]


def _communication_ready() -> bool:
    from mindspore.communication import GlobalComm

    return bool(GlobalComm.INITED)


_GROUP_MEMBERS = {}  # subgroup name -> its world ranks in group rank order


def new_group(name: str, ranks) -> str:
    """The subgroup ``name`` of the world ranks ``ranks`` (ascending), made once per process;
    called by the member ranks only (MindSpore cannot make a group without the calling rank)."""
    ranks = [int(r) for r in ranks]
    if ranks != sorted(set(ranks)):
        raise ValueError(f"group ranks must be distinct and ascending, got {ranks}")
    known = _GROUP_MEMBERS.get(name)
    if known is not None:
        if known != ranks:
            raise ValueError(f"group {name!r} already holds ranks {known}, not {ranks}")
        return name
    from mindspore.communication import create_group

    create_group(name, ranks)
    _GROUP_MEMBERS[name] = ranks
    return name


def _members(group) -> list:
    """World ranks of ``group`` in group rank order."""
    if group not in _GROUP_MEMBERS:
        from mindspore.communication import get_group_size, get_world_rank_from_group_rank

        _GROUP_MEMBERS[group] = [get_world_rank_from_group_rank(group, r) for r in range(get_group_size(group))]
    return _GROUP_MEMBERS[group]


def _over_world(group) -> bool:
    """True for a subgroup whose AllGather / Broadcast must run over the world (MindSpore CPU)."""
    from mindspore.communication import GlobalComm

    return group is not None and group != GlobalComm.WORLD_COMM_GROUP and ms.get_context("device_target") == "CPU"


def _world_gather(x, group=None):
    """The AllGather of ``x`` over ``group`` (None: the world); float64 / int64 as int32 words: exact."""
    gather = ops.AllGather() if group is None else ops.AllGather(group=group)
    if x.dtype in _WIDE:  # CPU AllGather rounds float64 to float32: move the raw bits instead
        return gather(x.view(ms.int32)).view(x.dtype)
    return gather(x)


class MindSporeOps:
    """MindSpore ops (PyNative)."""

    name = "mindspore"
    # PyNative is one process-wide executor (its grad switch, op queue, kernel caches): two threads
    # running forwards at once segfault inside the kernels, so generate() serialises them
    thread_safe = False
    # attention over the pool reads gathered K/V (``gather_slots``): a loop of pieces costs
    # kernels, what MindSpore's runtime charges for; Ascend's paged-attention kernel is the way there
    paged_columns = None
    in_place_attention_kernel = False  # no in-place paged kernel on MindSpore's CPU ops

    def is_tensor(self, x):
        return isinstance(x, ms.Tensor)

    def asarray(self, array, dtype=None):
        array = np.asarray(array)
        if dtype == "bfloat16":
            return ms.Tensor(array.astype(np.float32)).astype(ms.bfloat16)
        if dtype is not None:
            array = array.astype(dtype, copy=False)
        return ms.Tensor(np.ascontiguousarray(array))

    def to_numpy(self, x):
        if x.dtype == ms.bfloat16:
            x = x.astype(ms.float32)
        return x.asnumpy()

    def dtype_name(self, x):
        return _NAMES[x.dtype]

    def cast(self, x, dtype):
        target = ms_dtype(dtype)
        return x if x.dtype == target else x.astype(target)

    def zeros(self, shape, dtype):
        if dtype == "bfloat16":  # the others from numpy: ops.zeros leaks host memory a call on CPU
            return ops.zeros(tuple(shape), ms.bfloat16)
        return ms.Tensor(np.zeros(tuple(shape), _NUMPY[dtype]))

    def param_dtype(self, model):
        if isinstance(model, ms.nn.Cell):
            for param in model.get_parameters():
                if param.dtype in (ms.float16, ms.bfloat16, ms.float32, ms.float64):
                    return _NAMES[param.dtype]
        return "float32"

    def concat(self, xs, axis):
        return ops.cat(tuple(xs), axis)

    def where(self, cond, a, b):
        return ops.where(cond, a, b)

    def argmax(self, x, axis=-1):
        return cast(ops.argmax(x, axis), ms.int64)  # int64 already in MindSpore 2.10: no cast kernel

    def max(self, x, axis=-1, keepdims=True):
        return x.max(axis=axis, keepdims=keepdims)

    def sum(self, x, axis=-1, keepdims=False):
        return (_SUM_KEEP if keepdims else _SUM)(x, axis)  # Tensor.sum(axis) leaks host memory a call

    def exp(self, x):
        return ops.exp(x)

    def topk(self, x, k):
        values, indices = ops.topk(x, k)
        return values, indices.astype(ms.int64)

    def sort(self, x, descending=False):
        values, indices = ops.sort(x, axis=-1, descending=descending)
        return values, indices.astype(ms.int64)

    def cumsum(self, x, axis=-1):
        return ops.cumsum(x, axis)

    def softmax(self, x, axis=-1):
        return mint.nn.functional.softmax(x, axis)

    def take_along_axis(self, x, indices, axis=-1):
        return ops.gather_elements(x, axis, indices)

    def scatter(self, x, indices, values, axis=-1):
        return ops.tensor_scatter_elements(x, indices, values, axis)

    def take(self, x, indices, axis=0):
        if isinstance(indices, ms.Tensor):  # already on the device (a table kept across steps)
            return ops.gather(x, indices, axis)
        return ops.gather(x, ms.Tensor(np.asarray(indices, dtype=np.int32)), axis)

    def log_softmax(self, x, axis=-1):
        return ops.log_softmax(x, axis)

    def multinomial(self, probs):
        return ops.multinomial(probs, 1).astype(ms.int64).reshape(-1)

    def write_slice(self, buf, axis, start, value):
        index = [slice(None)] * buf.ndim
        index[axis] = slice(start, start + value.shape[axis])
        buf[tuple(index)] = value  # slice assignment really writes on MindSpore CPU (copy_ does not)

    def buffer(self, shape, dtype):
        # a Parameter: ScatterUpdate writes its rows in place (index assignment on a plain tensor
        # copies the whole buffer on CPU: 52 ms a write into a 512 MiB pool)
        return ms.Parameter(self.zeros(shape, dtype), requires_grad=False)

    def write_rows(self, buf, rows, values):
        ops.scatter_update(buf, ms.Tensor(np.asarray(rows, dtype=np.int32).reshape(-1)), values)

    def gather_slots(self, pool, slots):
        b, t = np.shape(slots)
        rows = ops.gather(pool, ms.Tensor(np.asarray(slots, dtype=np.int32).reshape(-1)), 0)
        return rows.reshape(b, t, *pool.shape[1:]).transpose(0, 2, 1, 3)

    def write_slots(self, pool, slots, values):
        b, h, s, d = values.shape
        self.write_rows(pool, slots, values.transpose(0, 2, 1, 3).reshape(b * s, h, d))

    def no_grad(self):
        return ms._no_grad()

    def release_memory(self):
        # frees the device memory pool's unused blocks on Ascend; MindSpore 2.10's CPU pool keeps them
        # (reused by the next allocation: docs/kv_cache.md)
        ms.runtime.empty_cache()

    def is_distributed(self, x):
        return hyperparallel.is_dtensor(x)  # MindSpore's own sharding has no distributed tensor type

    def full_tensor(self, x):
        return x.full_tensor() if self.is_distributed(x) else x

    # collectives (CPU: AllGather / AllReduce / Broadcast only; Ascend HCCL has all) ------------
    def rank(self, group=None):
        if not _communication_ready():
            return 0
        from mindspore.communication import get_rank

        return get_rank() if group is None else get_rank(group)

    def world_size(self, group=None):
        if not _communication_ready():
            return 1
        from mindspore.communication import get_group_size

        return get_group_size() if group is None else get_group_size(group)

    def _group(self, group):
        from mindspore.communication import GlobalComm

        return GlobalComm.WORLD_COMM_GROUP if group is None else group

    def all_gather(self, x, axis=0, group=None):
        with _naming_timeouts("AllGather", self):
            if _over_world(group):  # CPU: a subgroup's AllGather is a world one (module docstring)
                gathered = gather_over_world(self, x, _members(group))
            else:
                gathered = _world_gather(x, self._group(group))  # stacks along axis 0
        if axis % x.ndim == 0:
            return gathered
        parts = ops.split(gathered, x.shape[0], axis=0)
        return ops.cat(parts, axis)

    def all_reduce(self, x, op="sum", group=None):
        if x.dtype == ms.float64:
            # no float64 CPU AllReduce kernel: gather the exact bits (all_gather), and every rank
            # reduces the parts in rank order, so every rank holds the same float64 result
            parts = self.all_gather(x.reshape((1,) + x.shape), axis=0, group=group)
            combine = {"sum": ops.add, "max": ops.maximum, "min": ops.minimum}[op]
            total = parts[0]
            for rank in range(1, parts.shape[0]):
                total = combine(total, parts[rank])
            return total
        reduce = {"sum": ops.ReduceOp.SUM, "max": ops.ReduceOp.MAX, "min": ops.ReduceOp.MIN}[op]
        with _naming_timeouts("AllReduce", self):
            return ops.AllReduce(reduce, group=self._group(group))(x)

    def broadcast(self, x, src=0, group=None):
        with _naming_timeouts("Broadcast", self):
            if _over_world(group):  # CPU: the group's gather over the world, src's part (src: a world rank)
                gathered = gather_over_world(self, x, _members(group))
                index = _members(group).index(src)
                return gathered[index * x.shape[0] : (index + 1) * x.shape[0]] if x.ndim else gathered[index]
            if x.dtype in _WIDE:  # CPU Broadcast narrows float64/int64: move the raw bits instead
                return ops.Broadcast(src, group=self._group(group))((x.view(ms.int32),))[0].view(x.dtype)
            return ops.Broadcast(src, group=self._group(group))((x,))[0]


@contextlib.contextmanager
def _naming_timeouts(collective: str, ops_):
    """A CPU collective whose wait for its peers failed ("Launch kernel failed, name:...AllGather")
    as a TimeoutError naming the wait, instead of MindSpore's kernel-launch message alone."""
    try:
        yield
    except RuntimeError as error:
        message = str(error)
        if "Launch kernel failed" not in message or collective not in message:
            raise
        raise TimeoutError(
            f"MindSpore {collective} on rank {ops_.rank()} failed waiting for its peers, after at most "
            f"{timeout_description()}: another rank of the group stalled, died or is running something "
            f"else ({message.strip().splitlines()[0]})"
        ) from error
