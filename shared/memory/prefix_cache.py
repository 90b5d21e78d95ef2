"""The prefix cache: full pages of prefilled K/V, target and draft together, shared by an engine's requests.

**The structure.** A tree of pages. A node is one full page of a prefix, holding that page's id in every
cache of the engine (the target's and each draft cache's, one page count for all), a reference count and
the time it was last used. Its key is exact: ``(parent node's id, the page's tokens, the successor token)``,
kept in one dict, so a lookup walks the prompt page by page (one dict probe per page) and a hit never rests
on a hash being collision-free (Python's hash of integers is not keyed: a client could craft collisions).
This is vLLM's automatic prefix caching (full blocks chained by their parent's hash, one table) with the
parent's identity in the key in place of a cryptographic digest, and, since a node's parent is explicit,
SGLang RadixAttention's tree as well: eviction takes leaves only, so a cached page is never left unreachable
behind an evicted parent. Page granularity (no token-level radix edges): a page is what the pools allocate,
copy and hand off, and the tail of a prompt shorter than a page is recomputed (under ``page_size`` tokens).

**The draft's K/V and the tail-token rule (seed 000).** Draft position t runs on (target feature at t, token
at t + 1), so the draft K/V of a page's last position depends on the first token after the page. With a
draft, that token is part of the page's key (``successor``): a hit is exact for the target's and every draft
cache's K/V, and no draft position is recomputed. This costs nothing at lookup: a prompt's last position is
always computed (its logits draw the first token, its draft row gives the first draft state), so a matched
page always ends before the prompt's last token, and the token after it is known. What it costs is a miss on
the page before a divergence that falls exactly on a page boundary (SGLang keys its tree on token bigrams
under EAGLE for the same reason; vLLM drops the last matched block instead).

**What is cached.** Pages a prefill forward computed (the prompt, and a resumed request's output but its
last), inserted after each chunk as soon as every position of the page and its successor token are known; on a
decode engine, the prompt pages a hand-off brought (a prefill instance's forward computed them), inserted when
the request is activated, and a later hand-off takes those it holds instead of receiving them.
Positions written by decode steps (verify, compaction) are not: their K/V is the target's over a tree, equal
to a prefill's only to rounding, and a cache that must not change an output by a token keeps to what a
prefill of the same prompt computes.

**Ownership.** A page is either a request's own (freed when the request ends) or the cache's (a node). A
request holds references to the nodes of its prefix (the ones it matched at admission and the ones it
inserted), never writes them (its writes start at its first uncached position, a page boundary), and drops
its references when it ends. A node with no reference is free in the scheduler's eyes: the page allocator
evicts the least recently used unreferenced leaves when it runs short (``PageAllocator.spare``), so a page
in use is never evicted, and the admission counts unreferenced pages as free (``KVCache.num_free_pages``).

**The summary.** Each node also carries its chained digest (``shared/memory/prefix_digest.py``), computed once
when it is cached, and the nodes are kept in the order they were last used: ``summary`` gives the router the
digests of the most recently used ones (an instance's published cache summary, for prefix-aware placement).
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Sequence

from shared.memory.kv_cache import KVCache
from shared.memory.prefix_digest import ROOT, PrefixSummary, page_digest


class CachedPage:
    """One full page of a cached prefix: its page id in every cache, target first."""

    __slots__ = ("id", "parent", "key", "pages", "children", "refs", "last_used", "digest")

    def __init__(self, node_id: int, parent: CachedPage | None, key: tuple | None, pages: tuple[int, ...]):
        self.id = node_id
        self.parent = parent
        self.key = key
        self.pages = pages
        # the chained digest the router computes for the same page (prefix_digest.py)
        self.digest = ROOT if parent is None else page_digest(parent.digest, key[1], key[2])
        self.children = 0  # cached children (a node is evictable only as a leaf)
        self.refs = 0  # requests holding it
        self.last_used = 0


class PrefixCache:
    """The cached pages of an engine's caches (target first), keyed as the module docstring says."""

    def __init__(self, caches: list[KVCache], successor: bool):
        sizes = {c.page_size for c in caches}
        if len(sizes) != 1:
            raise ValueError(f"a prefix cache needs one page size across the caches, got {sorted(sizes)}")
        self.caches = caches
        self.page_size = sizes.pop()
        self.successor = successor  # keys carry the token after the page (a draft's K/V depends on it)
        self.root = CachedPage(0, None, None, ())
        self._nodes: dict[tuple, CachedPage] = {}
        self._ids = itertools.count(1)
        self._clock = itertools.count(1)
        self._unreferenced = 0
        self._leaves: list[tuple[int, int, CachedPage]] = []  # (last used, id, node): evictable leaves, lazily
        self.hits = self.lookups = 0  # prompt tokens matched, and prompt tokens looked up (hit rate)
        self._recent: OrderedDict[CachedPage, None] = OrderedDict()  # every node, least recently used first
        self.version = 0  # changes whenever a page is cached or evicted (the published summary's)
        for cache in caches:
            cache.allocator.spare = self

    # ---- counters --------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._nodes)

    @property
    def evictable(self) -> int:
        """Cached pages no request holds (per cache): free to the scheduler, evicted when pages run short."""
        return self._unreferenced

    def cached_pages(self) -> list[tuple[int, ...]]:
        """Every node's page ids, per cache (the accounting checks read them)."""
        return [n.pages for n in self._nodes.values()]

    def referenced(self) -> int:
        """Nodes some request holds."""
        return len(self._nodes) - self._unreferenced

    def summary(self, limit: int) -> PrefixSummary:
        """The digests of the ``limit`` most recently used cached pages, most recent first (a parent before
        the children it was used with), for the router's prefix-aware placement."""
        digests = tuple(n.digest for n in itertools.islice(reversed(self._recent), max(0, limit)))
        return PrefixSummary(self.version, self.page_size, self.successor, digests)

    # ---- lookup and references -------------------------------------------------------------------
    def _key(self, parent: CachedPage, tokens: Sequence[int], index: int) -> tuple:
        ps = self.page_size
        succ = tokens[(index + 1) * ps] if self.successor else -1
        return parent.id, tuple(tokens[index * ps:(index + 1) * ps]), succ

    def pages_within(self, tokens: Sequence[int], limit: int) -> int:
        """How many leading pages of ``tokens`` within ``limit`` positions have a key: with a draft, only those
        whose successor token is in ``tokens``."""
        pages = limit // self.page_size
        if self.successor:
            pages = min(pages, (len(tokens) - 1) // self.page_size)
        return max(0, pages)

    def next_key(self, path: list[CachedPage], tokens: Sequence[int]) -> tuple:
        """The key of page ``len(path)`` of ``tokens`` after the chain ``path`` (from the root): the page a
        lookup probes next, and the one a request holding ``path`` inserts next."""
        return self._key(path[-1] if path else self.root, tokens, len(path))

    def match(self, tokens: Sequence[int], limit: int) -> list[CachedPage]:
        """The longest chain of cached pages for ``tokens``, covering at most ``limit`` positions (the ones
        whose K/V the request may take rather than compute); with a draft, a page only when the token after
        it is in ``tokens``."""
        pages = self.pages_within(tokens, limit)
        path, node = [], self.root
        for i in range(pages):
            node = self._nodes.get(self._key(node, tokens, i))
            if node is None:
                break
            path.append(node)
        return path

    def lock(self, path: list[CachedPage]) -> None:
        """A request takes ``path`` (a chain from the root): no page of it is evicted until ``unlock``."""
        now = next(self._clock)
        for node in path:
            if node.refs == 0:
                self._unreferenced -= 1
            node.refs += 1
            node.last_used = now
        for node in reversed(path):  # the root's end last: the most recent in the summary
            self._recent.move_to_end(node)

    def unlock(self, path: list[CachedPage]) -> None:
        """A request drops ``path``; nodes no request holds any more become evictable (leaves first)."""
        now = next(self._clock)
        for node in reversed(path):
            node.refs -= 1
            node.last_used = now
            self._recent.move_to_end(node)
            if node.refs == 0:
                self._unreferenced += 1
                if node.children == 0:
                    heapq.heappush(self._leaves, (now, node.id, node))

    def insert(self, parent: CachedPage, tokens: Sequence[int], index: int,
               pages: tuple[int, ...]) -> CachedPage | None:
        """Page ``index`` of ``tokens`` under ``parent`` (a node the caller holds, or the root), its page
        ``pages`` (per cache) handed over to the cache and held by the caller (one reference); None when
        the same page is cached already (the caller keeps its own copy)."""
        key = self._key(parent, tokens, index)
        if key in self._nodes:
            return None
        node = CachedPage(next(self._ids), parent, key, pages)
        node.refs, node.last_used = 1, next(self._clock)
        self._nodes[key] = node
        self._recent[node] = None
        self.version += 1
        parent.children += 1
        return node

    # ---- eviction --------------------------------------------------------------------------------
    def evict(self, n: int) -> int:
        """Free up to ``n`` pages in every cache, least recently used unreferenced leaves first; how many."""
        freed = 0
        while freed < n and self._leaves:
            used, _, node = heapq.heappop(self._leaves)
            if node.refs or node.children or used != node.last_used or self._nodes.get(node.key) is not node:
                continue  # stale: taken again, or given a child, since it was pushed
            del self._nodes[node.key]
            del self._recent[node]
            self.version += 1
            self._unreferenced -= 1
            for cache, page in zip(self.caches, node.pages):
                cache.allocator.free([page])
            parent = node.parent
            parent.children -= 1
            if parent is not self.root and parent.children == 0 and parent.refs == 0:
                heapq.heappush(self._leaves, (parent.last_used, parent.id, parent))
            freed += 1
        return freed

    def flush(self) -> int:
        """Evict every unreferenced page; how many."""
        return self.evict(self._unreferenced)
