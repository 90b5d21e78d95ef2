"""On the GPU: the hand-off between two CUDA engines (the decode one replaying CUDA graphs from the
first step after the hand-off) and through the two services equals the single-process engine, which
equals the CPU engine, token for token (float32)."""

from __future__ import annotations

import pytest
import torch
from handoff_helpers import GREEDY, PROMPTS, engine_config, hand_off, load_models, make_engine, prefill_until_handoff

from proto.eyrie.v1 import eyrie_pb2 as pb
from shared.handoff import sampling_to_pb

pytestmark = pytest.mark.gpu

CASES = [(None, 1, 16), ("eagle", 4, 1), ("eagle3", 4, 16), ("mtp", 1, 16)]


@pytest.fixture(scope="module")
def models(oracle_model_dir):
    return {"cpu": load_models(oracle_model_dir), "cuda": load_models(oracle_model_dir, device="cuda")}


def config(draft, topk, page_size, device, graphs=False):
    return engine_config(draft, topk, page_size, max_context=512, device=device, cuda_graph=graphs)


@pytest.mark.parametrize("draft, topk, page_size", CASES)
def test_hand_off_between_cuda_engines_with_graphs_equals_one_engine(models, draft, topk, page_size):
    cpu = make_engine(models["cpu"], draft, config(draft, topk, page_size, "cpu")).generate(PROMPTS, GREEDY)
    gpu = make_engine(models["cuda"], draft, config(draft, topk, page_size, "cuda", True)).generate(PROMPTS, GREEDY)
    assert [r.token_ids for r in gpu] == [r.token_ids for r in cpu]
    prefill = make_engine(models["cuda"], draft, config(draft, topk, page_size, "cuda"), role="prefill")
    decode = make_engine(models["cuda"], draft, config(draft, topk, page_size, "cuda", True), role="decode")
    reqs = prefill_until_handoff(prefill, PROMPTS, GREEDY)
    moved = []
    for req in reqs:
        moved.append(hand_off(prefill, req, decode))
        if req.draft_state is not None:
            assert moved[-1].draft_state.hidden.device.type == "cuda"
            assert torch.equal(moved[-1].draft_state.hidden, req.draft_state.hidden)
        prefill.release(req)
    decode.run_until_done()
    assert [decode.result(d).token_ids for d in moved] == [r.token_ids for r in cpu]
    assert prefill.is_idle_and_clean() and decode.is_idle_and_clean()


def test_services_on_cuda_equal_the_single_process_engine(models, tmp_path):
    import grpc

    from proto.eyrie.v1 import eyrie_pb2_grpc as pb_grpc
    from services.decode.server import start_decode
    from services.metadata import EmbeddedRedis
    from services.prefill.server import start_prefill
    from services.settings import DecodeSettings, PrefillSettings

    m = models["cuda"]
    want = make_engine(m, "eagle3", config("eagle3", 4, 16, "cuda", True)).generate(PROMPTS, GREEDY)
    redis = EmbeddedRedis()
    url = redis.start()
    prefill = start_prefill(PrefillSettings(redis_url=url), make_engine(m, "eagle3", config("eagle3", 4, 16, "cuda"),
                                                                        role="prefill"))
    decode = start_decode(DecodeSettings(redis_url=url), make_engine(m, "eagle3", config("eagle3", 4, 16, "cuda", True),
                                                                     role="decode"))
    try:
        pstub = pb_grpc.PrefillStub(grpc.insecure_channel(prefill.grpc_address))
        dstub = pb_grpc.DecodeStub(grpc.insecure_channel(decode.grpc_address))
        for i, (prompt, w) in enumerate(zip(PROMPTS, want)):
            events = list(pstub.Prefill(pb.PrefillRequest(request_id=f"g{i}", prompt_ids=prompt,
                                                          sampling=sampling_to_pb(GREEDY),
                                                          decode_address=decode.grpc_address), timeout=60))
            tokens = [events[0].first_token.token_id]
            for msg in dstub.Stream(pb.StreamRequest(request_id=f"g{i}"), timeout=60):
                tokens += msg.token_ids
            assert tokens == w.token_ids
        for h in (prefill, decode):
            assert h.engine_loop.call(lambda e: e.is_idle_and_clean()).result(10)
    finally:
        prefill.stop(0.5)
        decode.stop(0.5)
        redis.stop()


@pytest.mark.parametrize("transport", ["ipc", "grpc-stream"])
def test_services_on_cuda_over_each_transport_equal_the_engine_and_count_the_hand_off_bytes(models, transport):
    """The stack in-process on the GPU with the transport forced (ipc: CUDA IPC handles, side-stream copies
    after each prefill step's event; grpc-stream: pinned staging, the decode side's indexed copy into
    fragmented pages): greedy output equals the single-process engine's, chunked prompts included, and each
    hand-off reports exactly the K/V bytes of its pages in every cache (plus its draft state)."""
    import grpc

    from proto.eyrie.v1 import eyrie_pb2_grpc as pb_grpc
    from services.decode.server import start_decode
    from services.metadata import EmbeddedRedis
    from services.prefill.server import start_prefill
    from services.settings import DecodeSettings, PrefillSettings

    m, cfg = models["cuda"], config("eagle3", 4, 16, "cuda")
    want = make_engine(m, "eagle3", config("eagle3", 4, 16, "cuda", True)).generate(PROMPTS, GREEDY)
    prefill_engine = make_engine(m, "eagle3", cfg, role="prefill")
    redis = EmbeddedRedis()
    url = redis.start()
    prefill = start_prefill(PrefillSettings(redis_url=url, handoff_transport=transport), prefill_engine)
    decode = start_decode(DecodeSettings(redis_url=url, handoff_transport=transport),
                          make_engine(m, "eagle3", config("eagle3", 4, 16, "cuda", True), role="decode"))
    try:
        pstub = pb_grpc.PrefillStub(grpc.insecure_channel(prefill.grpc_address))
        dstub = pb_grpc.DecodeStub(grpc.insecure_channel(decode.grpc_address))
        caches = prefill_engine.scheduler.caches
        for i, (prompt, w) in enumerate(zip(PROMPTS, want)):
            rid = f"{transport}-{i}"
            events = list(pstub.Prefill(pb.PrefillRequest(request_id=rid, prompt_ids=prompt,
                                                          sampling=sampling_to_pb(GREEDY),
                                                          decode_address=decode.grpc_address), timeout=60))
            kv = sum(c.pages_for(len(prompt)) * c.layout.num_layers * 2 * c.page_size * c.layout.num_kv_heads
                     * c.layout.head_dim * c.pool.element_size() for c in caches)
            assert kv <= events[1].handed_off.bytes <= kv + (64 << 10), (kv, events[1].handed_off.bytes)
            tokens = [events[0].first_token.token_id]
            for msg in dstub.Stream(pb.StreamRequest(request_id=rid), timeout=60):
                tokens += msg.token_ids
            assert tokens == w.token_ids
        for h in (prefill, decode):
            assert h.engine_loop.call(lambda e: e.is_idle_and_clean()).result(10)
    finally:
        prefill.stop(0.5)
        decode.stop(0.5)
        redis.stop()


def test_an_in_place_write_waits_for_its_steps_event_not_for_later_work():
    """An ipc increment is copied once the step that wrote its pages is done (its event): the copy sees
    those writes, and does not wait behind work queued on the prefill's stream after them (a second's
    kernel here, as later chunks of other requests would be)."""
    import time
    from types import SimpleNamespace

    from kernels.page_copy import copy_pages
    from shared.handoff.ipc import write_in_place
    from shared.handoff.wire import Increment, PageFeed, PageSource, Prefilled

    page_size, dev = 4, torch.device("cuda")
    src, dst = torch.zeros(2, 3, 32, 2, 8, device=dev), torch.zeros(2, 3, 32, 2, 8, device=dev)
    copy_pages(dst, src, [0, 1], [5, 6], page_size)  # compiled before the clock starts
    torch.cuda.synchronize()
    torch.cuda._sleep(50_000_000)  # the step: the pages are written late
    src[:, :, 0:8] = 1.0  # pages 0 and 1
    written = torch.cuda.Event()
    written.record()
    torch.cuda._sleep(2_000_000_000)  # later work on the same stream (over a second)
    feed = PageFeed()
    feed.put(Increment([[0, 1]], [2], written, Prefilled(b"")))
    source = PageSource("r", [SimpleNamespace(pool=src, page_size=page_size)], [], b"", feed=feed)
    t0 = time.perf_counter()
    out = write_in_place(source, [dst], [[5, 6]], time.monotonic() + 60)
    took = time.perf_counter() - t0
    busy = not torch.cuda.default_stream(dev).query()  # the later work still runs
    assert busy and took < 0.5, took
    assert bool((dst[:, :, 20:28] == 1).all()) and float(dst.sum()) == 2 * 3 * 8 * 2 * 8
    assert out.bytes == 2 * page_size * 2 * 3 * 2 * 8 * 4
    torch.cuda.synchronize()


@pytest.mark.parametrize("transport", ["ipc", "grpc-stream"])
def test_a_decode_cache_on_cuda_is_sent_only_the_pages_it_lacks(models, transport):
    """The decode instance's prefix cache on the GPU (CUDA graphs on the decode side): a second prompt sharing the
    first's two whole pages is handed off with its third page only (its K/V bytes, plus the draft state), over
    ipc (in-place copies from the page it lacks on) and the gRPC stream; greedy output equals the single-process
    engine's and every pool is full after (the decode cache flushed)."""
    import grpc

    from proto.eyrie.v1 import eyrie_pb2_grpc as pb_grpc
    from services.decode.server import start_decode
    from services.metadata import EmbeddedRedis
    from services.prefill.server import start_prefill
    from services.settings import DecodeSettings, PrefillSettings
    from shared.handoff.wire import page_bytes

    shared = [(i * 37 + 11) % 500 for i in range(40)]  # pages 0-1 shared, their successor (token 32) too
    prompts = [shared + list(range(1, 9)), shared + list(range(9, 17))]
    m = models["cuda"]
    want = make_engine(m, "eagle3", config("eagle3", 4, 16, "cuda", True)).generate(prompts, GREEDY)
    prefill_engine = make_engine(m, "eagle3", config("eagle3", 4, 16, "cuda"), role="prefill")
    decode_cfg = engine_config("eagle3", 4, 16, max_context=512, device="cuda", cuda_graph=True, prefix_cache=True)
    redis = EmbeddedRedis()
    url = redis.start()
    prefill = start_prefill(PrefillSettings(redis_url=url, handoff_transport=transport), prefill_engine)
    decode = start_decode(DecodeSettings(redis_url=url, handoff_transport=transport),
                          make_engine(m, "eagle3", decode_cfg, role="decode"))
    try:
        pstub = pb_grpc.PrefillStub(grpc.insecure_channel(prefill.grpc_address))
        dstub = pb_grpc.DecodeStub(grpc.insecure_channel(decode.grpc_address))
        per_page = sum(c.layout.num_layers * page_bytes(c) for c in prefill_engine.scheduler.caches)
        for i, (prompt, w, held) in enumerate(zip(prompts, want, (0, 2))):
            rid = f"cached-{transport}-{i}"
            events = list(pstub.Prefill(pb.PrefillRequest(request_id=rid, prompt_ids=prompt,
                                                          sampling=sampling_to_pb(GREEDY),
                                                          decode_address=decode.grpc_address), timeout=60))
            kv = (3 - held) * per_page  # 48 tokens: 3 pages of 16
            assert kv <= events[1].handed_off.bytes <= kv + (64 << 10), (held, kv, events[1].handed_off.bytes)
            tokens = [events[0].first_token.token_id]
            for msg in dstub.Stream(pb.StreamRequest(request_id=rid), timeout=60):
                tokens += msg.token_ids
            assert tokens == w.token_ids
        decode.engine_loop.call(lambda e: e.flush_prefix_cache()).result(10)
        for h in (prefill, decode):
            assert h.engine_loop.call(lambda e: e.is_idle_and_clean()).result(10)
    finally:
        prefill.stop(0.5)
        decode.stop(0.5)
        redis.stop()
