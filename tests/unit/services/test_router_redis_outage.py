"""Redis can blink: requests streaming through an outage finish with every token and end with a terminal
record once Redis is back; meanwhile new requests are refused with UNAVAILABLE / 503 + Retry-After and
health says why; heartbeats and a router started without Redis recover by themselves.

The outage lasts ``REDIS_OUTAGE_S`` seconds (default 3; the issue's figure is 15)."""

from __future__ import annotations

import os
import sys
import threading
import time

import grpc
import httpx
import pytest
import redis as redis_lib
from grpc_health.v1 import health_pb2, health_pb2_grpc

from proto.eyrie.v1 import eyrie_pb2 as pb
from services.metadata import Heartbeat, InstanceInfo, Registry, RequestStore, connect
from services.router.records import RecordsUnavailable, RecordWriter
from services.router.server import start_router
from services.settings import RouterSettings
from tests.unit.services.scripted_stack import RestartableRedis, SteadyDecode, start_scripted_stack

OUTAGE_S = float(os.environ.get("REDIS_OUTAGE_S", "3"))
STREAMS = 8


def health(stack) -> tuple[int, dict, int]:
    """(telemetry /health status, its body, grpc.health.v1 status of the Generation service)."""
    r = httpx.get(f"http://{stack.router.http_address}/health", timeout=5)
    check = health_pb2_grpc.HealthStub(stack.channel).Check(
        health_pb2.HealthCheckRequest(service="eyrie.v1.Generation"), timeout=5)
    return r.status_code, r.json(), check.status


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"{what}: not within {timeout} s")


@pytest.fixture
def redis(tmp_path):
    server = RestartableRedis(tmp_path).start()
    yield server
    server.stop()


def test_requests_streaming_through_a_redis_outage_lose_nothing(redis, tiny_model_dir):
    # Each stream lasts about OUTAGE_S / 2 after the outage starts: every request ends while Redis is away.
    tokens = 40
    decode = SteadyDecode(interval_s=OUTAGE_S / 2 / tokens, tokens=tokens)
    stack = start_scripted_stack(redis.url, tiny_model_dir, decode=decode, heartbeat_s=0.2)
    try:
        wait_for(lambda: health(stack)[0] == 200, 10, "router ready")
        results: dict[str, list] = {}
        started = threading.Barrier(STREAMS + 1)

        def stream(rid: str) -> None:
            got, finish = [], None
            req = pb.GenerateRequest(request_id=rid, token_ids=pb.TokenIds(ids=[5, 6]),
                                     sampling=pb.SamplingParams(max_new_tokens=tokens))
            for i, msg in enumerate(stack.stub.Generate(req, timeout=60)):
                got += msg.token_ids
                finish = msg.finish.reason if msg.HasField("finish") else finish
                if i == 1:
                    started.wait()
            results[rid] = [got, finish]

        threads = [threading.Thread(target=stream, args=(f"blink-{i}",)) for i in range(STREAMS)]
        for t in threads:
            t.start()
        started.wait(30)  # every stream has tokens: the records say decoding
        redis.stop()
        t_down = time.monotonic()

        # While Redis is away: new requests are refused with a clear status, health says why.
        with pytest.raises(grpc.RpcError) as e:
            list(stack.stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5])), timeout=10))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "cannot record" in e.value.details()
        r = httpx.post(stack.http_url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=10)
        assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1, r.text
        status, body, grpc_status = wait_for(lambda: (h := health(stack))[0] == 503 and h, 5, "health 503")
        assert "Redis is unreachable" in body["reason"] and grpc_status == health_pb2.HealthCheckResponse.NOT_SERVING
        r = httpx.get(stack.http_url + "/health", timeout=5)
        assert r.status_code == 503 and "Redis" in r.json()["reason"]

        for t in threads:  # the streams end during the outage (it lasts until they have, on a slow machine)
            t.join(OUTAGE_S + 120)
        assert all(not t.is_alive() for t in threads), "a stream did not finish during the outage"
        assert stack.router.extra["core"].records.buffered >= STREAMS  # their terminal writes wait for Redis
        time.sleep(max(0.0, OUTAGE_S - (time.monotonic() - t_down)))  # the outage's length, REDIS_OUTAGE_S
        redis.start()

        # Every client got every token and its final message; every record ends finished, in order.
        assert sorted(results) == sorted(f"blink-{i}" for i in range(STREAMS))
        for rid, (got, finish) in results.items():
            assert finish == "length" and got == [7, *range(8, 8 + tokens - 1)], (rid, got, finish)
        store = stack.store
        wait_for(lambda: all(store.get(f"blink-{i}").get("state") == "finished" for i in range(STREAMS)), 10,
                 "every record finished")
        for i in range(STREAMS):
            states = [s for s, _ in store.get(f"blink-{i}")["transitions"]]
            assert states == ["queued", "prefilling", "transferring", "decoding", "finished"], states
        core = stack.router.extra["core"]
        assert core.records.buffered == 0 and core.records.flushed >= STREAMS and core.records.dropped == 0
        metrics = httpx.get(f"http://{stack.router.http_address}/metrics", timeout=5).text
        assert "eyrie_records_flushed_total" in metrics and "eyrie_records_buffered" in metrics

        # Recovery without a restart.
        wait_for(lambda: health(stack)[0] == 200, 10, "health back to 200")
        assert health(stack)[2] == health_pb2.HealthCheckResponse.SERVING
        msgs = list(stack.stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5]),
                                                           sampling=pb.SamplingParams(max_new_tokens=3)), timeout=10))
        assert msgs[-1].HasField("finish")
    finally:
        stack.stop()


def test_a_router_started_without_redis_says_why_and_recovers(redis, tiny_model_dir):
    redis.stop()
    router = start_router(RouterSettings(model=str(tiny_model_dir / "target"), redis_url=redis.url,
                                         heartbeat_s=0.2))
    try:
        url = f"http://{router.http_address}/health"
        body = wait_for(lambda: (r := httpx.get(url, timeout=5)).status_code == 503 and r.json(), 5, "503")
        assert body["status"] == "not_serving" and "Redis is unreachable" in body["reason"]
        redis.start()
        body = wait_for(lambda: "no prefill" in (httpx.get(url, timeout=5).json().get("reason") or "") and
                        httpx.get(url, timeout=5).json(), 5, "the next reason")
        assert body["reason"] == "no prefill and no decode instance is registered"
        registry = Registry(connect(redis.url), 60)
        registry.register(InstanceInfo("p", "prefill", "127.0.0.1:1"))
        registry.register(InstanceInfo("d", "decode", "127.0.0.1:2"))
        wait_for(lambda: httpx.get(url, timeout=5).status_code == 200, 5, "ready once both roles registered")
    finally:
        router.stop(0.5)


def test_a_heartbeat_survives_an_outage_and_a_start_without_redis(redis):
    redis.stop()
    registry = Registry(connect(redis.url), ttl_s=1.0)
    beat = Heartbeat(registry, InstanceInfo("decode-x", "decode", "127.0.0.1:9"), interval_s=0.05).start()
    try:
        redis.start()
        wait_for(lambda: [i.instance_id for i in registry.instances()] == ["decode-x"], 30, "registered")
        redis.stop()
        after = beat.info.beat + 3
        wait_for(lambda: beat.info.beat >= after, 30, "beats meanwhile")  # they fail; the thread goes on
        redis.start()
        connect(redis.url).flushdb()  # even a Redis that came back empty
        wait_for(lambda: [i.instance_id for i in registry.instances()] == ["decode-x"], 30, "registered again")
    finally:
        beat.stop()


class _BlinkingStore:
    """A RequestStore stand-in whose Redis is away while ``down``; records each write that lands."""

    def __init__(self):
        self.down, self.written = True, []

    def transition(self, rid, state, **fields):
        if self.down:
            raise redis_lib.ConnectionError("Error 111 connecting: connection refused")
        self.written.append((rid, state))
        return True

    def create(self, rid, created_at=None, **fields):
        return self.transition(rid, "queued")

    def discard(self, rid, created_at):
        return self.transition(rid, "discard")


def test_the_record_buffer_keeps_order_is_bounded_and_drops_non_terminal_writes_first():
    store = _BlinkingStore()
    writer = RecordWriter(store, max_buffered=4, backoff_s=(0.001,), flush_interval_s=0.01)
    with pytest.raises(RecordsUnavailable):
        writer.create("new")  # a request that cannot be recorded is not accepted (its record, if any, discarded)
    for rid, state in [("a", "decoding"), ("b", "decoding"), ("a", "finished"), ("c", "decoding"),
                       ("b", "failed"), ("c", "aborted")]:
        writer.transition(rid, state)  # never raises
    assert writer.buffered == 4 and writer.dropped == 3  # the three oldest non-terminal writes went
    store.down = False
    writer.start()
    wait_for(lambda: writer.buffered == 0, 5, "flushed")
    writer.stop()
    assert store.written == [("new", "discard"), ("a", "finished"), ("b", "failed"), ("c", "aborted")]
    assert writer.flushed == 4
    writer.transition("d", "finished")  # Redis answers: written at once
    assert store.written[-1] == ("d", "finished")


class _LostAnswers(RequestStore):
    """A real store whose next ``lose`` creates run on Redis and then lose their answer (the connection drops
    after the script ran), and whose Redis is away for good once ``down``."""

    def __init__(self, client, lose: int):
        super().__init__(client)
        self.lose, self.down = lose, False

    def create(self, rid, created_at=None, **fields):
        if self.down:
            raise redis_lib.ConnectionError("Error 111 connecting: connection refused")
        created = super().create(rid, created_at=created_at, **fields)
        if self.lose:
            self.lose -= 1
            self.down = self.down or self.lose == 0 and self.stay_down
            raise redis_lib.ConnectionError("Connection closed by server.")
        return created

    stay_down = False


def test_a_create_whose_answer_was_lost_is_neither_a_taken_id_nor_left_behind(redis):
    client = connect(redis.url)
    # Retried after a lost answer: the record it wrote is its own, so the request is created, once.
    store = _LostAnswers(client, lose=1)
    writer = RecordWriter(store, backoff_s=(0.001, 0.001), flush_interval_s=0.01)
    assert writer.create("once", prompt_tokens=3) is True and writer.buffered == 0
    assert RequestStore(client).get("once")["state"] == "queued"
    assert writer.create("once", prompt_tokens=3) is False  # a second request under the id: taken
    # Every try lost or refused: the request is refused, and its record (it landed) is discarded once Redis is back.
    store = _LostAnswers(client, lose=1)
    store.stay_down = True
    writer = RecordWriter(store, backoff_s=(0.001, 0.001), flush_interval_s=0.01)
    with pytest.raises(RecordsUnavailable):
        writer.create("refused", prompt_tokens=3)
    assert RequestStore(client).get("refused")["state"] == "queued" and writer.buffered == 1
    writer.start()
    wait_for(lambda: writer.buffered == 0, 10, "the discard flushed")
    writer.stop()
    assert RequestStore(client).get("refused") == {}
    # The discard takes only that create's record: one made since under the same id (another router's) stays.
    RequestStore(client).create("again")
    assert RequestStore(client).discard("again", repr(123.0)) is False and RequestStore(client).exists("again")


def test_a_router_sets_its_gil_switch_interval(redis, tiny_model_dir):
    """The router's I/O pool threads (Redis batches) hand the GIL back to its event loop within the configured
    interval, not Python's default 5 ms (docs/benchmarks.md: ~5-8 ms added to every relayed token at 256 streams)."""
    before = sys.getswitchinterval()
    router = start_router(RouterSettings(model=str(tiny_model_dir / "target"), redis_url=redis.url,
                                         gil_switch_interval_ms=0.75))
    try:
        assert sys.getswitchinterval() == pytest.approx(0.00075)
    finally:
        router.stop()
        sys.setswitchinterval(before)
    assert RouterSettings(model=str(tiny_model_dir / "target")).gil_switch_interval_ms == 0.5
