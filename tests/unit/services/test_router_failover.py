"""Mid-stream failover against scripted engines that compute a deterministic "model" (the next token is a
function of the whole context): a decode stream that breaks after some tokens is placed again, the
client's tokens equal the unbroken sequence (no duplicate, no gap), the seed is carried, and a planted bug
(the failover forgets the last token it sent) is caught."""

from __future__ import annotations

import json
import threading

import grpc
import pytest

from proto.eyrie.v1 import eyrie_pb2 as pb
from proto.eyrie.v1 import eyrie_pb2_grpc as pb_grpc
from services.common import start_grpc_server
from services.router.server import RouterCore
from shared.metadata import InstanceInfo
from tests.unit.services.test_router import make_core, req


def next_token(context: list[int]) -> int:
    return (sum(context) * 31 + len(context)) % 500 + 3


def truth(prompt: list[int], n: int) -> list[int]:
    ctx = list(prompt)
    for _ in range(n):
        ctx.append(next_token(ctx))
    return ctx[len(prompt):]


class Handoffs:
    """What a hand-off carries to a decode instance: the context and the tokens still to generate."""

    def __init__(self):
        self.by_decode: dict[tuple[str, str], tuple[list[int], int]] = {}
        self.seeds: list[int] = []


class ModelPrefill(pb_grpc.PrefillServicer):
    def __init__(self, handoffs: Handoffs):
        self.handoffs = handoffs

    def Prefill(self, request, context):  # noqa: N802
        self.handoffs.seeds.append(request.sampling.seed)
        ctx = list(request.prompt_ids)
        first = next_token(ctx)
        yield pb.PrefillEvent(first_token=pb.FirstToken(token_id=first, logprob=-0.5))
        self.handoffs.by_decode[(request.decode_address, request.request_id)] = (
            ctx + [first], request.sampling.max_new_tokens - 1)
        yield pb.PrefillEvent(handed_off=pb.HandedOff(bytes=1, seconds=0.001, chunks=1))

    def Abort(self, request, context):  # noqa: N802
        return pb.AbortResponse(found=False)


class ModelDecode(pb_grpc.DecodeServicer):
    """Streams the model's tokens two at a time; with ``break_after`` its streams break after that many."""

    def __init__(self, handoffs: Handoffs, break_after: int | None = None):
        self.handoffs, self.break_after, self.address = handoffs, break_after, ""

    def Stream(self, request, context):  # noqa: N802
        ctx, left = self.handoffs.by_decode[(self.address, request.request_id)]
        sent = 0
        while left > 0:
            if self.break_after is not None and sent >= self.break_after:
                context.abort(grpc.StatusCode.UNAVAILABLE, "Socket closed")
            step = [next_token(ctx)]
            ctx.append(step[0])
            if left > 1:
                step.append(next_token(ctx))
                ctx.append(step[1])
            left -= len(step)
            sent += len(step)
            yield pb.GenerateResponse(request_id=request.request_id, token_ids=step, logprobs=[-0.1] * len(step),
                                      finish=pb.Finish(reason="length") if left == 0 else None)

    def Abort(self, request, context):  # noqa: N802
        return pb.AbortResponse(found=False)


@pytest.fixture
def model_stack(redis_url, tiny_model_dir):
    core = make_core(redis_url, tiny_model_dir, max_context=512)
    handoffs = Handoffs()
    servers = []

    def add(role: str, instance_id: str, servicer, load: int) -> None:
        add_fn = pb_grpc.add_PrefillServicer_to_server if role == "prefill" else pb_grpc.add_DecodeServicer_to_server
        server, port, _ = start_grpc_server("127.0.0.1", 0, [(add_fn, servicer)], [])
        servers.append(server)
        servicer.address = f"127.0.0.1:{port}"
        core.registry.register(InstanceInfo(instance_id, role, servicer.address, outstanding_tokens=load, beat=1))

    add("prefill", "p", ModelPrefill(handoffs), 0)
    add("decode", "breaks", ModelDecode(handoffs, break_after=5), 0)  # least loaded: chosen first
    add("decode", "steady", ModelDecode(handoffs), 10_000)
    yield core, handoffs
    core.close()
    for s in servers:
        s.stop(0)


def run(core: RouterCore, rid: str, prompt: list[int], n: int, **sampling) -> list[int]:
    return [t for m in core.generate(req(prompt=prompt, rid=rid, max_new_tokens=n, **sampling)) for t in m.token_ids]


def test_a_broken_decode_stream_fails_over_without_duplicate_or_gap(model_stack):
    core, handoffs = model_stack
    prompt = [5, 9, 11]
    assert run(core, "fo-1", prompt, 20, temperature=0.7) == truth(prompt, 20)
    rec = core.store.get("fo-1")
    assert rec["state"] == "finished" and rec["output_tokens"] == "20"
    placements = json.loads(rec["placements"])
    assert [p["decode"] for p in placements] == ["breaks", "steady"]
    assert placements[1]["reason"].startswith("failover: decode instance breaks failed mid-stream after 7 tokens")
    assert len(set(handoffs.seeds)) == 1 and handoffs.seeds[0] != 0  # the same seed, fixed by the router


def test_requests_fail_over_concurrently(model_stack):
    core, _ = model_stack
    results = {}

    def one(i: int) -> None:
        results[i] = run(core, f"fo-c{i}", [i + 3, 7], 16)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(results[i] == truth([i + 3, 7], 16) for i in range(6)), results


def test_the_failover_check_catches_a_planted_duplicate(model_stack, monkeypatch):
    core, _ = model_stack
    place = RouterCore._place

    def forgetful(self, active, ids, params, t0, avoid, reason):  # forgets the last token it sent
        if reason.startswith("failover"):
            ids = ids[:-1]
            params = params.model_copy(update={"max_new_tokens": params.max_new_tokens + 1})
        return place(self, active, ids, params, t0, avoid, reason)

    monkeypatch.setattr(RouterCore, "_place", forgetful)
    got = run(core, "fo-dup", [5, 9, 11], 20)
    assert got != truth([5, 9, 11], 20)
    assert len(got) == 21 and got[:7] == truth([5, 9, 11], 7) and got[7] == got[6]  # the last one sent, twice
