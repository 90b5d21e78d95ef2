"""A service's life as an operator sees it: SIGTERM drains (health 503, new requests refused, the stream in
flight finishes, exit 0); ``eyrie up`` restarts a service that dies and gives up after ``--max-restarts``;
``--config x.yaml`` is honoured; ``eyrie up --demo`` prints the demo's text on stdout, no log lines on the
terminal, and leaves no temporary model behind."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest

from proto.eyrie.v1 import eyrie_pb2 as pb
from proto.eyrie.v1 import eyrie_pb2_grpc as pb_grpc
from services.faults import HOLD_FILE_ENV
from services.launch import Stack, free_port
from tests.e2e.conftest import emptied
from tests.e2e.test_up import Up, generate, gone
from tests.polling import poll


def health(addr: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"http://{addr}/health", timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def draining(addr: str) -> bool:
    code, body = health(addr)
    return code == 503 and body["status"] == "draining"


def log_events(stack: Stack, role: str, event: str) -> list[dict]:
    lines = (stack.log_dir / f"{role}.log").read_text().splitlines()
    return [obj for obj in map(json.loads, lines) if obj["event"] == event]


def test_sigterm_drains_the_stream_in_flight_then_every_service_exits_0(tmp_path, tiny_model_dir):
    # The decode engine holds the stream two tokens in (services/faults.py) until the drain has been seen: on a
    # fast machine the 40 tokens could otherwise all be out, and the router gone, before the signal lands.
    gate = tmp_path / "hold-decode"
    gate.touch()
    # The drain's bound is generous: it runs from the signal, and on a loaded machine the checks below and the 38
    # tokens after the gate took past the default 30 s (a stress run: the decode ended the relay one token short).
    stack = Stack(str(tiny_model_dir / "target"), str(tiny_model_dir / "eagle"), None, free_port(),
                  extra={"page_size": 4, "chunk_size": 8}, log_dir=tmp_path / "logs",
                  env={HOLD_FILE_ENV: str(gate)}, common={"drain_timeout_s": 300.0}, drain_timeout_s=300.0).start()
    try:
        stub = pb_grpc.GenerationStub(grpc.insecure_channel(stack.router_address))
        req = pb.GenerateRequest(request_id="drained", token_ids=pb.TokenIds(ids=list(range(3, 30))),
                                 sampling=pb.SamplingParams(max_new_tokens=40, ignore_eos=True))
        tokens, finish = [], None
        for msg in stub.Generate(req, timeout=120):
            if not tokens:  # the first tokens are out: every service is told to stop
                for proc in stack.procs.values():
                    proc.send_signal(signal.SIGTERM)
                # the signal is handled in a moment (a loaded CI machine: slower)
                poll(lambda: draining(stack.http["router"]), 60, "the router did not say it drains")
                with pytest.raises(grpc.RpcError) as refused:
                    generate(stack.router_address, "after-sigterm")
                assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
                poll(Path(f"{gate}.held").exists, 60, "the decode engine never held the stream")
                assert not [p for p in stack.procs.values() if p.poll() is not None]  # draining, not gone
                gate.unlink()  # the stream in flight goes on to its end
            tokens += msg.token_ids
            if msg.HasField("finish"):
                finish = msg.finish
        assert finish is not None and finish.reason == "length" and len(tokens) == 40
        assert {role: proc.wait(60) for role, proc in stack.procs.items()} == {"prefill": 0, "decode": 0, "router": 0}
        (stopped,) = log_events(stack, "decode", "stopped")
        assert stopped["fields"]["drained"] is True
        assert log_events(stack, "decode", "finished")[-1]["rid"] == "drained"
    finally:
        stack.stop()


def test_up_restarts_a_killed_decode_then_gives_up_after_max_restarts(tmp_path, tiny_model_dir):
    up = Up(tmp_path, tiny_model_dir, "--max-restarts", "1", "--openai-port", "0")
    try:
        router, _ = up.ready()
        for words in ("prefill on 127.0.0.1:", "decode on 127.0.0.1:", "OpenAI http://127.0.0.1:", "health http://"):
            assert words in up.ready_line, up.ready_line

        def decode():
            (proc,) = [p for p in up.services() if p.cmdline()[p.cmdline().index("serve") + 1] == "decode"]
            return proc

        first = decode()
        first.kill()
        deadline = time.monotonic() + 120
        while "eyrie up: decode restarted" not in up.stderr():
            assert time.monotonic() < deadline and up.proc.poll() is None, up.stderr()[-3000:]
            time.sleep(0.2)
        assert "decode exited with status -9; restarting it in 1s (restart 1 of 1)" in up.stderr()
        assert decode().pid != first.pid
        assert generate(router, "after-restart").reason == "length"

        services = up.services()
        decode().kill()
        assert up.proc.wait(90) == 1, up.stderr()[-3000:]
        assert "eyrie up: error: decode exited with status -9 after 1 restarts; stopping the stack" in up.stderr()
        assert all(gone(p) for p in services)
    finally:
        up.kill()


def test_serve_honours_a_yaml_config_file(tmp_path, tiny_model_dir, redis_url):
    port = free_port()
    cfg = tmp_path / "router.yaml"
    cfg.write_text(f"model: {tiny_model_dir / 'target'}\nredis_url: '{redis_url}'\ngrpc-port: {port}\n"
                   f"model_name: from-yaml\nlog_level: warning\n")
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", "serve", "router", "--config", str(cfg)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "EYRIE_API_KEY": ""})
    try:
        started = json.loads(proc.stdout.readline())
        assert started["grpc"] == f"127.0.0.1:{port}"
        info = pb_grpc.GenerationStub(grpc.insecure_channel(started["grpc"])).GetModelInfo(pb.ModelInfoRequest(),
                                                                                           timeout=10)
        assert info.model == "from-yaml"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert proc.stderr.read() == ""  # log_level: warning from the file: no INFO line
    finally:
        proc.kill()


def test_up_demo_prints_text_on_stdout_no_log_lines_and_removes_its_model():
    tmp = Path(tempfile.mkdtemp(prefix="eyrie-demo-"))  # short: torch's shared-memory manager puts a socket here
    try:
        env = {**os.environ, "TMPDIR": str(tmp), "EYRIE_API_KEY": ""}
        proc = subprocess.run([sys.executable, "-m", "services.cli", "up", "--demo", "--grpc-port", "0"],
                              capture_output=True, text=True, timeout=120, env=env)
        assert proc.returncode == 0, proc.stderr[-2000:]
        out = proc.stdout.splitlines()
        assert out[0].startswith("eyrie up: router on ") and len(out) >= 2  # the ready line, then the demo's text
        assert not any(line.lstrip().startswith("{") for line in proc.stdout.splitlines() + proc.stderr.splitlines())
        assert "finish_reason length" in proc.stderr
        assert emptied(tmp), "eyrie up left its temporary model behind"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
