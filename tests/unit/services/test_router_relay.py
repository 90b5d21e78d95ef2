"""The router's side of a decode relay (``services/router/relay.py``): while a request's walk waits on its inbox,
the relay's reader hands the tokens that need no await straight to the client's session (the walk's task is not
woken per message); a refused message, and every one after it, queue for the walk in order; several messages
that arrive before the client's next write go out as one."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest

from proto.eyrie.v1 import eyrie_pb2 as pb
from proto.eyrie.v1 import eyrie_pb2_grpc as pb_grpc
from services.common import start_grpc_server
from services.metadata import InstanceInfo
from services.router.relay import RELAY_METADATA, Inbox
from services.router.session import Session
from tests.unit.services.test_router import make_core, req


def msg(*ids: int, finish: bool = False) -> pb.GenerateResponse:
    out = pb.GenerateResponse(request_id="r", token_ids=ids, logprobs=[-0.5] * len(ids))
    if finish:
        out.finish.reason = "length"
    return out


def test_an_inbox_hands_messages_to_direct_only_while_the_walk_waits_and_keeps_their_order():
    async def main():
        conn = SimpleNamespace(inboxes={})
        inbox = conn.inboxes["r"] = Inbox(conn, "r")
        taken = []

        def direct(m: pb.GenerateResponse) -> bool:  # takes odd tokens, refuses even ones
            if m.token_ids[0] % 2 == 0:
                return False
            taken.append(m.token_ids[0])
            return True

        inbox.direct = direct
        inbox.push(msg(1))  # the walk is not waiting: it queues
        assert list((await anext(inbox)).token_ids) == [1] and taken == []
        waiting = asyncio.ensure_future(anext(inbox))
        await asyncio.sleep(0)  # the walk now waits on its inbox
        inbox.push(msg(3))  # taken: the walk stays asleep
        assert taken == [3] and not waiting.done()
        for t in (4, 5, 7):  # 4 is refused: it and everything after it go to the walk, in order
            inbox.push(msg(t))
        assert [list((await waiting).token_ids), list((await anext(inbox)).token_ids),
                list((await anext(inbox)).token_ids)] == [[4], [5], [7]]
        assert taken == [3]
        inbox.direct = lambda m: 1 / 0  # a direct that fails fails the walk, not the relay's reader
        waiting = asyncio.ensure_future(anext(inbox))
        await asyncio.sleep(0)
        inbox.push(msg(9))
        with pytest.raises(ZeroDivisionError):
            await waiting

    asyncio.run(main())


class RelayDecode(pb_grpc.DecodeServicer):
    """Admits a prompt (prefilled there) and streams it over a relay: ``batches`` (lists of messages' token ids,
    the last message finishing), each after the test releases it (the first at once)."""

    def __init__(self, batches: list[list[list[int]]]):
        self.batches = batches
        self.release = threading.Semaphore(0)
        self.closed = threading.Event()

    def Admit(self, request, context):  # noqa: N802
        return pb.ReserveResponse(accepted=True)

    def Relay(self, request_iterator, context):  # noqa: N802
        context.add_callback(self.closed.set)
        context.send_initial_metadata((RELAY_METADATA,))
        rid = next(request_iterator).request_id
        sent = 0
        for i, batch in enumerate(self.batches):
            if i:
                assert self.release.acquire(timeout=30)
            out = pb.RelayBatch()
            for ids in batch:
                sent += len(ids)
                m = out.messages.add(request_id=rid, token_ids=ids, logprobs=[-0.25] * len(ids))
                if i == len(self.batches) - 1 and ids is batch[-1]:
                    m.finish.reason = "length"
                    m.finish.usage.completion_tokens = sent
            yield out
        self.closed.wait(30)  # the relay stays open (shared by the router's requests) until the router closes it

    def Abort(self, request, context):  # noqa: N802
        return pb.AbortResponse(found=False)


def test_relayed_tokens_reach_the_session_from_the_reader_and_only_the_first_and_last_wake_the_walk(
        redis_url, tiny_model_dir):
    core = make_core(redis_url, tiny_model_dir, local_prefill_max_tokens=64)
    decode = RelayDecode([[[11]], [[12, 13], [14, 15], [16, 17], [18, 19]], [[20]]])
    server, port, _ = start_grpc_server("127.0.0.1", 0, [(pb_grpc.add_DecodeServicer_to_server, decode)], [])
    core.registry.register(InstanceInfo("d-relay", "decode", f"127.0.0.1:{port}", beat=1))
    core.registry.register(InstanceInfo("p-idle", "prefill", "127.0.0.1:1", beat=1))  # never used (local prefill)
    walked, relay_message = [], core._relay_message

    async def counted(active, m, *args):
        walked.append(list(m.token_ids))
        return await relay_message(active, m, *args)

    core._relay_message = counted

    async def drive() -> list[pb.GenerateResponse]:
        request = req(prompt=[5, 6, 7], rid="relayed", max_new_tokens=10)
        request.return_logprobs = True
        session = Session(core, request)
        got = [await session.next()]
        decode.release.release()  # four messages in one batch: handed over by the reader, sent as one
        got.append(await session.next())
        decode.release.release()
        while (m := await session.next()) is not None:
            got.append(m)
        return got

    try:
        got = core._on_loop(drive())
        assert [list(m.token_ids) for m in got] == [[11], [12, 13, 14, 15, 16, 17, 18, 19], [20]]
        assert [len(m.logprobs) for m in got] == [1, 8, 1]
        assert walked == [[11], [20]]  # the walk's task took the first (its records) and the last only
        assert got[-1].finish.reason == "length" and got[-1].finish.usage.completion_tokens == 10
        record = core.store.get("relayed")
        assert record["state"] == "finished" and int(record["output_tokens"]) == 10
    finally:
        core.close()
        server.stop(0)


def test_a_relayed_request_leaves_no_reference_cycle(redis_url, tiny_model_dir):
    """A request's walk state (``Active``) and its relay inbox are freed by reference counting when it ends: the
    inbox's ``direct`` held the walk state, which held the inbox, a cycle per request that only the cyclic
    collector freed (20-110 ms pauses of the router's loop at 512 streams: docs/benchmarks.md)."""
    import gc
    import weakref

    core = make_core(redis_url, tiny_model_dir, local_prefill_max_tokens=64)
    decode = RelayDecode([[[11], [12, 13], [14]]])
    server, port, _ = start_grpc_server("127.0.0.1", 0, [(pb_grpc.add_DecodeServicer_to_server, decode)], [])
    core.registry.register(InstanceInfo("d-relay", "decode", f"127.0.0.1:{port}", beat=1))
    core.registry.register(InstanceInfo("p-idle", "prefill", "127.0.0.1:1", beat=1))
    refs, attach = [], core._attach

    def attached(active, call):
        refs.append(weakref.ref(active))
        return attach(active, call)

    core._attach = attached

    async def drive() -> list[bool]:
        session = Session(core, req(prompt=[5, 6, 7], rid="no-cycle", max_new_tokens=4))
        while await session.next() is not None:
            pass
        await session.task
        del session
        for _ in range(3):
            await asyncio.sleep(0)
        return [r() is None for r in refs]

    gc.disable()
    try:
        assert core._on_loop(drive()) == [True]  # freed with no collection
    finally:
        gc.enable()
        core.close()
        server.stop(0)
