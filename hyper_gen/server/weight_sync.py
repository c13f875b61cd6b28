"""Weights pushed by a trainer in another process: SGLang's distributed and tensor endpoints.

``POST /init_weights_update_group`` (``master_address``, ``master_port``, ``rank_offset``,
``world_size``, ``group_name``, ``backend``): this server joins the trainer's group, its ranks as
``rank_offset`` .. ``rank_offset + tp - 1`` (SGLang's; the trainer is rank 0 and hosts the
rendezvous), through its backend's adapter (``join_weight_group``; an adapter without one,
MindSpore's, answers a 400: push with ``/update_weights_from_disk`` or
``/update_weights_from_tensor`` instead). The calls are the engine's
(``Engine.init_weights_update_group`` and the two below): rank 0's plan carries them, and every
rank of a tensor-parallel server joins, receives every broadcast and keeps its own shard. ``POST
/update_weights_from_distributed`` (``names``, ``dtypes``, ``shapes``, ``group_name``,
``weight_version``, ``abort_all_requests``): the announced tensors are checked against the model
first (a name it lacks, a shape that disagrees, a dtype it cannot take: a 400 naming ``names`` /
``shapes`` / ``dtypes``; the trainer's broadcasts are still received and dropped, so its side and
the group stay usable), then received from group rank 0 in the order of ``names`` (one broadcast
per tensor, as SGLang receives them; with ``load_format: "flattened_bucket"``, SGLang's bucket: one
broadcast of the tensors flattened and concatenated in that order, all of one dtype) and applied as
one update at a step boundary: every tensor of the call on every rank, or none.
``POST /destroy_weights_update_group`` (``group_name``). ``POST /update_weights_from_tensor``
(``serialized_named_tensors``: base64 safetensors, ``tensor_body``), on every backend.

Every wait for the trainer is bounded by ``HYPER_GEN_WEIGHT_SYNC_TIMEOUT_S`` (default 300 s): the
rendezvous, the group's creation, each broadcast. A timeout is a 500 naming what was waited for;
the engine is unchanged and a group whose broadcast timed out is destroyed on every rank (init
it again). Calls on the groups run one at a time, off the event loop; the engine's steps wait at
the boundary while the trainer's broadcasts arrive (as SGLang's scheduler does).
"""

from __future__ import annotations

import asyncio
import functools
import os
from typing import List, Optional

from hyper_gen import registry
from hyper_gen.models.weight_update import announced_problem, model_shapes

from . import tensor_body
from .errors import APIError, bad_value, not_supported
from .sglang import version_text
from .sglang_protocol import DestroyGroupRequest, DistributedUpdateRequest, InitGroupRequest, TensorUpdateRequest

TIMEOUT_ENV = "HYPER_GEN_WEIGHT_SYNC_TIMEOUT_S"
FLATTENED = "flattened_bucket"
DEFAULT_TIMEOUT_S = 300.0
MAX_TENSOR_BODY_BYTES = 8 << 30  # /update_weights_from_tensor carries the weights themselves


def timeout_s() -> float:
    try:
        value = float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S))
    except ValueError:
        return DEFAULT_TIMEOUT_S
    return value if value > 0 else DEFAULT_TIMEOUT_S


def _timed_out(what: str, exc: BaseException) -> APIError:
    return APIError(f"{what} timed out: {exc}; the weights are unchanged", status=500, code="weight_sync_timeout")


class WeightGroups:
    """The weight-update group endpoints over the engine's calls (``Engine.init_weights_update_group``,
    ``update_weights_from_distributed``, ``destroy_weights_update_group``): every rank of the engine
    is a member, and every rank receives."""

    def __init__(self, engine):
        self.engine = engine
        self._lock: Optional[asyncio.Lock] = None

    @property
    def lock(self) -> asyncio.Lock:
        if self._lock is None:  # made on the event loop that uses it
            self._lock = asyncio.Lock()
        return self._lock

    def _adapter(self, path: str):
        model = getattr(self.engine, "model", None)
        adapter = registry.adapter_of(model)
        if getattr(self.engine, "init_weights_update_group", None) is None or adapter is None:
            raise not_supported(path, "init_weights_update_group()", self.engine)
        return adapter

    def _group(self, name: str) -> None:
        if name not in self.engine.weight_groups:
            known = list(self.engine.weight_groups) or "none: POST /init_weights_update_group first"
            raise bad_value("group_name", f"unknown weight update group {name!r} (groups: {known})")

    async def init(self, request: InitGroupRequest) -> dict:
        path = "POST /init_weights_update_group"
        adapter = self._adapter(path)
        if getattr(adapter, "join_weight_group", None) is None:
            raise bad_value(
                "backend",
                f"a {getattr(adapter, 'NAME', 'non-torch')} server cannot join a torch.distributed weight update "
                "group: push the weights with POST /update_weights_from_disk or POST /update_weights_from_tensor",
            )
        backends = tuple(getattr(adapter, "WEIGHT_GROUP_BACKENDS", ()))
        if request.backend not in backends:
            raise bad_value("backend", f"backend must be one of {backends}, got {request.backend!r}")
        ranks = getattr(self.engine, "world_size", 1)
        if request.world_size < 1 + ranks:
            raise bad_value(
                "world_size",
                f"world_size counts the trainer and this server's {ranks} rank(s): at least {1 + ranks}, "
                f"got {request.world_size}",
            )
        if not 1 <= request.rank_offset <= request.world_size - ranks:
            raise bad_value(
                "rank_offset",
                f"rank_offset must be in [1, {request.world_size - ranks}]: this server's {ranks} rank(s) take "
                f"rank_offset .. rank_offset + {ranks - 1} of world_size={request.world_size} (rank 0 is the "
                f"trainer's), got {request.rank_offset}",
            )
        if not request.group_name:
            raise bad_value("group_name", "group_name must not be empty")
        async with self.lock:
            if request.group_name in self.engine.weight_groups:
                raise bad_value(
                    "group_name",
                    f"this server is already in group {request.group_name!r}: POST /destroy_weights_update_group first",
                )
            what = f"joining weight update group {request.group_name!r}"  # (every rank of this server joins)
            args = (request.master_address, request.master_port, request.rank_offset, request.world_size)
            join = self.engine.init_weights_update_group
            await _engine_call(what, "group_name", join, *args, request.group_name, request.backend, timeout_s())
        return {"success": True, "message": f"Joined weight update group {request.group_name!r}."}

    def _announced(self, adapter, request: DistributedUpdateRequest):
        """``(field, message)`` of the first announced tensor the model cannot take, and whether
        the broadcasts can still be received (every dtype known)."""
        lengths = {"names": len(request.names), "dtypes": len(request.dtypes), "shapes": len(request.shapes)}
        if len(set(lengths.values())) != 1:
            field = "dtypes" if lengths["dtypes"] != lengths["names"] else "shapes"
            return field, f"names, dtypes and shapes must have one item per tensor, got lengths {lengths}", False
        if not request.names:
            return "names", "names is empty: announce at least one tensor", True
        problem, drainable = (None, None), True
        for i, dtype in enumerate(request.dtypes):
            try:
                floating = adapter.weight_dtype_is_floating(dtype)
            except ValueError as exc:
                return f"dtypes.{i}", f"{request.names[i]!r}: {exc}", False
            if not floating and problem[0] is None:
                problem = f"dtypes.{i}", f"{request.names[i]!r} has dtype {dtype!r}: the model takes floating dtypes"
        for i, shape in enumerate(request.shapes):
            if any(d < 0 for d in shape):
                return f"shapes.{i}", f"{request.names[i]!r} has a negative dimension: {shape}", False
        if problem[0] is not None:
            return problem[0], problem[1], drainable
        try:
            shapes = model_shapes(self.engine.model)
        except ValueError as exc:
            return "names", str(exc), drainable
        seen = set()
        for i, (name, shape) in enumerate(zip(request.names, request.shapes)):
            if name in seen:
                return f"names.{i}", f"{name!r} is announced twice", drainable
            seen.add(name)
            field, message = announced_problem(shapes, name, shape)
            if field is not None:
                return f"{field}.{i}", message, drainable
        return None, None, drainable

    async def update(self, state_abort_all, request: DistributedUpdateRequest) -> dict:
        adapter = self._adapter("POST /update_weights_from_distributed")
        if request.load_format not in (None, "auto", FLATTENED):
            raise bad_value(
                "load_format", f"load_format must be null, auto or {FLATTENED}, got {request.load_format!r}"
            )
        flattened = request.load_format == FLATTENED
        if flattened and len(set(request.dtypes)) > 1:  # refused before any broadcast: of which dtype would it be?
            raise bad_value(
                "dtypes",
                f"a {FLATTENED} update carries one dtype, got {sorted(set(request.dtypes))}; the update "
                "was not applied",
            )
        async with self.lock:
            field, message, drainable = self._announced(adapter, request)
            if field is not None and not drainable:  # nothing can be received: the broadcasts cannot be drained
                raise bad_value(field, f"the update was not applied: {message}")
            self._group(request.group_name)
            receive = functools.partial(
                self.engine.update_weights_from_distributed,
                request.names,
                request.dtypes,
                request.shapes,
                request.group_name,
                flattened=flattened,
                timeout_s=timeout_s(),
            )
            what = f"receiving the update over group {request.group_name!r} (the group was destroyed: init it again)"
            if field is not None:
                note = ""
                if drainable:  # the trainer and the group stay in step: every rank takes the broadcasts, drops them
                    try:
                        await asyncio.to_thread(receive, drop=True)
                        note = " (the broadcast tensors were received and dropped)"
                    except TimeoutError:
                        note = f" (no broadcast came within {timeout_s():g}s; the group was destroyed)"
                raise bad_value(field, f"the update was not applied: {message}{note}")
            paused = 0
            if request.abort_all_requests:
                paused = len(await asyncio.to_thread(state_abort_all))
            version = request.weight_version
            if version is None:  # SGLang's: the version stays as it was
                version = getattr(self.engine, "weight_version", None)
            count = await _engine_call(what, "names", receive, version=version)
        return _updated(count, f"group {request.group_name!r}", version, paused)

    async def destroy(self, request: DestroyGroupRequest) -> dict:
        async with self.lock:
            self._group(request.group_name)
            leave = self.engine.destroy_weights_update_group
            await _engine_call(f"leaving group {request.group_name!r}", "group_name", leave, request.group_name)
        return {"success": True, "message": f"Left weight update group {request.group_name!r}."}

    def close(self) -> None:
        """Leave every group the engine is in, while it runs (a server stopped before its engine)."""
        if not getattr(self.engine, "alive", False):
            return
        for name in getattr(self.engine, "weight_groups", ()):
            try:
                self.engine.destroy_weights_update_group(name)
            except Exception:  # (gone meanwhile, or the engine stopping): nothing left to leave
                pass


async def _engine_call(what: str, param: str, call, *args, **kwargs):
    """``call(*args, **kwargs)`` off the event loop: a TimeoutError is a 500 naming ``what``, a
    ValueError / TypeError a 400 naming ``param``."""
    try:
        return await asyncio.to_thread(call, *args, **kwargs)
    except TimeoutError as exc:
        raise _timed_out(what, exc) from None
    except (ValueError, TypeError) as exc:
        refused = "the update was not applied" if param == "names" else f"{what} failed"
        raise bad_value(param, f"{refused}: {exc}") from None


def _updated(count: int, source: str, version, paused: int) -> dict:
    return {
        "success": True,
        "message": f"Updated {count} tensors from {source} (weight_version {version_text(version)}).",
        "num_paused_requests": paused,
    }


async def _apply(engine, abort_all, weights: List[tuple], request, param: str, source: str) -> dict:
    """``engine.update_weights(weights, version)`` off the event loop (all or nothing); a refusal
    is a 400 naming ``param``."""
    paused = 0
    if request.abort_all_requests:
        paused = len(await asyncio.to_thread(abort_all))
    version = request.weight_version
    if version is None:  # SGLang's: the version stays as it was
        version = getattr(engine, "weight_version", None)
    try:
        count = await asyncio.to_thread(engine.update_weights, weights, version)
    except (ValueError, TypeError) as exc:
        raise bad_value(param, f"the update was not applied: {exc}") from None
    return _updated(count, source, version, paused)


async def update_from_tensor(state, request: TensorUpdateRequest) -> dict:
    """``POST /update_weights_from_tensor``: the tensors of ``serialized_named_tensors[0]`` (one item
    per rank of the engine; a one-rank engine takes one), checked and applied all or nothing."""
    engine = state.engine
    if getattr(engine, "update_weights", None) is None:
        raise not_supported("POST /update_weights_from_tensor", "update_weights()", engine)
    if request.load_format not in (None, "safetensors"):
        raise bad_value("load_format", f"load_format must be null or safetensors, got {request.load_format!r}")
    items = request.serialized_named_tensors
    ranks = getattr(engine, "world_size", 1)
    if len(items) != ranks:
        raise bad_value("serialized_named_tensors", f"give one item per rank of the engine ({ranks}), got {len(items)}")
    weights = await asyncio.to_thread(tensor_body.decode, items[0], "serialized_named_tensors.0")
    if not weights:
        raise bad_value("serialized_named_tensors.0", "no tensor in the item")
    try:
        shapes = model_shapes(engine.model)
    except ValueError as exc:
        raise bad_value("serialized_named_tensors", str(exc)) from None
    for name, array in weights:
        field, message = announced_problem(shapes, name, array.shape)
        if field is not None:
            raise bad_value("serialized_named_tensors.0", f"the update was not applied: {message}")
    abort_all = getattr(engine, "abort_all", list)
    return await _apply(engine, abort_all, weights, request, "serialized_named_tensors.0", "the request")
