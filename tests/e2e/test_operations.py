"""Operating the services: health, metrics, gRPC health and reflection, API keys, killed processes,
and ``eyrie up --demo``."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from proto.eyrie.v1 import eyrie_pb2 as pb
from proto.eyrie.v1 import eyrie_pb2_grpc as pb_grpc
from services.launch import Stack, free_port
from shared.metadata import RequestStore, connect
from tests.e2e.conftest import start_stack


def http_get(addr: str, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://{addr}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def metric(text: str, name: str, **labels) -> float:
    total = 0.0
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


@pytest.fixture(scope="module")
def stack(redis_url, tiny_model_dir):
    s = start_stack(redis_url, tiny_model_dir, "eagle", page_size=4, chunk_size=8)
    yield s
    s.stop()


def test_metrics_parse_and_move(stack):
    router_http = stack.router.http_address
    before = metric(http_get(router_http, "/metrics")[1], "eyrie_requests_total", outcome="finished")
    stack.generate([5, 6, 7, 8], max_new_tokens=6, ignore_eos=True)
    code, text = http_get(router_http, "/metrics")
    assert code == 200
    assert metric(text, "eyrie_requests_total", outcome="finished") == before + 1
    assert metric(text, "eyrie_ttft_seconds_count") >= 1
    _, ptext = http_get(stack.prefills[0].http_address, "/metrics")
    assert metric(ptext, "eyrie_handoff_bytes_total") > 0
    _, dtext = http_get(stack.decodes[0].http_address, "/metrics")
    assert metric(dtext, "eyrie_accept_length_count") >= 1
    assert metric(dtext, "eyrie_kv_pages_total", cache="target") > 0
    assert metric(dtext, "eyrie_kv_pages_used", cache="draft0") == 0  # nothing running now


def test_grpc_health_and_reflection(stack):
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    for handle, service in ((stack.router, "eyrie.v1.Generation"), (stack.prefills[0], "eyrie.v1.Prefill"),
                            (stack.decodes[0], "eyrie.v1.Decode")):
        ch = grpc.insecure_channel(handle.grpc_address)
        health = health_pb2_grpc.HealthStub(ch)
        for name in ("", service):
            reply = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        assert service in ProtoReflectionDescriptorDatabase(ch).get_services()
        code, body = http_get(handle.http_address, "/health")
        assert code == 200 and json.loads(body)["status"] == "ready"


def test_model_info(stack):
    info = pb_grpc.GenerationStub(grpc.insecure_channel(stack.router.grpc_address)).GetModelInfo(pb.ModelInfoRequest())
    assert info.vocab_size == 512 and info.max_context > 0 and info.model == "eyrie"
    assert (info.dtype, info.page_size) == ("float32", 4)  # the engines' figures, from the registry
    assert (info.spec.draft_kind, info.spec.topk, info.spec.steps, info.spec.num_draft_tokens) == ("eagle", 1, 3, 4)


def test_health_is_503_while_loading(redis_url, tiny_model_dir, monkeypatch):
    import services.prefill.server as prefill_server
    from services.settings import PrefillSettings

    real_engine = prefill_server.Engine
    gate = threading.Event()

    def slow_engine(*args, **kwargs):
        gate.wait(10)
        return real_engine(*args, **kwargs)

    monkeypatch.setattr(prefill_server, "Engine", slow_engine)
    port = free_port()
    settings = PrefillSettings(model=str(tiny_model_dir / "target"), redis_url=redis_url, http_port=port)
    handles = []
    t = threading.Thread(target=lambda: handles.append(prefill_server.start_prefill(settings)))
    t.start()
    deadline = time.monotonic() + 10
    code = None
    while code != 503 and time.monotonic() < deadline:
        try:
            code, body = http_get(f"127.0.0.1:{port}", "/health")
        except OSError:
            time.sleep(0.01)
    assert code == 503 and json.loads(body)["status"] == "loading"
    gate.set()
    t.join(30)
    assert http_get(f"127.0.0.1:{port}", "/health")[0] == 200
    handles[0].stop(0.5)


KEY = "sekret"
AUTH = [("authorization", f"Bearer {KEY}")]
WRONG_KEYS = [None, [("authorization", "Bearer wrong")], [("authorization", KEY)], [("authorization", "")]]


def call_method(channel, service: str, method, metadata, timeout=10):
    """Call ``service``'s ``method`` (a descriptor) with an empty request: None if it succeeded, else its status."""
    path = f"/{pb.DESCRIPTOR.services_by_name[service].full_name}/{method.name}"
    request, output = getattr(pb, method.input_type.name)(), getattr(pb, method.output_type.name)
    kind = {(False, False): channel.unary_unary, (False, True): channel.unary_stream,
            (True, False): channel.stream_unary, (True, True): channel.stream_stream}
    call = kind[(method.client_streaming, method.server_streaming)](
        path, request_serializer=type(request).SerializeToString, response_deserializer=output.FromString)
    arg = iter([request]) if method.client_streaming else request
    try:
        result = call(arg, metadata=metadata, timeout=timeout)
        if method.server_streaming:
            list(result)
    except grpc.RpcError as e:
        return e.code()
    return None


def reflect(channel, metadata) -> set[str]:
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    (reply,) = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                         metadata=metadata, timeout=10)
    return {svc.name for svc in reply.list_services_response.service}


def http(addr: str, path: str, key: str | None = None, method: str = "GET") -> tuple[int, dict, str]:
    req = urllib.request.Request(f"http://{addr}{path}", method=method, data=b"{}" if method == "POST" else None,
                                 headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, dict(r.headers), r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read().decode()


def test_api_key_guards_every_grpc_service_and_http_route_of_every_service(redis_url, tiny_model_dir):
    """With a key set, the router's Generation, the internal Prefill and Decode services, server reflection on each,
    and every HTTP route but /health on each refuse a call without it or with a wrong one; with it they answer,
    and a request walks the whole stack (the services call each other with the key). Health stays open."""
    s = start_stack(redis_url, tiny_model_dir, "eagle", page_size=4, chunk_size=8, api_key=KEY,
                    router_extra=dict(api_key=KEY))
    services = [(s.router, "Generation"), (s.prefills[0], "Prefill"), (s.decodes[0], "Decode")]
    try:
        tokens, finish = s.generate(list(range(5, 30)), max_new_tokens=8, ignore_eos=True, metadata=AUTH)
        assert len(tokens) == 8 and finish.reason == "length"  # prefill -> decode hand-off carried the key
        for handle, service in services:
            channel = grpc.insecure_channel(handle.grpc_address)
            for method in pb.DESCRIPTOR.services_by_name[service].methods:
                for md in WRONG_KEYS:
                    assert call_method(channel, service, method, md) == grpc.StatusCode.UNAUTHENTICATED, \
                        (service, method.name, md)
                # With the key the call gets through: it succeeds or is refused for its (empty) content.
                assert call_method(channel, service, method, AUTH) != grpc.StatusCode.UNAUTHENTICATED, \
                    (service, method.name)
            for md in WRONG_KEYS:
                with pytest.raises(grpc.RpcError) as err:
                    reflect(channel, md)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, (service, "reflection")
            assert f"eyrie.v1.{service}" in reflect(channel, AUTH)
            health = health_pb2_grpc.HealthStub(channel)
            for name in ("", f"eyrie.v1.{service}"):
                assert health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5).status == \
                    health_pb2.HealthCheckResponse.SERVING

            addr = handle.http_address
            for path, method in (("/metrics", "GET"), ("/metrics?x=1", "GET"), ("/nothing", "GET"),
                                 ("/metrics", "POST")):
                for key in (None, "wrong"):
                    code, headers, body = http(addr, path, key, method)
                    assert code == 401, (service, method, path, key)
                    assert headers["WWW-Authenticate"].startswith("Bearer")
                    assert json.loads(body)["error"]["code"] == "invalid_api_key"
            code, _, text = http(addr, "/metrics", KEY)
            assert code == 200 and metric(text, "eyrie_errors_total", kind="unauthenticated") > 0
            assert http(addr, "/nothing", KEY)[0] == 404 and http(addr, "/metrics", KEY, "POST")[0] == 405
            code, _, body = http(addr, "/health")
            assert code == 200 and json.loads(body)["status"] == "ready"
            assert http(addr, "/health", method="POST")[0] == 405  # open, and only for GET
        assert s.wait_clean()
    finally:
        s.stop()


@pytest.fixture(scope="module")
def process_stack(tiny_model_dir, tmp_path_factory):
    stack = Stack(str(tiny_model_dir / "target"), str(tiny_model_dir / "mtp"), None, free_port(),
                  extra={"page_size": 4, "chunk_size": 8}, log_dir=tmp_path_factory.mktemp("logs")).start()
    yield stack
    stack.stop()


LOG_KEYS = {"ts", "level", "service", "instance", "rid", "event", "fields"}


def service_log(stack, role: str) -> list[dict]:
    """Every line the service process wrote to its log, each parsed as one JSON object."""
    lines = (stack.log_dir / f"{role}.log").read_text().splitlines()
    out = [json.loads(line) for line in lines]
    assert out and all(set(obj) == LOG_KEYS for obj in out), lines[:3]
    assert {obj["service"] for obj in out} == {role}
    return out


def events(stack, role: str, rid: str) -> list[dict]:
    return [x for x in service_log(stack, role) if x["rid"] == rid]


def test_every_service_logs_json_lines_with_the_request_id(process_stack):
    """The service processes' own log output (stderr): one JSON object per line, and for a finished, an aborted
    and a refused request every lifecycle event of each service, carrying the request id and the reason."""
    stack = process_stack
    stub = pb_grpc.GenerationStub(grpc.insecure_channel(stack.router_address))
    ok = pb.GenerateRequest(request_id="logged-ok", token_ids=pb.TokenIds(ids=list(range(3, 30))),
                            sampling=pb.SamplingParams(max_new_tokens=8, ignore_eos=True))
    assert sum(len(m.token_ids) for m in stub.Generate(ok, timeout=60)) == 8
    long = pb.GenerateRequest(request_id="logged-abort", token_ids=pb.TokenIds(ids=list(range(3, 30))),
                              sampling=pb.SamplingParams(max_new_tokens=2000, ignore_eos=True))
    with pytest.raises(grpc.RpcError) as err:
        for i, _ in enumerate(stub.Generate(long, timeout=60)):
            if i == 2:
                assert stub.Abort(pb.AbortRequest(request_id="logged-abort"), timeout=10).found
    assert err.value.code() == grpc.StatusCode.ABORTED
    with pytest.raises(grpc.RpcError):
        list(stub.Generate(pb.GenerateRequest(request_id="logged-bad", text="hi",
                                              sampling=pb.SamplingParams(temperature=-1)), timeout=30))
    rec = RequestStore(connect(stack.redis_url)).get("logged-ok")

    router = events(stack, "router", "logged-ok")
    assert [x["event"] for x in router] == ["received", "placed", "prefill_done", "handoff_done", "first_token",
                                            "finished"]
    assert router[1]["fields"]["prefill"] == rec["prefill_instance"] == router[2]["fields"]["prefill"]
    assert router[1]["fields"]["decode"] == rec["decode_instance"]
    assert router[-1]["fields"]["reason"] == "length" and router[-1]["fields"]["output_tokens"] == 8
    prefill = events(stack, "prefill", "logged-ok")
    assert [x["event"] for x in prefill] == ["received", "prefill_done", "handoff_sent"]
    assert {x["instance"] for x in prefill} == {rec["prefill_instance"]}
    assert prefill[-1]["fields"]["bytes"] == int(rec["handoff_bytes"]) > 0
    decode = events(stack, "decode", "logged-ok")
    assert [x["event"] for x in decode] == ["reserved", "handoff_received", "stream_attached", "first_token",
                                            "finished"]
    assert {x["instance"] for x in decode} == {rec["decode_instance"]}
    assert decode[1]["fields"]["bytes"] == int(rec["handoff_bytes"]) and decode[-1]["fields"]["reason"] == "length"
    ts = [x["ts"] for x in router]
    assert ts == sorted(ts)

    (aborted,) = [x for x in events(stack, "router", "logged-abort") if x["event"] == "aborted"]
    assert aborted["fields"]["reason"] == "aborted by an Abort call" and aborted["fields"]["code"] == "ABORTED"
    deadline = time.monotonic() + 10  # the decode side hears of it through the router's Abort call
    while not any(x["event"] == "aborted" for x in events(stack, "decode", "logged-abort")):
        assert time.monotonic() < deadline, "the decode service did not log the abort"
        time.sleep(0.1)
    (refused,) = events(stack, "router", "logged-bad")
    assert refused["event"] == "refused" and refused["fields"]["field"] == "sampling.temperature"
    assert not events(stack, "prefill", "logged-bad") and not events(stack, "decode", "logged-bad")
    lifecycle = {"received", "placed", "prefill_done", "handoff_done", "handoff_sent", "handoff_received",
                 "first_token", "finished", "failed", "aborted", "refused", "reserved", "stream_attached"}
    for role in ("router", "prefill", "decode"):
        assert all(x["rid"] for x in service_log(stack, role) if x["event"] in lifecycle)
        assert {x["event"] for x in service_log(stack, role)} >= {"started"}


def test_kill_9_of_decode_mid_stream(process_stack):
    stack = process_stack
    stub = pb_grpc.GenerationStub(grpc.insecure_channel(stack.router_address))
    req = pb.GenerateRequest(request_id="killed-1", token_ids=pb.TokenIds(ids=list(range(3, 30))),
                             sampling=pb.SamplingParams(max_new_tokens=2000, ignore_eos=True))
    seen = 0
    with pytest.raises(grpc.RpcError) as err:
        for msg in stub.Generate(req, timeout=60):
            seen += len(msg.token_ids)
            if seen >= 3 and stack.procs["decode"].poll() is None:
                stack.procs["decode"].send_signal(signal.SIGKILL)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "decode" in err.value.details()
    rec = RequestStore(connect(stack.redis_url)).get("killed-1")
    assert rec["state"] == "failed" and "decode" in rec["error"] and "mid-stream" in rec["error"]
    assert [s for s, _ in rec["transitions"]] == ["queued", "prefilling", "transferring", "decoding", "failed"]
    times = [t for _, t in rec["transitions"]]
    assert all(a < b for a, b in zip(times, times[1:]))
    assert int(rec["output_tokens"]) >= seen >= 3
    (failed,) = [x for x in events(stack, "router", "killed-1") if x["event"] == "failed"]
    assert "mid-stream" in failed["fields"]["reason"] and failed["fields"]["code"] == "UNAVAILABLE"
    _, text = http_get(stack.http["prefill"], "/metrics")
    assert metric(text, "eyrie_kv_pages_used", cache="target") == 0  # the survivor's pool is full
    assert metric(text, "eyrie_requests_running") == 0


def test_eyrie_up_demo_within_a_minute(tmp_path):
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "services.cli", "up", "--demo", "--grpc-port", "0"],
                          capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert time.monotonic() - t0 < 60
    assert "router on" in proc.stdout and "finish_reason length" in proc.stderr


def test_client_exit_2_on_invalid_argument(process_stack):
    proc = subprocess.run([sys.executable, "-m", "services.cli", "client", "hello", "--router",
                           process_stack.router_address, "--temperature", "-1"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and "sampling.temperature" in proc.stderr


PARENT = """
import os, subprocess, sys, time
env = {**os.environ, "EYRIE_PARENT_PID": str(os.getpid())}
subprocess.Popen([sys.executable, "-m", "services.cli", "serve", "router", "--model", sys.argv[1],
                  "--redis-url", sys.argv[2]], env=env)
time.sleep(120)
"""


def test_services_exit_when_eyrie_up_is_killed(tiny_model_dir, redis_url):
    """kill -9 of ``eyrie up`` leaves no orphan: its services watch the parent and stop themselves."""
    import psutil

    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(tiny_model_dir / "target"), redis_url],
                              stdout=subprocess.PIPE, text=True)
    try:
        started = json.loads(parent.stdout.readline())  # the router's line: it is serving
        assert started["role"] == "router"
        (child,) = psutil.Process(parent.pid).children()
        parent.send_signal(signal.SIGKILL)
        parent.wait(5)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                if child.status() == psutil.STATUS_ZOMBIE:
                    break
            except psutil.NoSuchProcess:
                break
            time.sleep(0.05)
        else:
            child.kill()
            pytest.fail("the router outlived the eyrie up process that started it")
    finally:
        parent.kill()
