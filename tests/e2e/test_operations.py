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
from services.metadata import RequestStore, connect
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
    # One running request at a time on the prefill side: a second one waits (the queued gauge can move).
    # The fixed chain of 3: every draft offers 3 positions (test_the_decode_service_counts_speculation_by_token).
    s = start_stack(redis_url, tiny_model_dir, "eagle", page_size=4, chunk_size=8, prefill_extra=dict(max_running=1),
                    spec_topk=1, spec_policy="fixed")
    yield s
    s.stop()


def scrape(handle) -> str:
    code, text = http_get(handle.http_address, "/metrics")
    assert code == 200
    return text


def wait_for(condition, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def hold(loop, timeout: float = 30.0) -> threading.Event:
    """Keep ``loop``'s engine thread busy until the returned event is set."""
    gate, entered = threading.Event(), threading.Event()
    loop.call(lambda engine: (entered.set(), gate.wait(timeout)))
    assert entered.wait(5)
    return gate


def test_the_decode_service_counts_speculation_by_token(stack):
    """The vLLM-shaped counters on the decode service's /metrics move with a request's verify steps
    (each draft offers the same number of positions; accepted tokens are the per-position counts
    summed); nothing verifies on the router or the prefill side."""
    router, prefill, decode = stack.router, stack.prefills[0], stack.decodes[0]
    names = ("eyrie_spec_decode_num_drafts_total", "eyrie_spec_decode_num_draft_tokens_total",
             "eyrie_spec_decode_num_accepted_tokens_total", "eyrie_spec_decode_num_accepted_tokens_per_pos_total")
    before = [metric(scrape(decode), n) for n in names]
    stack.generate(list(range(30, 50)), max_new_tokens=12, ignore_eos=True)
    drafts, draft_tokens, accepted, per_pos = (a - b for a, b in zip([metric(scrape(decode), n) for n in names],
                                                                     before))
    assert drafts >= 1 and draft_tokens >= drafts and draft_tokens % drafts == 0
    assert accepted == per_pos and 0 <= accepted <= draft_tokens
    for handle in (router, prefill):
        assert metric(scrape(handle), "eyrie_spec_decode_num_drafts_total") == 0


def test_metrics_parse_and_move(stack):
    """Under real traffic every family moves where it should: requests and errors by kind, TTFT, inter-token
    latency, latency by stage, hand-off bytes and seconds, accept length, draft and verify time."""
    router, prefill, decode = stack.router, stack.prefills[0], stack.decodes[0]
    before = {h.instance_id: scrape(h) for h in (router, prefill, decode)}

    def moved(handle, name, **labels) -> float:
        return metric(scrape(handle), name, **labels) - metric(before[handle.instance_id], name, **labels)

    stack.generate(list(range(5, 25)), max_new_tokens=6, ignore_eos=True)
    assert moved(router, "eyrie_requests_total", outcome="finished") == 1
    assert moved(router, "eyrie_time_to_first_token_seconds_count") == 1
    for stage in ("placement", "prefill", "handoff", "decode", "total"):
        assert moved(router, "eyrie_request_stage_seconds_count", stage=stage) == 1, stage
        assert moved(router, "eyrie_request_stage_seconds_sum", stage=stage) > 0, stage
    for name in ("eyrie_spec_decode_draft_seconds", "eyrie_spec_decode_verify_seconds",
                 "eyrie_spec_decode_accept_length", "eyrie_spec_decode_accept_rate"):
        assert moved(router, f"{name}_count") == 1 and moved(decode, f"{name}_count") == 1, name
    assert moved(router, "eyrie_spec_decode_draft_seconds_sum") > 0
    assert moved(decode, "eyrie_spec_decode_verify_seconds_sum") > 0
    assert moved(prefill, "eyrie_request_stage_seconds_count", stage="prefill") == 1
    assert moved(prefill, "eyrie_request_stage_seconds_count", stage="handoff") == 1
    assert moved(prefill, "eyrie_time_to_first_token_seconds_count") == 1
    assert moved(prefill, "eyrie_handoff_bytes_total") > 0
    assert moved(prefill, "eyrie_requests_total", outcome="handed_off") == 1
    for handle in (prefill, decode):  # both ends of the hand-off time it
        assert moved(handle, "eyrie_handoff_seconds_count") == 1 and moved(handle, "eyrie_handoff_seconds_sum") > 0
    assert moved(decode, "eyrie_handoff_bytes_total") == moved(prefill, "eyrie_handoff_bytes_total")
    assert moved(decode, "eyrie_inter_token_latency_seconds_count") >= 1  # per streamed batch after the first
    assert moved(decode, "eyrie_inter_token_latency_seconds_sum") > 0
    assert moved(decode, "eyrie_requests_total", outcome="length") == 1
    assert metric(scrape(decode), "eyrie_kv_pages_capacity", cache="target") > 0
    assert metric(scrape(decode), "eyrie_kv_pages_used", cache="draft0") == 0  # nothing running now

    # Errors by kind: a bad request, a refused duplicate id, an aborted request.
    with pytest.raises(grpc.RpcError):
        stack.generate([5, 6], max_new_tokens=2, temperature=-1)
    req = pb.GenerateRequest(request_id="metrics-dup", token_ids=pb.TokenIds(ids=[5, 6, 7]),
                             sampling=pb.SamplingParams(max_new_tokens=2))
    list(stack.stub.Generate(req, timeout=30))
    with pytest.raises(grpc.RpcError):
        list(stack.stub.Generate(req, timeout=30))
    assert moved(router, "eyrie_errors_total", kind="invalid_argument") == 2

    # Gauges: a long request runs on the decode instance (running 1, pages used), then is aborted.
    long = pb.GenerateRequest(request_id="metrics-long", token_ids=pb.TokenIds(ids=list(range(5, 25))),
                              sampling=pb.SamplingParams(max_new_tokens=2000, ignore_eos=True))
    with pytest.raises(grpc.RpcError) as err:
        for i, _ in enumerate(stack.stub.Generate(long, timeout=60)):
            if i == 2:
                wait_for(lambda: metric(scrape(decode), "eyrie_num_requests_running") == 1, what="decode running 1")
                assert metric(scrape(decode), "eyrie_kv_pages_used", cache="target") > 0
                assert stack.stub.Abort(pb.AbortRequest(request_id="metrics-long"), timeout=10).found
    assert err.value.code() == grpc.StatusCode.ABORTED
    assert moved(router, "eyrie_errors_total", kind="aborted") == 1
    assert moved(router, "eyrie_requests_total", outcome="aborted") == 1
    wait_for(lambda: metric(scrape(decode), "eyrie_num_requests_running") == 0, what="decode running 0")
    assert metric(scrape(decode), "eyrie_kv_pages_used", cache="target") == 0

    # Queued: the decode's engine thread is held, so the first request's hand-off waits for its reservation and
    # keeps the prefill's one running slot; the second waits for admission there.
    gate = hold(decode.engine_loop)
    results = []
    threads = [threading.Thread(target=lambda i=i: results.append(
        stack.generate(list(range(5 + i, 25)), max_new_tokens=4, ignore_eos=True)[1].reason)) for i in range(2)]
    try:
        for t in threads:
            t.start()
        wait_for(lambda: (metric(scrape(prefill), "eyrie_num_requests_running"),
                          metric(scrape(prefill), "eyrie_num_requests_waiting")) == (1, 1), what="1 running, 1 queued")
    finally:
        gate.set()
        for t in threads:
            t.join(60)
    assert results == ["length", "length"]
    wait_for(lambda: metric(scrape(prefill), "eyrie_num_requests_waiting") == 0 == metric(scrape(prefill),
                                                                                      "eyrie_num_requests_running"))
    assert stack.wait_clean()


def test_health_is_503_capturing_while_graphs_are_captured(redis_url, tiny_model_dir, monkeypatch):
    """With cuda_graph on, an engine that can capture ahead does so before the service serves: /health says
    503 capturing (after loading) until it is done, gRPC health is not up yet, and no registry entry exists."""
    import services.decode.server as decode_server
    import services.followers as followers  # where the services build their engine (start_engine)
    from services.metadata import Registry
    from services.settings import DecodeSettings

    real_engine = followers.Engine
    gate, capturing = threading.Event(), threading.Event()

    def engine_that_captures(*args, **kwargs):
        engine = real_engine(*args, **kwargs)

        def capture_graphs():
            capturing.set()
            assert gate.wait(10)

        engine.capture_graphs = capture_graphs
        return engine

    monkeypatch.setattr(followers, "Engine", engine_that_captures)
    port = free_port()
    settings = DecodeSettings(model=str(tiny_model_dir / "target"), redis_url=redis_url, http_port=port,
                              page_size=4, max_context=64, cuda_graph=True, instance_id="decode-capturing")
    handles = []
    t = threading.Thread(target=lambda: handles.append(decode_server.start_decode(settings)))
    t.start()
    try:
        assert capturing.wait(30)
        code, body = http_get(f"127.0.0.1:{port}", "/health")
        assert code == 503 and json.loads(body)["status"] == "capturing"
        assert "decode-capturing" not in {i.instance_id for i in Registry(connect(redis_url)).instances()}
        gate.set()
        t.join(30)
        assert http_get(f"127.0.0.1:{port}", "/health")[0] == 200
        assert "decode-capturing" in {i.instance_id for i in Registry(connect(redis_url)).instances()}
    finally:
        gate.set()
        t.join(30)
        for h in handles:
            h.stop(0.5)
    settings.cuda_graph = False  # graphs off: the engine's capture is never called, nor the state entered
    capturing.clear()
    handle = decode_server.start_decode(settings)
    try:
        assert not capturing.is_set() and http_get(f"127.0.0.1:{port}", "/health")[0] == 200
    finally:
        handle.stop(0.5)


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
    import services.followers as followers  # where the services build their engine (start_engine)
    import services.prefill.server as prefill_server
    from services.settings import PrefillSettings

    real_engine = followers.Engine
    gate, loading = threading.Event(), threading.Event()

    def slow_engine(*args, **kwargs):
        loading.set()
        assert gate.wait(10)
        return real_engine(*args, **kwargs)

    monkeypatch.setattr(followers, "Engine", slow_engine)  # where the services build their engine
    port = free_port()
    settings = PrefillSettings(model=str(tiny_model_dir / "target"), redis_url=redis_url, http_port=port,
                               max_context=64)
    handles = []
    t = threading.Thread(target=lambda: handles.append(prefill_server.start_prefill(settings)))
    t.start()
    try:
        assert loading.wait(30)  # the engine is loading now (held here)
        code, body = http_get(f"127.0.0.1:{port}", "/health")
        assert code == 503 and json.loads(body)["status"] == "loading"
        gate.set()
        t.join(30)
        assert http_get(f"127.0.0.1:{port}", "/health")[0] == 200
    finally:
        gate.set()
        t.join(30)
        for h in handles:
            h.stop(0.5)


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


def http(addr: str, path: str, key: str | None = None, method: str = "GET") -> tuple[int, object, str]:
    """(status, headers (case-insensitive, as HTTP's are), body)."""
    req = urllib.request.Request(f"http://{addr}{path}", method=method, data=b"{}" if method == "POST" else None,
                                 headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, r.headers, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read().decode()


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
    # The router waits 3 s, not 10, for a decode instance to take over a stream whose decode was killed
    # (test_kill_9_of_decode_mid_stream: none can, it fails either way; 10 s of it were idle)
    stack = Stack(str(tiny_model_dir / "target"), str(tiny_model_dir / "mtp"), None, free_port(),
                  extra={"page_size": 4, "chunk_size": 8}, router_extra={"placement_timeout_s": 3.0},
                  log_dir=tmp_path_factory.mktemp("logs")).start()
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
    # The first token goes to the client once the decode instance holds the request, before its hand-off ends.
    assert [x["event"] for x in router] == ["received", "placed", "prefill_done", "first_token", "handoff_done",
                                            "finished"]
    assert router[1]["fields"]["prefill"] == rec["prefill_instance"] == router[2]["fields"]["prefill"]
    assert router[1]["fields"]["decode"] == rec["decode_instance"]
    assert router[-1]["fields"]["reason"] == "length" and router[-1]["fields"]["output_tokens"] == 8
    prefill = events(stack, "prefill", "logged-ok")
    # Two threads log the last two: the call's handler once it has the first token, the hand-off's sender once the
    # decode side acknowledged; a short prompt's hand-off can end before the handler runs again (a loaded host).
    assert prefill[0]["event"] == "received"
    assert sorted(x["event"] for x in prefill[1:]) == ["handoff_sent", "prefill_done"]
    assert {x["instance"] for x in prefill} == {rec["prefill_instance"]}
    (sent,) = [x for x in prefill if x["event"] == "handoff_sent"]
    assert sent["fields"]["bytes"] == int(rec["handoff_bytes"]) > 0
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
    assert metric(text, "eyrie_num_requests_running") == 0


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
