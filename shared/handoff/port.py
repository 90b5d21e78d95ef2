"""The engine's side of a hand-off: a port adapting the engine's narrow page API to the wire types.

The engine offers a few facts about its pages (``EnginePages``, its scheduler's: its caches, a request's page
ids in position order, whether it still holds a request, and ``activate``, which resumes a request whose K/V
arrived) and its device; ``HandoffPort`` turns them into what the transports read and write (``PageSource``,
``Increment``, ``PageSink``, the exported pools, the ``HandoffSchema``). Under tensor parallelism the port
also owns the per-request staging tables: rank 0 gathers every rank's KV heads into a staging cache before
a request leaves a split prefill engine, and scatters them from one (or from the landing cache a same-host
prefill wrote into) when it enters a split decode engine, so that groups of different sizes fit each other.
Those tables are released with the request (``forget``, called by the scheduler's ``retire``).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Protocol

import torch

from shared.config import EngineConfig, SpecConfig
from shared.handoff.schema import HandoffSchema
from shared.handoff.wire import Increment, PageFeed, PageGuard, PageSink, PageSource, Prefilled, encode_draft_state
from shared.memory.kv_cache import KVCache
from shared.parallel import staging_cache, staging_pages
from shared.request import Request, Stage
from shared.spec.state import DraftState

LANDING_REQUESTS = 4  # a split decode engine's in-place hand-offs in flight at once (more are refused: no room)


class EnginePages(Protocol):
    """What the port asks of an engine's pages (its scheduler's: the owner of its requests and their pages)."""

    @property
    def caches(self) -> list[KVCache]: ...  # target first, then the draft's

    def page_ids(self, req: Request) -> list[list[int]]: ...  # per cache, in position order

    def holds(self, req: Request) -> bool: ...

    def activate(self, req: Request, committed_len: int, draft_state: DraftState | None,
                 output_ids: list[int], output_logprobs: list[float]) -> None: ...


class SplitPages(Protocol):
    """What the port asks of a split engine's model runner (the tensor-parallel seam): the collectives that move
    a hand-off's K/V between every rank's heads and rank 0's staging caches (``shared/parallel.py``); the runner
    sends each to the other ranks, which run it too (``shared/replay.py``)."""

    def gather_pages(self, cache: KVCache, pages: list[int]) -> KVCache | None: ...

    def gather_pages_into(self, staging: KVCache | None, first: int, cache: KVCache, pages: list[int]) -> None: ...

    def scatter_pages(self, staging: KVCache | None, staged: list[int] | None, cache: KVCache,
                      pages: list[int]) -> None: ...

    def share_pages(self, cache: KVCache, pages: list[int]) -> None: ...


def landing_pages(leads_split_decode: bool, positions: int, page_size: int) -> int:
    """The landing cache's pages: room for ``LANDING_REQUESTS`` requests of ``positions`` (the whole context
    and headroom) on rank 0 of a split decode engine (``leads_split_decode``), 0 elsewhere."""
    return LANDING_REQUESTS * -(-positions // page_size) if leads_split_decode else 0


class HandoffPort:
    """The hand-off of one engine, both sides (a prefill engine sends, a decode engine receives)."""

    def __init__(self, pages: EnginePages, device: torch.device,
                 on_device: Callable[[], contextlib.AbstractContextManager], config: EngineConfig, vocab_size: int,
                 kv_heads: int, split: SplitPages | None = None, landing: int = 0, draft=None,
                 tree: SpecConfig | None = None):
        """``device``: the engine's, made the thread's current CUDA device by ``on_device()``; ``kv_heads``: the
        target's KV heads, every rank's; ``split``: under tensor parallelism the engine's model runner, whose
        collectives gather and scatter every rank's heads (None on one rank); ``landing``: the landing cache's
        pages (``landing_pages``); ``draft`` (a ``DraftHead``) and ``tree``: the speculation, None without."""
        self.pages, self.device, self.on_device = pages, device, on_device
        self.split = split
        self.kv_heads = kv_heads
        target = pages.caches[0]
        layouts = [c.layout for c in pages.caches]
        if split is not None:  # a split engine's hand-offs carry every KV head (``page_source``)
            layouts[0] = dataclasses.replace(layouts[0], num_kv_heads=kv_heads)
        # What this engine's hand-offs carry; the other side of a hand-off must agree on all of it.
        self.schema = HandoffSchema.build(
            layouts, page_size=config.page_size, dtype=config.dtype, vocab_size=vocab_size,
            draft_kind=draft.kind if draft else "", tree=tree if draft else None,
            draft_hidden_width=draft.hidden_width if draft else 0)
        # Rank 0 of a split decode engine: where same-host prefills write hand-offs in place, every KV head.
        self.landing = staging_cache(target.layout, kv_heads, landing, shareable=True) if landing else None
        self._staged: dict[str, KVCache] = {}  # under TP, on rank 0: hand-offs' target K/V, every KV head, by id
        self._gathered: dict[str, int] = {}  # under TP, on rank 0: a fed hand-off's target pages gathered so far
        self._landed: dict[str, list[int]] = {}  # under TP, decode rank 0: in-place hand-offs' landing pages, by id

    # ---- the sending side (prefill) --------------------------------------------------------------
    def page_source(self, req: Request, fed: bool = False) -> PageSource | None:
        """The sending side of ``req``'s hand-off. Parked (its prompt done): its pages and its draft state.
        ``fed``: empty, to be fed an ``Increment`` after each step of its prefill (``increment``). The pages
        an increment names as done are not written again until ``req`` is released, so the transport may
        read them off the engine's thread until then; an abort cancels the guard first. Under tensor
        parallelism a collective (``_gathered_source``)."""
        caches = self.pages.caches
        if self.split is not None:
            return self._gathered_source(req, fed)
        if fed:
            return PageSource(req.rid, caches, [], b"", feed=PageFeed())
        return PageSource(req.rid, caches, self.pages.page_ids(req), encode_draft_state(req))

    def _gathered_source(self, req: Request, fed: bool) -> PageSource | None:
        """Under tensor parallelism, the source of a request's hand-off with every rank's KV heads gathered into a
        cache of its own (the draft's caches are whole on every rank already), so that it fits a decode engine
        of any split. Parked: a collective, every page gathered now.
        ``fed``: the cache is sized for the prompt and each ``increment`` gathers the pages completed since
        the last one (a collective then)."""
        caches = self.pages.caches
        if fed:
            self._gathered[req.rid] = 0
            staged = staging_cache(caches[0].layout, self.kv_heads, caches[0].pages_for(req.prefill_len))
            self._staged[req.rid] = staged
            return PageSource(req.rid, [staged, *caches[1:]], [], b"", feed=PageFeed())
        ids = self.pages.page_ids(req)
        staging = self.split.gather_pages(caches[0], ids[0])
        return PageSource(req.rid, [staging, *caches[1:]], [staging_pages(len(ids[0])), *ids[1:]],
                          encode_draft_state(req))

    def increment(self, req: Request) -> Increment:
        """``req``'s pages so far and how many of each cache's hold their final K/V (every position of the
        page computed: a chunk's draft extend writes the same positions as its target forward); with its
        prompt done, all of them and what the decode side resumes from (the draft state, the first token).
        On CUDA, an event after the work queued so far orders the transport's reads behind the step that
        wrote the pages (the engine's thread never waits for them)."""
        page_ids = self.pages.page_ids(req)
        parked = req.stage is Stage.HANDOFF
        done = [len(p) if parked else req.kv_len // c.page_size for c, p in zip(self.pages.caches, page_ids)]
        if self.split is not None:  # a collective: the target's pages come from the staging cache (``page_source``)
            page_ids[0] = self._gather_done(req, page_ids[0], done[0])
        written = None
        if self.device.type == "cuda":
            with self.on_device():
                written = torch.cuda.Event()
                written.record()
        last = Prefilled(encode_draft_state(req), tuple(req.output_ids[req.resumed:]),
                         tuple(req.output_logprobs[req.resumed:])) if parked else None
        return Increment(page_ids, done, written, last)

    def _gather_done(self, req: Request, pages: list[int], done: int) -> list[int]:
        """Under tensor parallelism, a collective: ``req``'s target pages completed since the last increment
        (``pages[:done]`` are final) gathered, every KV head, into its staging cache on rank 0; the staging
        cache's ids of ``pages``."""
        first = self._gathered[req.rid]
        if done > first:
            self.split.gather_pages_into(self._staged.get(req.rid), first, self.pages.caches[0], pages[first:done])
            self._gathered[req.rid] = done
        return staging_pages(len(pages))

    # ---- the receiving side (decode) -------------------------------------------------------------
    def page_sink(self, req: Request, guard: PageGuard, in_place: bool = False) -> PageSink | None:
        """The receiving side of ``req``'s transfer, writing into its reserved pages (or, with ``in_place``,
        checking that the sender wrote them itself); None when ``req`` is no longer the engine's request
        waiting for its K/V (it was aborted), or, in place into a split engine, when its landing cache has
        no room now."""
        if not self._receiving(req):
            return None
        if self.split is not None:
            return self._staged_sink(req, guard, in_place)
        # The pages it took from this engine's prefix cache (``admit_handoff``) are not sent.
        return PageSink(req.rid, self.pages.caches, self.pages.page_ids(req), guard, in_place, len(req.prefix_pages))

    def _staged_sink(self, req: Request, guard: PageGuard, in_place: bool) -> PageSink | None:
        """Under tensor parallelism: a sink writing the target's K/V, every KV head, into a cache of its own, from
        which ``activate`` gives each rank its heads (the draft's K/V lands in rank 0's pages, copied to the
        others then). ``in_place``: the sender writes the target's K/V into pages of the landing cache (``pools``)
        instead; None when it has no room now. Pages the prefix cache holds (on every rank, ``admit_handoff``)
        are the sink's ``held`` ones, never sent."""
        caches, ids = self.pages.caches, self.pages.page_ids(req)
        # The leading pages every rank's prefix cache holds (``admit_handoff``) are not sent: the staging or
        # landing pages are the arriving ones only, the held ones stand in as page 0 (never written, never read).
        held = len(req.prefix_pages)
        arriving = len(ids[0]) - held
        if in_place:
            if self.landing is None or self.landing.num_free_pages < arriving:
                return None
            landed = self._landed[req.rid] = self.landing.allocator.alloc(arriving)
            return PageSink(req.rid, [self.landing, *caches[1:]], [[0] * held + landed, *ids[1:]], guard,
                            in_place=True, held=held)
        staging = self._staged[req.rid] = staging_cache(caches[0].layout, self.kv_heads, arriving)
        return PageSink(req.rid, [staging, *caches[1:]], [[0] * held + staging_pages(arriving), *ids[1:]], guard,
                        held=held)

    def pools(self) -> list[torch.Tensor]:
        """Per cache (target first), its whole K/V pool: what a decode engine exports to a same-host prefill
        (``shared.handoff.ipc``), fixed for the engine's life. Under tensor parallelism a rank's pool holds its
        share of the KV heads: rank 0 of a decode engine exports its landing cache in the target's place
        (``page_sink`` in place), the other ranks nothing."""
        caches = self.pages.caches
        if self.split is not None:
            return [] if self.landing is None else [self.landing.pool, *(c.pool for c in caches[1:])]
        return [c.pool for c in caches]

    def activate(self, req: Request, committed_len: int, draft_state: DraftState | None = None,
                 output_ids: list[int] = (), output_logprobs: list[float] = ()) -> bool:
        """The K/V has arrived: the request resumes straight into the decode loop (no pseudo-forward), its
        outputs extended by ``output_ids``. False when ``req`` is no longer the engine's request waiting for
        its K/V (it was aborted)."""
        if not self._receiving(req):
            return False
        if self.split is not None:
            self._spread(req)
        self.pages.activate(req, committed_len, draft_state, output_ids, output_logprobs)
        return True

    def _spread(self, req: Request) -> None:
        """Under tensor parallelism, collectives: each rank's share of the target's KV heads that arrived, and the
        draft's pages (the other ranks replay these calls, then the activation with rank 0's arguments:
        ``shared/replay.py``). The pages taken from the prefix cache are not sent: every rank's holds them."""
        caches, ids = self.pages.caches, self.pages.page_ids(req)
        # The pages the prefix cache holds stay as they are; the ranks' caches hold the same, under the same ids.
        arriving = [pages[len(req.prefix_pages):] for pages in ids]
        landed, staged = self._landed.get(req.rid), self._staged.pop(req.rid, None)
        if landed is not None:
            self.split.scatter_pages(self.landing, landed, caches[0], arriving[0])
        else:
            self.split.scatter_pages(staged, None if staged is None else staging_pages(len(arriving[0])), caches[0],
                                     arriving[0])
        self._land_off(req.rid)
        for cache, pages in zip(caches[1:], arriving[1:]):
            self.split.share_pages(cache, pages)

    def _receiving(self, req: Request) -> bool:
        return self.pages.holds(req) and req.stage is Stage.RECEIVING

    # ---- the port's tables -----------------------------------------------------------------------
    def forget(self, req: Request) -> None:
        """``req`` ended (the scheduler's ``retire``): its staging tables and landing pages go."""
        if self.split is None:
            return
        self._staged.pop(req.rid, None)
        self._gathered.pop(req.rid, None)
        self._land_off(req.rid)

    def _land_off(self, rid: str) -> None:
        """Free request ``rid``'s pages of the landing cache, if it holds any."""
        landed = self._landed.pop(rid, None)
        if landed is not None:
            self.landing.allocator.free(landed)

    def is_clean(self) -> bool:
        """Every landing page back (the no-leak invariant)."""
        return self.landing is None or self.landing.is_full()
