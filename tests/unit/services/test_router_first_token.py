"""The first token reaches the client as soon as the prefill instance says the decode instance holds the
request (``FirstToken.decode_reserved``), while the hand-off is still under way; a hand-off that fails after
that is a failover: placed again with the token the client has (no duplicate, no gap), avoiding the decode
instance only when the decode side broke."""

from __future__ import annotations

import json
import threading

import grpc
import pytest

from proto.eyrie.v1 import eyrie_pb2 as pb
from proto.eyrie.v1 import eyrie_pb2_grpc as pb_grpc
from services.common import start_grpc_server
from services.metadata import InstanceInfo
from services.router.server import MAX_FAILOVERS
from tests.polling import poll
from tests.unit.services.test_router import make_core, req
from tests.unit.services.test_router_failover import Handoffs, ModelDecode, next_token, truth


class ReservedPrefill(pb_grpc.PrefillServicer):
    """Sends the first token with ``decode_reserved``, then waits for ``go`` before it reports the hand-off.
    ``breaks``: how the first ``len(breaks)`` hand-offs end instead ("decode": the decode side unreachable,
    "prefill": the call breaks on the prefill side)."""

    def __init__(self, handoffs: Handoffs, breaks: list[str] = ()):
        self.handoffs, self.breaks = handoffs, list(breaks)
        self.go = threading.Event()
        self.calls: list[tuple[str, list[int]]] = []  # (decode address, prompt) per call

    def Prefill(self, request, context):  # noqa: N802
        ctx = list(request.prompt_ids) + list(request.resume_ids)  # a failover's: the client's tokens too
        self.calls.append((request.decode_address, list(ctx)))
        if not request.resume_ids:  # a new request's first token, sent while the hand-off goes on
            ctx.append(next_token(ctx))
            yield pb.PrefillEvent(first_token=pb.FirstToken(token_id=ctx[-1], logprob=-0.5, decode_reserved=True))
            assert self.go.wait(10)
        if self.breaks:
            kind = self.breaks.pop(0)
            named = request.decode_address if kind == "decode" else "the prefill's own worker"
            context.abort(grpc.StatusCode.UNAVAILABLE, f"hand-off to {named} failed: connection reset")
        self.handoffs.by_decode[(request.decode_address, request.request_id)] = (
            ctx, request.sampling.max_new_tokens - len(ctx) + len(request.prompt_ids), False)
        yield pb.PrefillEvent(handed_off=pb.HandedOff(bytes=1, seconds=0.001, chunks=1))

    def Abort(self, request, context):  # noqa: N802
        return pb.AbortResponse(found=False)


@pytest.fixture
def stack(redis_url, tiny_model_dir):
    """(core, handoffs, add): ``add(role, id, servicer, load)`` serves and registers an instance."""
    core = make_core(redis_url, tiny_model_dir, max_context=512)
    handoffs, servers = Handoffs(), []

    def add(role: str, instance_id: str, servicer, load: int = 0):
        add_fn = pb_grpc.add_PrefillServicer_to_server if role == "prefill" else pb_grpc.add_DecodeServicer_to_server
        server, port, _ = start_grpc_server("127.0.0.1", 0, [(add_fn, servicer)], [])
        servers.append(server)
        servicer.address = f"127.0.0.1:{port}"
        core.registry.register(InstanceInfo(instance_id, role, servicer.address, outstanding_tokens=load, beat=1))
        return servicer

    yield core, handoffs, add
    core.close()
    for s in servers:
        s.stop(0)


def test_the_first_token_reaches_the_client_while_the_hand_off_is_under_way(stack):
    core, handoffs, add = stack
    prefill = add("prefill", "p", ReservedPrefill(handoffs))
    add("decode", "d", ModelDecode(handoffs))
    prompt = [5, 9, 11]
    gen = core.generate(req(prompt=prompt, rid="early", max_new_tokens=6))
    first = next(gen)  # the prefill holds its hand-off back until `go`: this cannot wait for it
    assert list(first.token_ids) == truth(prompt, 1) and not prefill.go.is_set()
    # The walk's non-terminal transitions are asked for, not awaited (the first token does not wait on Redis): the
    # record shows the transfer within a batch's round trip, while the hand-off is still held back
    poll(lambda: [s for s, _ in core.store.get("early")["transitions"]] == ["queued", "prefilling", "transferring"],
         30, "the record never showed the transfer under way")
    assert not prefill.go.is_set()
    prefill.go.set()
    rest = [t for m in gen for t in m.token_ids]
    assert list(first.token_ids) + rest == truth(prompt, 6)
    rec = core.store.get("early")
    assert [s for s, _ in rec["transitions"]] == ["queued", "prefilling", "transferring", "decoding", "finished"]
    assert rec["handoff_bytes"] == "1" and rec["output_tokens"] == "6"


@pytest.mark.parametrize("side", ["decode", "prefill"])
def test_a_hand_off_failing_after_the_first_token_is_placed_again_with_it(stack, side):
    core, handoffs, add = stack
    prefill = add("prefill", "p", ReservedPrefill(handoffs, breaks=[side]))
    prefill.go.set()
    add("decode", "d1", ModelDecode(handoffs), load=0)  # least loaded: chosen first
    add("decode", "d2", ModelDecode(handoffs), load=10_000)
    prompt = [4, 8, 15]
    assert [t for m in core.generate(req(prompt=prompt, rid=f"late-{side}", max_new_tokens=9))
            for t in m.token_ids] == truth(prompt, 9)
    (_, again), = prefill.calls[1:]  # the second placement recomputes the prompt and the token sent
    assert again == prompt + truth(prompt, 1)
    rec = core.store.get(f"late-{side}")
    placements = json.loads(rec["placements"])
    assert rec["state"] == "finished" and rec["output_tokens"] == "9"
    assert placements[1]["reason"].startswith("failover: ")
    # The decode side broke: it is passed over; the prefill side broke: the same decode instance is fine.
    assert [p["decode"] for p in placements] == (["d1", "d2"] if side == "decode" else ["d1", "d1"])


def test_a_hand_off_that_keeps_failing_after_the_first_token_ends_the_request(stack):
    core, handoffs, add = stack
    prefill = add("prefill", "p", ReservedPrefill(handoffs, breaks=["prefill"] * 10))
    prefill.go.set()
    add("decode", "d1", ModelDecode(handoffs))
    got = []
    with pytest.raises(Exception) as err:
        for m in core.generate(req(prompt=[4, 8], rid="doomed", max_new_tokens=9)):
            got += m.token_ids
    assert "connection reset" in str(err.value)
    # The first token, then resumed placements (which send none) that fail: no duplicate, and it gives up.
    assert got == truth([4, 8], 1) and 2 <= len(prefill.calls) <= MAX_FAILOVERS + 1
    assert core.store.get("doomed")["state"] == "failed"
