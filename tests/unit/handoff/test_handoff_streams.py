"""A hand-off split over several parallel streams (``Lane``s): the planes are shared out whole, each stream is
checked on its own (order, count, its last chunk), the receiver completes the hand-off when the last stream
ends, and one stream failing fails the whole hand-off: over real gRPC, the sender cancels the other streams
and raises at once, and the decode service frees the reservation.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from proto.eyrie.v1 import eyrie_pb2 as pb
from proto.eyrie.v1 import eyrie_pb2_grpc as pb_grpc
from services.common import start_grpc_server
from shared.handoff import (
    GrpcStreamTransport,
    Increment,
    PageFeed,
    PageGuard,
    PageSink,
    PageSource,
    Prefilled,
    TransferCancelled,
    TransferError,
    iter_chunks,
)
from shared.handoff.transport import add_decode_servicer
from shared.handoff.wire import page_bytes, split_lanes
from shared.memory.kv_cache import CacheLayout, KVCache
from tests.polling import poll, wait_for

PS = 4


def cache(layers: int, seed: int, pages: int = 16) -> KVCache:
    c = KVCache(CacheLayout(num_layers=layers, num_kv_heads=2, head_dim=8, dtype=torch.float32,
                          device=torch.device("cpu"), page_size=PS, num_pages=pages, max_reqs=4, max_context=64))
    g = torch.Generator().manual_seed(seed)
    c.pool.copy_(torch.randn(c.pool.shape, generator=g))
    return c


def pair():
    """A target cache of 3 layers and a draft cache of 1 on each side, and their (fragmented) pages."""
    srcs, dsts = [cache(3, 0), cache(1, 1)], [cache(3, 10), cache(1, 11)]
    return srcs, dsts, [[3, 4, 9, 10, 11], [2, 3, 4, 5, 6]], [[8, 1, 2, 3, 12], [7, 6, 5, 4, 3]]


def same_pages(srcs, dsts, src_pages, dst_pages) -> bool:
    return all(torch.equal(s.pool[:, :, a * PS:(a + 1) * PS], d.pool[:, :, b * PS:(b + 1) * PS])
               for s, d, sp, dp in zip(srcs, dsts, src_pages, dst_pages) for a, b in zip(sp, dp))


def lane_chunks(source: PageSource, streams: int, chunk_bytes: int) -> list[list[pb.KVChunk]]:
    return [list(iter_chunks(source, chunk_bytes, lane=lane)) for lane in split_lanes(source, streams)]


def test_the_planes_are_shared_out_whole_in_ranges_and_never_more_streams_than_planes():
    srcs = [cache(3, 0), cache(1, 1)]
    source = PageSource("r", srcs, [[1], [1]], b"")
    lanes = split_lanes(source, 3)
    assert [sorted(lane.planes) for lane in lanes] == [[(0, 0)], [(0, 1)], [(0, 2), (1, 0)]]
    assert {(lane.index, lane.count) for lane in lanes} == {(0, 3), (1, 3), (2, 3)}
    assert [len(lane.planes) for lane in split_lanes(source, 8)] == [1, 1, 1, 1]  # one plane per stream at most
    assert len(split_lanes(source, 1)) == 1 and split_lanes(source, 1)[0].planes == frozenset(
        {(0, 0), (0, 1), (0, 2), (1, 0)})


def test_a_hand_off_over_several_streams_arrives_whole_whatever_the_interleaving():
    srcs, dsts, src_pages, dst_pages = pair()
    source = PageSource("r", srcs, src_pages, b"state")
    lanes = lane_chunks(source, 3, 2 * page_bytes(srcs[0]))
    assert all(c.streams == 3 and c.stream == i for i, chunks in enumerate(lanes) for c in chunks)
    assert [c.seq for c in lanes[1]] == list(range(len(lanes[1])))  # each stream numbers its own chunks
    assert [bool(chunks[-1].draft_state) for chunks in lanes] == [True, False, False]  # stream 0 carries it
    sink = PageSink("r", dsts, dst_pages)
    for i in range(max(map(len, lanes))):  # round robin over the streams, the last stream's end first
        for chunks in reversed(lanes):
            if i < len(chunks):
                sink.write(chunks[i])
    ends = [sink.finish(lanes[2][-1]), sink.finish(lanes[0][-1])]
    assert [e.complete for e in ends] == [False, False] and ends[0].chunks == len(lanes[2])
    assert ends[0].bytes == sum(len(c.k) + len(c.v) for c in lanes[2])  # a stream's own share
    done = sink.finish(lanes[1][-1])  # the last stream to end completes the hand-off
    assert done.complete and done.draft_state == b"state" and done.chunks == sum(map(len, lanes))
    assert done.bytes == sum(len(c.k) + len(c.v) for chunks in lanes for c in chunks) + len(b"state")
    assert same_pages(srcs, dsts, src_pages, dst_pages)


def test_each_stream_is_checked_on_its_own():
    srcs, dsts, src_pages, dst_pages = pair()
    source = PageSource("r", srcs, src_pages, b"state")
    chunk = 2 * page_bytes(srcs[0])

    def sink_after(lanes, n: int) -> PageSink:
        sink = PageSink("r", dsts, dst_pages)
        for c in lanes[0][:n]:
            sink.write(c)
        return sink

    lanes = lane_chunks(source, 2, chunk)
    with pytest.raises(TransferError, match="arrived as chunk 1: chunks lost"):  # a stream's chunk lost
        sink_after(lanes, 1).write(lanes[0][2])
    with pytest.raises(TransferError, match="hand-off came in 2 streams"):  # a stream of another split
        sink_after(lanes, 1).write(lane_chunks(source, 3, chunk)[1][0])
    sink = sink_after(lanes, len(lanes[0]))
    assert not sink.finish(lanes[0][-1]).complete
    with pytest.raises(TransferError, match="after the last chunk of its stream 0"):  # a stream ends once
        sink.write(lanes[0][0])
    with pytest.raises(TransferError, match="the sender sent"):  # a stream's count checked at its end
        sink_after(lanes, 2).finish(lanes[0][-1])
    lanes[1][-1].draft_state = b"state"
    sink = sink_after(lanes, len(lanes[0]))
    for c in lanes[1]:
        sink.write(c)
    with pytest.raises(TransferError, match="only stream 0 does"):
        sink.finish(lanes[1][-1])
    lanes = lane_chunks(source, 2, chunk)
    sink = sink_after(lanes, len(lanes[0]))
    for c in lanes[1][:-1]:  # the other stream's end never arrives: never complete
        sink.write(c)
    assert not sink.finish(lanes[0][-1]).complete
    with pytest.raises(TransferError, match="ended before its last chunk"):
        sink.finish(lanes[1][-2])


def test_the_streams_read_one_feed_each_increment_once_and_stop_together_when_cancelled():
    """Fed increments (the prefill under way) are taken once and read by every stream on its own thread."""
    srcs, dsts, src_pages, dst_pages = pair()
    source = PageSource("r", srcs, [], b"", feed=PageFeed())
    lanes = split_lanes(source, 3)
    chunked = [[] for _ in lanes]

    def read(lane):
        for chunk in iter_chunks(source, page_bytes(srcs[0]), lane=lane):
            chunked[lane.index].append(chunk)

    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(read, lane) for lane in lanes]
        try:
            source.feed.put(Increment(src_pages, [2, 2]))
            # Every stream sends the first increment's pages while the next one has not come (the engine may wait
            # for them before it computes more): no stream waits behind another's wait for the next increment.
            wait_for(lambda: all(chunked), 60)
            assert [bool(c) for c in chunked] == [True] * 3 and not any(f.done() for f in futures)
            source.feed.put(Increment(src_pages, [5, 5], last=Prefilled(b"state", (11,), (-0.5,))))
            for f in futures:
                f.result(10)
        finally:
            source.guard.cancel()  # after a failed check, the streams stop rather than wait for more
    sink = PageSink("r", dsts, dst_pages)
    for chunks in chunked:
        for c in chunks:
            sink.write(c)
    results = [sink.finish(chunks[-1]) for chunks in chunked]
    assert results[-1].complete and results[-1].output_ids == [11] and results[-1].draft_state == b"state"
    assert same_pages(srcs, dsts, src_pages, dst_pages)
    waiting = PageSource("w", srcs, [], b"", feed=PageFeed())
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(lambda lane: list(iter_chunks(waiting, page_bytes(srcs[0]), lane=lane)), lane)
                   for lane in split_lanes(waiting, 2)]
        waiting.guard.cancel()
        for f in futures:
            with pytest.raises(TransferCancelled):
                f.result(10)


def test_the_guard_lets_streams_write_at_once_and_cancel_waits_for_all_of_them():
    guard, inside, release = PageGuard(), threading.Barrier(3), threading.Event()

    def access():
        with guard.access():
            inside.wait(30)  # both accesses are in at once
            release.wait(60)

    with ThreadPoolExecutor(3) as pool:
        writers = [pool.submit(access) for _ in range(2)]
        inside.wait(30)
        cancelled = pool.submit(guard.cancel)
        poll(lambda: guard.cancelled, 30, "cancel never began")
        assert not cancelled.done()  # waits for the accesses in progress
        release.set()
        assert cancelled.result(30) and all(w.result(30) is None for w in writers)
    with pytest.raises(TransferCancelled), guard.access():
        pass


class OneStreamFails(pb_grpc.DecodeServicer):
    """Stream 1 refuses its second chunk once every other stream has written its first; each other stream then
    waits for its call to be cancelled (and counts it). Stream 1 waiting keeps the others' first chunks from
    racing the abort (a stream cancelled before its handler saw a chunk would count nothing)."""

    def __init__(self, sink: PageSink, others: int = 2):
        self.sink, self.others = sink, others
        self.cancelled, self.arrived = threading.Semaphore(0), threading.Semaphore(0)

    def Transfer(self, request_iterator, context):  # noqa: N802
        for i, chunk in enumerate(request_iterator):
            if chunk.stream == 1 and i == 1:
                assert all(self.arrived.acquire(timeout=30) for _ in range(self.others))
                context.abort(grpc.StatusCode.DATA_LOSS, "stream 1: chunk 1 refused")
            self.sink.write(chunk)
            if chunk.stream != 1:
                ended = threading.Event()
                waiting = context.add_callback(ended.set)  # the call ends: here, by the client's cancel
                self.arrived.release()
                if waiting:  # (False: it has ended already)
                    ended.wait(60)
                if not context.is_active():
                    self.cancelled.release()
                return pb.TransferAck()
        return pb.TransferAck()


def test_a_stream_failing_mid_way_cancels_the_others_and_fails_the_hand_off_at_once():
    srcs, dsts, src_pages, dst_pages = pair()
    servicer = OneStreamFails(PageSink("r", dsts, dst_pages))
    server, port, _ = start_grpc_server("127.0.0.1", 0, [(add_decode_servicer, servicer)], [])
    transport = GrpcStreamTransport(chunk_bytes=page_bytes(srcs[0]), streams=3)
    try:
        t0 = time.perf_counter()
        with pytest.raises(grpc.RpcError) as err:
            transport.send(f"127.0.0.1:{port}", PageSource("r", srcs, src_pages, b"state"), timeout=30)
        assert err.value.code() == grpc.StatusCode.DATA_LOSS and "stream 1" in err.value.details()
        assert time.perf_counter() - t0 < 15  # at once (milliseconds), not at the 30 s deadline
        assert all(servicer.cancelled.acquire(timeout=30) for _ in range(2))  # streams 0 and 2 were cancelled
    finally:
        transport.close()
        server.stop(0)
