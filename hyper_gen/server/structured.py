"""Structured outputs from a request: OpenAI's ``response_format`` (chat) and vLLM's ``structured_outputs``
/ ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` extras (both endpoints), as
the engine's ``StructuredOutputs``; a 400 naming the field for a malformed one or a grammar the library
(llguidance) rejects. JSON leaves no free whitespace (vLLM's ``disable_any_whitespace``), unless
``structured_outputs`` says ``"disable_any_whitespace": false``. SGLang's ``/generate`` names them in its
``sampling_params``: ``json_schema`` (the schema as text), ``regex``, ``ebnf`` (``sglang_requested``).
"""

from __future__ import annotations

from typing import Optional, Tuple

from hyper_gen.grammar import StructuredOutputs

from .errors import bad_value

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def _response_format(value) -> Optional[dict]:
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), (dict, bool)):
            raise bad_value(
                "response_format", f"response_format.json_schema must be an object with a 'schema', got {spec!r}"
            )
        return {"json": spec.get("schema", {})}
    raise bad_value(
        "response_format",
        f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
    )


def requested(request) -> Optional[Tuple[dict, str]]:
    """(the StructuredOutputs fields, the request field that set them), or None."""
    found = []
    if getattr(request, "response_format", None) is not None:
        spec = _response_format(request.response_format)
        if spec is not None:
            found.append((spec, "response_format"))
    if request.structured_outputs is not None:
        found.append((dict(request.structured_outputs), "structured_outputs"))
    for name, kind in _GUIDED.items():
        value = getattr(request, name)
        if value is not None:
            found.append(({kind: value}, name))
    if len(found) > 1:
        names = ", ".join(name for _, name in found)
        raise bad_value(found[1][1], f"give one of response_format / structured_outputs / guided_*, got {names}")
    return found[0] if found else None


_SGLANG = {"json_schema": "json", "regex": "regex", "ebnf": "grammar"}


def sglang_requested(sp, where: str) -> Optional[Tuple[dict, str]]:
    """SGLang's ``sampling_params`` ``json_schema`` (text) / ``regex`` / ``ebnf`` as (the StructuredOutputs
    fields, the field named ``where`` + its name), or None; a 400 when more than one is set."""
    found = [(name, getattr(sp, name)) for name in _SGLANG if getattr(sp, name, None) is not None]
    if len(found) > 1:
        names = ", ".join(where + name for name, _ in found)
        raise bad_value(where + found[1][0], f"give one of json_schema / regex / ebnf, got {names}")
    if not found:
        return None
    name, value = found[0]
    return {_SGLANG[name]: value}, where + name


def build(state, spec: dict, param: str) -> StructuredOutputs:
    """``spec`` checked and compiled by the engine's grammar backend (cached there); a 400 naming ``param``."""
    try:
        outputs = StructuredOutputs.of(spec)
    except (TypeError, ValueError) as exc:
        raise bad_value(param, f"{param}: {exc}") from None
    backend = getattr(state.engine, "grammar_backend", None)
    backend = backend() if backend is not None else None
    if backend is None:
        raise bad_value(param, f"{param} needs the model's tokenizer, and this server has none")
    try:
        backend.compile(outputs)
    except ValueError as exc:
        raise bad_value(param, f"{param} is not a grammar the grammar library takes: {exc}") from None
    return outputs


__all__ = ["requested", "sglang_requested", "build"]
