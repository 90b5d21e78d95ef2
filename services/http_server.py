"""One way to serve HTTP in every Eyrie service: an ASGI app (FastAPI) under uvicorn on a daemon thread.

What the standard library's server lacked and this adds: a real listen backlog (many simultaneous
connections are queued, not reset), a deadline on a request's head (a client that never finishes its
headers is disconnected) and, with ``read_body``, on its body; Content-Length checked before a byte of the
body is read (a negative or malformed one is refused by h11 with 400, an oversized one answers 413, a short
one times out with 408). Bearer-key auth is one middleware (``require_key``) for every path but the open ones.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import socket
import threading
from collections.abc import Callable

import uvicorn
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from uvicorn.protocols.http.h11_impl import H11Protocol

BACKLOG = 2048  # pending connections the kernel queues before the server accepts them
HEAD_TIMEOUT_S = 10.0  # a request's line and headers must arrive within this
BODY_TIMEOUT_S = 30.0  # and its body within this (read_body)


class HttpError(Exception):
    """An error answered in OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type_ or ("invalid_request_error" if status < 500 else "server_error")
        self.headers = headers or {}
        self.counted = False  # True once logged and counted where it arose (RouterCore's refusals)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bearer(api_key: str) -> str:
    return f"Bearer {api_key}"


def key_matches(given: str | None, api_key: str) -> bool:
    """Constant-time comparison of an ``authorization`` value with ``Bearer <api_key>``."""
    return hmac.compare_digest((given or "").strip().encode(), bearer(api_key).encode())


class _KeyGuard:
    """Pure ASGI (a streaming response passes through untouched, client disconnects included)."""

    def __init__(self, app, api_key: str, open_paths: tuple[str, ...], on_denied: Callable[[], None] | None):
        self.app, self.api_key, self.open_paths, self.on_denied = app, api_key, open_paths, on_denied

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            return await self.app(scope, receive, send)
        given = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"), None)
        if key_matches(given, self.api_key):
            return await self.app(scope, receive, send)
        if self.on_denied is not None:
            self.on_denied()
        denied = HttpError(401, "missing or wrong API key (send Authorization: Bearer <key>)", code="invalid_api_key",
                           headers={"WWW-Authenticate": 'Bearer realm="eyrie"'})
        await denied.response()(scope, receive, send)


def require_key(app, api_key: str | None, open_paths: tuple[str, ...], on_denied: Callable[[], None] | None = None):
    """Every request to ``app`` but ``open_paths`` (any method, unknown paths too) needs ``Authorization:
    Bearer <api_key>``, else 401; ``on_denied`` counts the refusals. No key: everything is open."""
    if api_key:
        app.add_middleware(_KeyGuard, api_key=api_key, open_paths=open_paths, on_denied=on_denied)


class _HeaderLimit:
    """Pure ASGI: a request whose header lines together exceed ``max_bytes`` is refused with 400 naming the limit
    (h11 itself only bounds a head still arriving in pieces)."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            size = sum(len(k) + len(v) + 4 for k, v in scope["headers"])  # "name: value\r\n"
            if size > self.max_bytes:
                refused = HttpError(400, f"request headers: {size} bytes exceed the limit of {self.max_bytes} "
                                         "(max_header_bytes)", param="headers", code="headers_too_large",
                                    headers={"Connection": "close"})
                return await refused.response()(scope, receive, send)
        return await self.app(scope, receive, send)


def limit_headers(app, max_bytes: int) -> None:
    """Every request to ``app`` whose headers exceed ``max_bytes`` gets 400 naming the limit."""
    app.add_middleware(_HeaderLimit, max_bytes=max_bytes)


async def read_body(request: Request, limit: int, timeout_s: float = BODY_TIMEOUT_S) -> bytes:
    """The request's body, at most ``limit`` bytes, within ``timeout_s``: 411 without a Content-Length
    (chunked bodies are not accepted), 413 over the limit (nothing read), 408 when it does not all come."""
    length = request.headers.get("content-length")
    if length is None:
        raise HttpError(411, "a JSON body with a Content-Length is required", code="length_required")
    n = int(length)  # h11 already refused a malformed or negative one
    if n > limit:
        raise HttpError(413, f"the body's {n} bytes exceed the limit of {limit}", code="body_too_large",
                        headers={"Connection": "close"})
    try:
        return await asyncio.wait_for(request.body(), timeout_s)
    except asyncio.TimeoutError:
        raise HttpError(408, f"the body did not arrive within {timeout_s:g} s", code="request_timeout",
                        headers={"Connection": "close"}) from None


def json_response(body: dict, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(json.dumps(body, ensure_ascii=False), status_code=status, headers=headers,
                    media_type="application/json")


class _DeadlineProtocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each request's head: a connection with no request in
    progress after ``HEAD_TIMEOUT_S`` (nothing sent, or headers never finished) is closed.

    Every connection is TCP_NODELAY: a stream writes its headers, then each event, as small writes, and with
    Nagle's algorithm each one waited for the ACK of the one before, which a client's delayed ACK holds up to
    40 ms. Through the OpenAI API every streamed request's first token came ~43 ms after its headers
    (``bench/bench_router.py --api openai``: first event 53 ms after the token left the instance, gRPC's 5)."""

    head_timeout_s = HEAD_TIMEOUT_S

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._arm_head_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_head_deadline()

    def _arm_head_deadline(self) -> None:
        self._head_epoch = getattr(self, "_head_epoch", 0) + 1
        self.loop.call_later(self.head_timeout_s, self._head_deadline, self._head_epoch)

    def _head_deadline(self, epoch: int) -> None:
        # No response completed since arming and no request in progress: the head never came (whole).
        idle = self.cycle is None or self.cycle.response_complete
        if epoch == self._head_epoch and idle and not self.transport.is_closing():
            self.transport.close()


class HttpServer:
    """``app`` served on ``host:port`` (0 = any free port) from a daemon thread; ``stop()`` ends it.

    The socket is bound here, in the caller's thread, so a busy port raises ``OSError`` at once."""

    def __init__(self, app, host: str, port: int, name: str, head_timeout_s: float = HEAD_TIMEOUT_S,
                 backlog: int = BACKLOG, max_incomplete_head_bytes: int | None = None, reuse_port: bool = False):
        # IPPROTO_TCP named: asyncio sets TCP_NODELAY only on sockets whose proto says TCP (an accepted socket
        # inherits it); with proto 0, Nagle held each small write behind the last one's ACK (``_DeadlineProtocol``).
        self.sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM,
                                  socket.IPPROTO_TCP)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:  # several processes serve this port: the kernel spreads the connections
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            self.sock.bind((host, port))
        except OSError:
            self.sock.close()
            raise
        self.sock.listen(backlog)
        protocol = type("Protocol", (_DeadlineProtocol,), {"head_timeout_s": head_timeout_s})
        config = uvicorn.Config(app, http=protocol, backlog=backlog, log_config=None, access_log=False,
                                lifespan="off", timeout_graceful_shutdown=1, ws="none",
                                h11_max_incomplete_event_size=max_incomplete_head_bytes)
        self.server = uvicorn.Server(config)
        self._served = None  # the serve() future when served on another loop
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, name=name,
                                        daemon=True)
        logging.getLogger("uvicorn.error").setLevel(logging.WARNING)

    @property
    def port(self) -> int:
        return self.sock.getsockname()[1]

    @property
    def host(self) -> str:
        return self.sock.getsockname()[0]

    def start(self, timeout_s: float = 10.0, loop: asyncio.AbstractEventLoop | None = None) -> HttpServer:
        """Serve from the daemon thread, or with ``loop`` (running in another thread) on that loop: an
        application whose handlers share state with other servers of that loop (the router's gRPC)."""
        if loop is not None:
            self._served = asyncio.run_coroutine_threadsafe(self.server.serve(sockets=[self.sock]), loop)
            return self._wait_started(timeout_s, self._served.done)
        self._thread.start()
        return self._wait_started(timeout_s, lambda: not self._thread.is_alive())

    def _wait_started(self, timeout_s: float, ended) -> HttpServer:
        for _ in range(int(timeout_s / 0.01)):
            if self.server.started or ended():
                break
            threading.Event().wait(0.01)
        if not self.server.started:
            raise RuntimeError(f"the HTTP server {self._thread.name} did not start")
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        self.server.should_exit = True
        if self._served is not None:
            try:
                self._served.result(timeout_s)
            except Exception:  # noqa: BLE001 (stopping: a server that failed is stopped too)
                pass
        else:
            self._thread.join(timeout_s)
        self.sock.close()


__all__ = ["HttpError", "HttpServer", "bearer", "json_response", "key_matches", "limit_headers", "read_body",
           "require_key"]
