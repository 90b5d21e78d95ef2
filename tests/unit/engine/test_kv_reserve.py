"""KVCache.reserve (slots from ints, page by page) gives every position exactly the slot the earlier
vectorised computation gave it, across page sizes, partially filled pages, multi-page jumps, shrinks and
interleaved requests."""

from __future__ import annotations

import random

import pytest
import torch

from shared.memory.kv_cache import CacheLayout, KVCache, ReqToTokenMap


class VectorisedKVCache(KVCache):
    """The reference: the earlier reserve, every position's slot from tensor ops."""

    def reserve(self, h, n_positions):
        if n_positions <= h.reserved:
            return
        ps = self.page_size
        new_pages = self.allocator.alloc(self.pages_needed(h, n_positions))
        pos = torch.arange(h.reserved, n_positions)
        first_new_page = self.pages_for(h.reserved)
        slots = torch.empty(n_positions - h.reserved, dtype=torch.int64)
        in_old = pos < first_new_page * ps
        if in_old.any():
            last_page = int(self.req_to_token.host[h.row, (first_new_page - 1) * ps]) // ps
            slots[in_old] = last_page * ps + pos[in_old] % ps
        if new_pages:
            p = pos[~in_old]
            slots[~in_old] = torch.tensor(new_pages, dtype=torch.int64)[p // ps - first_new_page] * ps + p % ps
        self.req_to_token.write(h.row, h.reserved, slots)
        h.reserved = n_positions


def cache(page_size: int, kind=KVCache) -> KVCache:
    return kind(CacheLayout(num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32, device=torch.device("cpu"),
                          page_size=page_size, num_pages=400, max_reqs=4, max_context=512))


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_int_reservations_give_the_vectorised_slots(page_size):
    rng = random.Random(page_size)
    ints, vec = cache(page_size), cache(page_size, VectorisedKVCache)
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


def test_a_device_table_takes_every_write_in_one_copy_when_read():
    """The device table (here a separate CPU tensor standing in for the GPU's) lags the host until it is
    read, then equals it: writes, a freed row and rewrites of the same entries included."""
    m = ReqToTokenMap(max_reqs=3, max_context=16, device=torch.device("cpu"))
    m._table = m.host.clone()  # a mirror, as on a GPU
    copies = []
    real_flush = m.flush
    m.flush = lambda: (copies.append(len(m._pending_rows)) if m._pending_rows else None, real_flush())
    a, b = m.alloc_row(), m.alloc_row()
    m.write(a, 0, [5, 6, 7])
    m.write(b, 0, torch.tensor([9, 10], dtype=torch.int64))
    m.write(a, 3, [8])
    m.write(a, 1, [11])  # a rewrite before the read: the last value wins
    assert not torch.equal(m._table, m.host)
    assert torch.equal(m.table, m.host) and copies == [7]
    assert m.table[a, :4].tolist() == [5, 11, 7, 8] and copies == [7]  # nothing pending: no copy
    m.free_row(a)
    m.write(b, 2, [12])
    assert torch.equal(m.table, m.host) and m.table[a].abs().sum() == 0 and copies == [7, 1]
