"""An engine service runs one warm-up request before it says it is ready (``services/warmup.py``): while it
runs, /health answers 503 ``warming_up``, gRPC is not serving and Redis does not list the instance; when it
fails (as a prefill whose cuBLAS cannot allocate fails every step), start-up stops with one line naming the
failure and the instance never turns ready. A warm-up that succeeds leaves the pools full and /metrics
without its tokens."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from services.decode import server as decode_server
from services.launch import free_port
from services.metadata import Registry, connect
from services.prefill import server as prefill_server
from services.settings import DecodeSettings, PrefillSettings
from services.warmup import CPU_WARMUP_TOKENS, warm_up
from shared.config import EngineConfig, SpecConfig
from shared.engine import Engine
from shared.request import RequestError


def http_get(addr: str, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://{addr}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def grpc_serving(address: str) -> bool:
    try:
        reply = health_pb2_grpc.HealthStub(grpc.insecure_channel(address)).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=2)
    except grpc.RpcError:
        return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def registered(redis_url: str) -> set[str]:
    return {i.instance_id for i in Registry(connect(redis_url)).instances()}


def test_a_failing_warm_up_keeps_the_service_out_of_service_and_stops_its_start(tiny_model_dir, redis_url):
    engine = Engine(str(tiny_model_dir / "target"), str(tiny_model_dir / "eagle3"),
                    EngineConfig(page_size=4, max_context=64, spec=SpecConfig(topk=1, steps=3)), role="prefill")
    stepping, gate = threading.Event(), threading.Event()

    def failing_step():
        stepping.set()
        assert gate.wait(30)
        raise RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`\nmore")

    engine.step = failing_step
    http, grpc_port = free_port(), free_port()
    settings = PrefillSettings(model=str(tiny_model_dir / "target"), redis_url=redis_url, http_port=http,
                               grpc_port=grpc_port, page_size=4, max_context=64, instance_id="prefill-warmup")
    errors: list[BaseException] = []

    def start():
        try:
            prefill_server.start_prefill(settings, engine=engine).stop(0.5)
        except BaseException as e:  # noqa: BLE001 (the test reads it)
            errors.append(e)

    t = threading.Thread(target=start)
    t.start()
    try:
        assert stepping.wait(60)
        code, body = http_get(f"127.0.0.1:{http}", "/health")
        assert code == 503 and json.loads(body)["status"] == "warming_up"
        assert not grpc_serving(f"127.0.0.1:{grpc_port}")
        assert "prefill-warmup" not in registered(redis_url)
    finally:
        gate.set()
        t.join(60)
    (error,) = errors
    assert isinstance(error, RequestError) and error.field == "warmup"
    assert "CUBLAS_STATUS_ALLOC_FAILED" in str(error) and "\n" not in str(error)
    assert "prefill-warmup" not in registered(redis_url) and not grpc_serving(f"127.0.0.1:{grpc_port}")
    with pytest.raises(OSError):  # its telemetry is stopped too: nothing answers for it
        urllib.request.urlopen(f"http://127.0.0.1:{http}/health", timeout=2)
    assert engine.is_idle_and_clean()  # the warm-up request's pages went back


@pytest.mark.parametrize("cache", [False, True], ids=["no-cache", "prefix-cache"])
@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_warm_up_runs_a_short_prompt_off_a_gpu_and_gives_every_page_back(tiny_model_dir, role, cache):
    engine = Engine(str(tiny_model_dir / "target"), str(tiny_model_dir / "eagle3"),
                    EngineConfig(page_size=4, max_context=128, chunk_size=48, spec=SpecConfig(topk=1, steps=3),
                                 prefix_cache=cache), role=role)
    facts = warm_up(engine)
    assert facts["prompt_tokens"] == CPU_WARMUP_TOKENS  # on a GPU: the 48-token chunk
    assert facts["output_tokens"] == (1 if role == "prefill" else 4)
    assert engine.is_idle_and_clean() and not engine.requests
    if cache:  # the made-up prompt's pages are not kept: nothing published, nothing to evict later
        assert engine.prefix_summary(64).digests == () and engine.flush_prefix_cache() == 0


def test_a_served_decode_instance_counts_none_of_its_warm_up_in_metrics(tiny_model_dir, redis_url):
    settings = DecodeSettings(model=str(tiny_model_dir / "target"), draft=str(tiny_model_dir / "eagle3"),
                              redis_url=redis_url, page_size=4, max_context=64, instance_id="decode-warm")
    handle = decode_server.start_decode(settings)
    try:
        assert "decode-warm" in registered(redis_url)
        code, text = http_get(handle.http_address, "/metrics")
        samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
        assert code == 200 and samples["eyrie_spec_decode_num_drafts_total"] == 0, samples
        assert samples["eyrie_generation_tokens_total"] == 0
    finally:
        handle.stop(0.5)
