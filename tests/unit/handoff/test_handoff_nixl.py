"""The NIXL transport's data path on the CPU (UCX between host-memory pools): each increment's pages land in the
reserved pages, runs coalesced or not, and nowhere else; a cancelled guard stops it. The services over NIXL are in
test_handoff_services.py and tests/e2e/test_stack.py (parametrized by transport)."""

from __future__ import annotations

import pytest
import torch

from shared.handoff import Increment, PageFeed, PageSource, Prefilled, TransferCancelled
from shared.handoff.nixl import NixlAgent, nixl_api, write_pages
from shared.handoff.wire import TransportFailed
from shared.memory.kv_cache import CacheLayout, KVCache

pytestmark = pytest.mark.skipif(nixl_api() is None, reason="NIXL is not installed (the test extra installs it)")

PS = 4


def cache(layers: int, seed: int | None = None) -> KVCache:
    c = KVCache(CacheLayout(num_layers=layers, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16,
                            device=torch.device("cpu"), page_size=PS, num_pages=12, max_reqs=1, max_context=48,
                            shareable=True))
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        c.pool.copy_(torch.randn(c.pool.shape, generator=g).to(torch.bfloat16))
    return c


@pytest.fixture(scope="module")
def agents():
    pair = NixlAgent("decode"), NixlAgent("prefill")
    yield pair
    for agent in pair:
        agent.close()


def test_a_closed_agent_refuses_writes_and_ends_its_threads():
    """A closed agent is gone (its UCX progress threads, which poll without pause, end with it): every process's
    count of live agents drops, and a write through it fails as a transport failure, never a crash."""
    before = NixlAgent.live
    agent = NixlAgent("decode")
    assert NixlAgent.live == before + 1
    agent.close()
    agent.close()  # twice is harmless
    assert NixlAgent.live == before and agent.agent is None
    with pytest.raises(TransportFailed, match="closed"):
        agent.write("nobody", [], [], "DRAM", "DRAM", deadline=0.0)
    with pytest.raises(TransportFailed, match="closed"):
        agent.register([cache(1).pool])


def test_each_increments_pages_land_in_the_reserved_pages_only(agents):
    decode, prefill = agents
    dst = [cache(3), cache(1)]
    blob = decode.export([c.pool for c in dst])
    src = [cache(3, seed=1), cache(1, seed=2)]
    src_pages, dst_pages = [1, 2, 3, 7, 8, 5], [9, 10, 2, 3, 4, 11]  # runs on one side, on both, on neither
    feed = PageFeed()
    feed.put(Increment([src_pages[:4]] * 2, [2, 2]))
    feed.put(Increment([src_pages] * 2, [6, 6], last=Prefilled(b"state", (7,), (-0.5,))))
    written = write_pages(prefill, PageSource("r", src, [], b"", feed=feed), blob, [dst_pages] * 2, deadline=1e18)
    assert written.last.draft_state == b"state" and written.last.output_ids == (7,)
    assert written.bytes == sum(c.pool[:, :, :PS].numel() * 2 * len(src_pages) for c in src)
    for s, d in zip(src, dst):
        want = torch.zeros_like(d.pool)
        for a, b in zip(src_pages, dst_pages):
            want[:, :, b * PS:(b + 1) * PS] = s.pool[:, :, a * PS:(a + 1) * PS]
        assert torch.equal(d.pool, want)


def test_a_cancelled_guard_stops_the_writes(agents):
    decode, prefill = agents
    dst = [cache(1)]
    blob = decode.export([dst[0].pool])
    source = PageSource("r", [cache(1, seed=3)], [[1, 2]], b"")
    source.guard.cancel()
    with pytest.raises(TransferCancelled):
        write_pages(prefill, source, blob, [[4, 5]], deadline=1e18)
    assert not dst[0].pool.any()
