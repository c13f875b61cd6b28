"""One line per HTTP request on stderr: when, who, the method and path, the status, how long.

``hyper-gen serve`` logs every request this way unless ``-q``: a client that is refused (a 400
naming the parameter) otherwise leaves no trace on the server, and an evaluation run's hundreds of
refusals look like a hang. uvicorn's own access log has neither the time taken nor a line for a
response that never started; this ASGI middleware writes one when the response ends (a streamed
one after its last event), whatever ended it.
"""

from __future__ import annotations

import logging
import sys
import time

LOGGER_NAME = "hyper_gen.server.access"


def access_logger() -> logging.Logger:
    """The access log's logger: INFO to stderr, on its own (not through the root logger's handlers)."""
    logger = logging.getLogger(LOGGER_NAME)
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("hyper-gen serve: %(asctime)s %(message)s", "%Y-%m-%d %H:%M:%S"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    return logger


class AccessLog:
    """ASGI middleware: ``client "METHOD /path?query" status N.N ms`` once each HTTP response ends."""

    def __init__(self, app, logger: logging.Logger = None):
        self.app, self.logger = app, logger or access_logger()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start, status = time.perf_counter(), None

        async def sending(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except Exception:
            status = status or 500  # Starlette's outermost layer answers it with our 500
            raise
        finally:
            client = scope.get("client")
            who = f"{client[0]}:{client[1]}" if client else "-"
            query = scope.get("query_string", b"").decode("latin-1")
            target = scope.get("path", "") + (f"?{query}" if query else "")
            took = (time.perf_counter() - start) * 1000
            shown = status if status is not None else "-"  # the response never started (the client left)
            self.logger.info('%s "%s %s" %s %.1f ms', who, scope.get("method", ""), target, shown, took)
