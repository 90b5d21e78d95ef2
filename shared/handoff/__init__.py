"""The prefill -> decode hand-off: the schema both sides must agree on, and the KV wire format.

A request's K/V travels per cache (target first, then each draft cache), per layer, K and V of its
pages in position order. Runs of contiguous page ids are coalesced into one slice, and slices are cut
so that one message holds at most ``chunk_bytes``; every chunk carries a CRC32 of its bytes. The
draft state (``shared.spec.state.DraftState``) rides on the last chunk, with the number of chunks
sent, so the receiver knows the transfer is complete and whole.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from proto.eyrie.v1 import eyrie_pb2 as pb
from shared.memory.kv_cache import KVCache

SCHEMA_VERSION = 1


class SchemaMismatch(ValueError):
    pass


class TransferError(ValueError):
    pass


def engine_schema(engine) -> pb.HandoffSchema:
    """What a request's hand-off from/to ``engine`` contains; both sides must agree exactly."""
    caches = [pb.CacheShape(num_layers=c.spec.num_layers, num_kv_heads=c.spec.num_kv_heads, head_dim=c.spec.head_dim)
              for c in engine.scheduler.caches]
    spec = pb.SpecConfig()
    hidden = 0
    if engine.spec is not None:
        sc = engine.config.spec
        spec = pb.SpecConfig(draft_kind=engine.spec.draft.kind, topk=sc.topk, steps=sc.steps,
                             num_draft_tokens=sc.num_draft_tokens)
        hidden = engine.spec.draft.hidden_width
    return pb.HandoffSchema(version=SCHEMA_VERSION, page_size=engine.config.page_size, dtype=engine.config.dtype,
                            caches=caches, spec=spec, draft_hidden_width=hidden,
                            vocab_size=engine.model.config.vocab_size)


def describe(schema: pb.HandoffSchema) -> dict:
    return {
        "version": schema.version, "page_size": schema.page_size, "dtype": schema.dtype,
        "caches": [(c.num_layers, c.num_kv_heads, c.head_dim) for c in schema.caches],
        "spec": (f"{schema.spec.draft_kind or 'none'}(topk={schema.spec.topk}, steps={schema.spec.steps}, "
                 f"draft_tokens={schema.spec.num_draft_tokens})"),
        "draft_hidden_width": schema.draft_hidden_width, "vocab_size": schema.vocab_size,
    }


def check_schema(mine: pb.HandoffSchema, theirs: pb.HandoffSchema, me: str = "decode", them: str = "prefill") -> None:
    """Raise SchemaMismatch naming every differing field with both sides' values."""
    a, b = describe(mine), describe(theirs)
    diffs = [f"{k}: {me} has {a[k]}, {them} has {b[k]}" for k in a if a[k] != b[k]]
    if diffs:
        raise SchemaMismatch("hand-off schema mismatch: " + "; ".join(diffs))


@dataclass
class Run:
    first: int  # index of the run's first page among the request's pages
    page: int  # its page id in the pool
    count: int


def coalesce(page_ids: list[int]) -> list[Run]:
    """Contiguous page-id runs, in the request's page order."""
    runs: list[Run] = []
    for i, p in enumerate(page_ids):
        if runs and runs[-1].page + runs[-1].count == p:
            runs[-1].count += 1
        else:
            runs.append(Run(first=i, page=p, count=1))
    return runs


def _bytes_of(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).cpu().numpy().tobytes()


def iter_chunks(rid: str, caches: list[KVCache], page_ids: list[list[int]], draft_state: bytes,
                chunk_bytes: int = 4 << 20) -> Iterator[pb.KVChunk]:
    """The request's pages as KVChunk messages, read lazily (bounded in-flight memory)."""
    sent = 0
    pending: pb.KVChunk | None = None
    for c, (cache, pages) in enumerate(zip(caches, page_ids)):
        ps = cache.page_size
        per_page = 2 * ps * cache.spec.num_kv_heads * cache.spec.head_dim * cache.k[0].element_size()
        step = max(1, chunk_bytes // per_page)
        for layer in range(cache.spec.num_layers):
            for run in coalesce(pages):
                for off in range(0, run.count, step):
                    n = min(step, run.count - off)
                    lo, hi = (run.page + off) * ps, (run.page + off + n) * ps
                    k, v = _bytes_of(cache.k[layer][lo:hi]), _bytes_of(cache.v[layer][lo:hi])
                    if pending is not None:
                        yield pending
                        sent += 1
                    pending = pb.KVChunk(request_id=rid, cache=c, layer=layer, first_page=run.first + off,
                                         num_pages=n, k=k, v=v, crc32=zlib.crc32(v, zlib.crc32(k)))
    last = pending or pb.KVChunk(request_id=rid, crc32=zlib.crc32(b""))
    last.draft_state = draft_state
    last.last = True
    last.total_chunks = sent + 1
    yield last


class ChunkWriter:
    """Writes received chunks into the pages reserved for the request, checking every one."""

    def __init__(self, caches: list[KVCache], page_ids: list[list[int]]):
        self.caches, self.page_ids = caches, page_ids
        self.received = 0
        self.bytes = 0

    def write(self, chunk: pb.KVChunk) -> None:
        if zlib.crc32(chunk.v, zlib.crc32(chunk.k)) != chunk.crc32:
            raise TransferError(f"chunk {self.received} (cache {chunk.cache}, layer {chunk.layer}) failed its CRC32")
        self.received += 1
        self.bytes += len(chunk.k) + len(chunk.v) + len(chunk.draft_state)
        if chunk.num_pages == 0:
            return
        if chunk.cache >= len(self.caches):
            raise TransferError(f"chunk names cache {chunk.cache}; this side has {len(self.caches)}")
        cache, pages = self.caches[chunk.cache], self.page_ids[chunk.cache]
        if chunk.layer >= cache.spec.num_layers or chunk.first_page + chunk.num_pages > len(pages):
            raise TransferError(f"chunk out of range: cache {chunk.cache} layer {chunk.layer} pages "
                                f"[{chunk.first_page}, {chunk.first_page + chunk.num_pages}) of {len(pages)}")
        ps = cache.page_size
        shape = (chunk.num_pages * ps, cache.spec.num_kv_heads, cache.spec.head_dim)
        dtype = cache.k[0].dtype
        expected = shape[0] * shape[1] * shape[2] * cache.k[0].element_size()
        if len(chunk.k) != expected or len(chunk.v) != expected:
            raise TransferError(f"chunk of {len(chunk.k)} K bytes, expected {expected} (page size / dtype differ?)")
        dst = torch.tensor(pages[chunk.first_page:chunk.first_page + chunk.num_pages], dtype=torch.int64)
        slots = (dst.unsqueeze(1) * ps + torch.arange(ps)).reshape(-1).to(cache.k[0].device)
        for src, pool in ((chunk.k, cache.k), (chunk.v, cache.v)):
            data = torch.frombuffer(bytearray(src), dtype=torch.uint8).view(dtype).view(shape)
            pool[chunk.layer][slots] = data.to(pool[chunk.layer].device)

    def finish(self, last: pb.KVChunk) -> None:
        if not last.last:
            raise TransferError("the transfer ended before its last chunk")
        if last.total_chunks != self.received:
            raise TransferError(f"received {self.received} chunks, the sender sent {last.total_chunks}")


def sampling_to_pb(params) -> pb.SamplingParams:
    msg = pb.SamplingParams(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                            max_new_tokens=params.max_new_tokens, stop_token_ids=list(params.stop_token_ids),
                            ignore_eos=params.ignore_eos)
    if params.seed is not None:
        msg.seed = params.seed
    return msg


def sampling_from_pb(msg: pb.SamplingParams, default_max_new_tokens: int = 16):
    """SamplingParams from the wire (0 / unset fields take their defaults); raises pydantic errors."""
    from shared.sampling import SamplingParams

    return SamplingParams(
        temperature=msg.temperature, top_k=msg.top_k, top_p=msg.top_p if msg.top_p != 0 else 1.0,
        seed=msg.seed if msg.HasField("seed") else None,
        max_new_tokens=msg.max_new_tokens or default_max_new_tokens,
        stop_token_ids=tuple(msg.stop_token_ids), ignore_eos=msg.ignore_eos,
    )
