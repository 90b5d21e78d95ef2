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
