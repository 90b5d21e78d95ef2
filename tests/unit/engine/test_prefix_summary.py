"""The prefix cache's published summary (issue 33, prefix-aware placement): the digests an engine computes for
its cached pages are the ones the router computes from a prompt's token ids, so the router's count of a
prompt's leading pages an instance holds is the engine's own match, for page sizes 1, 4 and 16, with and
without the successor rule (a draft's). The summary is bounded, most recently used first, and versioned."""

from __future__ import annotations

import random

import pytest
import torch
from engine_checks import check_pools_full

from services.router.prefix import PromptDigests
from shared.config import EngineConfig, SpecConfig
from shared.engine import Engine
from shared.memory.kv_cache import CacheLayout, KVCache
from shared.memory.prefix_cache import PrefixCache
from shared.memory.prefix_digest import PrefixSummary, leading_pages, prompt_digests
from shared.sampling import SamplingParams


def caches(page_size: int, num_pages: int = 64, n: int = 2) -> list[KVCache]:
    return [KVCache(CacheLayout(num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32,
                                device=torch.device("cpu"), page_size=page_size, num_pages=num_pages, max_reqs=4,
                                max_context=128)) for _ in range(n)]


def cache_prompt(pc: PrefixCache, cs: list[KVCache], tokens: list[int]) -> None:
    """Cache every page of ``tokens`` a request would (as test_prefix_cache.cache_pages: match, reserve the rest,
    hand them over, end)."""
    n_pages = (len(tokens) - 1) // pc.page_size
    path = pc.match(tokens, n_pages * pc.page_size)
    pc.lock(path)
    handles = [c.open() for c in cs]
    for i, (c, h) in enumerate(zip(cs, handles)):
        c.attach(h, [node.pages[i] for node in path])
        c.reserve(h, n_pages * pc.page_size)
    for i in range(len(path), n_pages):
        path.append(pc.insert(path[-1] if path else pc.root, tokens, i,
                              tuple(c.pages_of(h, i, i + 1)[0] for c, h in zip(cs, handles))))
        for c, h in zip(cs, handles):
            c.share(h, i + 1)
    for c, h in zip(cs, handles):
        c.close(h)
    pc.unlock(path)


def router_count(summary: PrefixSummary, prompt: list[int]) -> int:
    """The leading pages of ``prompt`` the router finds in ``summary`` (as ``PrefixIndex.matches`` counts them)."""
    return leading_pages(frozenset(summary.digests), PromptDigests(prompt, summary.page_size, summary.successor))


def probes(base: list[int], ps: int, rng: random.Random) -> list[list[int]]:
    """Prompts against a cache holding ``base``: itself, longer, cut inside a page and at a page boundary (with
    and without one token after it), diverging inside a page and right after a boundary, and an unrelated one."""
    out = [base, base + [7, 8, 9], base[:2 * ps + ps // 2 + 1], base[:2 * ps], base[:2 * ps + 1]]
    inside = base[:]
    inside[ps + ps // 2] += 1
    after = base[:]
    after[2 * ps] += 1  # the first token after page 2: a successor key misses page 2
    return out + [inside, after, [rng.randrange(1, 500) for _ in base]]


@pytest.mark.parametrize("ps", [1, 4, 16])
@pytest.mark.parametrize("successor", [True, False], ids=["successor", "plain"])
def test_the_router_counts_what_the_engine_matches(ps, successor):
    rng = random.Random(ps)
    cs = caches(ps, num_pages=64 if ps < 16 else 16)
    pc = PrefixCache(cs, successor=successor)
    base = [rng.randrange(1, 500) for _ in range(4 * ps + 1)]
    cache_prompt(pc, cs, base)
    cache_prompt(pc, cs, base[:ps] + [rng.randrange(1, 500) for _ in range(2 * ps + 1)])  # a sibling branch
    summary = PrefixSummary.from_json(pc.summary(10_000).to_json())  # what the router reads back
    assert len(summary.digests) == len(pc) and (summary.page_size, summary.successor) == (ps, successor)
    counts = []
    for prompt in probes(base, ps, rng):
        path = pc.match(prompt, len(prompt) - 1)
        assert router_count(summary, prompt) == len(path), (prompt, len(path))
        assert prompt_digests(prompt, ps, successor)[:len(path)] == [n.digest for n in path]
        counts.append(len(path))
    assert counts[0] == 4 and counts[-1] == 0  # the probes hit whole, partly and not at all
    assert counts[6] == (1 if successor else 2)  # a divergence right after page 2: the successor rule's miss
    assert counts[5] == (1 if ps > 1 or not successor else 0)  # a divergence inside page 1 (page 0's successor)
    pc.flush()


def test_the_summary_is_bounded_most_recent_first_and_versioned():
    cs = caches(4, n=1)
    pc = PrefixCache(cs, successor=True)
    old, new = [1] * 9, [2] * 9
    v0 = pc.summary(10).version
    cache_prompt(pc, cs, old)
    cache_prompt(pc, cs, new)
    v1 = pc.summary(10).version
    assert v1 > v0
    top = pc.summary(2)  # the last used prompt's two pages, its first page first
    assert top.digests == tuple(prompt_digests(new, 4, True)) and len(pc.summary(3).digests) == 3
    cache_prompt(pc, cs, old)  # a hit: recency changes, the content does not
    assert pc.summary(2).digests == tuple(prompt_digests(old, 4, True)) and pc.summary(2).version == v1
    assert pc.evict(1) == 1  # the least recently used leaf (new's second page) goes
    after = pc.summary(10)
    assert after.version > v1 and len(after.digests) == 3
    assert router_count(after, new) == 1 and router_count(after, old) == 2
    pc.flush()
    assert pc.summary(10).digests == ()


def test_a_malformed_summary_is_refused_by_name():
    for raw in ("not json", '{"version": 1}', '{"version": 1, "page_size": 4, "successor": true, "digests": "AAA"}',
                '{"version": 1, "page_size": 0, "successor": true, "digests": ""}'):
        with pytest.raises(ValueError, match="malformed prefix summary"):
            PrefixSummary.from_json(raw)


@pytest.mark.parametrize("kind", ["eagle", None], ids=["draft", "no-draft"])
def test_an_engines_summary_agrees_with_its_lookup(tiny_model_dir, kind):
    """Through the engine's API (``Engine.prefix_summary``): after real prefills, the router's count of each
    prompt's leading pages is the engine's own match (the successor rule with a draft, none without)."""
    spec = SpecConfig(topk=2, steps=3, num_draft_tokens=6) if kind else None
    e = Engine(tiny_model_dir / "target", tiny_model_dir / kind if kind else None,
               EngineConfig(page_size=4, chunk_size=8, max_running=4, max_context=96, spec=spec, prefix_cache=True))
    assert Engine(tiny_model_dir / "target", None, EngineConfig(page_size=4, max_context=96)).prefix_summary(8) is None
    shared = [11, 12, 13, 14, 15, 16, 17, 18, 19]
    prompts = [shared + [20 + i] * 6 for i in range(3)]
    e.generate(prompts, SamplingParams(max_new_tokens=3, ignore_eos=True))
    summary = e.prefix_summary(1000)
    assert summary.successor == (kind is not None) and summary.page_size == 4 and summary.digests
    assert summary.version == e.load().prefix_version
    for prompt in [*prompts, shared + [99] * 6, shared[:8] + [5], [3] * 15]:
        assert router_count(summary, prompt) == len(e.prefix_cache.match(prompt, len(prompt) - 1))
    assert router_count(summary, prompts[0]) >= 3
    check_pools_full(e)
