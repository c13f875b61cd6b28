"""A request body as its pydantic request model, or the error that says exactly what is wrong.

Read here rather than by FastAPI, so that each way a body can be unusable gets its own message:
a body not sent as ``Content-Type: application/json`` (415: curl's ``-d`` alone sends a form
type), one larger than ``MAX_BODY_BYTES`` (413, read no further), an empty one (naming the
parameter the endpoint requires), bytes that are not UTF-8, invalid JSON (the parser's whole
message, with its line and column), ``NaN`` / ``Infinity`` (not JSON), something other than an
object, and a string holding a lone UTF-16 surrogate (``"\\ud800"``: valid JSON, but no text a
tokenizer can encode). Every one is a 4xx in OpenAI's schema naming the parameter where there is one.
"""

from __future__ import annotations

import json
from typing import Optional, Type, TypeVar

from pydantic import BaseModel, ValidationError

from .errors import APIError, validation_error

MAX_BODY_BYTES = 32 << 20  # a whole context of token ids is a few MB of JSON

Model = TypeVar("Model", bound=BaseModel)


def _content_type_error(content_type: Optional[str]) -> Optional[APIError]:
    fix = "send the JSON body with 'Content-Type: application/json' (curl: -H 'Content-Type: application/json')"
    if not content_type:
        return APIError(f"the request has no Content-Type header: {fix}", status=415, code="unsupported_media_type")
    mime = content_type.split(";", 1)[0].strip().lower()
    if mime == "application/json" or (mime.startswith("application/") and mime.endswith("+json")):
        return None
    return APIError(
        f"the request's Content-Type is {content_type!r}, not application/json: {fix}",
        status=415,
        code="unsupported_media_type",
    )


def _too_large(size: str, limit: int = MAX_BODY_BYTES) -> APIError:
    return APIError(
        f"the request body is {size} bytes, more than the {limit} bytes this server reads",
        status=413,
        code="request_too_large",
    )


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON value (JSON numbers are finite)")


def _kind(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "a list"


def lone_surrogate(value) -> Optional[tuple]:
    """(parameter path, code point) of the first string (or object key) in ``value`` holding a
    lone UTF-16 surrogate, else None. Iterative: the JSON parser's nesting limit is not ours."""
    stack = [((), value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, dict):
            for key, child in reversed(list(item.items())):
                stack.append((path + (key,), child))
                stack.append((path + (key,), key))
        elif isinstance(item, list):
            stack.extend((path + (str(i),), child) for i, child in reversed(list(enumerate(item))))
        elif isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as exc:
                shown = (p.encode("utf-8", "backslashreplace").decode("utf-8") for p in path)  # a key may hold one
                return ".".join(shown) or None, ord(item[exc.start])
    return None


async def read_json(request, model: Type[Model], required: str, max_bytes: int = MAX_BODY_BYTES) -> Model:
    """The body of ``request`` validated as ``model`` (strict JSON types); ``required``: the
    parameter the endpoint cannot do without, named when the body is empty; ``max_bytes``: the
    largest body taken (a 413 past it)."""
    error = _content_type_error(request.headers.get("content-type"))
    if error is not None:
        raise error
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(declared, max_bytes)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_bytes:
            raise _too_large(f"at least {len(body)}", max_bytes)
    if not body.strip():
        raise APIError(
            f"the request body is empty: {request.method} {request.url.path} takes a JSON object "
            f"with at least {required!r}; missing required parameter {required!r}",
            param=required,
        )
    try:
        text = bytes(body).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise APIError(
            f"the request body is not UTF-8 text (byte {exc.start}: {exc.reason}); JSON is UTF-8", code="invalid_json"
        ) from None
    try:
        value = json.loads(text, parse_constant=_no_constant)
    except json.JSONDecodeError as exc:
        raise APIError(f"invalid JSON in the request body: {exc}", code="invalid_json") from None
    except ValueError as exc:  # NaN / Infinity, an integer of more digits than Python converts
        raise APIError(f"invalid JSON in the request body: {exc}", code="invalid_json") from None
    except RecursionError:
        raise APIError("invalid JSON in the request body: nested too deeply", code="invalid_json") from None
    if not isinstance(value, dict):
        raise APIError(f"the request body must be a JSON object ({{...}}), got {_kind(value)}")
    found = lone_surrogate(value)
    if found is not None:
        param, point = found
        where = f"{param!r}" if param else "the request body"
        raise APIError(
            f"{where} holds a lone UTF-16 surrogate (\\u{point:04x}), which is not valid Unicode text: "
            "a surrogate must be half of a pair (\\ud83d\\ude00 is one character)",
            param=param,
        )
    try:
        return model.model_validate(value)
    except ValidationError as exc:
        raise validation_error(exc.errors()) from None
