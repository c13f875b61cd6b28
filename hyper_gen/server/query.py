"""Query parameters (and the absent body) of the control endpoints that vLLM drives by URL.

``POST /sleep?level=1&abort=true`` and ``POST /wake_up?tags=kv_cache`` take their options in the
query string and no body. Anything else a client sends there is a mistake that would otherwise be
ignored, with the engine doing what it was not asked (``/sleep?level=abc`` used to sleep): an unknown
parameter, one given twice, a value outside the parameter's words, or a body, is a 400 naming it.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from fastapi import Request

from .errors import bad_value, shown

_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off", "")
SLEEP_LEVELS = ("1", "2")  # vLLM's: both free the KV cache here (the weights stay: an update writes them in place)
WAKE_TAGS = ("weights", "kv_cache")  # vLLM's; the weights are never released, so only kv_cache wakes anything


def params(http_request: Request, allowed: Tuple[str, ...], repeatable: Tuple[str, ...] = ()) -> Dict[str, List[str]]:
    """The query parameters, name -> values; a 400 naming the first one that ``allowed`` lacks, or
    one given twice that is not ``repeatable``."""
    found: Dict[str, List[str]] = {}
    for name, value in http_request.query_params.multi_items():
        found.setdefault(name, []).append(value)
    where = f"{http_request.method} {http_request.url.path}"
    for name, values in found.items():
        if name not in allowed:
            takes = f"it takes {', '.join(repr(a) for a in allowed)}" if allowed else "it takes none"
            raise bad_value(name, f"unknown query parameter {name!r}: not a parameter of {where} ({takes})")
        if len(values) > 1 and name not in repeatable:
            raise bad_value(name, f"query parameter {name!r} is given {len(values)} times; give it once")
    return found


def flag(found: Dict[str, List[str]], name: str) -> bool:
    """A boolean parameter (absent: false); any other word is a 400 naming it."""
    value = found.get(name, [None])[0]
    if value is None or value.lower() in _FALSE:
        return False
    if value.lower() in _TRUE:
        return True
    raise bad_value(name, f"{name!r} must be true or false, got {shown(value)}")


def choice(found: Dict[str, List[str]], name: str, words: Tuple[str, ...]) -> Optional[str]:
    """A parameter that takes one of ``words`` (absent: None); anything else is a 400 naming it."""
    value = found.get(name, [None])[0]
    if value is not None and value not in words:
        raise bad_value(name, f"{name!r} must be one of {', '.join(words)}, got {shown(value)}")
    return value


def choices(found: Dict[str, List[str]], name: str, words: Tuple[str, ...]) -> Optional[List[str]]:
    """A repeatable parameter whose every value is one of ``words`` (absent: None)."""
    values = found.get(name)
    for value in values or ():
        if value not in words:
            raise bad_value(name, f"each {name!r} must be one of {', '.join(words)}, got {shown(value)}")
    return values


async def no_body(http_request: Request, options: str) -> None:
    """A 400 for a body on an endpoint that takes none (``options``: where its options go instead)."""
    body = await http_request.body()
    if body.strip() not in (b"", b"{}"):  # (an empty JSON object sets nothing either)
        where = f"{http_request.method} {http_request.url.path}"
        text = body[:80].decode("utf-8", "replace")
        raise bad_value("body", f"{where} takes no request body ({options}), got {shown(text)}")


__all__ = ["SLEEP_LEVELS", "WAKE_TAGS", "choice", "choices", "flag", "no_body", "params"]
