"""The shared HTTP server's header limit: a request whose headers exceed it is a 400 naming the limit, before
any route or key check runs; one within it is served."""

from __future__ import annotations

import httpx
from fastapi import FastAPI

from services.http_server import HttpServer, json_response, limit_headers, require_key


def test_headers_over_the_limit_are_a_400_naming_it():
    app = FastAPI()
    app.add_api_route("/ping", lambda: json_response({"ok": True}), methods=["GET"])
    require_key(app, "k", ())
    limit_headers(app, 4096)
    server = HttpServer(app, "127.0.0.1", 0, name="limits-test", max_incomplete_head_bytes=2 * 4096 + 16384).start()
    try:
        url, auth = f"http://127.0.0.1:{server.port}/ping", {"Authorization": "Bearer k"}
        assert httpx.get(url, headers=auth, timeout=30).json() == {"ok": True}
        for big in ({"X-Big": "a" * 5000}, {f"X-{i}": "b" * 90 for i in range(60)}, {"X-Huge": "c" * 70_000}):
            r = httpx.get(url, headers={**auth, **big}, timeout=30)
            assert r.status_code == 400, (r.status_code, r.text[:200])
            err = r.json()["error"]
            assert err["code"] == "headers_too_large" and "limit of 4096 (max_header_bytes)" in err["message"]
        r = httpx.get(url, headers={"X-Big": "a" * 5000}, timeout=30)  # refused for its size before the key check
        assert r.status_code == 400
        assert httpx.get(url, headers=auth, timeout=30).status_code == 200  # still serving
    finally:
        server.stop()


def test_every_connection_is_tcp_nodelay():
    """A stream writes its headers and then each event as small writes: with Nagle's algorithm on, each waited for
    the client's ACK of the one before (a delayed ACK: up to 40 ms; the OpenAI API's first event came ~43 ms after
    its headers). Every accepted connection of the shared server has TCP_NODELAY set, on a kept-alive connection
    as users' clients hold them."""
    import socket

    app = FastAPI()
    app.add_api_route("/ping", lambda: json_response({"ok": True}), methods=["GET"])
    server = HttpServer(app, "127.0.0.1", 0, name="nodelay-test").start()
    try:
        assert server.sock.proto == socket.IPPROTO_TCP  # what asyncio looks at before setting it itself
        with httpx.Client(timeout=30) as client:  # one kept-alive connection
            for _ in range(2):
                assert client.get(f"http://127.0.0.1:{server.port}/ping").json() == {"ok": True}
            connections = list(server.server.server_state.connections)
            assert len(connections) == 1
            sock = connections[0].transport.get_extra_info("socket")
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
    finally:
        server.stop()
