"""Horizontal front-ends: two router processes (``eyrie up --routers 2``'s plan) serve the same gRPC and OpenAI
ports (SO_REUSEPORT), share one Redis and the same prefill and decode instances, and each serves requests; one
of them killed (-9), the other keeps serving every new request on the same ports."""

from __future__ import annotations

import re
import signal
import urllib.request

import grpc
import openai

from proto.eyrie.v1 import eyrie_pb2 as pb
from proto.eyrie.v1 import eyrie_pb2_grpc as pb_grpc
from services.launch import Stack, free_port
from services.metadata import EmbeddedRedis, RequestStore, connect

FINISHED = re.compile(r'^eyrie_requests_total\{[^}]*outcome="finished"[^}]*\} (\S+)$', re.M)


def finished_on(http: str) -> int:
    """Requests the router whose telemetry is at ``http`` finished (its own count: each router has its own)."""
    with urllib.request.urlopen(f"http://{http}/metrics", timeout=10) as r:
        text = r.read().decode()
    return int(sum(float(v) for v in FINISHED.findall(text)))


def generate(address: str, rid: str) -> tuple[list[int], pb.Finish | None]:
    """One request on a channel of its own (its own connection: the kernel picks the router for it)."""
    with grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)]) as ch:
        req = pb.GenerateRequest(request_id=rid, token_ids=pb.TokenIds(ids=list(range(5, 25))),
                                 sampling=pb.SamplingParams(max_new_tokens=6, ignore_eos=True))
        tokens, finish = [], None
        for msg in pb_grpc.GenerationStub(ch).Generate(req, timeout=60):
            tokens += msg.token_ids
            if msg.HasField("finish"):
                finish = msg.finish
    return tokens, finish


def test_two_routers_share_the_ports_both_serve_and_one_killed_leaves_the_other_serving(tmp_path, tiny_model_dir):
    server = EmbeddedRedis(str(tmp_path / "routers.db"))
    url = server.start()
    port, openai_port = free_port(), free_port()
    stack = Stack(str(tiny_model_dir / "target"), str(tiny_model_dir / "eagle"), url, port, openai_port,
                  extra={"page_size": 4, "chunk_size": 8}, replicas={"router": 2})
    try:
        stack.start(timeout=300)
        address = stack.router_address
        https = {name: stack.http[name] for name in ("router", "router-2")}
        want, _ = generate(address, "routers-0")
        assert len(want) == 6
        n = 1
        while not all(finished_on(h) for h in https.values()):  # new connections until each router took one
            assert n < 200, {name: finished_on(h) for name, h in https.items()}
            tokens, finish = generate(address, f"routers-{n}")
            assert tokens == want and finish.reason == "length"
            n += 1
        oai = openai.OpenAI(base_url=f"http://127.0.0.1:{openai_port}/v1", api_key="none", max_retries=0)
        text = oai.completions.create(model=oai.models.list().data[0].id, prompt=[list(range(5, 25))],
                                      max_tokens=6, extra_body={"ignore_eos": True}).choices[0]
        assert text.finish_reason == "length"

        stack.procs["router-2"].send_signal(signal.SIGKILL)
        assert stack.procs["router-2"].wait(30) == -signal.SIGKILL
        before = finished_on(https["router"])
        for k in range(10):  # every new connection now reaches the one left
            tokens, finish = generate(address, f"after-{k}")
            assert tokens == want and finish.reason == "length"
        assert finished_on(https["router"]) == before + 10
        store = RequestStore(connect(url))
        assert all(store.get(f"after-{k}")["state"] == "finished" for k in range(10))
    finally:
        stack.stop()
        server.stop()
