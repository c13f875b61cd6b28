"""Errors in OpenAI's schema: ``{"error": {"message", "type", "param", "code"}}``.

A bad value is HTTP 400 naming its parameter (``param``) and the value sent; an unknown model is
404 (``code: "model_not_found"``); a body that is not JSON (``body.py``), an unknown field and a
wrong type are 400s too; an unknown route 404, a wrong method 405, a body that is not sent as
``application/json`` 415, a server shutting down or an engine asleep 503, a sleep the busy engine
refuses 409, an engine without sleep / wake-up 501, and anything that fails inside a handler a
500 in the same schema (never Starlette's text/plain). Nothing a client sends reaches the engine
unless it is valid, so a bad request never disturbs the others.
"""

from __future__ import annotations

import json
import logging
from http import HTTPStatus
from typing import List, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from .protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger("hyper_gen.server")


class APIError(Exception):
    """An error the client gets back in OpenAI's schema."""

    def __init__(
        self, message: str, status: int = 400, param: Optional[str] = None, code=None, type_=None, headers=None
    ):
        super().__init__(message)
        self.message, self.status, self.param, self.code = message, status, param, code
        self.type = type_ or ("invalid_request_error" if status < 500 else "internal_server_error")
        self.headers = headers

    def response_body(self) -> dict:
        info = ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorResponse(error=info).model_dump()

    def response(self) -> JSONResponse:
        return JSONResponse(self.response_body(), status_code=self.status, headers=self.headers)


def bad_value(param: str, message: str) -> APIError:
    return APIError(message, status=400, param=param)


def unknown_model(name: str, served: str) -> APIError:
    return APIError(
        f"The model {name!r} does not exist; this server serves {served!r}",
        status=404,
        param="model",
        code="model_not_found",
    )


def shutting_down() -> APIError:
    return APIError(
        "the server is shutting down and this request did not finish within its grace period: retry on another server",
        status=503,
        code="server_shutting_down",
        type_="service_unavailable",
    )


def draining() -> APIError:
    return APIError(
        "the server is stopping (SIGTERM) and takes no new requests; those it holds finish: retry on another server",
        status=503,
        code="server_draining",
        type_="service_unavailable",
    )


def engine_sleeping() -> APIError:
    return APIError(
        "the engine is asleep (POST /sleep freed its KV cache): POST /wake_up before sending requests",
        status=503,
        code="engine_sleeping",
        type_="service_unavailable",
    )


def not_supported(path: str, method: str, engine) -> APIError:
    return APIError(
        f"{path} is not supported: this engine ({type(engine).__name__}) has no {method}",
        status=501,
        code="not_implemented",
        type_="not_implemented_error",
    )


def shown(value, limit: int = 80) -> str:
    """A value as the client sent it (JSON, ASCII only), cut to ``limit`` characters."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# the types of a union a request field allows, for a value that fits none of them
_UNION_SHAPES = {
    "prompt": "a string, a list of strings, a list of token ids (integers) or a list of lists of token ids",
    "stop": "a string or a list of strings",
    "content": 'a string or a list of text parts ({"type": "text", "text": ...})',
    "input_ids": "a list of token ids (integers) or a list of lists of token ids",  # SGLang's /generate
    "text": "a string or a list of strings",
    "sampling_params": "an object or a list of objects (one per prompt)",
    "rid": "a string or a list of strings (one per prompt)",
}

# pydantic's error kind -> what the value must be
_KINDS = {
    "int_type": "an integer",
    "int_from_float": "an integer",
    "float_type": "a number",
    "string_type": "a string",
    "bool_type": "a boolean (true or false)",
    "list_type": "a list",
    "dict_type": "an object",
    "model_type": "an object",
    "model_attributes_type": "an object",
    "none_required": "null",
}


def _is_member(part) -> bool:
    """A union member's name in pydantic's error location ('str', 'list[int]', 'function-after[...]')."""
    return isinstance(part, str) and (any(ch in part for ch in "[]") or part in ("str", "int", "float", "bool"))


def _param(loc) -> Optional[str]:
    """'max_tokens', 'messages.0.role' from pydantic's error location (FastAPI's starts at 'body')."""
    parts = [str(p) for p in loc if p != "body" and not _is_member(p)]
    return ".".join(parts) or None


def _pick(errors: List[dict]) -> dict:
    """The error to report: a union's errors are one per member, and the deepest one is where the
    value came closest to fitting (``prompt: [[1, "a"]]``: its element ``prompt.0.1``)."""
    first = errors[0]
    loc = list(first.get("loc", ()))
    if not any(_is_member(p) for p in loc):
        return first
    root = loc[: next(i for i, p in enumerate(loc) if _is_member(p))]
    same = [e for e in errors if list(e.get("loc", ()))[: len(root)] == root]
    deepest = max(same, key=lambda e: len(e.get("loc", ())))
    if len(deepest.get("loc", ())) > len(root) + 2:  # past the member and one index: inside a fitting shape
        return deepest
    return {"type": "union", "loc": tuple(root), "input": first.get("input"), "msg": "", "root": root}


def validation_error(exc) -> APIError:
    """A pydantic / FastAPI validation error (or its ``errors()`` list) as one 400 naming the parameter."""
    errors = exc if isinstance(exc, list) else exc.errors()
    if not errors:
        return APIError("invalid request")
    first = _pick(errors)
    kind, param = first.get("type", ""), _param(first.get("loc", ()))
    if kind == "json_invalid":
        detail = first.get("ctx", {}).get("error", "")
        return APIError(f"invalid JSON in the request body: {detail}", code="invalid_json")
    if kind == "extra_forbidden":
        return APIError(f"unknown field {param!r}: not a parameter of this endpoint", param=param)
    if kind == "missing":
        return APIError(f"missing required parameter {param!r}", param=param)
    if param is None and kind in ("model_attributes_type", "model_type", "dict_type"):
        return APIError(f"the request body must be a JSON object, got {shown(first.get('input'))}")
    value = shown(first.get("input"))
    if kind == "union":
        name = next((str(p) for p in reversed(first["root"]) if isinstance(p, str)), "")
        what = _UNION_SHAPES.get(name, "one of the types this parameter takes")
        return APIError(f"{param!r} must be {what}, got {value}", param=param)
    if kind in _KINDS:
        return APIError(f"{param!r} must be {_KINDS[kind]}, got {value}", param=param)
    return APIError(f"invalid value for {param!r}: {first.get('msg', 'invalid')} (got {value})", param=param)


def install(app: FastAPI) -> None:
    """Every error the app returns, in OpenAI's schema."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        return validation_error(exc).response()

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException):
        status = exc.status_code
        message = exc.detail if isinstance(exc.detail, str) else HTTPStatus(status).phrase
        code = None
        if status == 404:
            message, code = f"no route {request.method} {request.url.path}", "not_found"
        elif status == 405:
            allowed = (exc.headers or {}).get("Allow", "")
            message = f"method {request.method} is not allowed on {request.url.path}" + (
                f" (allowed: {allowed})" if allowed else ""
            )
            code = "method_not_allowed"
        return APIError(message, status=status, code=code, headers=exc.headers).response()

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        # Starlette still logs the traceback (the exception propagates after this response)
        return APIError(f"internal server error: {type(exc).__name__}: {exc}", status=500).response()
