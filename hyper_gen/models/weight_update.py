"""``update_weights``: a trainer's tensors (HF checkpoint names) written into a loaded native model.

Backend-neutral. Every tensor is checked first (name, type, shape, dtype, finite) and turned into
numpy through the backends' Ops; then the model's port (the module of the model's class, e.g.
``hyper_gen.backends.torch.models.qwen3_5``) converts them with its own load code, reading them
from an ``UpdateSource``: the checkpoint the model was loaded from (``model.weight_source``, a ``WeightSource`` set by
``load_model``) with the new tensors laid over it. So fusing, padding, transposing, norm folding,
tensor-parallel slicing (each rank reads its slices of the full tensors) and kernel-plan widths are
load's own. ``prepare_update(model, source, names)`` returns the write, run only once everything is
converted: an error anywhere before it leaves the model unchanged.

A port rebuilds whole units (what its load builds together: a fused projection, an MoE layer's
experts, on MindSpore a decoder layer with its folded norms). A unit's tensors that the update
does not carry are read from the checkpoint on disk, unless an earlier update changed them: the
model does not keep a second copy of the weights, so such a partial update is a ValueError asking
for the unit's whole group of tensors.
"""

from __future__ import annotations

import dataclasses
import importlib
from functools import partial
from typing import Dict, Iterable, Optional, Set

import numpy as np

from hyper_gen import registry
from hyper_gen.models.checkpoint import _MULTIMODAL_TEXT_PREFIX, _SKIPPED_PREFIXES, Checkpoint, Piece, _all_finite
from hyper_gen.models.expert_layouts import into_model_layout, other_layout
from hyper_gen.models.qwen3_5.shards import EMBED_TOKENS


def piece_names(unit) -> Set[str]:
    """The checkpoint names a shard description (a Piece, a dataclass of them, tuples) reads."""
    if isinstance(unit, Piece):
        return {unit.name}
    if isinstance(unit, str):
        return {unit}
    if isinstance(unit, (tuple, list)):
        return set().union(*(piece_names(u) for u in unit)) if unit else set()
    if dataclasses.is_dataclass(unit):
        return piece_names([getattr(unit, f.name) for f in dataclasses.fields(unit)])
    return set()


def touches(unit, names: Set[str]) -> bool:
    """Whether the update ``names`` change anything ``unit`` is built from."""
    return not piece_names(unit).isdisjoint(names)


def expected_shapes(shard) -> Dict[str, tuple]:
    """name -> full checkpoint shape of every tensor a model built from ``shard`` (a ``ModelShard``) reads."""
    shapes: Dict[str, tuple] = {}

    def walk(unit):
        if isinstance(unit, Piece):
            shapes[unit.name] = unit.shape
        elif isinstance(unit, (tuple, list)):
            for u in unit:
                walk(u)
        elif dataclasses.is_dataclass(unit):
            for f in dataclasses.fields(unit):
                walk(getattr(unit, f.name))

    walk(shard.layers)
    walk(shard.final_norm)
    vocab = (shard.config.vocab_size, shard.config.hidden_size)
    shapes[EMBED_TOKENS] = vocab
    if shard.lm_head is not None:
        shapes[shard.lm_head] = vocab
    return shapes


class UpdateSource(Checkpoint):
    """The model's checkpoint with the update's arrays laid over it: what a port's load code reads.
    A tensor neither updated now nor ever before is read from ``base`` (the files on disk)."""

    def __init__(
        self, base: Checkpoint, arrays: Dict[str, np.ndarray], updated_before: Set[str], keep_strides: bool = False
    ):
        # no Checkpoint.__init__: the folder is base's, already opened and checked. keep_strides: a
        # given array is read as the view it is (a port that stages tensors in its own memory order)
        self.base, self.arrays, self.updated_before = base, arrays, updated_before
        self.keep_strides = keep_strides
        self.path, self.config, self.full_config = base.path, base.config, base.full_config
        self.architecture, self.generation_config = base.architecture, base.generation_config

    def has(self, name: str) -> bool:
        return name in self.arrays or self.base.has(name)

    def shape(self, name: str) -> tuple:
        return tuple(self.arrays[name].shape) if name in self.arrays else self.base.shape(name)

    def _read(self, name, window, dtype: str) -> np.ndarray:
        if name not in self.arrays:
            if name in self.updated_before:
                raise ValueError(
                    f"update_weights: the model stores {name!r} together with tensors of this update, and an earlier "
                    f"update changed {name!r}: send {name!r} again with them (the model keeps no second copy of "
                    "its weights)"
                )
            return self.base._read(name, window, dtype)
        array = self.arrays[name]
        if window is not None:
            axis, start, stop = window
            index = [slice(None)] * array.ndim
            index[axis % array.ndim] = slice(start, stop)
            array = array[tuple(index)]
        narrowed = np.dtype(dtype).itemsize < array.dtype.itemsize  # a float64 past float32's range: inf
        with np.errstate(over="ignore"):
            array = array.astype(dtype, copy=False)
        if not self.keep_strides or min(array.strides, default=0) < 0:  # (torch takes no negative stride)
            array = np.ascontiguousarray(array)
        if narrowed and not _all_finite(array):  # (``check`` saw the given values finite)
            raise ValueError(f"update_weights: tensor {name!r} has values past {np.dtype(dtype).name}'s range (inf)")
        return array


def normalised_name(name: str) -> str:
    """A multimodal checkpoint's text weight name as the model knows it (Checkpoint's rule)."""
    return "model." + name[len(_MULTIMODAL_TEXT_PREFIX) :] if name.startswith(_MULTIMODAL_TEXT_PREFIX) else name


def to_numpy(name: str, tensor) -> np.ndarray:
    """A torch / MindSpore tensor (a DTensor: its full tensor) or a numpy array on the host."""
    if isinstance(tensor, np.ndarray):
        return tensor
    try:
        ops = registry.backend_for(tensor)
    except TypeError:
        ops = None
    if ops is None or not ops.is_tensor(tensor):
        raise TypeError(
            f"update_weights: {name!r} must be a torch / MindSpore tensor or a numpy array, got {type(tensor).__name__}"
        )
    if ops.is_distributed(tensor):
        tensor = ops.full_tensor(tensor)
    return ops.to_numpy(tensor)


class WeightUpdate:
    """Checked tensors for one model (``check``); ``apply()`` converts them with the port's load code
    and writes them (all or nothing), returning how many tensors were applied. ``prepare()`` is the
    first half alone: every conversion, nothing written; it returns the write (``apply() ==
    prepare()()``), so a multi-rank engine can convert on every rank, agree that all ranks did, and
    only then write."""

    def __init__(self, model, source: "WeightSource", arrays: Dict[str, np.ndarray], count: Optional[int] = None):
        # count: the caller's tensors (a fused expert tensor may stand for many of ``arrays``, or many for one)
        self.model, self.source, self.arrays = model, source, arrays
        self.count = len(arrays) if count is None else count

    def prepare(self):
        port = importlib.import_module(type(self.model).__module__)
        staged = hasattr(port, "stage_update")
        overlay = UpdateSource(self.source.checkpoint, self.arrays, self.source.updated, keep_strides=staged)
        write = port.prepare_update(self.model, overlay, set(self.arrays))  # every conversion, nothing written

        def commit() -> int:
            write()
            self.source.updated.update(self.arrays)
            return self.count

        return commit

    def apply(self) -> int:
        return self.prepare()()


class WeightSource:
    """What ``load_model`` leaves on a native model (``model.weight_source``) for update_weights: the
    checkpoint it was loaded from, its family description module, and the names updated since (the
    engine, on floor 0, reaches the driver through it)."""

    def __init__(self, checkpoint: Checkpoint, family):
        self.checkpoint, self.family, self.updated = checkpoint, family, set()

    def check(self, model, weights: Iterable) -> WeightUpdate:
        return check(model, weights)

    def checker(self, model) -> "Checker":
        return Checker(model)


def check(model, weights: Iterable) -> WeightUpdate:
    """Every ``(name, tensor)`` of ``weights`` checked against the model's checkpoint description:
    a ValueError naming the tensor for an unknown name, a wrong shape, a non-float dtype or a
    non-finite value; a TypeError for something that is not a tensor. MoE experts are taken in
    either layout (fused as a transformers 5 trainer holds them, or per expert as checkpoints
    name them) and put into the model's (``expert_layouts``). Nothing is converted yet."""
    checker = Checker(model)
    for item in weights.items() if isinstance(weights, dict) else weights:
        checker.add(item)
    return checker.finish()


class Checker:
    """``check`` one tensor at a time (``add``), then ``finish()``: a receiver checks each tensor as
    it arrives, while the next one is still on the wire."""

    def __init__(self, model):
        source = getattr(model, "weight_source", None)
        if not isinstance(source, WeightSource):
            raise ValueError(
                f"update_weights needs a native model loaded by hyper_gen.load_model, got {type(model).__name__}"
            )
        self.model, self.source = model, source
        shard = source.family.describe(source.checkpoint, model.config, model.tp_plan)
        self.shapes = expected_shapes(shard)
        self.other = other_layout(self.shapes)  # the expert layout the model was not loaded from
        self.arrays: Dict[str, np.ndarray] = {}
        self.translated: Dict[str, tuple] = {}  # a name of ``other`` -> (the caller's name, array)
        self.stage = None

    def staging(self) -> "Checker":
        """Each checked tensor also laid out as the model keeps it, when its port can
        (``stage_update(model, name, array)``): a receiver does it while the next tensor is on the
        wire, and the update's write is then a plain copy instead of a transposing one."""
        stage = getattr(importlib.import_module(type(self.model).__module__), "stage_update", None)
        self.stage = None if stage is None else partial(stage, self.model)
        return self

    def add(self, item) -> None:
        if not (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], str)):
            raise TypeError(f"update_weights: each item must be a (name: str, tensor) pair, got {item!r:.80}")
        given, tensor = item
        name = normalised_name(given)
        if name.startswith(_SKIPPED_PREFIXES):  # vision tower / MTP weights: not part of the text model
            return
        expected = self.shapes.get(name, self.other.get(name))
        if expected is None:
            raise ValueError(f"update_weights: {given!r} is not a weight of this model's checkpoint")
        array = to_numpy(given, tensor)
        if array.dtype.kind != "f":
            raise ValueError(f"update_weights: {given!r} has dtype {array.dtype}, expected a floating dtype")
        if tuple(array.shape) != tuple(expected):
            raise ValueError(f"update_weights: {given!r} has shape {tuple(array.shape)}, expected {expected}")
        if not _all_finite(array):
            nan, inf = int(np.isnan(array).sum()), int(np.isinf(array).sum())
            raise ValueError(f"update_weights: {given!r} has non-finite values ({nan} NaN, {inf} inf)")
        if name in self.arrays or name in self.translated:
            raise ValueError(f"update_weights: {given!r} is given twice")
        if name in self.shapes:
            self.arrays[name] = array if self.stage is None else self.stage(name, array)
        else:
            self.translated[name] = (given, array)

    def finish(self) -> WeightUpdate:
        source, shapes, arrays, translated = self.source, self.shapes, self.arrays, self.translated
        count = len(arrays) + len(translated)
        if translated:

            def read(name: str, dtype) -> np.ndarray:  # the model's source's value of a tensor no update changed
                wide = "float64" if source.checkpoint.stored_dtype(name) in ("F64", "float64") else np.dtype(dtype).name
                return source.checkpoint.get(name, wide)

            for name, (given, array) in into_model_layout(translated, shapes, read, source.updated).items():
                if name in arrays:
                    raise ValueError(f"update_weights: {given!r} and {name!r} both give {name!r}: it is given twice")
                arrays[name] = array
        return WeightUpdate(self.model, source, arrays, count)


def model_shapes(model) -> Dict[str, tuple]:
    """name -> full checkpoint shape of every tensor ``update_weights`` takes for ``model`` (a
    ValueError for a model not loaded by ``load_model``), MoE experts in both layouts: what a
    server checks a trainer's announced tensors against before it receives them."""
    source = getattr(model, "weight_source", None)
    if not isinstance(source, WeightSource):
        raise ValueError(
            f"update_weights needs a native model loaded by hyper_gen.load_model, got {type(model).__name__}"
        )
    shapes = expected_shapes(source.family.describe(source.checkpoint, model.config, model.tp_plan))
    return {**other_layout(shapes), **shapes}


def announced_problem(shapes: Dict[str, tuple], name: str, shape) -> tuple:
    """``(field, message)`` when the tensor ``name`` of shape ``shape`` cannot update a model whose
    tensors are ``shapes`` (``model_shapes``): ``names`` for a name it lacks, ``shapes`` for a
    shape that disagrees; ``(None, None)`` when it can (a vision tower / MTP weight, skipped, too)."""
    normal = normalised_name(name)
    if normal.startswith(_SKIPPED_PREFIXES):
        return None, None
    if normal not in shapes:
        return "names", f"{name!r} is not a weight of this model's checkpoint"
    if tuple(shape) != tuple(shapes[normal]):
        return "shapes", f"{name!r} has shape {tuple(shape)}, the model's is {tuple(shapes[normal])}"
    return None, None


def update_weights(model, weights: Iterable) -> int:
    """Write ``weights``, an iterable (or dict) of ``(name, tensor)`` with the HF checkpoint's names
    (torch / MindSpore tensors, numpy arrays, torch DTensors: their full tensor), a subset or all of
    them, into ``model`` (loaded by ``load_model``), laid out as ``load_model`` lays out those
    tensors (fused, padded, transposed, this rank's tensor-parallel slices of the full tensors).

    All or nothing: every tensor is checked (ValueError / TypeError naming it) and converted before
    any is written; on an error the model is unchanged. Returns the number of tensors applied.
    Not thread-safe against a generate() running on the model: an engine applies it between steps
    (``Engine.update_weights``)."""
    return check(model, weights).apply()


__all__ = [
    "UpdateSource",
    "WeightSource",
    "WeightUpdate",
    "announced_problem",
    "check",
    "model_shapes",
    "update_weights",
]
