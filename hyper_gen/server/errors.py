"""Errors in OpenAI's schema: ``{"error": {"message", "type", "param", "code"}}``.

A bad value is HTTP 400 naming its parameter (``param``); an unknown model is 404
(``code: "model_not_found"``); invalid JSON, an unknown field and a wrong type are 400s too,
from the request validation. Nothing a client sends reaches the engine unless it is valid, so a
bad request never disturbs the others.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from .protocol import ErrorInfo, ErrorResponse


class APIError(Exception):
    """An error the client gets back in OpenAI's schema."""

    def __init__(self, message: str, status: int = 400, param: Optional[str] = None, code=None, type_=None):
        super().__init__(message)
        self.message, self.status, self.param, self.code = message, status, param, code
        self.type = type_ or ("invalid_request_error" if status < 500 else "internal_server_error")

    def response_body(self) -> dict:
        info = ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorResponse(error=info).model_dump()

    def response(self) -> JSONResponse:
        return JSONResponse(self.response_body(), status_code=self.status)


def bad_value(param: str, message: str) -> APIError:
    return APIError(message, status=400, param=param)


def unknown_model(name: str, served: str) -> APIError:
    return APIError(
        f"The model {name!r} does not exist; this server serves {served!r}",
        status=404,
        param="model",
        code="model_not_found",
    )


def _param(loc) -> Optional[str]:
    """'max_tokens', 'messages.0.role' from pydantic's error location (which starts at 'body')."""
    parts = [str(p) for p in loc if p != "body"]
    # a union's member name (e.g. 'str', 'list[int]') is not a parameter
    parts = [p for p in parts if not any(ch in p for ch in "[]") and p not in ("str", "int", "float", "bool")]
    return ".".join(parts) or None


def validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    first = errors[0] if errors else {"type": "", "loc": (), "msg": "invalid request"}
    kind, param = first.get("type", ""), _param(first.get("loc", ()))
    if kind == "json_invalid":
        detail = first.get("ctx", {}).get("error", "")
        return APIError(f"invalid JSON in the request body: {detail}".rstrip(": "), param=None, code="invalid_json")
    if kind == "extra_forbidden":
        return APIError(f"unknown field {param!r}: not a parameter of this endpoint", param=param)
    if kind == "missing":
        return APIError(f"missing required parameter {param!r}", param=param)
    if kind == "model_attributes_type" and param is None:
        return APIError("the request body must be a JSON object", param=None)
    value = first.get("input")
    shown = f" (got {value!r})" if not isinstance(value, (dict, list)) or len(repr(value)) < 80 else ""
    return APIError(f"invalid value for {param!r}: {first.get('msg', 'invalid')}{shown}", param=param)


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
        message = exc.detail if isinstance(exc.detail, str) else HTTPStatus(exc.status_code).phrase
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        return APIError(message, status=exc.status_code).response()
