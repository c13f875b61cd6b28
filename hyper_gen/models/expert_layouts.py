"""The two names of MoE expert weights, so ``update_weights`` takes either whatever the model was loaded from.

transformers 5 keeps a layer's experts fused at run time (``...mlp.experts.gate_up_proj`` (E, 2I, H),
gate rows first, and ``...mlp.experts.down_proj`` (E, H, I)): a trainer's ``state_dict()`` has those
names. Its ``save_pretrained`` writes one tensor per expert (``...mlp.experts.N.gate_proj.weight``
(I, H), ``up_proj`` (I, H), ``down_proj`` (H, I)), and a checkpoint may hold either. A model reads
the layout of its checkpoint (``shards.describe``); this module translates the other layout's
tensors into it before anything is converted, so the all-or-nothing rule of ``weight_update`` holds:

- fused given, per-expert model: each fused tensor is split into its experts' tensors (views);
- per-expert given, fused model: each fused tensor is stacked from the given experts, the experts
  not given read from the model's source (its checkpoint, or a ValueError when an earlier update
  changed that fused tensor: the model keeps no second copy of its weights).
"""

from __future__ import annotations

import re
from typing import Callable, Dict, Iterable, Set, Tuple

import numpy as np

_PER_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_FUSED = re.compile(r"^(.*\.experts)\.(gate_up_proj|down_proj)$")


def other_layout(shapes: Dict[str, tuple]) -> Dict[str, tuple]:
    """name -> full shape of every expert tensor in the layout the model was *not* loaded from,
    given the model's own ``shapes`` (``weight_update.expected_shapes``)."""
    other: Dict[str, tuple] = {}
    experts: Dict[str, int] = {}  # per-expert prefix -> how many experts
    for name, shape in shapes.items():
        fused = _FUSED.match(name)
        if fused is not None:
            prefix, proj = fused.groups()
            if proj == "gate_up_proj":
                for e in range(shape[0]):
                    other[f"{prefix}.{e}.gate_proj.weight"] = other[f"{prefix}.{e}.up_proj.weight"] = (
                        shape[1] // 2,
                        shape[2],
                    )
            else:
                for e in range(shape[0]):
                    other[f"{prefix}.{e}.down_proj.weight"] = tuple(shape[1:])
            continue
        per_expert = _PER_EXPERT.match(name)
        if per_expert is not None:
            prefix, expert, _ = per_expert.groups()
            experts[prefix] = max(experts.get(prefix, 0), int(expert) + 1)
    for prefix, count in experts.items():
        inter, hidden = shapes[f"{prefix}.0.gate_proj.weight"]
        other[f"{prefix}.gate_up_proj"] = (count, 2 * inter, hidden)
        other[f"{prefix}.down_proj"] = (count, hidden, inter)
    return other


def _split_fused(name: str, array: np.ndarray) -> Iterable[Tuple[str, np.ndarray]]:
    prefix, proj = _FUSED.match(name).groups()
    if proj == "down_proj":
        for e in range(array.shape[0]):
            yield f"{prefix}.{e}.down_proj.weight", array[e]
        return
    inter = array.shape[1] // 2
    for e in range(array.shape[0]):
        yield f"{prefix}.{e}.gate_proj.weight", array[e, :inter]
        yield f"{prefix}.{e}.up_proj.weight", array[e, inter:]


def into_model_layout(
    given: Dict[str, Tuple[str, np.ndarray]],
    shapes: Dict[str, tuple],
    read: Callable[[str, np.dtype], np.ndarray],
    updated_before: Set[str],
) -> Dict[str, Tuple[str, np.ndarray]]:
    """``given`` (normalised name in the other layout -> (the caller's name, checked array)) as the
    model's layout: model name -> (a caller's name, array). ``read(name, dtype)`` reads a fused
    tensor of the model's source for the experts an update does not carry."""
    out: Dict[str, Tuple[str, np.ndarray]] = {}
    stacks: Dict[str, Dict[Tuple[int, int], Tuple[str, np.ndarray]]] = {}  # fused name -> (expert, half)
    for name, (caller, array) in given.items():
        if _FUSED.match(name):
            for part, piece in _split_fused(name, array):
                out[part] = (caller, piece)
            continue
        prefix, expert, proj = _PER_EXPERT.match(name).groups()
        fused = f"{prefix}.down_proj" if proj == "down_proj" else f"{prefix}.gate_up_proj"
        stacks.setdefault(fused, {})[(int(expert), 1 if proj == "up_proj" else 0)] = (caller, array)
    for fused, parts in stacks.items():
        shape = shapes[fused]
        halves = 1 if fused.endswith(".down_proj") else 2
        dtype = np.result_type(*(array.dtype for _, array in parts.values()))
        if len(parts) == shape[0] * halves:
            stacked = np.empty(shape, dtype)
        else:  # some experts not given: the model's current values of them
            if fused in updated_before:
                raise ValueError(
                    f"update_weights: the model stores every expert of {fused!r} together, and an earlier update "
                    f"changed {fused!r}: send all of its experts' tensors again, or {fused!r} itself (the model "
                    "keeps no second copy of its weights)"
                )
            stacked = read(fused, np.result_type(dtype, np.float32)).copy()
        rows = shape[1] // halves
        for (expert, half), (_, array) in parts.items():
            stacked[expert, half * rows : (half + 1) * rows] = array
        caller = min(caller for caller, _ in parts.values())
        out[fused] = (caller, stacked)
    return out


__all__ = ["into_model_layout", "other_layout"]
