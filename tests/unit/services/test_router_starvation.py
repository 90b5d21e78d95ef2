"""A router that cannot be starved: with 256 streams open, grpc.health.v1, GetModelInfo and Abort answer with
a p99 under 100 ms (on a loaded machine: 10x their p99 with no stream open, when that is more); past the
configurable cap on concurrent requests a new one gets RESOURCE_EXHAUSTED / 429."""

from __future__ import annotations

import time

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from proto.eyrie.v1 import eyrie_pb2 as pb
from services.metadata import EmbeddedRedis
from tests.polling import poll, wait_for
from tests.unit.services.scripted_stack import SteadyDecode, start_scripted_stack

OPEN_STREAMS = 256
P99_LIMIT_S = 0.1
SAMPLES, ABORTS = 200, 200  # p99 of 200 is the second slowest: one hiccup of a shared CI machine is not a p99


@pytest.fixture
def held_stack(tmp_path, tiny_model_dir):
    """A router whose decode holds every stream open after its first token."""
    redis_server = EmbeddedRedis()
    decode = SteadyDecode(tokens=2)
    decode.hold.set()
    stack = start_scripted_stack(redis_server.start(), tiny_model_dir, decode=decode)
    yield stack
    decode.hold.clear()
    stack.stop()
    redis_server.stop()


def open_streams(stack, n: int, prefix: str) -> list:
    """``n`` Generate calls, each past its first message (open, and holding its place on the decode)."""
    calls = []
    for i in range(n):
        req = pb.GenerateRequest(request_id=f"{prefix}-{i}", token_ids=pb.TokenIds(ids=[5, 6]),
                                 sampling=pb.SamplingParams(max_new_tokens=8))
        calls.append(stack.stub.Generate(req, timeout=120))
    for call in calls:
        next(call)
    return calls


def p99(samples: list[float]) -> float:
    return sorted(samples)[min(len(samples) - 1, int(len(samples) * 0.99))]


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def control_call_times(stack, abort_prefix: str) -> dict[str, list[float]]:
    """SAMPLES health checks, SAMPLES GetModelInfo and ABORTS aborts (of ``{abort_prefix}-i``), each timed."""
    health = health_pb2_grpc.HealthStub(stack.channel)
    check = health_pb2.HealthCheckRequest(service="eyrie.v1.Generation")
    return {"health": [timed(lambda: health.Check(check, timeout=30)) for _ in range(SAMPLES)],
            "GetModelInfo": [timed(lambda: stack.stub.GetModelInfo(pb.ModelInfoRequest(), timeout=30))
                             for _ in range(SAMPLES)],
            "Abort": [timed(lambda i=i: stack.stub.Abort(pb.AbortRequest(request_id=f"{abort_prefix}-{i}"), timeout=30))
                      for i in range(ABORTS)]}


def test_control_calls_answer_promptly_with_256_open_streams(held_stack):
    """The p99 limit holds on an idle machine; on a loaded one (CI beside other work, tests/stress.sh) the same
    calls with no stream open are slower too, and the limit is 10x their p99 when that is more: a router starved
    by its streams (calls queued behind them) is seconds late either way, and this machine's speed fails nothing."""
    stack = held_stack
    control_call_times(stack, "warm-up")  # unmeasured: the first calls of each kind set up what they use
    idle = control_call_times(stack, "idle")
    calls = open_streams(stack, OPEN_STREAMS, "held")
    poll(lambda: stack.decode.open_streams >= OPEN_STREAMS, 120, "the streams did not all reach the decode side")
    assert stack.decode.open_streams == OPEN_STREAMS
    for name, samples in control_call_times(stack, "held").items():
        limit = max(P99_LIMIT_S, 10 * p99(idle[name]))
        print(name, [round(x * 1000, 1) for x in sorted(samples)[-5:]], "ms (slowest five); idle p99",
              round(p99(idle[name]) * 1000, 1), "ms")
        assert p99(samples) < limit, (f"{name} p99 {p99(samples) * 1000:.1f} ms with {OPEN_STREAMS} open streams "
                                      f"(limit {limit * 1000:.0f} ms)")
    for i in range(ABORTS):  # the aborts took: those streams end ABORTED
        with pytest.raises(grpc.RpcError) as e:
            list(calls[i])
        assert e.value.code() == grpc.StatusCode.ABORTED
    for call in calls[ABORTS:]:
        call.cancel()


def test_a_request_past_the_concurrency_cap_is_resource_exhausted(tmp_path, tiny_model_dir):
    redis_server = EmbeddedRedis()
    decode = SteadyDecode(tokens=2)
    decode.hold.set()
    stack = start_scripted_stack(redis_server.start(), tiny_model_dir, decode=decode, max_concurrent_requests=4)
    try:
        calls = open_streams(stack, 4, "capped")
        with pytest.raises(grpc.RpcError) as e:
            list(stack.stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5])), timeout=10))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "limit of 4" in e.value.details()
        r = httpx.post(stack.http_url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=10)
        assert r.status_code == 429 and r.headers["retry-after"] == "1", r.text
        for call in calls:
            call.cancel()
        decode.hold.clear()
        # the cancelled ones leave: there is room again
        wait_for(lambda: not stack.router.extra["core"]._active, 60)
        msgs = list(stack.stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5]),
                                                           sampling=pb.SamplingParams(max_new_tokens=2)), timeout=10))
        assert msgs[-1].HasField("finish")
    finally:
        decode.hold.clear()
        stack.stop()
        redis_server.stop()
