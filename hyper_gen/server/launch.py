"""Running the server: uvicorn on rank 0, the engine's follower loop on every other rank.

SIGINT / SIGTERM stop uvicorn gracefully: new requests are 503s from then on (``/health`` too, so a
router sends them elsewhere), in-flight responses get ``GRACE_S`` seconds to finish,
then every one still open ends well-formed (a 503 in OpenAI's schema, or, once streaming, a last
error event and ``data: [DONE]``; ``ServerState.interrupt_all``), which also frees their slots;
uvicorn's own cancellation ``CLOSE_S`` later is only a backstop. Then the engine shuts down,
which on a multi-rank job releases the followers; the process then returns normally (exit
status 0) instead of dying by the signal uvicorn would otherwise re-raise. uvicorn's own two
replies (bytes that are not HTTP, an app that ends without answering) are OpenAI errors too.
Ranks other than 0 ignore both signals (a launcher or a terminal sends them to every rank) and
leave when rank 0's engine stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import socket
import threading
from typing import Callable, Optional

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from .app import create_app
from .errors import APIError

GRACE_S = 5.0
CLOSE_S = 2.0  # after the grace: for the interrupted responses to be written before uvicorn cancels them
SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _error_bytes(message: str, status: int) -> bytes:
    return json.dumps(APIError(message, status=status).response_body()).encode("utf-8")


# RFC 9113: the bytes an HTTP/2 client opens a cleartext connection with (a gRPC health probe's, as
# sglang-router sends one to every worker it registers), and what a server that speaks only HTTP/1.1
# answers: an empty SETTINGS frame (the server's preface), then GOAWAY, last stream 0, HTTP_1_1_REQUIRED
H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
H2_HTTP_1_1_REQUIRED = bytes.fromhex("000000040000000000") + bytes.fromhex("0000080700000000000000000000000d")


class _H11(H11Protocol):
    """uvicorn's HTTP/1.1 protocol, its own error replies in OpenAI's schema instead of text/plain,
    an HTTP/2 (gRPC) probe answered with HTTP/2's "use HTTP/1.1" (not a warning per probe), and
    TCP_NODELAY on every connection."""

    def connection_made(self, transport) -> None:
        """TCP_NODELAY on every connection: asyncio sets it only on sockets made with proto IPPROTO_TCP,
        and without it a response written as headers then body waits out the client's delayed ACK
        (40 ms) on a kept-alive connection, as a router's pooled connections to its workers are."""
        super().connection_made(transport)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        fresh = self.cycle is None and self.conn.their_state is h11.IDLE and not self.conn.trailing_data[0]
        if fresh and data.startswith(H2_PREFACE):
            self.logger.debug("an HTTP/2 (gRPC) connection attempt: answered HTTP_1_1_REQUIRED")
            self.transport.write(H2_HTTP_1_1_REQUIRED)
            self.transport.close()
            return
        super().data_received(data)

    def send_400_response(self, msg: str) -> None:
        body = _error_bytes(f"{msg} (not an HTTP/1.1 request this server can parse)", 400)
        headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
        self.transport.write(self.conn.send(h11.Response(status_code=400, headers=headers, reason=b"Bad Request")))
        self.transport.write(self.conn.send(h11.Data(data=body)))
        self.transport.write(self.conn.send(h11.EndOfMessage()))
        self.transport.close()

    async def send_500_response(self) -> None:
        body = _error_bytes("internal server error: the request ended without a response", 500)
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        await self.send({"type": "http.response.start", "status": 500, "headers": headers})
        await self.send({"type": "http.response.body", "body": body, "more_body": False})


def _config(app, log_level: str) -> uvicorn.Config:
    # uvicorn's access log off: the app writes its own line per request (access_log.py)
    return uvicorn.Config(app, http=_H11, log_level=log_level, access_log=False, lifespan="off")


class _Server(uvicorn.Server):
    """uvicorn's server, telling us when it listens and not re-raising the signal that stopped it."""

    def __init__(self, config, on_started: Optional[Callable[[], None]] = None, state=None, grace_s: float = GRACE_S):
        config.timeout_graceful_shutdown = grace_s + CLOSE_S
        super().__init__(config)
        self.on_started = on_started
        self.state, self.grace_s = state, grace_s  # the app's ServerState: its open responses end at the grace
        self.stopped_by: Optional[int] = None

    async def shutdown(self, sockets=None) -> None:
        timer = None
        if self.state is not None:
            timer = asyncio.get_running_loop().call_later(self.grace_s, self.state.interrupt_all)
        try:
            await super().shutdown(sockets=sockets)
        finally:
            if timer is not None:
                timer.cancel()

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in SIGNALS}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig, frame) -> None:
        self.stopped_by = self.stopped_by or sig
        if self.state is not None:  # new requests are 503s (a router retries them elsewhere); open ones finish
            self.state.draining = True
        super().handle_exit(sig, frame)

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets=sockets)
        if self.started and self.on_started is not None:
            self.on_started()


def bind(host: str, port: int) -> socket.socket:
    """A listening-ready socket on host:port (port 0: any free port); OSError if it is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def serve(
    engine,
    tokenizer,
    model_name: str,
    sock: socket.socket,
    *,
    log_level: str = "warning",
    on_started: Optional[Callable[[], None]] = None,
    grace_s: float = GRACE_S,
    tool_call_parser: Optional[str] = "hermes",
    reasoning_parser: Optional[str] = None,
    access_log: bool = True,
    model_path: Optional[str] = None,
    tp_size: int = 1,
    backend: Optional[str] = None,
) -> Optional[int]:
    """Serve the OpenAI endpoints on ``sock`` until SIGINT / SIGTERM; the signal that stopped it.
    ``access_log``: a line on stderr per request (``access_log.py``).

    The engine is started by the caller and shut down here, whatever ends the server."""
    parsers = dict(tool_call_parser=tool_call_parser, reasoning_parser=reasoning_parser)
    described = dict(model_path=model_path, tp_size=tp_size, backend=backend)
    app = create_app(engine, tokenizer, model_name, access_log=access_log, **parsers, **described)
    server = _Server(_config(app, log_level), on_started=on_started, state=app.state.hyper_gen, grace_s=grace_s)
    try:
        server.run(sockets=[sock])
    finally:
        engine.shutdown()  # (every rank leaves the trainers' weight-update groups)
        sock.close()
    return server.stopped_by


def follow(engine) -> None:
    """A rank > 0: compute rank 0's steps until rank 0's engine shuts down; signals are rank 0's."""
    for sig in SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    engine.run_follower()


class BackgroundServer:
    """The server on a thread of this process, for a program that keeps its model (an RLHF job
    serving the policy it trains, a notebook, a test): ``url`` once it listens (``app_options``: what
    else ``create_app`` takes, e.g. ``reasoning_parser``, ``model_path``); ``stop()`` (or
    leaving the ``with`` block) stops it, giving open responses ``grace_s`` seconds to finish before
    they end with a 503 / a last error event. The engine stays the caller's to start and shut down."""

    def __init__(
        self,
        engine,
        tokenizer,
        model_name: str,
        host: str = "127.0.0.1",
        port: int = 0,
        timeout_s=60.0,
        grace_s=2.0,
        **app_options,
    ):
        self._sock = bind(host, port)
        address = self._sock.getsockname()
        self.url = f"http://{f'[{address[0]}]' if ':' in address[0] else address[0]}:{address[1]}"
        app = self._app = create_app(engine, tokenizer, model_name, **app_options)
        self._server = _Server(_config(app, "warning"), state=app.state.hyper_gen, grace_s=grace_s)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, name="hyper_gen-server", daemon=True
        )
        self._thread.start()
        deadline = threading.Event()
        for _ in range(int(timeout_s / 0.02)):
            if self._server.started or not self._thread.is_alive():
                break
            deadline.wait(0.02)
        if not self._server.started:
            self.stop()
            raise RuntimeError(f"the server on {self.url} did not start")

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(30)
        self._app.state.weight_groups.close()
        self._sock.close()

    def __enter__(self) -> "BackgroundServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
