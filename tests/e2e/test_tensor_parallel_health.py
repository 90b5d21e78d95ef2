"""A split service whose follower rank dies goes out of service at once, and ``eyrie serve`` exits non-zero.

Without this an idle TP service with a dead rank answered /health 200 and stayed in the registry: the router kept
placing requests on it, and no supervisor (compose, ``eyrie up``) restarted it, since the process lived on.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.engine_service import wait_until
from services.followers import Leader
from services.metadata import Registry, connect
from tests.e2e.conftest import start_stack
from tests.e2e.test_operations import http_get


def test_a_dead_follower_takes_the_service_out_of_health_and_the_registry(redis_url, oracle_model_dir):
    stack = start_stack(redis_url, oracle_model_dir, None, page_size=4, chunk_size=8, max_context=64, max_running=4,
                        transport="grpc-stream", decode_extra={"tensor_parallel": 2})
    decode = stack.decodes[0]
    leader = decode.engine_loop.engine
    try:
        assert isinstance(leader, Leader)
        assert stack.generate([5, 17, 33], max_new_tokens=4, ignore_eos=True)[1].reason == "length"
        registry = Registry(connect(stack.redis_url))
        assert decode.instance_id in [i.instance_id for i in registry.instances("decode")]
        assert http_get(decode.http_address, "/health")[0] == 200
        leader.ranks[0].kill()  # the follower dies while the service is idle
        assert wait_until(decode.extra["fatal"].is_set, time.monotonic() + 15)
        code, body = http_get(decode.http_address, "/health")
        assert code == 503, body
        health = json.loads(body)
        assert health["status"] == "not_serving" and "follower rank 1" in health["reason"], health
        check = health_pb2_grpc.HealthStub(grpc.insecure_channel(decode.grpc_address)).Check(
            health_pb2.HealthCheckRequest(), timeout=5)
        assert check.status == health_pb2.HealthCheckResponse.NOT_SERVING
        assert decode.instance_id not in [i.instance_id for i in registry.instances("decode")]
        assert "tensor_parallel_group_broken" in http_get(decode.http_address, "/metrics")[1]
    finally:
        stack.stop()


def test_eyrie_serve_exits_1_with_one_line_when_a_follower_dies(redis_url, oracle_model_dir, tmp_path):
    cmd = [sys.executable, "-m", "services.cli", "serve", "decode", "--model", str(oracle_model_dir / "target"),
           "--tensor-parallel", "2", "--redis-url", redis_url.replace("db=0", "db=15"), "--grpc-port", "0",
           "--http-port", "0", "--page-size", "4", "--max-context", "64", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=open(tmp_path / "stderr", "w"), text=True)
    try:
        ready = json.loads(proc.stdout.readline())  # the one line a started service prints
        assert ready["role"] == "decode"
        followers = [c for c in psutil.Process(proc.pid).children()  # (beside: resource tracker, shm manager)
                     if "multiprocessing.spawn" in " ".join(c.cmdline())]
        assert len(followers) == 1, [c.cmdline() for c in followers]
        followers[0].kill()
        assert proc.wait(30) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
            pytest.fail("eyrie serve did not exit after its follower died")
    # (the multiprocessing resource tracker, which shares the stream, may warn after it)
    said = [line for line in (tmp_path / "stderr").read_text().splitlines() if line.startswith("eyrie serve")]
    assert len(said) == 1 and said[0].startswith(
        "eyrie serve decode: the tensor-parallel group is broken: follower rank 1"), said
