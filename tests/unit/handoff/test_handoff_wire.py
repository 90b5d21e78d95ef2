"""The KV wire format on bare caches (no model): page order, coalescing, chunk limits, checks.

Round trips move a request's pages between two pools laid out differently; the bytes at every
position are identical after, whatever the fragmentation. Every corruption a receiver can see
(checksum, order, duplicates, sizes, ranges, truncation, a wrong count, a foreign draft state) is
refused with a message saying what; a released request's pages are never touched again. What the gRPC
stream sends (serialized once, read back without copying K and V, read ahead on a thread) is the same
message; a source fed increments sends each page once, as the prefill completes it.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from proto.eyrie.v1 import eyrie_pb2 as pb
from shared.handoff import (
    CacheShape,
    HandoffSchema,
    Increment,
    PageFeed,
    PageGuard,
    PageSink,
    PageSource,
    Prefilled,
    TransferCancelled,
    TransferError,
    coalesce,
    decode_draft_state,
    iter_chunks,
)
from shared.handoff.transport import read_ahead
from shared.handoff.wire import as_wire, page_bytes, parse_wire
from shared.memory.kv_cache import CacheLayout, KVCache
from shared.spec.state import DraftState

PS = 4


def cache(layers: int = 2, heads: int = 2, dim: int = 8, pages: int = 16, seed: int = 0,
          dtype: torch.dtype = torch.float32) -> KVCache:
    c = KVCache(CacheLayout(num_layers=layers, num_kv_heads=heads, head_dim=dim, dtype=dtype,
                          device=torch.device("cpu"), page_size=PS, num_pages=pages, max_reqs=4, max_context=64))
    g = torch.Generator().manual_seed(seed)
    for t in [*c.k, *c.v]:
        t.copy_(torch.randn(t.shape, generator=g).to(dtype))
    return c


def pages_kv(c: KVCache, pages: list[int]) -> list[torch.Tensor]:
    """K and V of the given pages, per layer, in page order."""
    idx = torch.tensor([p * PS + i for p in pages for i in range(PS)])
    return [t[idx] for layer in range(c.layout.num_layers) for t in (c.k[layer], c.v[layer])]


def round_trip(src_pages: list[list[int]], dst_pages: list[list[int]], chunk_bytes: int, shapes=((2, 2, 8),)):
    srcs = [cache(*s, seed=i) for i, s in enumerate(shapes)]
    dsts = [cache(*s, seed=10 + i) for i, s in enumerate(shapes)]
    source = PageSource("r", srcs, src_pages, b"state")
    sink = PageSink("r", dsts, dst_pages)
    chunks = list(iter_chunks(source, chunk_bytes))
    for ch in chunks:
        sink.write(ch)
    received = sink.finish(chunks[-1])
    return srcs, dsts, chunks, received


def test_coalesce_finds_contiguous_runs_in_request_order():
    runs = coalesce([3, 4, 5, 9, 10, 2])
    assert [(r.first, r.page, r.count) for r in runs] == [(0, 3, 3), (3, 9, 2), (5, 2, 1)]
    assert len(coalesce(list(range(1, 9)))) == 1
    assert coalesce([]) == []


def test_fragmented_pages_send_more_runs_and_arrive_identical():
    contiguous, fragmented = [1, 2, 3, 4, 5, 6], [7, 2, 3, 12, 5, 9]
    big = 1 << 20  # no cutting: one chunk per run per layer
    _, _, whole, _ = round_trip([contiguous], [[8, 9, 10, 11, 12, 13]], big)
    srcs, dsts, pieces, received = round_trip([fragmented], [[14, 1, 6, 3, 10, 4]], big)
    assert len(whole) == 2 * 1 and len(pieces) == 2 * len(coalesce(fragmented)) == 2 * 5
    for a, b in zip(pages_kv(srcs[0], fragmented), pages_kv(dsts[0], [14, 1, 6, 3, 10, 4])):
        assert torch.equal(a, b)
    assert received.draft_state == b"state" and received.chunks == len(pieces)
    assert received.bytes == sum(len(c.k) + len(c.v) for c in pieces) + len(b"state")


def test_order_is_cache_then_layer_then_position_and_every_chunk_fits_the_limit():
    shapes = ((2, 2, 8), (1, 2, 16))  # a target and a draft cache with pages twice as wide
    src = [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]]
    dst = [[5, 4, 3, 2, 1], [10, 11, 12, 13, 14]]
    limit = 2 * page_bytes(cache(1, 2, 16))  # two draft pages, four target pages per message
    srcs, dsts, chunks, _ = round_trip(src, dst, limit, shapes)
    assert all(len(c.k) + len(c.v) <= limit for c in chunks)
    assert [(c.cache, c.layer, c.first_page, c.num_pages) for c in chunks] == [
        (0, 0, 0, 4), (0, 0, 4, 1), (0, 1, 0, 4), (0, 1, 4, 1), (1, 0, 0, 2), (1, 0, 2, 2), (1, 0, 4, 1)]
    assert [c.seq for c in chunks] == list(range(len(chunks)))
    assert [c.last for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert chunks[-1].total_chunks == len(chunks) and chunks[-1].draft_state == b"state"
    assert all(not c.draft_state for c in chunks[:-1])
    for c in range(2):
        for a, b in zip(pages_kv(srcs[c], src[c]), pages_kv(dsts[c], dst[c])):
            assert torch.equal(a, b)


def test_bfloat16_pages_travel_bit_for_bit():
    src, dst = cache(dtype=torch.bfloat16), cache(seed=3, dtype=torch.bfloat16)
    sink = PageSink("r", [dst], [[9, 3]])
    chunks = list(iter_chunks(PageSource("r", [src], [[2, 5]], b""), page_bytes(src)))
    for ch in chunks:
        sink.write(ch)
    sink.finish(chunks[-1])
    for a, b in zip(pages_kv(src, [2, 5]), pages_kv(dst, [9, 3])):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_chunks_are_read_lazily():
    """Bounded memory in flight: a page is read when its chunk is asked for, not before."""
    src = cache()
    gen = iter_chunks(PageSource("r", [src], [[1, 2, 3]], b""), page_bytes(src))
    first = next(gen)
    src.k[1][:].fill_(7.0)  # layer 1 is read later: the change shows in its chunks
    rest = list(gen)
    assert torch.frombuffer(bytearray(first.k), dtype=torch.float32).ne(7.0).any()
    assert all(torch.frombuffer(bytearray(c.k), dtype=torch.float32).eq(7.0).all() for c in rest if c.layer == 1)


def test_chunk_limit_below_one_page_is_refused():
    src = cache()
    with pytest.raises(ValueError, match="smaller than one page"):
        next(iter_chunks(PageSource("r", [src], [[1]], b""), page_bytes(src) - 1))


def chunks_of(pages=(1, 2, 3), chunk_pages: int = 1):
    src = cache()
    return list(iter_chunks(PageSource("r", [src], [list(pages)], b"state"), chunk_pages * page_bytes(src)))


def receive(chunks, pages=(4, 5, 6)):
    sink = PageSink("r", [cache(seed=9)], [list(pages)])
    for ch in chunks:
        sink.write(ch)
    return sink.finish(chunks[-1] if chunks else None)


def flip_k(chunk):
    k = bytearray(chunk.k)
    k[5] ^= 0x40
    chunk.k = bytes(k)


def resize(chunk):
    from shared.handoff.wire import checksum

    chunk.k, chunk.v = chunk.k[:-4], chunk.v[:-4]
    chunk.crc32 = checksum(chunk.k, chunk.v)


@pytest.mark.parametrize("damage, words", [
    (lambda cs: flip_k(cs[2]), "failed its CRC32"),
    (lambda cs: cs.pop(1), "chunks lost or out of order"),
    (lambda cs: cs.insert(1, cs[0]), "chunks lost or out of order"),
    (lambda cs: cs.pop(), "ended before its last chunk"),
    (lambda cs: setattr(cs[-1], "total_chunks", 9), "the sender sent 9"),
    (lambda cs: resize(cs[0]), "expected 256 each"),
    (lambda cs: setattr(cs[0], "request_id", "other"), "belongs to 'other'"),
    (lambda cs: setattr(cs[1], "first_page", 7), "the request has 3 reserved here"),
    (lambda cs: setattr(cs[1], "layer", 5), "names layer 5"),
    (lambda cs: setattr(cs[1], "cache", 1), "names cache 1"),
])
def test_receiver_refuses_damaged_transfers(damage, words):
    chunks = chunks_of()
    damage(chunks)
    with pytest.raises(TransferError, match=words):
        receive(chunks)


def test_receiver_refuses_a_page_written_twice_and_a_page_never_written():
    chunks = chunks_of()
    chunks[1].first_page = 0  # seq and CRC still fine: the receiver counts what each page got
    with pytest.raises(TransferError, match="a second time"):
        receive(chunks)
    short = chunks_of(pages=(1, 2))  # the sender has fewer pages than were reserved here
    with pytest.raises(TransferError, match="never arrived"):
        receive(short)


def test_a_cancelled_guard_stops_both_ends_before_they_touch_a_page():
    src, dst = cache(), cache(seed=4)
    guard = PageGuard()
    gen = iter_chunks(PageSource("r", [src], [[1, 2]], b"", guard), page_bytes(src))
    first = next(gen)
    assert guard.cancel() and not guard.cancel()  # only the first cancel counts
    with pytest.raises(TransferCancelled):
        next(gen)
    before = dst.k[0].clone()
    sink = PageSink("r", [dst], [[5, 6]], guard)
    with pytest.raises(TransferCancelled):
        sink.write(first)
    assert torch.equal(dst.k[0], before)


SCHEMA = HandoffSchema(version=1, page_size=PS, dtype="float32", caches=(CacheShape(2, 2, 8),), draft_kind="eagle",
                       topk=4, steps=3, num_draft_tokens=8, draft_hidden_width=32, vocab_size=100)


def state_bytes(**change) -> bytes:
    fields = dict(bonus_token=7, committed_len=10, hidden=torch.randn(32), topk_p=torch.rand(4),
                  topk_ids=torch.arange(4))
    return DraftState(**{**fields, **change}).to_bytes()


def test_draft_state_is_checked_against_the_receivers_schema():
    state = decode_draft_state(state_bytes(), SCHEMA, committed_len=10)
    assert state.bonus_token == 7 and state.hidden.shape == (32,)
    bad = [
        (state_bytes(hidden=torch.randn(96)), SCHEMA, "hidden width 96, the draft's is 32"),  # e.g. 3x EAGLE-3 width
        (state_bytes(committed_len=9), SCHEMA, "committed_len 9, the reservation is for 10"),
        (state_bytes(topk_p=torch.rand(1), topk_ids=torch.arange(1)), SCHEMA, r"topk_p of shape \(1,\)"),
        (state_bytes(bonus_token=100), SCHEMA, "outside the vocabulary"),
        (b"", SCHEMA, "no draft state arrived"),
        (b"\x05\x00\x00\x00garbage", SCHEMA, "cannot be read"),
        (state_bytes(), HandoffSchema(**{**SCHEMA.__dict__, "draft_kind": ""}), "without speculative decoding"),
    ]
    for data, schema, words in bad:
        with pytest.raises(TransferError, match=words):
            decode_draft_state(data, schema, committed_len=10)
    assert decode_draft_state(b"", HandoffSchema(**{**SCHEMA.__dict__, "draft_kind": ""}), 10) is None


# ---- what the gRPC stream sends: serialized once, read without copies ----------------------------------
def test_the_serialized_chunks_are_the_messages_and_read_back_without_a_copy():
    """``as_wire`` writes exactly the KVChunk message (any parser reads it); ``parse_wire`` gives back every
    field, K and V as views of the bytes that arrived; a receiver takes them as it takes the messages."""
    src, dst = cache(), cache(seed=4)
    source = PageSource("r", [src], [[2, 3, 7]], b"state")
    messages = list(iter_chunks(source, page_bytes(src) * 2))
    wire = list(iter_chunks(source, page_bytes(src) * 2, encode=as_wire))
    assert [pb.KVChunk.FromString(w) for w in wire] == messages and messages[-1].last
    sink = PageSink("r", [dst], [[9, 1, 5]])
    for data, message in zip(wire, messages):
        parsed = parse_wire(data)
        assert isinstance(parsed.k, memoryview) and parsed.k.obj is data  # a view, not a copy
        assert (bytes(parsed.k), bytes(parsed.v), parsed.header) == (message.k, message.v, pb.KVChunk(
            **{f.name: getattr(message, f.name) for f, _ in message.ListFields() if f.name not in ("k", "v")}))
        sink.write(parsed)
    assert sink.finish(parse_wire(wire[-1])).draft_state == b"state"
    assert all(torch.equal(a, b) for a, b in zip(pages_kv(src, [2, 3, 7]), pages_kv(dst, [9, 1, 5])))


def test_a_serialized_chunk_cut_short_is_refused():
    data = as_wire(pb.KVChunk(request_id="r", seq=1, crc32=3), memoryview(b"k" * 100), memoryview(b"v" * 100))
    assert bytes(parse_wire(data).v) == b"v" * 100
    for cut in (1, 50, len(data) - 90):
        with pytest.raises(ValueError, match="cut short"):
            parse_wire(data[:-cut])


def test_reading_ahead_keeps_the_order_hands_over_errors_and_stops_with_its_consumer():
    assert list(read_ahead(iter(range(50)), 2)) == list(range(50))

    def failing():
        yield 1
        raise TransferCancelled("released")

    ahead = read_ahead(failing(), 2)
    assert next(ahead) == 1
    with pytest.raises(TransferCancelled):
        next(ahead)
    produced = []

    def endless():
        for i in range(10 ** 6):
            produced.append(i)
            yield i

    before = set(threading.enumerate())
    ahead = read_ahead(endless(), 2)
    assert next(ahead) == 0
    (producer,) = [t for t in threading.enumerate() if t not in before and t.name == "handoff-read-ahead"]
    ahead.close()  # the consumer stops: the producer stops too, a few messages ahead at most
    producer.join(60)
    assert not producer.is_alive() and len(produced) <= 6


def test_fed_increments_send_each_page_once_as_the_prefill_completes_it():
    """A source fed increments (as the prefill service feeds it) sends the pages each one completed, once,
    and the draft state with the last; a cancelled guard stops one that waits for the next increment."""
    src, dst = cache(pages=16), cache(seed=6, pages=16)
    source = PageSource("r", [src], [], b"", feed=PageFeed())
    chunks = iter_chunks(source, 2 * page_bytes(src))
    source.feed.put(Increment([[4, 5]], [1]))  # page 5 is not complete yet
    first = next(chunks)
    assert (first.first_page, first.num_pages, first.layer, first.last) == (0, 1, 0, False)
    second = next(chunks)
    assert (second.first_page, second.layer) == (0, 1)  # the same page, layer 1; then nothing until more comes
    source.feed.put(Increment([[4, 5, 6]], [3], last=Prefilled(b"state", (11,), (-0.5,))))
    rest = list(chunks)
    assert [(c.first_page, c.num_pages) for c in rest] == [(1, 2), (1, 2)] and rest[-1].last
    assert (list(rest[-1].output_ids), rest[-1].draft_state, rest[-1].total_chunks) == ([11], b"state", 4)
    sink = PageSink("r", [dst], [[1, 2, 3]])
    for c in [first, second, *rest]:
        sink.write(c)
    assert sink.finish(rest[-1]).output_ids == [11]
    assert all(torch.equal(a, b) for a, b in zip(pages_kv(src, [4, 5, 6]), pages_kv(dst, [1, 2, 3])))
    waiting = PageSource("w", [src], [], b"", feed=PageFeed())
    gen = iter_chunks(waiting, page_bytes(src))
    waiting.guard.cancel()
    with pytest.raises(TransferCancelled):
        next(gen)


def test_pages_the_receiver_holds_are_neither_sent_nor_accepted():
    """A receiver whose prefix cache holds a request's first pages (``held``): the source, fed increments, starts
    after them in every cache (an increment completing fewer sends nothing), the sink counts them as written and
    refuses a chunk that writes one; the pages it held are untouched."""
    src, dst = [cache(pages=16), cache(3, 1, 4, pages=16, seed=1)], [cache(seed=6), cache(3, 1, 4, seed=7)]
    before = [pages_kv(c, [1, 2]) for c in dst]
    source = PageSource("r", src, [], b"", feed=PageFeed(), held=2)
    source.feed.put(Increment([[4, 5], [8, 9]], [1, 1]))  # within the held pages: nothing to send yet
    source.feed.put(Increment([[4, 5, 6, 7], [8, 9, 10, 11]], [4, 4], last=Prefilled(b"state")))
    chunks = list(iter_chunks(source, 2 * page_bytes(src[0])))
    assert {(c.cache, c.first_page, c.num_pages) for c in chunks} == {(0, 2, 2), (1, 2, 2)}
    assert len(chunks) == 2 + 3 and chunks[-1].last and chunks[-1].total_chunks == 5
    sink = PageSink("r", dst, [[1, 2, 3, 4], [1, 2, 3, 4]], held=2)
    for c in chunks:
        sink.write(c)
    assert sink.finish(chunks[-1]).draft_state == b"state"
    for s, d, b, sent in zip(src, dst, before, ([6, 7], [10, 11])):
        assert all(torch.equal(x, y) for x, y in zip(pages_kv(s, sent), pages_kv(d, [3, 4])))
        assert all(torch.equal(x, y) for x, y in zip(b, pages_kv(d, [1, 2])))  # the held pages kept
    everything = list(iter_chunks(PageSource("r", src, [[4, 5, 6, 7], [8, 9, 10, 11]], b""), 2 * page_bytes(src[0])))
    with pytest.raises(TransferError, match="a second time"):
        PageSink("r", dst, [[1, 2, 3, 4], [1, 2, 3, 4]], held=2).write(everything[0])


def test_scatter_writes_the_named_pages_only_and_never_into_a_copy():
    from shared.handoff.wire import scatter

    layer = torch.zeros(6 * PS, 2, 3, dtype=torch.bfloat16)
    data = torch.arange(3 * PS * 6, dtype=torch.float32).view(3 * PS, 2, 3).to(torch.bfloat16)
    scatter(layer, [4, 1, 2], data, PS)
    pages = layer.view(6, PS, 2, 3)
    for i, p in enumerate([4, 1, 2]):
        assert torch.equal(pages[p], data[i * PS:(i + 1) * PS])
    assert not pages[[0, 3, 5]].any()
    strided = torch.zeros(2, 6 * PS, 2, 3)[:, :, :, :2][0]  # its pages are not one block of memory each
    with pytest.raises(RuntimeError):
        scatter(strided, [0], torch.ones(PS, 2, 2), PS)


class _SlowSink:
    """Records its writes; each takes a while, and ``fail_at`` raises as a corrupt chunk would."""

    def __init__(self, fail_at: int = -1):
        self.written, self.fail_at = [], fail_at

    def write(self, chunk) -> None:
        time.sleep(0.05)
        if chunk.seq == self.fail_at:
            raise TransferError(f"chunk {chunk.seq} refused")
        self.written.append(chunk.seq)

    def finish(self, last):
        return last.seq


def test_receive_writes_in_order_one_ahead_and_stops_reading_at_the_first_refused_chunk():
    from shared.handoff import GrpcStreamTransport

    pulled = []

    def messages(n: int, broken: bool = False):
        for seq in range(n):
            pulled.append(seq)
            yield pb.KVChunk(request_id="r", seq=seq, last=seq == n - 1 and not broken)
        if broken:
            raise ConnectionError("the sender went away")

    sink = _SlowSink()
    assert GrpcStreamTransport().receive(messages(5), lambda rid: sink) == 4 and sink.written == [0, 1, 2, 3, 4]
    pulled.clear()
    sink = _SlowSink(fail_at=1)
    with pytest.raises(TransferError, match="chunk 1 refused"):
        GrpcStreamTransport().receive(messages(6), lambda rid: sink)
    assert sink.written == [0] and max(pulled) <= 2  # read at most one chunk past the one being written
    sink = _SlowSink()
    with pytest.raises(ConnectionError):
        GrpcStreamTransport().receive(messages(3, broken=True), lambda rid: sink)
    assert sink.written == [0, 1, 2]  # a broken transfer returns only after the write under way has finished
