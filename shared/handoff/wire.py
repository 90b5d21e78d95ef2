"""The KV wire format: a request's pages as page-aligned, checksummed chunks, and their receiver.

A hand-off starts with the prefill: the sending side (``PageSource``) yields ``Increment``s, one per
prefill step of the request (the pages that step completed, in every cache), and the last one also
carries what the decode side resumes from (``Prefilled``: the draft state and the first token). A
source built after the prompt ran yields one increment with everything.

Order: per increment, per cache (target first, then each draft cache), per layer, the increment's
pages in position order. Runs of contiguous page ids are coalesced into one slice (one tensor slice
read, one message), and a slice is cut so that a message holds at most ``chunk_bytes`` of K + V.
Every chunk carries its index (``seq``) and a CRC32C of its K bytes followed by its V bytes; the last
chunk carries the number of chunks sent, the request's draft state
(``shared.spec.state.DraftState.to_bytes``) and, when the reservation named none, its first token.
The first ``held`` pages of every cache (those the receiver's prefix cache holds: ``ReserveResponse.cached_pages``)
are neither sent (``PageSource.held``, for every transport) nor expected (``PageSink``'s ``held``).

Memory in flight stays bounded: ``iter_chunks`` is a lazy generator that reads one slice when the
transport asks for the next message (gRPC pulls the next request message only after the previous one
was written, under HTTP/2 flow control). The receiver writes each chunk straight into the pages the
decode side reserved and checks everything it can: checksum, order, cache / layer / page ranges, byte
sizes, every page of every layer written exactly once, the count on the last chunk.

Pages are touched only inside ``PageGuard.access()``. Whoever frees a request's pages while a transfer
may still touch them (an abort, a failure elsewhere) calls ``PageGuard.cancel()`` first: it waits for
the access in progress and makes every later one raise ``TransferCancelled``, so a transfer can never
read or write pages that were handed to another request.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import crc32c
import torch

from proto.eyrie.v1 import eyrie_pb2 as pb
from shared.memory.kv_cache import KVCache


class TransferError(ValueError):
    """A transfer that cannot be accepted: corrupt, incomplete, out of range or mis-sized."""


class TransferCancelled(RuntimeError):
    """The request's pages were released (aborted) while its transfer was under way."""


class TransportFailed(RuntimeError):
    """A transport's own data path failed (an in-place copy refused, a CUDA error) before the receiver
    acknowledged anything: that transport cannot carry hand-offs to this receiver, another one may (the
    sender marks it unusable for the receiver and sends again: ``PageFeed.rewind``)."""


class PageGuard:
    """Orders a transfer's page accesses against the release of those pages. Accesses may overlap (the
    streams of one hand-off write their pages at once); ``cancel`` waits until none is in progress."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._cancelled = False
        self._active = 0  # accesses in progress

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    @contextmanager
    def access(self):
        with self._cond:
            if self._cancelled:
                raise TransferCancelled("the request was released during its transfer")
            self._active += 1
        try:
            yield
        finally:
            with self._cond:
                self._active -= 1
                if not self._active:
                    self._cond.notify_all()

    def cancel(self) -> bool:
        """Forbid every later access (waits for those in progress); True if this call cancelled it."""
        with self._cond:
            first = not self._cancelled
            self._cancelled = True
            self._cond.wait_for(lambda: self._active == 0)
            return first


@dataclass
class PageRun:
    first: int  # index of the run's first page among the request's pages (position order)
    page: int  # its page id in the pool
    count: int


def coalesce(page_ids: list[int]) -> list[PageRun]:
    """Runs of contiguous page ids, in the request's page order."""
    runs: list[PageRun] = []
    for i, p in enumerate(page_ids):
        if runs and runs[-1].page + runs[-1].count == p:
            runs[-1].count += 1
        else:
            runs.append(PageRun(first=i, page=p, count=1))
    return runs


def kv_page_bytes(page_size: int, num_kv_heads: int, head_dim: int, itemsize: int) -> int:
    """K + V bytes of one page of one layer."""
    return 2 * page_size * num_kv_heads * head_dim * itemsize


def page_bytes(cache: KVCache) -> int:
    """K + V bytes of one page of one layer of ``cache``."""
    s = cache.layout
    return kv_page_bytes(s.page_size, s.num_kv_heads, s.head_dim, cache.k[0].element_size())


def pages_per_chunk(cache: KVCache, chunk_bytes: int) -> int:
    return chunk_pages(page_bytes(cache), chunk_bytes)


def chunk_pages(per_page: int, chunk_bytes: int) -> int:
    """Pages of ``per_page`` bytes a chunk of at most ``chunk_bytes`` holds (at least one, or ValueError)."""
    if per_page > chunk_bytes:
        raise ValueError(f"handoff_chunk_bytes {chunk_bytes} is smaller than one page of one layer "
                         f"(K + V: {per_page} bytes); chunks are page-aligned")
    return chunk_bytes // per_page


@dataclass
class Slice:
    """One chunk's worth of one layer: ``count`` contiguous pool pages starting at ``page``."""

    cache: int
    layer: int
    first: int  # index among the request's pages
    page: int
    count: int


def plan_slices(caches: list[KVCache], page_ids: list[list[int]], chunk_bytes: int,
                start: list[int] | None = None) -> list[Slice]:
    """The slices of each cache's pages from index ``start[c]`` on (default: all of them)."""
    slices = []
    for c, (cache, pages) in enumerate(zip(caches, page_ids)):
        first = start[c] if start is not None else 0
        step = pages_per_chunk(cache, chunk_bytes)
        runs = coalesce(pages[first:])
        for layer in range(cache.layout.num_layers):
            for run in runs:
                for off in range(0, run.count, step):
                    slices.append(Slice(c, layer, first + run.first + off, run.page + off,
                                        min(step, run.count - off)))
    return slices


def _raw(t: torch.Tensor) -> memoryview:
    """The bytes of a host tensor, without a copy (valid while ``t`` is; read under the page guard)."""
    return memoryview(t.contiguous().view(-1).view(torch.uint8).numpy())


def _view(data: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A read-only tensor over a message's bytes (only ever copied from)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "the given buffer is not writable": it is never written
        return torch.frombuffer(data, dtype=torch.uint8).view(dtype).view(shape)


class Staging:
    """Device -> host reads of a transfer's slices, one ahead: slice i+1 is copied into pinned memory on a
    side stream while slice i is checksummed and sent (on the CPU a slice's bytes are read directly)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        if self.cuda:
            self.stream.wait_stream(torch.cuda.default_stream(device))  # the pages' writes were queued there

    def after(self, written) -> None:
        """Later reads wait for ``written`` (the CUDA event of the step that wrote their pages)."""
        if written is not None and self.cuda:
            self.stream.wait_event(written)

    def start(self, k: torch.Tensor, v: torch.Tensor):
        """Begin reading one slice; ``finish`` of what this returns gives its bytes."""
        if not self.cuda:
            return k, v, None
        with torch.cuda.stream(self.stream):
            hk = torch.empty(k.shape, dtype=k.dtype, pin_memory=True).copy_(k, non_blocking=True)
            hv = torch.empty(v.shape, dtype=v.dtype, pin_memory=True).copy_(v, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        return hk, hv, done

    @staticmethod
    def finish(pending) -> tuple[memoryview, memoryview]:
        k, v, done = pending
        if done is not None:
            done.synchronize()
        return _raw(k), _raw(v)


def checksum(k: bytes | memoryview, v: bytes | memoryview) -> int:
    """CRC32C (Castagnoli) of ``k`` followed by ``v``: the CPU's CRC instruction (SSE4.2, ARMv8), several GB/s
    per core against zlib's CRC32 at ~1-2, and computed without the GIL, beside gRPC's and the engine's threads."""
    return crc32c.crc32c(v, crc32c.crc32c(k))


@dataclass(frozen=True)
class InPlaceTarget:
    """Where an in-place (ipc) hand-off writes: the decode side's reservation."""

    exported: bytes  # the decode instance's exported pools (its handshake reply)
    page_ids: list[list[int]]  # per cache (target first), the reserved pages in position order
    deadline: float  # the host's CLOCK_MONOTONIC time after which no page may be written


@dataclass(frozen=True)
class Prefilled:
    """What the decode side resumes from, sent with the prompt's last chunk."""

    draft_state: bytes  # DraftState.to_bytes(), or b"" without a draft
    output_ids: tuple[int, ...] = ()  # the first token, unless the reservation named it
    output_logprobs: tuple[float, ...] = ()


@dataclass(frozen=True)
class Increment:
    """One prefill step's part of a request's hand-off: the pages whose K/V is now final."""

    page_ids: list[list[int]]  # per cache (target first), the request's pages so far, in position order
    done: list[int]  # per cache, how many of those (from the first) hold their final K/V in every layer
    written: object | None = None  # CUDA event recorded after the step that wrote them (None: already visible)
    last: Prefilled | None = None  # with the prompt's last chunk


FEED_POLL_S = 0.05  # how often a transport waiting for the next increment checks for an abort


class PageFeed:
    """The increments of one request's hand-off: put by the engine loop after each prefill step of the
    request, taken by the transport on its own thread (the prefill runs on while the pages travel)."""

    def __init__(self) -> None:
        self._queue: queue.Queue[Increment] = queue.Queue()
        self._latest: Increment | None = None  # the last increment taken (each one names every page so far)
        self._replay = False

    def put(self, increment: Increment) -> None:
        self._queue.put(increment)

    def rewind(self) -> None:
        """The next ``take`` starts again from the first page: it yields the last increment taken first (an
        increment names all the request's pages so far and how many are done, so it stands for those before)."""
        self._replay = self._latest is not None

    def take(self, guard: PageGuard) -> Iterator[Increment]:
        """Each increment as it comes, up to the last; TransferCancelled once ``guard`` is cancelled."""
        if self._replay:
            self._replay = False
            yield self._latest
            if self._latest.last is not None:
                return
        while True:
            try:
                inc = self._queue.get(timeout=FEED_POLL_S)
            except queue.Empty:
                if guard.cancelled:
                    raise TransferCancelled("the request was released during its prefill") from None
                continue
            self._latest = inc
            yield inc
            if inc.last is not None:
                return


@dataclass
class PageSource:
    """The sending side of one request's hand-off (its pages stay put until the acknowledgement)."""

    rid: str
    caches: list[KVCache]
    page_ids: list[list[int]]  # per cache, the request's pages in position order (without a feed)
    draft_state: bytes  # DraftState.to_bytes(), or b"" without a draft (without a feed)
    guard: PageGuard = field(default_factory=PageGuard)
    in_place: InPlaceTarget | None = None  # set (by a copy sharing the guard) once an ipc reservation is made
    feed: PageFeed | None = None  # increments while the prompt is being prefilled (None: every page is written)
    held: int = 0  # leading pages of every cache the receiver holds already (its prefix cache's): never sent

    def first_unsent(self, done: list[int] | None = None) -> list[int]:
        """Per cache, the first page a transport has not sent after an increment that completed ``done``
        pages (None: before the first increment): the held pages count as sent."""
        return [max(self.held, d) for d in (done or [0] * len(self.caches))]

    def increments(self) -> Iterator[Increment]:
        """The hand-off's increments in order, the last one carrying ``Prefilled``."""
        if self.feed is not None:
            yield from self.feed.take(self.guard)
            return
        yield Increment(self.page_ids, [len(p) for p in self.page_ids], None, Prefilled(self.draft_state))


def as_message(header: pb.KVChunk, k: memoryview, v: memoryview) -> pb.KVChunk:
    """A chunk as a KVChunk message (its K and V copied in)."""
    if len(k) or len(v):
        header.MergeFrom(pb.KVChunk(k=bytes(k), v=bytes(v)))
    return header


def as_wire(header: pb.KVChunk, k: memoryview, v: memoryview) -> bytes:
    """A chunk serialized as a KVChunk message, its K and V copied once, straight from the pages (or the
    pinned staging buffers) into the message: the header's fields, then ``k`` and ``v`` as fields 6 and 7
    (a protobuf parser reads fields in any order)."""
    parts = [header.SerializeToString()]
    for number, data in ((6, k), (7, v)):
        if len(data):
            parts += [_varint(number << 3 | 2) + _varint(len(data)), data]
    return b"".join(parts)


@dataclass
class WireChunk:
    """A KVChunk read from its serialized bytes (``parse_wire``): its K and V are views of those bytes, not
    copies; every other field is read from ``header``."""

    header: pb.KVChunk  # every field but k and v
    k: memoryview
    v: memoryview

    def __getattr__(self, name: str):
        return getattr(self.header, name)


def parse_wire(data: bytes) -> WireChunk:
    """The receiving side's deserializer of ``Decode.Transfer``: K and V (fields 6 and 7) are sliced out of
    ``data`` without a copy, the rest parsed as a KVChunk (a malformed message raises ValueError)."""
    view = memoryview(data)
    header, payload, i = [], {6: view[:0], 7: view[:0]}, 0
    while i < len(data):
        key, body = _read_varint(data, i)
        end, body = _field_end(data, body, key & 7)
        if key & 7 == 2 and key >> 3 in payload:
            payload[key >> 3] = view[body:end]
        else:
            header.append(view[i:end])
        i = end
    if i != len(data):
        raise ValueError("a KVChunk cut short")
    return WireChunk(pb.KVChunk.FromString(b"".join(header)), payload[6], payload[7])


def _field_end(data: bytes, i: int, wire_type: int) -> tuple[int, int]:
    """Where the field whose value starts at ``i`` ends, and where its bytes start (length-delimited)."""
    if wire_type == 0:
        return _read_varint(data, i)[1], i
    if wire_type == 2:
        n, body = _read_varint(data, i)
        return body + n, body
    if wire_type in (1, 5):
        return i + (8 if wire_type == 1 else 4), i
    raise ValueError(f"a KVChunk field of wire type {wire_type}")


def _read_varint(data: bytes, i: int) -> tuple[int, int]:
    n, shift = 0, 0
    while True:
        if i >= len(data):
            raise ValueError("a KVChunk cut short")
        byte = data[i]
        i += 1
        n |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return n, i


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


@dataclass(frozen=True)
class Lane:
    """One of the parallel streams a hand-off is split over (one gRPC stream tops out near 1-2 GB/s in Python):
    a contiguous range of the (cache, layer) planes, every increment's pages of those planes."""

    index: int  # this stream's number, 0 .. count - 1 (stream 0's last chunk carries the draft state)
    count: int  # the streams the hand-off is split over
    planes: frozenset[tuple[int, int]]  # the (cache, layer) pairs this stream sends
    increments: Callable[[], Iterator[Increment]]  # this stream's reader of the source's increments


def split_lanes(source: PageSource, streams: int) -> list[Lane]:
    """``source`` split over ``streams`` parallel streams (at most one per plane) by ranges of its (cache,
    layer) planes; each stream reads every increment (``SharedIncrements``: the source's feed is taken once)."""
    planes = [(c, layer) for c, cache in enumerate(source.caches) for layer in range(cache.layout.num_layers)]
    k = max(1, min(streams, len(planes)))
    read = source.increments if k == 1 else SharedIncrements(source.increments()).reader
    return [Lane(i, k, frozenset(planes[i * len(planes) // k:(i + 1) * len(planes) // k]), read) for i in range(k)]


class SharedIncrements:
    """One source's increments, taken once and read by each stream of the hand-off on its own thread. A stream
    never waits for the next increment while another wants one already taken (the engine may be waiting for
    those pages to arrive before it computes the next)."""

    def __init__(self, increments: Iterator[Increment]):
        self._increments = increments
        self._seen: list[Increment] = []
        self._error: BaseException | None = None
        self._taking = False  # a stream is waiting for the next increment (outside the lock)
        self._changed = threading.Condition()

    def reader(self) -> Iterator[Increment]:
        i = 0
        while True:
            inc = self._get(i)
            yield inc
            if inc.last is not None:
                return
            i += 1

    def _get(self, i: int) -> Increment:
        with self._changed:
            while i >= len(self._seen):
                if self._error is not None:
                    raise self._error
                if not self._taking:
                    self._taking = True
                    break
                self._changed.wait()
            else:
                return self._seen[i]
        try:
            inc = next(self._increments)
        except BaseException as e:  # TransferCancelled: every stream stops
            with self._changed:
                self._error, self._taking = e, False
                self._changed.notify_all()
            raise
        with self._changed:
            self._seen.append(inc)
            self._taking = False
            self._changed.notify_all()
            return self._seen[i]


def iter_chunks(source: PageSource, chunk_bytes: int = 4 << 20,
                encode: Callable[[pb.KVChunk, memoryview, memoryview], object] = as_message,
                lane: Lane | None = None) -> Iterator:
    """The request's pages as chunks, each increment's as soon as it comes, each slice read when it is
    asked for. ``encode(header, k, v)`` makes each message from its header (every field but ``k`` and ``v``)
    and its K and V bytes (valid during the call only): a KVChunk (``as_message``), or its serialized
    bytes (``as_wire``: what the gRPC stream sends). With a ``lane``, only that stream's planes, its chunks
    numbered on their own (each stream ends with a last chunk; stream 0's carries the draft state)."""
    staging = Staging(source.caches[0].pool.device)
    sent, seq = source.first_unsent(), 0
    lanes = {} if lane is None or lane.count == 1 else {"stream": lane.index, "streams": lane.count}
    for inc in (lane.increments() if lane is not None else source.increments()):
        staging.after(inc.written)
        done_pages = [pages[:n] for pages, n in zip(inc.page_ids, inc.done)]
        slices = plan_slices(source.caches, done_pages, chunk_bytes, sent)
        if lane is not None:
            slices = [s for s in slices if (s.cache, s.layer) in lane.planes]
        sent = source.first_unsent(inc.done)
        headers = [pb.KVChunk(request_id=source.rid, seq=seq + i, cache=s.cache, layer=s.layer, first_page=s.first,
                              num_pages=s.count, **lanes) for i, s in enumerate(slices)]
        if inc.last is not None:
            if not headers:  # nothing left to send but the state
                headers.append(pb.KVChunk(request_id=source.rid, seq=seq, **lanes))
            headers[-1].MergeFrom(pb.KVChunk(last=True, total_chunks=seq + len(headers)))
            if lane is None or lane.index == 0:
                headers[-1].MergeFrom(pb.KVChunk(draft_state=inc.last.draft_state, output_ids=inc.last.output_ids,
                                                 output_logprobs=inc.last.output_logprobs))
        yield from _read_slices(source, staging, slices, headers, encode)
        seq += len(headers)


def _read_slices(source: PageSource, staging: Staging, slices: list[Slice], headers: list[pb.KVChunk],
                 encode) -> Iterator:
    """Each header's message (the slice's bytes, or none past the slices), the next slice's read started
    while one is sent; the bytes are read, checksummed and encoded under the guard."""
    pending = None
    for i, header in enumerate(headers):
        if i >= len(slices):
            header.crc32 = checksum(b"", b"")
            yield encode(header, memoryview(b""), memoryview(b""))
            continue
        with source.guard.access():
            pending = pending or _start(staging, source, slices[i])
            k, v = staging.finish(pending)
            pending = _start(staging, source, slices[i + 1]) if i + 1 < len(slices) else None
            header.crc32 = checksum(k, v)
            message = encode(header, k, v)
        yield message


def _start(staging: Staging, source: PageSource, s: Slice):
    cache = source.caches[s.cache]
    lo, hi = s.page * cache.page_size, (s.page + s.count) * cache.page_size
    return staging.start(cache.k[s.layer][lo:hi], cache.v[s.layer][lo:hi])


@dataclass
class Received:
    rid: str
    draft_state: bytes
    bytes: int  # K/V + draft-state bytes received
    chunks: int
    output_ids: list[int] = field(default_factory=list)  # the first token, when the reservation named none
    output_logprobs: list[float] = field(default_factory=list)
    complete: bool = True  # False: one stream of several ended (its own bytes and chunks), others are to come


def scatter(layer: torch.Tensor, page_ids: list[int], data: torch.Tensor, page_size: int) -> None:
    """Write ``data`` ([len(page_ids) * page_size, ...], host memory) into ``layer``'s pages ``page_ids``, in
    place. On the CPU one indexed copy of whole pages as bytes (numpy: no per-page tensor op, whose overhead
    cost ~1 s/GB at 16-token pages); on a GPU ``_scatter_on_device``."""
    if layer.device.type == "cpu":
        _pages_as_bytes(layer, page_size)[page_ids] = _pages_as_bytes(data, page_size)
        return
    _scatter_on_device(layer, page_ids, data, page_size)


_RECEIVER = threading.local()  # per receiving thread: its copy stream on each device


def receiver_stream(device: torch.device) -> torch.cuda.Stream:
    """The calling thread's copy stream on ``device``: a stream of torch's pool, created non-blocking, so
    that its copies neither wait for the engine's work on the device's default stream nor hold it up."""
    streams = _RECEIVER.__dict__.setdefault("streams", {})
    if device not in streams:
        streams[device] = torch.cuda.Stream(device)
    return streams[device]


def _scatter_on_device(layer: torch.Tensor, page_ids: list[int], data: torch.Tensor, page_size: int) -> None:
    """The GPU half of ``scatter``, on the receiving thread: the bytes go to pinned memory (a host memcpy,
    without the GIL), then on the thread's own stream (``receiver_stream``) one host -> device copy straight
    into the pages, or, with fragmented pages, into a buffer and one indexed copy; the thread then waits for
    that stream only. Before (issue 28) the copies from pageable memory ran on the default stream the engine
    steps on: each one waited for the step in flight and held the next one back, several times per chunk."""
    stream = receiver_stream(layer.device)
    with torch.cuda.device(layer.device):  # pinned on the pool's GPU (no context made on a receiving thread's 0)
        host = torch.empty(data.shape, dtype=data.dtype, pin_memory=True)
    host.copy_(data)
    runs = coalesce(page_ids)
    with torch.cuda.stream(stream):
        if len(runs) == 1:
            first = runs[0].page * page_size
            layer[first:first + len(page_ids) * page_size].copy_(host, non_blocking=True)
        else:
            pages = layer.view(-1, page_size, *layer.shape[1:])
            index = torch.tensor(page_ids, dtype=torch.int64).pin_memory().to(layer.device, non_blocking=True)
            staged = host.to(layer.device, non_blocking=True).view(-1, page_size, *layer.shape[1:])
            pages.index_copy_(0, index, staged)
    stream.synchronize()  # the pages hold the bytes before the chunk counts as written; ``host`` may go


def _pages_as_bytes(t: torch.Tensor, page_size: int):
    """A host tensor of whole pages ([pages * page_size, ...]) as a [pages, page bytes] uint8 array over the
    same memory (``view`` raises rather than copy, so writes always land in ``t``)."""
    return t.view(torch.uint8).view(t.shape[0] // page_size, -1).numpy()


class PageSink:
    """Writes one request's chunks into the pages reserved for it, checking each one. A hand-off split over
    several streams (``Lane``) writes through one sink from each stream's thread at once."""

    def __init__(self, rid: str, caches: list[KVCache], page_ids: list[list[int]], guard: PageGuard | None = None,
                 in_place: bool = False, held: int = 0):
        self.rid, self.caches, self.page_ids = rid, caches, page_ids
        self.guard = guard or PageGuard()
        self.in_place = in_place  # reserved for a sender that writes the pages itself (ipc)
        self.held = held  # leading pages of every cache this side holds already (the sender skips them)
        # Times each (layer, page) of each cache was written: all ones at the end, never more (the held ones: one).
        self.written = [torch.zeros(c.layout.num_layers, len(p), dtype=torch.int32) for c, p in zip(caches, page_ids)]
        for w in self.written:
            w[:, :held] = 1
        self.received = 0
        self.bytes = 0
        self.streams: int | None = None  # the streams the sender split the hand-off over (from its first chunk)
        self._next_seq: dict[int, int] = {}  # per stream, the seq its next chunk must have
        self._stream_bytes: dict[int, int] = {}
        self._ended: set[int] = set()  # streams whose last chunk was checked
        self._final: pb.KVChunk | None = None  # stream 0's last chunk (the draft state, the first token)
        self._lock = threading.Lock()

    def takes_another_stream(self) -> bool:
        """Whether another Transfer call may still join this hand-off (its stream count not yet known, or more
        than the calls that ended)."""
        with self._lock:
            return not self.in_place and (self.streams is None or 1 < self.streams > len(self._ended))

    def write(self, chunk: pb.KVChunk) -> None:
        where = f"chunk {chunk.seq} (cache {chunk.cache}, layer {chunk.layer})"
        if chunk.request_id != self.rid:
            raise TransferError(f"{where} belongs to {chunk.request_id!r}, the transfer is for {self.rid!r}")
        stream = self._take_seq(chunk, where)
        k_bytes, v_bytes = chunk.k, chunk.v  # read once: each read of a message's bytes field copies them
        if checksum(k_bytes, v_bytes) != chunk.crc32:
            raise TransferError(f"{where} failed its CRC32C check")
        if chunk.in_place or self.in_place:
            return self._written_in_place(chunk, where)
        with self._lock:
            self.received += 1
            n = len(k_bytes) + len(v_bytes) + len(chunk.draft_state)
            self.bytes += n
            self._stream_bytes[stream] = self._stream_bytes.get(stream, 0) + n
        if chunk.num_pages == 0:
            if k_bytes or v_bytes:
                raise TransferError(f"{where} has bytes but no pages")
            return
        self._check_range(chunk, where)
        cache, pages = self.caches[chunk.cache], self.page_ids[chunk.cache]
        ps, s = cache.page_size, cache.layout
        shape = (chunk.num_pages * ps, s.num_kv_heads, s.head_dim)
        expected = shape[0] * shape[1] * shape[2] * cache.k[0].element_size()
        if len(k_bytes) != expected or len(v_bytes) != expected:
            raise TransferError(f"{where} has {len(k_bytes)} K and {len(v_bytes)} V bytes for {chunk.num_pages} "
                                f"pages, expected {expected} each (page size, heads, head dim or dtype differ)")
        span = slice(chunk.first_page, chunk.first_page + chunk.num_pages)
        with self._lock:  # claimed before the write: two streams never write one page
            done = self.written[chunk.cache][chunk.layer, span]
            if bool((done > 0).any()):
                raise TransferError(f"{where} writes pages [{span.start}, {span.stop}) a second time")
            done += 1
        dtype = cache.k[0].dtype
        k, v = _view(k_bytes, dtype, shape), _view(v_bytes, dtype, shape)  # no copy: read once, into the pages
        with self.guard.access():
            scatter(cache.k[chunk.layer], pages[span], k, ps)
            scatter(cache.v[chunk.layer], pages[span], v, ps)

    def _take_seq(self, chunk: pb.KVChunk, where: str) -> int:
        """Check the chunk's stream and its place in it; returns the stream."""
        stream, streams = chunk.stream, chunk.streams or 1
        with self._lock:
            if self.streams is None:
                self.streams = streams
            if streams != self.streams or stream >= streams:
                raise TransferError(f"{where} is of stream {stream} of {streams}; the hand-off came in "
                                    f"{self.streams} streams")
            if stream in self._ended:
                raise TransferError(f"{where} arrived after the last chunk of its stream {stream}")
            expected = self._next_seq.get(stream, 0)
            if chunk.seq != expected:
                raise TransferError(f"{where} arrived as chunk {expected}: chunks lost or out of order")
            self._next_seq[stream] = expected + 1
        return stream

    def _written_in_place(self, chunk: pb.KVChunk, where: str) -> None:
        """The sender wrote every page of every cache itself: one message, then the end."""
        if not (chunk.in_place and self.in_place):
            mode = "in place (ipc)" if self.in_place else "as bytes (grpc-stream)"
            raise TransferError(f"{where}: the reservation was made for pages sent {mode}, the chunk does not match")
        if chunk.k or chunk.v or not chunk.last:
            raise TransferError(f"{where}: an in-place message carries no bytes and is the transfer's only one")
        with self.guard.access():  # aborted meanwhile: TransferCancelled
            self.received += 1
            self.bytes += chunk.in_place_bytes + len(chunk.draft_state)
            for w in self.written:
                w[:, self.held:] += 1

    def _check_range(self, chunk: pb.KVChunk, where: str) -> None:
        if chunk.cache >= len(self.caches):
            raise TransferError(f"{where} names cache {chunk.cache}; this side has {len(self.caches)} caches")
        cache, pages = self.caches[chunk.cache], self.page_ids[chunk.cache]
        if chunk.layer >= cache.layout.num_layers:
            raise TransferError(f"{where} names layer {chunk.layer}; cache {chunk.cache} has "
                                f"{cache.layout.num_layers}")
        if chunk.first_page + chunk.num_pages > len(pages):
            raise TransferError(f"{where} covers pages [{chunk.first_page}, {chunk.first_page + chunk.num_pages}); "
                                f"the request has {len(pages)} reserved here")

    def finish(self, last: pb.KVChunk | None) -> Received:
        """Check the transfer is complete; returns what arrived (the draft state bytes among it). Of a hand-off
        over several streams, each stream's end is checked, and the last stream to end checks the whole."""
        if last is None or not last.last:
            raise TransferError(f"the transfer of {self.rid!r} ended before its last chunk "
                                f"({self.received} chunks received)")
        with self._lock:
            stream = last.stream
            sent = self._next_seq.get(stream, 0)
            if last.total_chunks != sent:
                raise TransferError(f"received {sent} chunks, the sender sent {last.total_chunks}")
            if stream == 0:
                self._final = last
            elif last.draft_state or last.output_ids:
                raise TransferError(f"stream {stream} carries the draft state; only stream 0 does")
            self._ended.add(stream)
            if len(self._ended) < (self.streams or 1):
                return Received(self.rid, b"", self._stream_bytes.get(stream, 0), sent, complete=False)
        for c, w in enumerate(self.written):
            if w.numel() and not bool((w == 1).all()):
                missing = int((w == 0).sum())
                raise TransferError(f"cache {c}: {missing} (layer, page) pairs of {w.numel()} never arrived")
        last = self._final
        return Received(self.rid, last.draft_state, self.bytes, self.received, list(last.output_ids),
                        list(last.output_logprobs))


def encode_draft_state(req) -> bytes:
    """The request's DraftState, with its seed, as bytes (b"" without a draft).

    The seed travels so that a sampled request draws on the decode side exactly what it would have drawn
    in one process (an unseeded one too: its seed was chosen at admission); every draw hashes it with a
    position, so the seed and the committed length are all the sampling state there is.
    """
    state = req.draft_state
    if state is None:
        return b""
    return dataclasses.replace(state, seed=req.seed).to_bytes()


def decode_draft_state(data: bytes, schema, committed_len: int, device: torch.device | str = "cpu"):
    """The DraftState that arrived, checked against the receiver's schema and reservation.

    ``schema`` is the receiver's ``HandoffSchema``. Returns None for a target-only hand-off.
    """
    from shared.spec.state import DraftState

    if not schema.draft_kind:
        if data:
            raise TransferError("a draft state arrived, but this side runs without speculative decoding")
        return None
    if not data:
        raise TransferError(f"no draft state arrived; this side runs {schema.spec_description} and needs one")
    try:
        state = DraftState.from_bytes(data, "cpu")  # moved below, off the engine's stream
    except Exception as e:  # a corrupt or foreign blob: torch.load / json / struct errors alike
        raise TransferError(f"the draft state cannot be read: {e}") from e
    problems = []
    if state.committed_len != committed_len:
        problems.append(f"committed_len {state.committed_len}, the reservation is for {committed_len}")
    if state.hidden.numel() != schema.draft_hidden_width:
        problems.append(f"hidden width {state.hidden.numel()}, the draft's is {schema.draft_hidden_width}")
    for name in ("topk_p", "topk_ids"):
        shape = tuple(getattr(state, name).shape)
        if shape != (schema.topk,):
            problems.append(f"{name} of shape {shape}, expected ({schema.topk},)")
    if not 0 <= state.bonus_token < schema.vocab_size:
        problems.append(f"bonus token {state.bonus_token} outside the vocabulary [0, {schema.vocab_size})")
    if problems:
        raise TransferError("the draft state does not fit this side: " + "; ".join(problems))
    return dataclasses.replace(state, hidden=to_device(state.hidden, device), topk_p=to_device(state.topk_p, device),
                               topk_ids=to_device(state.topk_ids, device))


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``t`` (host memory) on ``device``, copied on the calling thread's ``receiver_stream`` (a receiving thread:
    a plain ``.to`` from pageable memory would run on the default stream and wait for the engine's step)."""
    device = torch.device(device)
    if device.type != "cuda":
        return t.to(device)
    stream = receiver_stream(device)
    with torch.cuda.stream(stream):  # (the stream's device current: pinned there)
        out = t.pin_memory().to(device, non_blocking=True)
    stream.synchronize()
    return out
