"""The prefix cache's bookkeeping (shared/memory/prefix_cache.py): references, LRU eviction of unreferenced
leaves, admission counting them free, and a stress run on a full pool with aborts (issue 33, "No leak").
The outputs with the cache on are checked against the cache off in tests/unit/spec/test_prefix_cache_lossless.py.
"""

from __future__ import annotations

import random

import pytest
import torch
from engine_checks import check_accounting, check_pools_full

from shared.config import EngineConfig, SpecConfig
from shared.engine import Engine
from shared.memory.kv_cache import CacheLayout, KVCache
from shared.memory.prefix_cache import PrefixCache
from shared.sampling import SamplingParams

GREEDY = SamplingParams(max_new_tokens=4, ignore_eos=True)


def small_caches(num_pages: int = 8, page_size: int = 2, n: int = 2) -> list[KVCache]:
    return [KVCache(CacheLayout(num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32,
                                device=torch.device("cpu"), page_size=page_size, num_pages=num_pages, max_reqs=4,
                                max_context=32)) for _ in range(n)]


def cache_pages(pc: PrefixCache, caches: list[KVCache], tokens: list[int], n_pages: int) -> list:
    """Run ``tokens``' first ``n_pages`` pages as a request does: take the cached ones, compute (here: reserve)
    the others and hand them over, then end (drop its references); the request's path of nodes."""
    ps = caches[0].page_size
    path = pc.match(tokens, n_pages * ps)
    pc.lock(path)
    handles = [c.open() for c in caches]
    for i, (c, h) in enumerate(zip(caches, handles)):
        c.attach(h, [node.pages[i] for node in path])
        c.reserve(h, n_pages * ps)
    for i in range(len(path), n_pages):
        node = pc.insert(path[-1] if path else pc.root, tokens, i,
                         tuple(c.pages_of(h, i, i + 1)[0] for c, h in zip(caches, handles)))
        path.append(node)
        for c, h in zip(caches, handles):
            c.share(h, i + 1)
    for c, h in zip(caches, handles):
        c.close(h)
    pc.unlock(path)
    return path


def test_lru_evicts_unreferenced_leaves_only():
    caches = small_caches(num_pages=8)
    pc = PrefixCache(caches, successor=True)
    a = cache_pages(pc, caches, list(range(10)), 3)  # pages (0 1)(2 3)(4 5), successor 6
    b = cache_pages(pc, caches, [0, 1, 2, 3, 9, 9, 9], 3)  # its second page's successor (9) differs: one shared
    assert b[0] is a[0] and len(pc) == 5 and pc.evictable == 5
    assert all(c.num_free_pages == 8 and c.allocator.num_free == 3 for c in caches)
    assert pc.match([0, 1, 2, 3, 9, 9, 9], 6) == b
    pc.lock(a[:2])  # a request holds a's first two pages: only a's tail and b's two may go
    assert pc.evictable == 3 and all(c.num_free_pages == 6 for c in caches)
    assert pc.evict(8) == 3  # leaves first (b's middle page once its child went); never a held page
    assert pc.match(list(range(10)), 6) == a[:2] and pc.match([0, 1, 2, 3, 9, 9, 9], 6) == a[:1]
    pc.unlock(a[:2])
    assert pc.flush() == 2 and len(pc) == 0
    assert all(sorted(c.allocator._free) == list(range(1, 9)) for c in caches)


def test_least_recently_used_goes_first():
    caches = small_caches(num_pages=8, n=1)
    pc = PrefixCache(caches, successor=False)
    old = cache_pages(pc, caches, [1, 1, 1, 1], 1)
    new = cache_pages(pc, caches, [2, 2, 2, 2], 1)
    hit = pc.match([1, 1, 1, 1], 3)  # a later hit on the older one makes it the most recent
    pc.lock(hit)
    pc.unlock(hit)
    assert pc.evict(1) == 1
    assert pc.match([2, 2, 2, 2], 3) == [] and pc.match([1, 1, 1, 1], 3) == old
    assert new[0].pages[0] in caches[0].allocator._free


def test_the_allocator_evicts_when_short():
    caches = small_caches(num_pages=4, n=2)
    pc = PrefixCache(caches, successor=False)
    cache_pages(pc, caches, [5, 5, 6, 6, 7, 7], 3)
    assert caches[0].allocator.num_free == 1 and caches[0].num_free_pages == 4
    h = caches[0].open()
    caches[0].reserve(h, 6)  # three pages: two come from the cache, which frees them in every cache
    assert len(pc) == 1 and caches[1].allocator.num_free == 3
    caches[0].close(h)


def test_keys_are_exact():
    """A page's key is its parent, its tokens and (with a draft) the next token: no hash stands for them."""
    caches = small_caches(n=1)
    pc = PrefixCache(caches, successor=True)
    cache_pages(pc, caches, [1, 2, 3, 4, 5], 2)
    assert len(pc.match([1, 2, 3, 4, 5], 4)) == 2
    assert len(pc.match([1, 2, 3, 4, 6], 4)) == 1  # the second page's successor differs
    assert len(pc.match([1, 2, 3, 9, 5], 4)) == 1
    assert pc.match([2, 2, 3, 4, 5], 4) == []
    assert len(pc.match([1, 2, 3, 4], 4)) == 1  # no token after the second page: not a hit
    pc.flush()


def engine(tiny_model_dir, cached: bool, num_pages: int | None = None, kind: str | None = "eagle") -> Engine:
    spec = SpecConfig(topk=2, steps=3, num_draft_tokens=6) if kind else None
    return Engine(tiny_model_dir / "target", tiny_model_dir / kind if kind else None,
                  EngineConfig(page_size=4, chunk_size=8, max_running=6, max_context=96, num_pages=num_pages,
                               spec=spec, prefix_cache=cached))


def test_admission_counts_unreferenced_pages_free(tiny_model_dir, one_thread):
    """A pool whose pages are nearly all cached (none held) admits a request needing most of the pool: the
    cached pages are evicted as its pages are reserved."""
    e = engine(tiny_model_dir, cached=True, num_pages=30)
    prompts = [[i + 3] * 40 for i in range(3)]  # 10 pages each, nothing shared
    for p in prompts:
        e.generate([p], GREEDY)
    assert len(e.prefix_cache) >= 27 and e.cache.allocator.num_free <= 3
    assert all(c.num_free_pages == 30 for c in e.scheduler.caches)
    big = e.add_request([9] * 60, GREEDY)  # 60 + 4 + headroom: 18 pages
    assert e.scheduler.can_admit(big)
    e.run_until_done()
    assert e.result(big).finish_reason == "length"
    assert sum(len(e.prefix_cache.match(p, 39)) for p in prompts) < 27  # it took pages evicted from them
    check_pools_full(e)


def check_in_use_never_evicted(e: Engine) -> None:
    """Every cached page a running request holds is still cached, held, and in no free list."""
    pc = e.prefix_cache
    cached = {id(n) for n in pc._nodes.values()}
    for r in e.scheduler.running:
        for node in r.prefix_pages:
            assert id(node) in cached and node.refs > 0, f"{r.rid}: a page it holds was evicted"
    for i, cache in enumerate(e.scheduler.caches):
        free = set(cache.allocator._free)
        assert len(free) == len(cache.allocator._free), f"cache {i}: a page freed twice"
        held = {p[i] for p in pc.cached_pages()}
        for r in e.scheduler.running:
            h = r.handles[i]
            held |= set(cache.pages_of(h, 0, cache.pages_for(h.reserved)))
        assert not free & held, f"cache {i}: pages both free and in use: {sorted(free & held)}"


@pytest.mark.parametrize("kind", [None, "mtp"])  # mtp: three draft caches, each page evicted from all four
def test_eviction_stress_full_pool_with_aborts(tiny_model_dir, kind, one_thread):
    """Requests from four shared prefixes on a pool that holds about two of them at once: the cache evicts
    constantly, never a page in use; the outputs are the cache-off engine's, and every page comes back
    after the aborts."""
    rng = random.Random(7)
    prefixes = [[rng.randrange(3, 500) for _ in range(24)] for _ in range(4)]
    prompts = [prefixes[rng.randrange(4)] + [rng.randrange(3, 500) for _ in range(rng.randrange(1, 9))]
               for _ in range(32)]
    e = engine(tiny_model_dir, cached=True, num_pages=26, kind=kind)
    reqs, aborted, pending = [], set(), list(enumerate(prompts))
    evicted_seen = False
    while pending or e.scheduler.has_work():
        for _ in range(rng.randrange(0, 3)):  # arrivals
            if pending:
                i, p = pending.pop(0)
                reqs.append((i, e.add_request(p, GREEDY, rid=f"r{i}")))
        if e.scheduler.running and rng.random() < 0.15:  # an abort mid-prefill or mid-decode
            victim = rng.choice(e.scheduler.running)
            aborted.add(victim.rid)
            e.abort(victim.rid)
        before = len(e.prefix_cache)
        e.step()
        evicted_seen |= len(e.prefix_cache) < before
        check_in_use_never_evicted(e)
        check_accounting(e)
    assert evicted_seen, "the pool never ran short: no eviction was exercised"
    assert sum(e.result(r).cached_tokens for _, r in reqs) > 0
    check_pools_full(e)
    ref = engine(tiny_model_dir, cached=False, kind=kind)
    want = ref.generate(prompts, GREEDY)
    for i, r in reqs:
        if r.rid not in aborted:
            assert e.result(r).token_ids == want[i].token_ids, f"request {i}"
    assert e.flush_prefix_cache() > 0 and len(e.prefix_cache) == 0
    check_pools_full(e)


def test_a_hand_off_is_admitted_for_every_page_it_fills(tiny_model_dir, one_thread):
    """A decode engine with a prefix cache (its own prompts prefilled there) admits a hand-off for all its pages:
    the K/V arrives in pages of its own, so cached pages of the same prompt do not lower what it needs."""
    e = Engine(tiny_model_dir / "target", config=EngineConfig(page_size=4, chunk_size=8, max_running=4,
                                                              max_context=96, num_pages=27, prefix_cache=True),
               role="decode")
    prompt, params = [(i * 7 + 3) % 500 for i in range(40)], SamplingParams(max_new_tokens=20, ignore_eos=True)
    local = e.add_request(prompt, params)  # prefilled here: its 10 pages cached and held; 16 at its peak
    while local.kv_len < len(prompt):
        e.step()
    assert len(local.prefix_pages) == 10
    # free 17, the local request may still claim 6: 11 unclaimed, a hand-off of 40 + 20 needs 16
    assert e.reserve_handoff("h", prompt, [], [], params, len(prompt)) is None
    e.abort(local.rid)
    check_pools_full(e)
