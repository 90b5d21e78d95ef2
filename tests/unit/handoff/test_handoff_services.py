"""Prefill and decode services over real gRPC sockets, without the router: a small driver calls
``Prefill`` (first token, then the hand-off) and then ``Decode.Stream``.

Output equals the single-process engine's (greedy and seeded sampling); the decode side refuses what
it cannot hold (RESOURCE_EXHAUSTED) and what does not match it (FAILED_PRECONDITION naming both
sides); and after every way a request can end (finished, refused, broken transfers on either side,
aborts on either side, clients that go away, a stream nobody attaches) every pool on both services
is full again. The hand-off overlaps the prefill: a prompt's first chunk reaches the decode side before
its last one is computed, a side that goes away mid-prefill frees the other's pages, and receiving a
slow transfer never stalls the requests decoding beside it.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch
from handoff_helpers import GREEDY, LONG, SHORT, engine_config, load_models, make_engine, positions_kv

from proto.eyrie.v1 import eyrie_pb2 as pb
from proto.eyrie.v1 import eyrie_pb2_grpc as pb_grpc
from services.common import start_grpc_server
from services.decode.server import start_decode
from services.followers import Leader
from services.metadata import EmbeddedRedis, Registry, connect
from services.prefill.server import start_prefill
from services.settings import DecodeSettings, PrefillSettings
from shared.engine import Engine
from shared.handoff import PageSource, iter_chunks, sampling_to_pb
from shared.handoff.nixl import agents_of, nixl_api
from shared.handoff.wire import page_bytes
from shared.sampling import SamplingParams

DRAFT, TOPK, PAGE = "eagle", 4, 4
CPU_TRANSPORTS = ["grpc-stream", "ipc"] + (["nixl"] if nixl_api() is not None else [])
MAX_RUNNING = 8
SAMPLED = SamplingParams(max_new_tokens=12, ignore_eos=True, temperature=0.9, seed=3)


@pytest.fixture(scope="module")
def models(oracle_model_dir):
    return load_models(oracle_model_dir)


@pytest.fixture(scope="module")
def redis_url():
    server = EmbeddedRedis()
    url = server.start()
    yield url
    server.stop()


def config(draft=DRAFT, **kw):
    return engine_config(draft, TOPK, PAGE, max_context=512, max_running=MAX_RUNNING, **kw)


class Stack:
    """One prefill and one decode instance (engines built in memory), and a driver for them."""

    def __init__(self, models, redis_url, prefill_draft=DRAFT, transport="grpc-stream", handoff_streams=1,
                 prefill_config=None, decode_config=None, prefill_engine=None, **decode_settings):
        """``decode_settings`` naming ``tensor_parallel``: the decode service builds its engine (and starts its
        followers) from the checkpoints the settings name."""
        self.transport = transport  # the hand-off's data transport, forced on the prefill side
        if transport == "nixl":  # offered by a decode instance only when it is named there too
            decode_settings.setdefault("handoff_transport", "nixl")
        self.prefill_engine = prefill_engine or make_engine(
            models, prefill_draft, config(prefill_draft, **(prefill_config or {})), role="prefill")
        decode_engine = None if "tensor_parallel" in decode_settings else make_engine(
            models, DRAFT, config(**(decode_config or {})), role="decode")
        smallest = 2 * max(page_bytes(c) for c in self.prefill_engine.scheduler.caches)  # many chunks per request
        # No heartbeat during the tests (it registers at start): its load query would queue engine-loop calls
        # that the abort tests count.
        common = dict(redis_url=redis_url, heartbeat_s=60, registry_ttl_s=120)
        self.prefill = start_prefill(PrefillSettings(**common, handoff_chunk_bytes=smallest, handoff_timeout_s=20,
                                                     handoff_transport=transport, handoff_streams=handoff_streams),
                                     self.prefill_engine)
        try:
            self.decode = start_decode(DecodeSettings(**common, **decode_settings), decode_engine)
        except BaseException:
            self.prefill.stop(0)
            raise
        self.pstub = pb_grpc.PrefillStub(grpc.insecure_channel(self.prefill.grpc_address))
        self.dstub = pb_grpc.DecodeStub(grpc.insecure_channel(self.decode.grpc_address))
        self._ids = iter(range(1 << 30))

    def rid(self) -> str:
        return f"t{next(self._ids)}"

    def prefill_call(self, rid, prompt, params=GREEDY, address=None, **kw):
        return self.pstub.Prefill(pb.PrefillRequest(request_id=rid, prompt_ids=prompt, sampling=sampling_to_pb(params),
                                                    decode_address=address or self.decode.grpc_address),
                                  timeout=kw.pop("timeout", 120), **kw)  # a bound: ~1 s idle

    def generate(self, prompt, params=GREEDY, rid=None):
        """Prefill, then Stream: (tokens, Finish, the prefill events)."""
        rid = rid or self.rid()
        events = list(self.prefill_call(rid, prompt, params))
        first = events[0].first_token
        if first.finish_reason:
            return [first.token_id], pb.Finish(reason=first.finish_reason), events
        assert events[1].HasField("handed_off") and len(events) == 2
        tokens, finish = [first.token_id], None
        # A bound, not the time it takes (~1 s idle): the suite beside two CPU hogs and a second suite ran past 30 s.
        for msg in self.dstub.Stream(pb.StreamRequest(request_id=rid), timeout=120):
            tokens += msg.token_ids
            if msg.HasField("finish"):
                finish = msg.finish
        return tokens, finish, events

    def engines(self):
        return [self.prefill.engine_loop, self.decode.engine_loop]

    def clean(self, timeout: float = 10.0) -> bool:
        """Every page and request slot back in every pool, on both services."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(loop.call(lambda e: e.is_idle_and_clean()).result(5) for loop in self.engines()):
                return True
            time.sleep(0.05)
        return False

    def stop(self) -> None:
        agents = agents_of(h.extra["servicer"] for h in (self.prefill, self.decode))
        self.prefill.stop(0.2)
        self.decode.stop(0.2)
        # No NIXL agent outlives its services (each one's UCX threads poll a core without pause).
        assert all(a.agent is None for a in agents), "a NIXL agent outlived the stack's services"


@pytest.fixture(scope="module")
def stacks(models, redis_url):
    """One stack per transport, built when first asked for."""
    built: dict[str, Stack] = {}
    yield lambda transport: built.get(transport) or built.setdefault(transport, Stack(models, redis_url,
                                                                                        transport=transport))
    for s in built.values():
        s.stop()


@pytest.fixture(params=CPU_TRANSPORTS)
def stack(stacks, request):
    """The stack over each transport that runs on the CPU (ipc: shared-memory pools; nixl: UCX over tcp, where
    NIXL is installed)."""
    return stacks(request.param)


@pytest.fixture
def stream_stack(stacks):
    """The stack over the gRPC stream (the fake decode instances below offer nothing else)."""
    return stacks("grpc-stream")


@pytest.fixture(scope="module")
def single(models):
    """The single-process engine's results for SHORT and LONG (greedy) and LONG (seeded sampling)."""
    engine = make_engine(models, DRAFT, config())
    greedy = engine.generate([SHORT, LONG], GREEDY)
    return greedy + engine.generate([LONG], SAMPLED)


def wait_until(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def queued(loop, name: str, rid: str) -> bool:
    """Whether the prefill servicer's engine-loop call ``name`` (add / abort) for ``rid`` waits in a queue (an
    admission goes through ``call_soon``, served first, an abort through ``call``)."""
    for fn, _ in list(loop._soon.queue) + list(loop._calls.queue):
        cells = [c.cell_contents for c in fn.__closure__ or ()]
        if fn.__name__ == name and any(getattr(c, "rid", None) == rid for c in cells):
            return True
    return False


def blocked(loop):
    """Hold the engine thread until the returned event is set (deterministic timing for aborts)."""
    gate, entered = threading.Event(), threading.Event()

    def hold(engine):
        entered.set()
        gate.wait(40)  # longer than wait_until: a slow machine times out waiting, not by the gate opening

    loop.call(hold)
    assert entered.wait(5)
    return gate


# ---- the happy path ----------------------------------------------------------------------------------
def test_prefill_then_stream_equals_the_single_process_engine(stack, single, redis_url):
    for prompt, params, want in [(SHORT, GREEDY, single[0]), (LONG, GREEDY, single[1]), (LONG, SAMPLED, single[2])]:
        tokens, finish, events = stack.generate(prompt, params)
        assert tokens == want.token_ids
        assert finish.reason == "length" and finish.usage.completion_tokens == len(want.token_ids)
        assert finish.usage.prompt_tokens == len(prompt)
        assert (finish.spec.verify_steps, finish.spec.accepted_drafts) == (want.spec_stats["verify_steps"],
                                                                           want.spec_stats["accepted_drafts"])
        handed = events[1].handed_off
        if stack.transport == "grpc-stream":
            assert handed.bytes > 0 and handed.chunks > 2 * 2  # cut into many chunks (the fixture's chunk limit)
        else:  # written in place, then one message with the draft state
            assert handed.bytes > 0 and handed.chunks == 1
    assert stack.clean()
    registry = Registry(connect(redis_url))
    assert {i.instance_id for i in registry.instances()} >= {stack.prefill.instance_id, stack.decode.instance_id}
    assert all(i.free_pages > 0 for i in registry.instances("decode"))


def test_concurrent_requests_all_equal_the_single_process_engine(stack, single):
    prompts = [SHORT, LONG] * 3
    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(stack.generate, prompts))
    for prompt, (tokens, finish, _) in zip(prompts, results):
        assert tokens == single[0 if prompt is SHORT else 1].token_ids and finish.reason == "length"
    assert stack.clean()


@pytest.mark.parametrize("transport", CPU_TRANSPORTS)
def test_a_prefill_with_a_prefix_cache_hands_off_the_same_and_reports_the_cached_tokens(models, redis_url, single,
                                                                                     transport):
    """The prefill instance's prefix cache (issue 33): a repeated prompt takes its cached pages (target and
    draft K/V) instead of computing them, the hand-off still carries every page, and the decode side's output
    and acceptance are the single-process engine's; the prefill reports the cached tokens with its hand-off."""
    s = Stack(models, redis_url, transport=transport, prefill_config=dict(prefix_cache=True))
    try:
        cached = lambda: s.prefill.engine_loop.call(lambda e: len(e.prefix_cache)).result()  # noqa: E731
        before = cached()  # the service's warm-up request's pages
        cold = s.generate(LONG)
        warm = s.generate(LONG)
        sampled = s.generate(LONG, SAMPLED)
        for (tokens, finish, _), want in [(cold, single[1]), (warm, single[1]), (sampled, single[2])]:
            assert tokens == want.token_ids and finish.reason == "length"
            assert (finish.spec.verify_steps, finish.spec.accepted_drafts) == (want.spec_stats["verify_steps"],
                                                                               want.spec_stats["accepted_drafts"])
        assert cold[2][1].handed_off.cached_tokens == 0
        # LONG: 30 tokens, pages of 4: 7 pages before its last token, the 7th's successor (token 28) in the prompt
        assert warm[2][1].handed_off.cached_tokens == sampled[2][1].handed_off.cached_tokens == 28
        assert s.clean()
        assert cached() == before + 7
    finally:
        s.stop()


@pytest.mark.parametrize("transport", CPU_TRANSPORTS)
def test_a_decode_instance_with_a_prefix_cache_is_sent_only_the_pages_it_lacks(models, redis_url, stacks, transport):
    """The decode instance's prefix cache (issue 33): the pages of a hand-off's prompt it holds (its Reserve reply
    says how many) are not sent, over every transport, and the output, seeded sampling too, and acceptance are the
    single-process engine's; without the cache every page goes. Both pools are full after (the cache flushed)."""
    branch = LONG[:22] + [3, 1, 4, 1, 5]  # LONG's first 5 pages of 4, and their successor (token 20)
    engine = make_engine(models, DRAFT, config())
    want = engine.generate([LONG, branch], GREEDY) + engine.generate([branch], SAMPLED)
    per_page = sum(c.layout.num_layers * page_bytes(c) for c in engine.scheduler.caches)  # K + V, every cache
    cold = stacks(transport)  # no cache on its decode side
    warm = Stack(models, redis_url, transport=transport, decode_config=dict(prefix_cache=True))
    try:
        runs = {s: [s.generate(LONG), s.generate(branch), s.generate(branch, SAMPLED)] for s in (cold, warm)}
        for results in runs.values():
            for (tokens, finish, _), w in zip(results, want):
                assert tokens == w.token_ids and finish.reason == "length"
                assert (finish.spec.verify_steps, finish.spec.accepted_drafts) == (w.spec_stats["verify_steps"],
                                                                                   w.spec_stats["accepted_drafts"])
        sent = {s: [r[2][1].handed_off for r in results] for s, results in runs.items()}
        # The branch's 7 pages: its first hand-off finds LONG's 5 held, its second all 6 before its last position;
        # without the cache all 7 go. Bytes: K + V of the pages sent, and the draft state (less than a page).
        for warm_one, cold_one, held in zip(sent[warm][1:], sent[cold][1:], (5, 6)):
            assert 0 < cold_one.bytes - 7 * per_page < per_page, (cold_one, per_page)
            assert 0 < warm_one.bytes - (7 - held) * per_page < per_page, (warm_one, per_page)
        warm.decode.engine_loop.call(lambda e: e.flush_prefix_cache()).result()
        assert warm.clean() and cold.clean()
    finally:
        warm.stop()


@pytest.mark.parametrize("transport", CPU_TRANSPORTS)
def test_a_tp2_decode_instance_with_a_prefix_cache_is_sent_only_the_pages_it_lacks(models, redis_url, transport):
    """The same under tensor parallelism: the decode instance is rank 0 of two gloo ranks (its follower replays
    every reservation, activation and the cache's flush, so both ranks' caches hold the same pages under the same
    ids); its Reserve reply names the pages every rank holds, the sender skips them (ipc and nixl: writing the rest
    into rank 0's landing cache) and each rank takes its heads of the rest. Output equals the single-process
    engine's, both pools are full after the cache's flush, and the follower ends with its service."""
    branch = LONG[:22] + [3, 1, 4, 1, 5]  # LONG's first 5 pages of 4, and their successor
    root = models.root  # engines from the checkpoints: the follower loads its rank's share from them
    engine = Engine(root / "target", root / DRAFT, config())
    want = engine.generate([LONG, branch], GREEDY)
    per_page = sum(c.layout.num_layers * page_bytes(c) for c in engine.scheduler.caches)  # K + V, every cache
    settings = dict(model=str(root / "target"), draft=str(root / DRAFT), page_size=PAGE, chunk_size=8,
                    max_context=512, max_running=MAX_RUNNING, spec_topk=TOPK, spec_steps=3, spec_policy="fixed",
                    prefix_cache=True, tensor_parallel=2)
    s = Stack(models, redis_url, transport=transport, prefill_engine=Engine(root / "target", root / DRAFT, config(),
                                                                            role="prefill"), **settings)
    leader = s.decode.engine_loop.engine
    try:
        assert isinstance(leader, Leader) and leader.engine.runner.tp.size == 2
        runs = [s.generate(LONG), s.generate(branch), s.generate(branch)]
        for (tokens, finish, _), w in zip(runs, [*want, want[1]]):
            assert tokens == w.token_ids and finish.reason == "length"
        # LONG's 8 pages all go; the branch's 7: its first hand-off finds LONG's 5 held, its second all 6 before its
        # last position (K + V of the pages sent, and the draft state: less than a page)
        for (_, _, events), pages in zip(runs, (8, 7 - 5, 7 - 6)):
            assert 0 < events[1].handed_off.bytes - pages * per_page < per_page, (events[1].handed_off, per_page)
        assert s.decode.engine_loop.call(lambda e: e.flush_prefix_cache()).result() > 0  # on both ranks
        assert s.clean() and leader.broken is None
        assert s.generate(branch)[0] == want[1].token_ids  # the ranks' pools still alike (each step's plan checked)
        assert s.clean()
    finally:
        s.stop()
    assert [p.exitcode for p in leader.ranks] == [0], "the follower did not end with its service"


def test_a_request_ending_at_its_first_token_is_not_handed_off(stack):
    decode_before = stack.decode.extra["telemetry"].handoff_bytes_total._value.get()
    tokens, finish, events = stack.generate(LONG, SamplingParams(max_new_tokens=1))
    assert len(events) == 1 and finish.reason == "length" and len(tokens) == 1
    assert stack.decode.extra["telemetry"].handoff_bytes_total._value.get() == decode_before
    assert stack.clean()


# ---- refusals --------------------------------------------------------------------------------------
@pytest.mark.parametrize("field, request_kw", [
    ("request_id", dict(request_id="")),
    ("decode_address", dict(decode_address="")),
    ("prompt", dict(prompt_ids=[5, 10 ** 6])),
    ("prompt", dict(prompt_ids=[])),
    ("sampling.top_p", dict(sampling=pb.SamplingParams(top_p=1.5))),
    ("max_new_tokens", dict(sampling=pb.SamplingParams(max_new_tokens=10 ** 6))),
])
def test_bad_prefill_requests_get_invalid_argument_naming_the_field(stack, field, request_kw):
    msg = dict(request_id="bad", prompt_ids=SHORT, sampling=pb.SamplingParams(max_new_tokens=4),
               decode_address=stack.decode.grpc_address)
    with pytest.raises(grpc.RpcError) as err:
        list(stack.pstub.Prefill(pb.PrefillRequest(**{**msg, **request_kw}), timeout=10))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(f"{field}:")
    assert stack.clean()


def test_a_prefill_without_speculation_is_refused_at_the_handshake(models, redis_url):
    s = Stack(models, redis_url, prefill_draft=None)
    try:
        with pytest.raises(grpc.RpcError) as err:
            s.generate(SHORT)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        details = err.value.details()
        assert f"speculative config: decode {s.decode.instance_id} has eagle (topk=4, steps=3, num_draft_tokens=8), " \
               "prefill has none" in details
        with pytest.raises(grpc.RpcError) as err:  # the handshake alone says the same
            s.dstub.Handshake(s.prefill_engine.handoff_schema().to_pb(), timeout=5)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "prefill has none" in err.value.details()
        assert s.clean()
    finally:
        s.stop()


def test_a_full_decode_instance_refuses_and_both_pools_stay_whole(stack, single):
    def fill(engine):
        return [engine.reserve_handoff(f"blocker{i}", [1, 2, 3], [4], [0.0], SamplingParams(max_new_tokens=2), 3)
                for i in range(MAX_RUNNING)]

    blockers = stack.decode.engine_loop.call(fill).result()
    assert all(b is not None for b in blockers)
    try:
        with pytest.raises(grpc.RpcError) as err:
            stack.generate(LONG)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "cannot hold the request" in \
            err.value.details()
        assert stack.prefill.engine_loop.call(lambda e: e.is_idle_and_clean()).result()
    finally:
        stack.decode.engine_loop.call(lambda e: [e.abort(b.rid) for b in blockers]).result()
    assert stack.clean()
    assert stack.generate(LONG)[0] == single[1].token_ids  # room again: the same request goes through


# ---- broken transfers ------------------------------------------------------------------------------
def reserve_directly(stack, rid):
    """The test plays the prefill side: a valid reservation for LONG's hand-off."""
    reply = stack.dstub.Reserve(pb.ReserveRequest(
        request_id=rid, prompt_ids=LONG, output_ids=[7], output_logprobs=[-1.0], sampling=sampling_to_pb(GREEDY),
        committed_len=len(LONG), schema=stack.prefill_engine.handoff_schema().to_pb()), timeout=5)
    assert reply.accepted
    caches = stack.prefill_engine.scheduler.caches
    pages = [list(range(1, c.pages_for(len(LONG)) + 1)) for c in caches]  # sizes right, contents whatever
    return list(iter_chunks(PageSource(rid, caches, pages, b""), page_bytes(caches[0])))


def test_a_transfer_broken_off_mid_way_frees_the_reservation(stack):
    rid = stack.rid()
    chunks = reserve_directly(stack, rid)
    sent_two, hang = threading.Event(), threading.Event()

    def messages():
        yield from chunks[:2]
        sent_two.set()
        hang.wait(10)  # the sender stalls, then goes away

    call = stack.dstub.Transfer.future(messages(), timeout=20)
    assert sent_two.wait(5)
    # Break off once the decode side has read the first chunk (and so knows the request): a transfer that
    # breaks before naming its request cannot be told apart and is reaped at the attach deadline instead.
    incoming = stack.decode.extra["servicer"]._incoming
    wait_until(lambda: incoming[rid].phase.value in ("receiving", "decoding"), timeout=10)
    break_off(stack, rid, call, hang)


def break_off(stack, rid: str, call, hang: threading.Event) -> None:
    """The sender of ``rid``'s transfer goes away mid-way: every page is back and the request never streams."""
    call.cancel()
    hang.set()
    assert stack.clean()
    with pytest.raises(grpc.RpcError) as err:
        list(stack.dstub.Stream(pb.StreamRequest(request_id=rid), timeout=5))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_a_hand_off_over_several_streams_equals_the_single_process_engine(models, redis_url, single):
    """The prefill splits each hand-off over 3 streams (target layers and the draft cache apart, one connection
    each), its pages arriving while the prompt is prefilled: output as in one process, every page back."""
    s = Stack(models, redis_url, handoff_streams=3)
    try:
        for prompt, params, want in [(LONG, GREEDY, single[1]), (LONG, SAMPLED, single[2])]:
            tokens, finish, events = s.generate(prompt, params)
            assert tokens == want.token_ids and finish.reason == "length"
            assert events[1].handed_off.bytes > 0
        assert s.clean()
    finally:
        s.stop()


def test_a_stream_broken_off_mid_way_fails_the_hand_off_over_several_and_frees_the_reservation(stream_stack):
    """Streams 0 and 2 of three end (each acknowledged for its own share: the hand-off is not complete), stream
    1 breaks off after two chunks: the decode side frees the reservation and the request never streams."""
    from shared.handoff.wire import split_lanes

    rid = stream_stack.rid()
    reserve_directly(stream_stack, rid)
    caches = stream_stack.prefill_engine.scheduler.caches
    source = PageSource(rid, caches, [list(range(1, c.pages_for(len(LONG)) + 1)) for c in caches], b"")
    lanes = [list(iter_chunks(source, page_bytes(caches[0]), lane=lane)) for lane in split_lanes(source, 3)]
    sent_two, hang = threading.Event(), threading.Event()

    def broken(chunks):
        yield from chunks[:2]
        sent_two.set()
        hang.wait(10)  # the sender stalls, then goes away

    whole = [stream_stack.dstub.Transfer.future(iter(lanes[i]), timeout=20) for i in (0, 2)]
    call = stream_stack.dstub.Transfer.future(broken(lanes[1]), timeout=20)
    acks = [f.result(10) for f in whole]
    assert [a.chunks for a in acks] == [len(lanes[0]), len(lanes[2])]
    assert sent_two.wait(5)
    sink = stream_stack.decode.extra["servicer"]._incoming[rid].sink
    wait_until(lambda: sink._next_seq.get(1, 0) > 0, timeout=10)  # the decode side read the broken stream's first
    break_off(stream_stack, rid, call, hang)


def truncate(chunks):
    return chunks[:3]


def corrupt(chunks):
    chunks[1].v = bytes(len(chunks[1].v))
    return chunks


def no_state(chunks):
    return chunks  # a speculative decode needs the draft state on the last chunk


@pytest.mark.parametrize("damage, words", [(truncate, "ended before its last chunk"), (corrupt, "CRC32"),
                                           (no_state, "no draft state arrived")])
def test_a_bad_transfer_is_refused_with_data_loss_and_frees_the_reservation(stack, damage, words):
    rid = stack.rid()
    chunks = damage(reserve_directly(stack, rid))
    with pytest.raises(grpc.RpcError) as err:
        stack.dstub.Transfer(iter(chunks), timeout=10)
    assert err.value.code() == grpc.StatusCode.DATA_LOSS and words in err.value.details()
    assert stack.clean()


def test_a_transfer_without_a_reservation_is_refused(stack):
    caches = stack.prefill_engine.scheduler.caches
    chunks = iter_chunks(PageSource("nobody", caches, [[1] for _ in caches], b""), 1 << 20)
    with pytest.raises(grpc.RpcError) as err:
        stack.dstub.Transfer(chunks, timeout=5)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and "'nobody'" in err.value.details()


class BreakingDecode(pb_grpc.DecodeServicer):
    """A decode instance that accepts the reservation and then fails (or stalls in) the transfer."""

    def __init__(self, stall: bool, drain: bool = False):
        self.stall, self.drain, self.aborted, self.chunks = stall, drain, [], 0
        self.receiving, self.release = threading.Event(), threading.Event()

    def Handshake(self, request, context):  # noqa: N802
        return pb.HandshakeResponse(instance_id="breaking")

    def Reserve(self, request, context):  # noqa: N802
        return pb.ReserveResponse(accepted=True)

    def Transfer(self, request_iterator, context):  # noqa: N802
        for chunk in request_iterator:  # the first chunk only, or (drain) every chunk up to the last
            self.chunks += 1
            if not self.drain or chunk.last:
                break
        self.receiving.set()
        if self.stall:
            self.release.wait(10)
            return pb.TransferAck(bytes=1234, chunks=self.chunks)
        context.abort(grpc.StatusCode.UNAVAILABLE, "disk on fire")

    def Abort(self, request, context):  # noqa: N802
        self.aborted.append(request.request_id)
        return pb.AbortResponse(found=True)


@pytest.fixture
def breaking_decode():
    servicers = []

    def start(stall: bool, drain: bool = False):
        servicer = BreakingDecode(stall, drain)
        server, port, _ = start_grpc_server("127.0.0.1", 0, [(pb_grpc.add_DecodeServicer_to_server, servicer)], [])
        servicers.append((server, servicer))
        return servicer, f"127.0.0.1:{port}"

    yield start
    for server, servicer in servicers:
        servicer.release.set()
        server.stop(0)


def test_a_transfer_failing_on_the_decode_side_frees_the_prefill_pages(stream_stack, breaking_decode):
    fake, address = breaking_decode(stall=False)
    rid = stream_stack.rid()
    with pytest.raises(grpc.RpcError) as err:
        list(stream_stack.prefill_call(rid, LONG, address=address))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "disk on fire" in err.value.details()
    assert fake.chunks == 1 and fake.aborted == [rid]  # the reservation there is released too
    assert stream_stack.clean()


def held_by(engine, rid: str) -> list[int] | None:
    """Pages ``rid`` holds in each cache (None when the engine no longer has it); every used page is its."""
    req = engine.requests.get(rid)
    if req is None:
        return None
    pages = [len(p) for p in engine.scheduler.page_ids(req)]
    used = [c.layout.num_pages - c.num_free_pages for c in engine.scheduler.caches]
    assert pages == used, (pages, used)
    return pages


def test_the_prefill_frees_the_pages_only_after_the_decode_acknowledges(stream_stack, breaking_decode):
    """Every chunk has reached the decode side but its acknowledgement is pending: the prefill still holds the
    request's pages in every cache; once the acknowledgement arrives it frees them and reports the hand-off."""
    fake, address = breaking_decode(stall=True, drain=True)
    rid = stream_stack.rid()
    loop = stream_stack.prefill.engine_loop
    call = stream_stack.prefill_call(rid, LONG, address=address)
    assert next(call).HasField("first_token")
    assert fake.receiving.wait(10) and fake.chunks > 2  # the last chunk arrived
    for _ in range(3):  # and stays held while the acknowledgement waits
        pages = loop.call(lambda e: held_by(e, rid)).result(5)
        assert pages is not None and all(n > 0 for n in pages) and len(pages) == 2  # target + draft cache
        time.sleep(0.1)
    assert not loop.call(lambda e: e.is_idle_and_clean()).result(5)
    fake.release.set()
    event = next(call)
    assert event.HasField("handed_off") and (event.handed_off.bytes, event.handed_off.chunks) == (1234, fake.chunks)
    assert loop.call(lambda e: held_by(e, rid)).result(5) is None  # released by the time the router hears
    assert stream_stack.clean()
    assert fake.aborted == []


# ---- aborts and clients that go away ---------------------------------------------------------------
def test_prefill_abort_during_the_hand_off_stops_the_transfer_and_frees_the_pages(stream_stack, breaking_decode):
    fake, address = breaking_decode(stall=True)
    rid = stream_stack.rid()
    call = stream_stack.prefill_call(rid, LONG, address=address)
    assert next(call).HasField("first_token")
    assert fake.receiving.wait(10)
    assert stream_stack.pstub.Abort(pb.AbortRequest(request_id=rid), timeout=5).found
    with pytest.raises(grpc.RpcError) as err:
        next(call)
    assert err.value.code() == grpc.StatusCode.ABORTED
    assert stream_stack.clean()


def test_prefill_abort_before_the_prompt_ran(stack):
    rid = stack.rid()
    loop = stack.prefill.engine_loop
    gate = blocked(loop)
    call = stack.prefill_call(rid, LONG)
    wait_until(lambda: queued(loop, "add", rid))  # the request's admission waits behind the held engine thread
    abort = stack.pstub.Abort.future(pb.AbortRequest(request_id=rid), timeout=10)
    wait_until(lambda: queued(loop, "abort", rid))  # and the abort behind it
    gate.set()
    assert abort.result().found
    with pytest.raises(grpc.RpcError) as err:
        list(call)
    assert err.value.code() == grpc.StatusCode.ABORTED
    assert stack.clean()


def test_a_prefill_client_that_goes_away_aborts_the_request(stack):
    loop = stack.prefill.engine_loop
    gate = blocked(loop)
    rid = stack.rid()
    call = stack.prefill_call(rid, LONG)
    wait_until(lambda: queued(loop, "add", rid))
    call.cancel()
    wait_until(lambda: queued(loop, "abort", rid))  # the abort the cancellation caused
    gate.set()
    assert stack.clean()


def aborted_on_decode(stack) -> float:
    return stack.decode.extra["telemetry"].requests_total.labels("abort")._value.get()


def start_long_stream(stack):
    rid = stack.rid()
    events = list(stack.prefill_call(rid, LONG, SamplingParams(max_new_tokens=400, ignore_eos=True)))
    assert events[-1].HasField("handed_off")
    stream = stack.dstub.Stream(pb.StreamRequest(request_id=rid), timeout=30)
    first = next(stream)
    assert first.token_ids and not first.HasField("finish")
    return rid, stream


def test_decode_abort_mid_stream_ends_the_stream_and_frees_the_pages(stack):
    before = aborted_on_decode(stack)
    rid, stream = start_long_stream(stack)
    with pytest.raises(grpc.RpcError) as err:  # a second subscriber is refused
        next(stack.dstub.Stream(pb.StreamRequest(request_id=rid), timeout=5))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert stack.dstub.Abort(pb.AbortRequest(request_id=rid), timeout=5).found
    with pytest.raises(grpc.RpcError) as err:
        for msg in stream:
            assert not msg.HasField("finish")
    assert err.value.code() == grpc.StatusCode.ABORTED
    assert stack.clean()
    wait_until(lambda: aborted_on_decode(stack) == before + 1)  # counted just after the pages went back


def test_a_hand_off_moves_through_named_phases_on_the_decode_side(stack, monkeypatch):
    """A hand-off's life on the decode instance is one state machine: reserved -> receiving -> decoding -> ended,
    through the one release path whether it finished or was aborted mid-stream (``services/decode/server.py``:
    ``Phase``, the moves ``NEXT`` allows)."""
    from services.decode.server import Incoming, Phase

    moves: list[tuple[str, Phase, Phase]] = []
    move = Incoming.move
    monkeypatch.setattr(Incoming, "move", lambda inc, to: moves.append((inc.rid, inc.phase, to)) or move(inc, to))
    rid = stack.rid()
    stack.generate(LONG, rid=rid)
    wait_until(lambda: (rid, Phase.DECODING, Phase.ENDED) in moves)  # its stream's end releases it (a no-op)
    assert [(a, b) for r, a, b in moves if r == rid] == [(Phase.RESERVED, Phase.RECEIVING),
                                                          (Phase.RECEIVING, Phase.DECODING),
                                                          (Phase.DECODING, Phase.ENDED)]
    rid, stream = start_long_stream(stack)
    assert stack.dstub.Abort(pb.AbortRequest(request_id=rid), timeout=5).found
    with pytest.raises(grpc.RpcError):
        list(stream)
    assert [b for r, _, b in moves if r == rid] == [Phase.RECEIVING, Phase.DECODING, Phase.ENDED]
    assert stack.clean() and rid not in stack.decode.extra["servicer"]._incoming


def test_a_prefill_call_moves_through_named_phases_too(stack, monkeypatch):
    """The prefill side's life of a request is one state machine too: prefilling -> handing off -> reserved ->
    handed off; one ending at its first token ends without a hand-off; an abort before its prompt ran ends it
    (``services/prefill/server.py``: ``Phase``, the moves ``AFTER`` allows; the last two are final)."""
    from services.prefill.server import Job, Phase

    moves: list[tuple[str, Phase, Phase]] = []
    move = Job.move
    monkeypatch.setattr(Job, "move", lambda job, to: moves.append((job.rid, job.phase, to)) or move(job, to))
    rid = stack.rid()
    stack.generate(LONG, rid=rid)
    wait_until(lambda: [to for r, _, to in moves if r == rid][-1:] == [Phase.ENDED])  # the call's end: a no-op
    assert [(a, b) for r, a, b in moves if r == rid] == [
        (Phase.PREFILLING, Phase.HANDING_OFF), (Phase.HANDING_OFF, Phase.RESERVED),
        (Phase.RESERVED, Phase.HANDED_OFF), (Phase.HANDED_OFF, Phase.ENDED)]
    one = stack.rid()
    stack.generate(LONG, SamplingParams(max_new_tokens=1), rid=one)
    wait_until(lambda: any(r == one for r, _, _ in moves))
    assert [(a, b) for r, a, b in moves if r == one][0] == (Phase.PREFILLING, Phase.ENDED)
    assert stack.clean()


def test_a_move_the_state_machine_does_not_allow_is_refused():
    from services.decode.server import Incoming, Phase

    inc = Incoming("r", None, 1, None, None, attach_deadline=0.0)
    with pytest.raises(RuntimeError, match="no move from reserved to decoding"):
        inc.move(Phase.DECODING)  # a request decodes only after its transfer
    inc.move(Phase.ENDED)
    with pytest.raises(RuntimeError, match="no move from ended to reserved"):
        inc.move(Phase.RESERVED)


def test_a_stream_client_that_goes_away_aborts_the_request(stack):
    before = aborted_on_decode(stack)
    _, stream = start_long_stream(stack)
    stream.cancel()
    assert stack.clean()
    wait_until(lambda: aborted_on_decode(stack) == before + 1)  # aborted, rather than ended by itself


def test_a_hand_off_nobody_streams_is_aborted_after_the_attach_timeout(models, redis_url):
    s = Stack(models, redis_url, stream_attach_timeout_s=0.5)
    try:
        rid = s.rid()
        events = list(s.prefill_call(rid, LONG, SamplingParams(max_new_tokens=400, ignore_eos=True)))
        assert events[-1].HasField("handed_off")
        assert s.clean()
        wait_until(lambda: aborted_on_decode(s) == 1)
        with pytest.raises(grpc.RpcError) as err:
            list(s.dstub.Stream(pb.StreamRequest(request_id=rid), timeout=5))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        # A transfer that breaks off before its first chunk never names its request: the same deadline frees it.
        rid = s.rid()
        reserve_directly(s, rid)
        stalled, opened = threading.Event(), threading.Event()

        def nothing():
            opened.set()  # gRPC asks for the first message once the call is under way
            stalled.wait(10)
            yield from ()

        call = s.dstub.Transfer.future(nothing(), timeout=20)
        assert opened.wait(30)
        call.cancel()
        stalled.set()
        assert s.clean()
        wait_until(lambda: aborted_on_decode(s) == 2)
    finally:
        t0 = time.monotonic()
        s.stop()
        # No wait on a stream or a transfer (theirs are 20-30 s): about half a second, 15 s on a loaded machine.
        assert time.monotonic() - t0 < 15
    assert not [i for i in Registry(connect(redis_url)).instances()
                if i.instance_id in (s.prefill.instance_id, s.decode.instance_id)], "stop deregisters"


# ---- the in-place (ipc) transport: a sender the decode side cannot stop ----------------------------
# An in-place reservation's lease: long enough that "freed at once" (milliseconds) and "freed at the deadline"
# stay apart on a loaded machine (1.5 s was once overrun between an abort and the look that followed it).
LEASE_S = 8.0


@pytest.fixture(scope="module")
def short_lease_stack(models, redis_url):
    """An ipc stack whose decode side frees an unattached reservation after ``LEASE_S``."""
    s = Stack(models, redis_url, transport="ipc", stream_attach_timeout_s=LEASE_S)
    yield s
    s.stop()


def reserve_in_place(stack, rid) -> pb.ReserveResponse:
    reply = stack.dstub.Reserve(pb.ReserveRequest(
        request_id=rid, prompt_ids=LONG, output_ids=[7], output_logprobs=[-1.0], sampling=sampling_to_pb(GREEDY),
        committed_len=len(LONG), schema=stack.prefill_engine.handoff_schema().to_pb(), in_place=True), timeout=5)
    assert reply.accepted and len(reply.pages) == 2  # target + draft cache: where the sender writes
    assert reply.write_deadline > time.monotonic()  # the same host's clock
    return reply


def test_an_in_place_sender_that_dies_mid_transfer_leaves_its_reservation_held_until_the_deadline(
        short_lease_stack):
    """The sender reserved in place and vanished (killed between writes): someone aborts the request, but the
    pages stay reserved while a write could still land, and go back to the pool at the write deadline."""
    stack, rid = short_lease_stack, short_lease_stack.rid()
    reply = reserve_in_place(stack, rid)
    assert stack.dstub.Abort(pb.AbortRequest(request_id=rid), timeout=5).found  # not from the sender
    # The abort is answered: it has deferred the release (or made it, wrongly) by now, no sleep needed.
    assert not stack.decode.engine_loop.call(lambda e: e.is_idle_and_clean()).result(5)  # still held
    assert stack.decode.extra["servicer"]._incoming[rid].phase.value == "deferred"
    assert 0 < reply.write_deadline - time.monotonic() < LEASE_S  # and seen so before the deadline
    assert stack.clean(timeout=LEASE_S + 30)  # freed once the deadline passed


def test_an_in_place_sender_that_stopped_frees_the_reservation_at_once(short_lease_stack):
    stack, rid = short_lease_stack, short_lease_stack.rid()
    reserve_in_place(stack, rid)
    assert stack.dstub.Abort(pb.AbortRequest(request_id=rid, sender_stopped=True), timeout=5).found
    assert stack.clean(timeout=LEASE_S / 2)  # well before the deadline


def test_a_byte_chunk_for_an_in_place_reservation_is_refused_with_data_loss(short_lease_stack):
    stack, rid = short_lease_stack, short_lease_stack.rid()
    reserve_in_place(stack, rid)
    caches = stack.prefill_engine.scheduler.caches
    pages = [list(range(1, c.pages_for(len(LONG)) + 1)) for c in caches]
    with pytest.raises(grpc.RpcError) as err:
        stack.dstub.Transfer(iter_chunks(PageSource(rid, caches, pages, b""), 1 << 20), timeout=5)
    assert err.value.code() == grpc.StatusCode.DATA_LOSS and "in place" in err.value.details()
    assert stack.clean(timeout=LEASE_S / 2)  # the sender opened its Transfer: it writes no more, freed at once


def test_the_decode_side_killed_mid_transfer_fails_the_request_and_frees_the_prefill_pages(models, redis_url):
    """The ipc peer is gone after the handshake (its pools stay mapped here): the in-place hand-off fails
    with a reason and the prefill side gets its pages back."""
    s = Stack(models, redis_url, transport="ipc")
    try:
        list(s.prefill_call(s.rid(), SHORT))  # a hand-off: the handshake is done, the pools mapped
        s.decode.stop(0)
        with pytest.raises(grpc.RpcError) as err:
            list(s.prefill_call(s.rid(), LONG, timeout=30))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "hand-off to decode" in err.value.details()
        assert s.prefill.engine_loop.call(lambda e: e.is_idle_and_clean()).result(5)
    finally:
        s.prefill.stop(0.2)


# ---- the hand-off overlaps the prefill ----------------------------------------------------------------
FRESH = [(i * 53 + 7) % 500 for i in range(30)]  # several chunks; no earlier test left its K/V in a pool


def prefill_holds_before(stack, monkeypatch, rid: str, condition, timeout: float = 20.0) -> dict:
    """Before the prefill engine computes ``rid``'s next chunk once its first one ran, wait (on the engine
    thread, up to ``timeout``) for ``condition(request)``; the returned dict gets ``met``: whether it
    held. The hand-off runs on other threads, so whatever it does can happen while the engine waits."""
    engine, seen = stack.prefill_engine, {}
    launch = engine.launch

    def held_launch():
        req = engine.requests.get(rid)
        if "met" not in seen and req is not None and 0 < req.kv_len < req.prompt_len:
            deadline = time.monotonic() + timeout
            while not condition(req) and time.monotonic() < deadline:
                time.sleep(0.01)
            seen["met"] = condition(req)
        return launch()

    monkeypatch.setattr(engine, "launch", held_launch)
    return seen


def first_pages_on_decode(stack, rid: str, req, n: int) -> bool:
    """Whether positions [0, n) of ``rid`` hold on the decode side what the prefill computed (every cache
    and layer); ``req`` is the prefill engine's request (read on its engine thread)."""
    want = positions_kv(stack.prefill_engine, req, n)

    def have(engine):
        moved = engine.requests.get(rid)
        return moved is not None and all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
                                         for a, b in zip(want, positions_kv(engine, moved, n)))

    return stack.decode.engine_loop.call(have).result(5)


def test_the_first_chunk_reaches_the_decode_side_before_the_last_chunk_is_computed(stack, monkeypatch, models):
    """Observable order, not timing: the prefill engine stops after the prompt's first chunk until that
    chunk's pages (target and draft caches) are on the decode side; sent only after the prompt, they never
    would be."""
    rid, chunk = stack.rid(), stack.prefill_engine.config.chunk_size
    seen = prefill_holds_before(stack, monkeypatch, rid, lambda req: first_pages_on_decode(stack, rid, req, chunk))
    tokens, finish, events = stack.generate(FRESH, rid=rid)
    assert seen == {"met": True}
    assert tokens == make_engine(models, DRAFT, config()).generate([FRESH], GREEDY)[0].token_ids
    assert finish.reason == "length" and events[1].handed_off.bytes > 0
    assert stack.clean()


def test_a_request_stopping_at_its_first_token_frees_the_reservation_its_prefill_made(stack, single, monkeypatch):
    """Its hand-off began with its first chunk (the engine waits after it until the decode side holds the
    reservation), then its first token is a stop token: it ends there, the hand-off stops, and both
    services get every page back."""
    first, rid = single[1].token_ids[0], stack.rid()
    incoming = stack.decode.extra["servicer"]._incoming
    seen = prefill_holds_before(stack, monkeypatch, rid, lambda req: rid in incoming)
    reserved_before = stack.decode.extra["telemetry"].requests_total.labels("abort")._value.get()
    tokens, finish, events = stack.generate(LONG, SamplingParams(max_new_tokens=8, stop_token_ids=(first,)), rid=rid)
    assert tokens == [first] and finish.reason == "stop" and len(events) == 1 and seen == {"met": True}
    assert stack.clean()
    wait_until(lambda: stack.decode.extra["telemetry"].requests_total.labels("abort")._value.get()
               == reserved_before + 1)  # there was a reservation, and it was aborted


def test_prefill_abort_mid_prefill_frees_both_sides(stack, monkeypatch):
    """Aborted while its prompt is half prefilled (the engine waits after its first chunk until the abort
    began) and its first pages are on their way: the Prefill call ends ABORTED, and both services get every
    page back (the decode side's reservation included)."""
    rid = stack.rid()
    incoming, jobs = stack.decode.extra["servicer"]._incoming, stack.prefill.extra["servicer"]._jobs

    holding = threading.Event()  # the engine waits before the request's second chunk (asking the condition)

    def abort_began(req):
        holding.set()
        job = jobs.get(rid)
        return job is not None and job.source is not None and job.source.guard.cancelled

    seen = prefill_holds_before(stack, monkeypatch, rid, abort_began)
    call = stack.prefill_call(rid, FRESH)
    # Reserved on the decode side (as it arrived), and its first chunk ran: the engine holds before the next.
    wait_until(lambda: rid in incoming and holding.is_set())
    assert stack.pstub.Abort(pb.AbortRequest(request_id=rid), timeout=30).found
    with pytest.raises(grpc.RpcError) as err:
        list(call)
    assert err.value.code() == grpc.StatusCode.ABORTED and seen == {"met": True}
    assert stack.clean()


@pytest.mark.parametrize("transport", ["grpc-stream", "ipc"])
def test_the_decode_side_gone_mid_prefill_fails_the_request_and_frees_the_prefill_pages(models, redis_url,
                                                                                     monkeypatch, transport):
    """The decode service stops while the prompt is half prefilled and its pages already travel: the
    request fails with a reason, and the prefill side gets its pages back."""
    s = Stack(models, redis_url, transport=transport)
    try:
        rid, gone, holding = s.rid(), threading.Event(), threading.Event()
        incoming = s.decode.extra["servicer"]._incoming
        seen = prefill_holds_before(s, monkeypatch, rid, lambda req: holding.set() or gone.is_set())
        call = s.prefill_call(rid, FRESH)
        # Reserved (the hand-off is under way) and the first chunk ran: the engine holds before the next.
        wait_until(lambda: rid in incoming and holding.is_set())
        s.decode.stop(0)
        gone.set()
        with pytest.raises(grpc.RpcError) as err:
            list(call)
        assert seen == {"met": True}
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "hand-off to decode" in err.value.details()
        assert s.prefill.engine_loop.call(lambda e: e.is_idle_and_clean()).result(5)
    finally:
        s.prefill.stop(0.2)


@pytest.mark.parametrize("transport", ["grpc-stream", "ipc"])
def test_the_prefill_side_gone_mid_prefill_frees_the_decode_reservation_by_the_attach_deadline(
        models, redis_url, monkeypatch, transport):
    """The prefill service stops while the prompt is half prefilled (its transfer open, or its in-place
    writes begun): the decode side's reservation is freed by the attach deadline at the latest."""
    s = Stack(models, redis_url, transport=transport, stream_attach_timeout_s=2.0)
    try:
        rid, gone, holding = s.rid(), threading.Event(), threading.Event()
        incoming = s.decode.extra["servicer"]._incoming
        prefill_holds_before(s, monkeypatch, rid, lambda req: holding.set() or gone.is_set())
        call = s.prefill_call(rid, FRESH)
        wait_until(lambda: rid in incoming and holding.is_set())  # reserved, and the first chunk ran
        t0 = time.monotonic()
        stopping = threading.Thread(target=s.prefill.stop, args=(0,))
        stopping.start()
        gone.set()
        stopping.join(10)
        with pytest.raises(grpc.RpcError):
            list(call)
        assert clean_within(s.decode.engine_loop, t0 + 2.0 + 1.0)  # the deadline, and the reaper's poll
    finally:
        s.decode.stop(0.2)


def clean_within(loop, deadline: float) -> bool:
    """Whether the engine of ``loop`` has every page back by ``deadline`` (time.monotonic)."""
    while not loop.call(lambda e: e.is_idle_and_clean()).result(5):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def wait_for(condition, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_receiving_never_stalls_decoding_and_the_request_joins_at_the_next_step(stream_stack, monkeypatch):
    """A slow sender (it waits between its first and second chunk until the running request has streamed
    8 more tokens, up to 30 s) while another request decodes on the same decode instance: that request
    keeps producing tokens while the transfer is open, and the transferred request commits its first
    tokens in the very step after the one its activation followed."""
    stack = stream_stack
    running, stream = start_long_stream(stack)
    streamed = {"n": 0}

    def consume():
        for msg in stream:
            streamed["n"] += len(msg.token_ids)

    consumer = threading.Thread(target=consume, daemon=True)
    consumer.start()
    transport, during = stack.prefill.extra["servicer"].transports["grpc-stream"], {}
    messages = transport._messages

    def slow(source):
        for i, msg in enumerate(messages(source)):
            if i == 1:  # the decode side opened the transfer with the first chunk
                during["opened"] = streamed["n"]
                during["kept_decoding"] = wait_for(lambda: streamed["n"] >= during["opened"] + 8, 30)
            if pb.KVChunk.FromString(msg).last:  # (the transport sends them serialized)
                during["closed"] = streamed["n"]
            yield msg

    monkeypatch.setattr(transport, "_messages", slow)
    loop, rid, steps = stack.decode.engine_loop, stack.rid(), {"n": 0}
    engine = loop.engine
    step, activate = loop.step_once, engine.activate_handoff

    def counted_step():
        events = step()
        steps["n"] += 1
        if "joined" not in steps and any(r.rid == rid and tokens for r, tokens in events):
            steps["joined"] = steps["n"]
        return events

    def counted_activate(req, *args, **kw):
        if req.rid == rid:
            steps["activated_after"] = steps["n"]
        return activate(req, *args, **kw)

    monkeypatch.setattr(loop, "step_once", counted_step)
    monkeypatch.setattr(engine, "activate_handoff", counted_activate)
    tokens, finish, _ = stack.generate(LONG, rid=rid)
    assert during["kept_decoding"] and during["closed"] - during["opened"] >= 8, during
    assert finish.reason == "length" and len(tokens) == GREEDY.max_new_tokens
    assert steps["joined"] == steps["activated_after"] + 1, steps
    consumer.join(60)
    assert stack.clean()


def test_a_stream_that_gets_no_token_ends_with_deadline_exceeded_and_frees_the_pages(models, redis_url):
    """A stream waits on its request's queue (no polling): with no token for ``stream_idle_timeout_s`` (here a
    reservation whose transfer never comes) it ends with DEADLINE_EXCEEDED and the request is aborted."""
    s = Stack(models, redis_url, stream_idle_timeout_s=1.0)
    try:
        rid = s.rid()
        reserve_directly(s, rid)
        with pytest.raises(grpc.RpcError) as err:
            list(s.dstub.Stream(pb.StreamRequest(request_id=rid), timeout=60))
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert err.value.details() == f"{rid}: no token for 1.0s"
        assert s.clean()
        wait_until(lambda: aborted_on_decode(s) == 1)
        assert s.decode.engine_loop.subscribers() == 0
    finally:
        s.stop()
