"""Engine-test helpers (imported by name, like tests/unit/spec/spec_helpers.py): the no-leak check."""

from __future__ import annotations

import torch

from shared.forward_batch import build_forward_batch
from shared.sampling import SamplingParams


def check_pools_full(engine) -> None:
    """Every page and request row of every cache is back in its pool, each exactly once.

    Reads the counters the allocator keeps and the free list itself, so a double free that hides a
    lost page (counter right, contents wrong) fails too; then the engine's own no-leak predicate.
    With a prefix cache, a cached page no request holds counts as returned (it is free to the scheduler,
    evicted when needed): the free list and the cached pages together are every page exactly once, and
    no cached page is still held by a request.
    """
    assert not engine.scheduler.running and not engine.scheduler.waiting, "requests still scheduled"
    assert not engine.requests, f"requests still registered: {sorted(engine.requests)}"
    prefix = getattr(engine, "prefix_cache", None)
    if prefix is not None:
        assert prefix.referenced() == 0, f"{prefix.referenced()} cached pages still held with no request running"
    cached = prefix.cached_pages() if prefix is not None else []
    for i, cache in enumerate(engine.scheduler.caches):
        n_pages, n_rows = cache.layout.num_pages, cache.req_to_token.num_rows
        assert cache.num_free_pages == n_pages, f"cache {i}: {cache.num_free_pages} of {n_pages} pages free"
        assert cache.num_free_rows == n_rows, f"cache {i}: {cache.num_free_rows} of {n_rows} request rows free"
        returned = cache.allocator._free + [pages[i] for pages in cached]
        assert sorted(returned) == list(range(1, n_pages + 1)), f"cache {i}: free list corrupted"
        assert sorted(cache.req_to_token._free_rows) == list(range(1, n_rows + 1)), f"cache {i}: row list corrupted"
        assert not cache.req_to_token.host.any(), f"cache {i}: a freed row still maps slots"
    assert engine.is_idle_and_clean()



# Prompts of different lengths (21, 3, 29 and 10 tokens) for the tiny model (vocabulary 512).
PROMPTS = [list(range(3, 24)), [7, 8, 9], [100 + (i * 37) % 300 for i in range(29)], [42] * 10]
GREEDY = SamplingParams(max_new_tokens=8, ignore_eos=True)


def check_accounting(engine) -> None:
    """Mid-run bookkeeping: the pages and rows in use are exactly those the live requests hold."""
    sched = engine.scheduler
    prefix = getattr(engine, "prefix_cache", None)
    for i, cache in enumerate(sched.caches):
        # A request's own pages are its pages past its cached prefix; cached pages are the cache's (held or not).
        held = sum(cache.pages_for(r.handles[i].reserved) - r.handles[i].shared for r in sched.running if r.handles)
        held += len(prefix) if prefix is not None else 0
        assert cache.allocator.num_free + held == cache.layout.num_pages, f"cache {i}: pages unaccounted for"
        rows = sum(1 for r in sched.running if r.handles)
        assert cache.num_free_rows + rows == cache.req_to_token.num_rows, f"cache {i}: rows unaccounted for"
    assert len(sched.running) <= engine.config.max_running


def record_logits(engine) -> dict[str, list]:
    """From now on, every logits row the engine samples from, per request id, in order."""
    seen: dict[str, list] = {}
    inner = engine.runner._sample_and_commit

    def spy(out, reqs, *rest):
        for req, row in zip(reqs, out.logits):
            seen.setdefault(req.rid, []).append(row.clone())
        return inner(out, reqs, *rest)

    engine.runner._sample_and_commit = spy
    return seen


def record_plans(engine) -> list[tuple[int, list[int], int]]:
    """From now on, per scheduling step: (decode requests, prefill chunk lengths, waiting requests)."""
    plans: list[tuple[int, list[int], int]] = []
    inner = engine.scheduler.schedule

    def spy():
        plan = inner()
        if not plan.empty:
            plans.append((len(plan.decode), [c.end - c.start for c in plan.prefill], len(engine.scheduler.waiting)))
        return plan

    engine.scheduler.schedule = spy
    return plans


def eyrie_logits(engine, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Every position's logits for each prompt, all prompts in one batched prefill forward."""
    cache = engine.cache
    handles = [cache.open() for _ in prompts]
    try:
        for h, p in zip(handles, prompts):
            cache.reserve(h, len(p))
        ids = torch.tensor([t for p in prompts for t in p])
        pos = torch.cat([torch.arange(len(p)) for p in prompts])
        batch = build_forward_batch(cache, [h.row for h in handles], [0] * len(prompts), [len(p) for p in prompts],
                                    ids, pos, pos)
        logits = engine.model(batch, cache).logits
    finally:
        for h in handles:
            cache.close(h)
    return list(logits.split([len(p) for p in prompts]))
