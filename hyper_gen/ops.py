"""The tensor-ops protocol: everything the core asks of a framework, and nothing more.

Names follow the Python array API standard where it has one. Dtypes cross the boundary as
strings ("float32", "int64", "bool", ...) so the core never touches a framework dtype object.
Python operators (``+ - * / < == & ~`` and basic slicing) are used directly on tensors: torch
and MindSpore both implement them with the same meaning.

Each backend adapter (``hyper_gen.backends.<name>``) provides ``ops_for(obj) -> Ops | None``;
:func:`backend_for` asks only adapters whose framework is already imported, so importing
``hyper_gen`` never imports torch or mindspore (the einops ``_backends`` pattern).
"""

from __future__ import annotations

import importlib
import sys
from typing import Any, ContextManager, Optional, Protocol, Sequence, Tuple

import numpy as np

Tensor = Any

# framework module name -> adapter module that knows it
ADAPTERS = {
    "torch": "hyper_gen.backends.torch_npu",
    "mindspore": "hyper_gen.backends.mindspore",
}


class Ops(Protocol):
    """Per-framework operations; one instance is bound to a device."""

    name: str

    # host <-> device
    def is_tensor(self, x: Any) -> bool: ...
    def asarray(self, array: np.ndarray, dtype: Optional[str] = None) -> Tensor: ...
    def to_numpy(self, x: Tensor) -> np.ndarray: ...

    # dtype / creation
    def dtype_name(self, x: Tensor) -> str: ...
    def cast(self, x: Tensor, dtype: str) -> Tensor: ...
    def zeros(self, shape: Sequence[int], dtype: str) -> Tensor: ...
    def param_dtype(self, model: Any) -> str: ...

    # math the sampler needs
    def concat(self, xs: Sequence[Tensor], axis: int) -> Tensor: ...
    def where(self, cond: Tensor, a: Tensor, b: Any) -> Tensor: ...
    def argmax(self, x: Tensor, axis: int = -1) -> Tensor: ...
    def max(self, x: Tensor, axis: int = -1, keepdims: bool = True) -> Tensor: ...
    def topk(self, x: Tensor, k: int) -> Tuple[Tensor, Tensor]: ...
    def sort(self, x: Tensor, descending: bool = False) -> Tuple[Tensor, Tensor]: ...
    def cumsum(self, x: Tensor, axis: int = -1) -> Tensor: ...
    def softmax(self, x: Tensor, axis: int = -1) -> Tensor: ...
    def take_along_axis(self, x: Tensor, indices: Tensor, axis: int = -1) -> Tensor: ...
    def scatter(self, x: Tensor, indices: Tensor, values: Tensor, axis: int = -1) -> Tensor: ...
    def multinomial(self, probs: Tensor) -> Tensor: ...

    # in place: must really write (MindSpore CPU silently ignores copy_/index_copy_)
    def write_slice(self, buf: Tensor, axis: int, start: int, value: Tensor) -> None: ...

    # execution
    def no_grad(self) -> ContextManager: ...
    def synchronize(self) -> None: ...

    # collectives (world_size() == 1 when no process group is initialised)
    def rank(self, group: Any = None) -> int: ...
    def world_size(self, group: Any = None) -> int: ...
    def all_gather(self, x: Tensor, axis: int = 0, group: Any = None) -> Tensor: ...
    def all_reduce(self, x: Tensor, op: str = "sum", group: Any = None) -> Tensor: ...
    def broadcast(self, x: Tensor, src: int = 0, group: Any = None) -> Tensor: ...


def backend_for(*objects: Any) -> Ops:
    """The ops of the first framework that claims one of ``objects`` (a model or a tensor)."""
    for framework, adapter_name in ADAPTERS.items():
        if framework not in sys.modules:
            continue
        adapter = importlib.import_module(adapter_name)
        for obj in objects:
            if obj is None:
                continue
            ops = adapter.ops_for(obj)
            if ops is not None:
                return ops
    kinds = ", ".join(type(o).__name__ for o in objects if o is not None)
    raise TypeError(
        f"no backend recognises {kinds or 'nothing'}: pass a torch.nn.Module / mindspore.nn.Cell model "
        "(or a callable whose parameters or inputs are torch / mindspore tensors)"
    )


def imported_framework_ops() -> list:
    """Ops for every framework already imported (used to convert foreign input tensors)."""
    found = []
    for framework, adapter_name in ADAPTERS.items():
        if framework in sys.modules:
            found.append(importlib.import_module(adapter_name))
    return found


def to_host(value: Any) -> Any:
    """A framework tensor as a numpy array; anything else unchanged."""
    for adapter in imported_framework_ops():
        ops = adapter.ops_for(value)
        if ops is not None and ops.is_tensor(value):
            return ops.to_numpy(value)
    return value
