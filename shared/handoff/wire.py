"""The KV wire format: a request's pages as page-aligned, checksummed chunks, and their receiver.

Order: per cache (target first, then each draft cache), per layer, the request's pages in position
order. Runs of contiguous page ids are coalesced into one slice (one tensor slice read, one message),
and a slice is cut so that a message holds at most ``chunk_bytes`` of K + V. Every chunk carries its
index (``seq``) and a CRC32 of its K bytes followed by its V bytes; the last chunk carries the number
of chunks sent and the request's draft state (``shared.spec.state.DraftState.to_bytes``).

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
import threading
import warnings
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from proto.eyrie.v1 import eyrie_pb2 as pb
from shared.memory.kv_cache import KVCache


class TransferError(ValueError):
    """A transfer that cannot be accepted: corrupt, incomplete, out of range or mis-sized."""


class TransferCancelled(RuntimeError):
    """The request's pages were released (aborted) while its transfer was under way."""


class PageGuard:
    """Orders a transfer's page accesses against the release of those pages."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cancelled = False

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    @contextmanager
    def access(self):
        with self._lock:
            if self._cancelled:
                raise TransferCancelled("the request was released during its transfer")
            yield

    def cancel(self) -> bool:
        """Forbid every later access (waits for the one in progress); True if this call cancelled it."""
        with self._lock:
            first = not self._cancelled
            self._cancelled = True
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


def plan_slices(caches: list[KVCache], page_ids: list[list[int]], chunk_bytes: int) -> list[Slice]:
    slices = []
    for c, (cache, pages) in enumerate(zip(caches, page_ids)):
        step = pages_per_chunk(cache, chunk_bytes)
        runs = coalesce(pages)
        for layer in range(cache.layout.num_layers):
            for run in runs:
                for off in range(0, run.count, step):
                    slices.append(Slice(c, layer, run.first + off, run.page + off, min(step, run.count - off)))
    return slices


def _raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).cpu().numpy().tobytes()


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
    def finish(pending) -> tuple[bytes, bytes]:
        k, v, done = pending
        if done is not None:
            done.synchronize()
        return _raw(k), _raw(v)


def checksum(k: bytes, v: bytes) -> int:
    return zlib.crc32(v, zlib.crc32(k))


@dataclass(frozen=True)
class InPlaceTarget:
    """Where an in-place (ipc) hand-off writes: the decode side's reservation."""

    exported: bytes  # the decode instance's exported pools (its handshake reply)
    page_ids: list[list[int]]  # per cache (target first), the reserved pages in position order
    deadline: float  # the host's CLOCK_MONOTONIC time after which no page may be written


@dataclass
class PageSource:
    """The sending side of one request's hand-off (its pages stay put until the acknowledgement)."""

    rid: str
    caches: list[KVCache]
    page_ids: list[list[int]]  # per cache, the request's pages in position order
    draft_state: bytes  # DraftState.to_bytes(), or b"" without a draft
    guard: PageGuard = field(default_factory=PageGuard)
    in_place: InPlaceTarget | None = None  # set (by a copy sharing the guard) once an ipc reservation is made


def iter_chunks(source: PageSource, chunk_bytes: int = 4 << 20) -> Iterator[pb.KVChunk]:
    """The request's pages as KVChunk messages, each read when it is asked for."""
    slices = plan_slices(source.caches, source.page_ids, chunk_bytes)
    total = max(1, len(slices))
    staging = Staging(source.caches[0].pool.device) if source.caches else None
    pending = None
    for seq, s in enumerate(slices):
        with source.guard.access():  # the slice's read (and the next one's start) happen under the guard
            pending = pending or _start(staging, source, s)
            k, v = staging.finish(pending)
            pending = _start(staging, source, slices[seq + 1]) if seq + 1 < len(slices) else None
        chunk = pb.KVChunk(request_id=source.rid, seq=seq, cache=s.cache, layer=s.layer, first_page=s.first,
                           num_pages=s.count, k=k, v=v, crc32=checksum(k, v))
        if seq == total - 1:
            chunk.last, chunk.total_chunks, chunk.draft_state = True, total, source.draft_state
        yield chunk
    if not slices:  # a request without pages (never happens for a non-empty prompt): state only
        yield pb.KVChunk(request_id=source.rid, seq=0, crc32=checksum(b"", b""), last=True, total_chunks=1,
                         draft_state=source.draft_state)


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


class PageSink:
    """Writes one request's chunks into the pages reserved for it, checking each one."""

    def __init__(self, rid: str, caches: list[KVCache], page_ids: list[list[int]], guard: PageGuard | None = None,
                 in_place: bool = False):
        self.rid, self.caches, self.page_ids = rid, caches, page_ids
        self.guard = guard or PageGuard()
        self.in_place = in_place  # reserved for a sender that writes the pages itself (ipc)
        # Times each (layer, page) of each cache was written: all ones at the end, never more.
        self.written = [torch.zeros(c.layout.num_layers, len(p), dtype=torch.int32) for c, p in zip(caches, page_ids)]
        self.received = 0
        self.bytes = 0

    def write(self, chunk: pb.KVChunk) -> None:
        where = f"chunk {chunk.seq} (cache {chunk.cache}, layer {chunk.layer})"
        if chunk.request_id != self.rid:
            raise TransferError(f"{where} belongs to {chunk.request_id!r}, the transfer is for {self.rid!r}")
        if chunk.seq != self.received:
            raise TransferError(f"{where} arrived as chunk {self.received}: chunks lost or out of order")
        if checksum(chunk.k, chunk.v) != chunk.crc32:
            raise TransferError(f"{where} failed its CRC32 check")
        if chunk.in_place or self.in_place:
            return self._written_in_place(chunk, where)
        self.received += 1
        self.bytes += len(chunk.k) + len(chunk.v) + len(chunk.draft_state)
        if chunk.num_pages == 0:
            if chunk.k or chunk.v:
                raise TransferError(f"{where} has bytes but no pages")
            return
        self._check_range(chunk, where)
        cache, pages = self.caches[chunk.cache], self.page_ids[chunk.cache]
        ps, s = cache.page_size, cache.layout
        shape = (chunk.num_pages * ps, s.num_kv_heads, s.head_dim)
        expected = shape[0] * shape[1] * shape[2] * cache.k[0].element_size()
        if len(chunk.k) != expected or len(chunk.v) != expected:
            raise TransferError(f"{where} has {len(chunk.k)} K and {len(chunk.v)} V bytes for {chunk.num_pages} "
                                f"pages, expected {expected} each (page size, heads, head dim or dtype differ)")
        span = slice(chunk.first_page, chunk.first_page + chunk.num_pages)
        done = self.written[chunk.cache][chunk.layer, span]
        if bool((done > 0).any()):
            raise TransferError(f"{where} writes pages [{span.start}, {span.stop}) a second time")
        dtype = cache.k[0].dtype
        k, v = _view(chunk.k, dtype, shape), _view(chunk.v, dtype, shape)  # no copy: read once, into the pages
        with self.guard.access():
            for run in coalesce(pages[span]):  # the destination pages, coalesced in their turn
                lo, n = (run.first) * ps, run.count * ps
                dst = slice(run.page * ps, run.page * ps + n)
                cache.k[chunk.layer][dst].copy_(k[lo:lo + n])
                cache.v[chunk.layer][dst].copy_(v[lo:lo + n])
        done += 1

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
                w += 1

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
        """Check the transfer is complete; returns what arrived (the draft state bytes among it)."""
        if last is None or not last.last:
            raise TransferError(f"the transfer of {self.rid!r} ended before its last chunk "
                                f"({self.received} chunks received)")
        if last.total_chunks != self.received:
            raise TransferError(f"received {self.received} chunks, the sender sent {last.total_chunks}")
        for c, w in enumerate(self.written):
            if w.numel() and not bool((w == 1).all()):
                missing = int((w == 0).sum())
                raise TransferError(f"cache {c}: {missing} (layer, page) pairs of {w.numel()} never arrived")
        return Received(self.rid, last.draft_state, self.bytes, self.received)


def encode_draft_state(req) -> bytes:
    """The request's DraftState, with its sampling generator's state and seed, as bytes (b"" without a
    draft).

    The generator state and the seed travel so that a sampled request draws on the decode side exactly
    what it would have drawn in one process (an unseeded one too: its seed was chosen at admission).
    """
    state = req.draft_state
    if state is None:
        return b""
    state = dataclasses.replace(state, seed=req.seed)
    if req.generator is not None:
        state = dataclasses.replace(state, rng_state=req.generator.get_state())
    return state.to_bytes()


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
        state = DraftState.from_bytes(data, device)
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
    return state
