"""Mid-stream failover against scripted engines that compute a deterministic "model" (the next token is a
function of the whole context; a sampled request's prefill draws differently from its decode steps, as a
target-only draw differs from a verify step's): a decode stream that breaks after some tokens is placed
again, the client's tokens equal the unbroken sequence (no duplicate, no gap), the seed is carried, and
planted bugs (the failover forgets the last token it sent; the failover's prefill samples a token of its
own again) are caught."""

from __future__ import annotations

import json
import threading

import grpc
import pytest

from proto.eyrie.v1 import eyrie_pb2 as pb
from proto.eyrie.v1 import eyrie_pb2_grpc as pb_grpc
from services.common import start_grpc_server
from services.metadata import InstanceInfo
from services.router.server import RouterCore
from tests.unit.services.test_router import make_core, req


def next_token(context: list[int], draw: int = 0) -> int:
    """``draw``: 0 for greedy, else which side draws (the prefill 1, a decode step 2)."""
    return (sum(context) * 31 + len(context) + 17 * draw) % 500 + 3


PREFILL_DRAW, DECODE_DRAW = 1, 2


def truth(prompt: list[int], n: int, sampled: bool = False) -> list[int]:
    """The unbroken sequence: the prefill's first token, then the decode's."""
    ctx = list(prompt)
    for i in range(n):
        ctx.append(next_token(ctx, (PREFILL_DRAW if i == 0 else DECODE_DRAW) if sampled else 0))
    return ctx[len(prompt):]


class Handoffs:
    """What a hand-off carries to a decode instance: the context, the tokens still to generate and whether
    the request samples."""

    def __init__(self):
        self.by_decode: dict[tuple[str, str], tuple[list[int], int, bool]] = {}
        self.seeds: list[int] = []


class ModelPrefill(pb_grpc.PrefillServicer):
    def __init__(self, handoffs: Handoffs):
        self.handoffs = handoffs

    def Prefill(self, request, context):  # noqa: N802
        """The services' contract: a new request gets a first token; a resumed one (a failover) none, its
        decode goes on after the tokens the client has."""
        self.handoffs.seeds.append(request.sampling.seed)
        ctx, sampled = list(request.prompt_ids) + list(request.resume_ids), request.sampling.temperature > 0
        assert len(request.resume_logprobs) == len(request.resume_ids)
        if not request.resume_ids:
            ctx.append(next_token(ctx, PREFILL_DRAW if sampled else 0))
            yield pb.PrefillEvent(first_token=pb.FirstToken(token_id=ctx[-1], logprob=-0.5))
        self.handoffs.by_decode[(request.decode_address, request.request_id)] = (
            ctx, request.sampling.max_new_tokens - len(ctx) + len(request.prompt_ids), sampled)
        yield pb.PrefillEvent(handed_off=pb.HandedOff(bytes=1, seconds=0.001, chunks=1))

    def Abort(self, request, context):  # noqa: N802
        return pb.AbortResponse(found=False)


class ModelDecode(pb_grpc.DecodeServicer):
    """Streams the model's tokens two at a time; with ``break_after`` its streams break after that many."""

    def __init__(self, handoffs: Handoffs, break_after: int | None = None):
        self.handoffs, self.break_after, self.address = handoffs, break_after, ""

    def Stream(self, request, context):  # noqa: N802
        ctx, left, sampled = self.handoffs.by_decode[(self.address, request.request_id)]
        draw = DECODE_DRAW if sampled else 0
        sent = 0
        while left > 0:
            if self.break_after is not None and sent >= self.break_after:
                context.abort(grpc.StatusCode.UNAVAILABLE, "Socket closed")
            step = [next_token(ctx, draw)]
            ctx.append(step[0])
            if left > 1:
                step.append(next_token(ctx, draw))
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
    assert run(core, "fo-1", prompt, 20, temperature=0.7) == truth(prompt, 20, sampled=True)
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

    def forgetful(self, active, ids, params, t0, avoid, reason, resume, resume_logprobs):  # forgets the last one
        return place(self, active, ids, params, t0, avoid, reason, resume[:-1], resume_logprobs[:-1])

    monkeypatch.setattr(RouterCore, "_place", forgetful)
    got = run(core, "fo-dup", [5, 9, 11], 20)
    assert got != truth([5, 9, 11], 20)
    assert len(got) == 21 and got[:7] == truth([5, 9, 11], 7) and got[7] == got[6]  # the last one sent, twice


def test_the_failover_check_catches_a_prefill_that_samples_again(model_stack, monkeypatch):
    """The failover as it was: the prompt plus the client's tokens prefilled as a new prompt, whose prefill
    samples the next token itself. Greedy output cannot tell; a sampled request's next token is then the
    prefill's draw, not the decode step's the unbroken run made."""
    core, _ = model_stack
    place = RouterCore._place

    def samples_again(self, active, ids, params, t0, avoid, reason, resume, resume_logprobs):
        if resume:
            left = params.max_new_tokens - len(resume)
            ids, params = ids + resume, params.model_copy(update={"max_new_tokens": left})
        return place(self, active, ids, params, t0, avoid, reason, [], [])  # its first token: new, after them

    monkeypatch.setattr(RouterCore, "_place", samples_again)
    prompt = [5, 9, 11]
    assert run(core, "fo-greedy-again", prompt, 20) == truth(prompt, 20)
    got = run(core, "fo-sampled-again", prompt, 20, temperature=0.7)
    want = truth(prompt, 20, sampled=True)
    assert len(got) == 20 and got[:7] == want[:7]
    assert got != want
