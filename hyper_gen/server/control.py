"""SGLang's control endpoints over the engine's controls, for an RL trainer in another process.

``GET /get_weight_version``; ``POST /pause_generation`` (``mode``: ``abort`` ends every unfinished
request, which answers what it generated so far; ``in_place`` keeps them, and they continue on
``/continue_generation`` exactly as if never paused; ``retract`` is served as ``in_place``: the
rows keep their KV cache instead of recomputing it); ``POST /continue_generation``; ``POST
/abort_request`` (``rid``, or ``abort_all``; an id that is unknown or already finished is a no-op,
as in SGLang); ``POST /flush_cache`` (GET too; a 400 while requests run or wait, as SGLang's);
``POST /release_memory_occupation`` / ``POST /resume_memory_occupation`` (the engine's sleep and
wake-up: the KV cache is freed and taken back; a 409 while requests run or wait); ``POST
/update_weights_from_disk`` (``model_path``: an HF checkpoint folder whose safetensors are applied
through ``Engine.update_weights`` at a step boundary, all or nothing, with ``weight_version``).

Each engine call that waits for a step boundary runs off the event loop, so requests keep streaming.
"""

from __future__ import annotations

import asyncio

from .errors import APIError, bad_value, not_supported
from .sglang import version_text
from .sglang_protocol import AbortRequest, DiskUpdateRequest, PauseRequest
from .state import ServerState

PAUSE_MODES = {"abort": "abort", "in_place": "keep", "retract": "keep"}


def _method(state: ServerState, name: str, path: str):
    method = getattr(state.engine, name, None)
    if method is None:
        raise not_supported(path, f"{name}()", state.engine)
    return method


def weight_version(state: ServerState) -> dict:
    return {"weight_version": version_text(getattr(state.engine, "weight_version", None))}


async def pause(state: ServerState, request: PauseRequest) -> dict:
    if request.mode not in PAUSE_MODES:
        raise bad_value("mode", f"mode must be one of {sorted(PAUSE_MODES)}, got {request.mode!r}")
    await asyncio.to_thread(_method(state, "pause", "POST /pause_generation"), PAUSE_MODES[request.mode])
    return {"message": "Generation paused successfully.", "status": "ok"}


async def resume(state: ServerState) -> dict:
    await asyncio.to_thread(_method(state, "resume", "POST /continue_generation"))
    return {"message": "Generation continued successfully.", "status": "ok"}


async def abort(state: ServerState, request: AbortRequest) -> dict:
    if request.abort_all:
        outputs = await asyncio.to_thread(_method(state, "abort_all", "POST /abort_request"))
        return {"success": True, "aborted": len(outputs)}
    if not request.rid:
        raise bad_value("rid", "give the rid of the request to abort, or abort_all: true")
    try:
        output = await asyncio.to_thread(_method(state, "abort", "POST /abort_request"), request.rid)
    except ValueError:  # never submitted: SGLang ignores an unknown rid
        output = None
    return {"success": True, "aborted": 0 if output is None else 1}


async def flush_cache(state: ServerState) -> dict:
    try:
        dropped = await asyncio.to_thread(_method(state, "flush_cache", "POST /flush_cache"))
    except RuntimeError as exc:
        raise APIError(
            f"the cache was not flushed: {exc}; flush when no request runs or waits", status=400, code="engine_busy"
        ) from None
    return {"success": True, "message": "Cache flushed.", "blocks_dropped": int(dropped or 0)}


async def release_memory(state: ServerState) -> dict:
    await state.sleep(False)
    return {"success": True, "message": "KV cache released."}


async def resume_memory(state: ServerState) -> dict:
    await state.wake_up()
    return {"success": True, "message": "KV cache resumed."}


def abort_everything(state: ServerState) -> list:
    """``engine.abort_all()`` (from a worker thread): the outputs of the requests it ended."""
    return _method(state, "abort_all", "abort_all_requests")()


def _read_checkpoint(path: str):
    from hyper_gen.models.checkpoint import Checkpoint

    checkpoint = Checkpoint(path)
    return [(name, checkpoint.get(name)) for name in checkpoint.names()]


async def update_from_disk(state: ServerState, request: DiskUpdateRequest) -> dict:
    update = _method(state, "update_weights", "POST /update_weights_from_disk")
    if request.load_format not in (None, "auto", "safetensors"):
        raise bad_value("load_format", f"load_format must be auto or safetensors, got {request.load_format!r}")
    try:
        weights = await asyncio.to_thread(_read_checkpoint, request.model_path)
    except (ValueError, TypeError, OSError) as exc:
        raise bad_value("model_path", f"cannot read the checkpoint at {request.model_path!r}: {exc}") from None
    paused = 0
    if request.abort_all_requests:
        paused = len(await asyncio.to_thread(_method(state, "abort_all", "POST /update_weights_from_disk")))
    version = request.weight_version
    if version is None:  # SGLang's: the version stays as it was
        version = getattr(state.engine, "weight_version", None)
    try:
        count = await asyncio.to_thread(update, weights, version)
    except (ValueError, TypeError) as exc:
        raise bad_value("model_path", f"the weights at {request.model_path!r} were not applied: {exc}") from None
    return {
        "success": True,
        "message": f"Updated {count} tensors from {request.model_path} (weight_version {version_text(version)}).",
        "num_paused_requests": paused,
    }
