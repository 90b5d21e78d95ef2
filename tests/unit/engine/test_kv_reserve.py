"""KVCache.reserve: the small-reservation path (plain ints, a decode step's few positions) gives every
position exactly the slot the vectorised path gives it, across page sizes, partially filled pages,
multi-page jumps, shrinks and interleaved requests."""

from __future__ import annotations

import random

import pytest
import torch

from shared.memory.kv_cache import CacheSpec, KVCache


def cache(page_size: int, small: int) -> KVCache:
    c = KVCache(CacheSpec(num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32, device=torch.device("cpu"),
                          page_size=page_size, num_pages=400, max_reqs=4, max_context=512))
    c.SMALL_RESERVE = small
    return c


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_small_and_vectorised_reservations_give_the_same_slots(page_size):
    rng = random.Random(page_size)
    ints, vec = cache(page_size, 10**9), cache(page_size, -1)  # every call on one path, then the other
    handles = [(ints.open(), vec.open()) for _ in range(3)]
    for _ in range(200):
        hi, hv = rng.choice(handles)
        if rng.random() < 0.2 and hi.reserved:
            n = rng.randrange(hi.reserved)
            ints.shrink(hi, n)
            vec.shrink(hv, n)
            continue
        n = min(hi.reserved + rng.choice([1, 2, 3, 6, page_size, 2 * page_size + 1, 40]), 512)
        ints.reserve(hi, n)
        vec.reserve(hv, n)
        assert hi.reserved == hv.reserved == n
    assert torch.equal(ints.req_to_token.host, vec.req_to_token.host)
    for hi, _ in handles:  # every reserved position has a slot of a page the request owns, at its offset
        slots = ints.req_to_token.host[hi.row, :hi.reserved]
        assert torch.equal(slots % page_size, torch.arange(hi.reserved) % page_size)
        assert (slots // page_size > 0).all()
    assert ints.num_free_pages == vec.num_free_pages
