"""The FastAPI app: OpenAI's endpoints on one running :class:`hyper_gen.engine.Engine`.

``create_app(engine, tokenizer, model_name)`` only routes; the engine is started and shut down
by whoever owns it (``hyper_gen.server.launch``, a test). Endpoints: ``POST /v1/completions``,
``POST /v1/chat/completions``, ``GET /v1/models``, ``GET /v1/models/{id}``, ``GET /health`` (503 unless
requests are taken: asleep, paused, draining); vLLM's ``POST /v1/completions/render`` and
``/v1/chat/completions/render`` (``render.py``); SGLang's ``GET /server_info`` and ``/model_info``
(``info.py``, for the routers);
``GET /metrics`` (Prometheus, ``metrics.py``); vLLM's ``POST /sleep`` (``?abort=true``),
``POST /wake_up`` and ``GET /is_sleeping`` (the engine frees its KV cache and takes it back);
vLLM's ``POST /tokenize``, ``POST /detokenize`` and ``GET /tokenizer_info`` (``tokenization.py``).
SGLang's native protocol, for RL trainers: ``POST /generate`` (``sglang.py``) and the control
endpoints (``control.py``): ``GET /get_weight_version``, ``POST /pause_generation``,
``/continue_generation``, ``/abort_request``, ``/flush_cache``, ``/release_memory_occupation``,
``/resume_memory_occupation``, ``/update_weights_from_disk``; the weights a trainer pushes
(``weight_sync.py``): ``POST /init_weights_update_group``, ``/update_weights_from_distributed``,
``/destroy_weights_update_group``, ``/update_weights_from_tensor``.
Request bodies are read by ``body.read_json`` (content type, size, JSON, strict types).
"""

from __future__ import annotations

from typing import Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from hyper_gen import __version__

from . import control, errors, info, query, render, tokenization, weight_sync
from .access_log import AccessLog
from .body import read_json
from .chat import create_chat_completion
from .completions import create_completion
from .metrics import CONTENT_TYPE, exposition, registry_for
from .protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from .sglang import generate
from .sglang_protocol import (
    AbortRequest,
    DestroyGroupRequest,
    DiskUpdateRequest,
    DistributedUpdateRequest,
    EmptyRequest,
    GenerateRequest,
    InitGroupRequest,
    MemoryRequest,
    PauseRequest,
    TensorUpdateRequest,
)
from .state import ServerState


def create_app(
    engine,
    tokenizer,
    model_name: str,
    max_model_len: Optional[int] = None,
    tool_call_parser: Optional[str] = "hermes",
    reasoning_parser: Optional[str] = None,
    access_log: bool = False,
    model_path: Optional[str] = None,
    tp_size: int = 1,
    backend: Optional[str] = None,
) -> FastAPI:
    """``access_log``: a line on stderr per request (``access_log.py``; ``hyper-gen serve`` without ``-q``)."""
    state = ServerState(engine, tokenizer, model_name, max_model_len)
    state.tool_call_parser, state.reasoning_parser = tool_call_parser, reasoning_parser
    state.model_path, state.tp_size, state.backend = model_path, tp_size, backend
    app = FastAPI(title="hyper_gen", version=__version__, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.hyper_gen = state
    errors.install(app)
    if access_log:
        app.add_middleware(AccessLog)
    registry = registry_for(engine, model_name)

    def card() -> ModelCard:
        return ModelCard(id=model_name, created=state.created, max_model_len=state.max_model_len)

    @app.get("/health")
    async def health():
        """{"status": "ok", "running": requests admitted, "waiting": queued} while requests are taken;
        503 with why not ("asleep", "paused", "draining", "engine stopped"), for a router to act on."""
        status = state.health()
        if status != "ok":
            return JSONResponse({"status": status, **state.load()}, status_code=503)
        return {"status": "ok", **state.load()}

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def get_server_info():
        """SGLang's: the model's path, the engine's limits and weight version (``info.py``)."""
        return info.server_info(state)

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def get_model_info():
        return info.model_info(state)

    @app.get("/metrics")
    async def metrics():
        """``engine.stats()`` in Prometheus' text format (``metrics.py``)."""
        return Response(exposition(registry), headers={"Content-Type": CONTENT_TYPE})

    @app.post("/sleep")
    async def sleep(http_request: Request):
        """Free the engine's KV cache; 409 while requests run or wait unless ``?abort=true``.
        ``level`` (vLLM's 1 or 2) frees the KV cache either way: the weights stay in place."""
        found = query.params(http_request, ("level", "abort"))
        query.choice(found, "level", query.SLEEP_LEVELS)
        abort = query.flag(found, "abort")
        await query.no_body(http_request, "its options are query parameters: ?level=1&abort=true")
        await state.sleep(abort)
        return {"is_sleeping": state.sleeping}

    @app.post("/wake_up")
    async def wake_up(http_request: Request):
        """Take the KV cache back; requests are served again. vLLM's ``tags``: without
        ``kv_cache`` among them nothing was released, so nothing is taken back."""
        tags = query.choices(query.params(http_request, ("tags",), repeatable=("tags",)), "tags", query.WAKE_TAGS)
        await query.no_body(http_request, "its options are query parameters: ?tags=kv_cache")
        if tags is None or "kv_cache" in tags:
            await state.wake_up()
        return {"is_sleeping": state.sleeping}

    @app.get("/is_sleeping")
    async def is_sleeping(http_request: Request):
        query.params(http_request, ())
        return {"is_sleeping": state.is_sleeping()}

    @app.get("/v1/models")
    async def models():
        return ModelList(data=[card()])

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        """The served model's card (``client.models.retrieve(id)``); 404 for any other id."""
        if model_id != model_name:
            raise errors.unknown_model(model_id, model_name)
        return card()

    @app.post("/v1/completions")
    async def completions(http_request: Request):
        request = await read_json(http_request, CompletionRequest, "prompt")
        return await create_completion(state, request, http_request)

    @app.post("/v1/chat/completions")
    async def chat_completions(http_request: Request):
        request = await read_json(http_request, ChatCompletionRequest, "messages")
        return await create_chat_completion(state, request, http_request)

    @app.post("/tokenize")
    async def tokenize(http_request: Request):
        return tokenization.tokenize(state, await read_json(http_request, tokenization.TokenizeRequest, "prompt"))

    @app.post("/detokenize")
    async def detokenize(http_request: Request):
        request = await read_json(http_request, tokenization.DetokenizeRequest, "tokens")
        return tokenization.detokenize(state, request)

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        return tokenization.tokenizer_info(state)

    @app.post("/v1/completions/render")
    async def completions_render(http_request: Request):
        """vLLM's: the prompts' token ids and sampling params, nothing generated (``render.py``)."""
        return render.completions(state, await read_json(http_request, CompletionRequest, "prompt"))

    @app.post("/v1/chat/completions/render")
    async def chat_completions_render(http_request: Request):
        return render.chat(state, await read_json(http_request, ChatCompletionRequest, "messages"))

    _native_routes(app, state)
    return app


async def _optional_body(http_request: Request, model):
    """A control endpoint's body: none (or an empty one) is every field at its default. Its
    options are the body's: a query parameter is a 400 naming it."""
    query.params(http_request, ())
    if not (await http_request.body()).strip():
        return model()
    return await read_json(http_request, model, "")


def _native_routes(app: FastAPI, state: ServerState) -> None:
    """SGLang's native endpoints (see the module docstring)."""

    @app.post("/generate")
    async def native_generate(http_request: Request):
        request = await read_json(http_request, GenerateRequest, "input_ids")
        return await generate(state, request, http_request)

    @app.get("/get_weight_version")
    async def get_weight_version(http_request: Request):
        query.params(http_request, ())
        return control.weight_version(state)

    @app.post("/pause_generation")
    async def pause_generation(http_request: Request):
        return await control.pause(state, await _optional_body(http_request, PauseRequest))

    @app.post("/continue_generation")
    async def continue_generation(http_request: Request):
        await _optional_body(http_request, EmptyRequest)
        return await control.resume(state)

    @app.post("/abort_request")
    async def abort_request(http_request: Request):
        return await control.abort(state, await _optional_body(http_request, AbortRequest))

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache(http_request: Request):
        query.params(http_request, ())
        await query.no_body(http_request, "it takes no options")
        return await control.flush_cache(state)

    @app.post("/release_memory_occupation")
    async def release_memory_occupation(http_request: Request):
        await _optional_body(http_request, MemoryRequest)
        return await control.release_memory(state)

    @app.post("/resume_memory_occupation")
    async def resume_memory_occupation(http_request: Request):
        await _optional_body(http_request, MemoryRequest)
        return await control.resume_memory(state)

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(http_request: Request):
        query.params(http_request, ())
        request = await read_json(http_request, DiskUpdateRequest, "model_path")
        return await control.update_from_disk(state, request)

    groups = weight_sync.WeightGroups(state.engine)
    app.state.weight_groups = groups

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(http_request: Request):
        query.params(http_request, ())
        return await groups.init(await read_json(http_request, InitGroupRequest, "master_address"))

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(http_request: Request):
        query.params(http_request, ())
        request = await read_json(http_request, DistributedUpdateRequest, "names")
        return await groups.update(lambda: control.abort_everything(state), request)

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(http_request: Request):
        return await groups.destroy(await _optional_body(http_request, DestroyGroupRequest))

    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(http_request: Request):
        query.params(http_request, ())
        max_bytes = weight_sync.MAX_TENSOR_BODY_BYTES
        request = await read_json(http_request, TensorUpdateRequest, "serialized_named_tensors", max_bytes)
        return await weight_sync.update_from_tensor(state, request)
