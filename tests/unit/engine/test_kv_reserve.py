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


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_batch_reservations_give_the_one_at_a_time_pages_and_slots(page_size):
    """``reserve_many`` over a batch leaves the table, every handle and the free list (its order too: later
    allocations take the same pages) as ``reserve`` called handle after handle, shrinks between batches."""
    rng = random.Random(10 + page_size)
    one, many = cache(page_size), cache(page_size)
    for c in (one, many):
        c.req_to_token._table = c.req_to_token.host.clone()  # a device mirror, as on a GPU
    handles = [(one.open(), many.open()) for _ in range(4)]
    for _ in range(150):
        batch = rng.sample(handles, rng.randrange(1, 5))
        for ho, hm in batch:
            if rng.random() < 0.2 and ho.reserved:
                n = rng.randrange(ho.reserved)
                one.shrink(ho, n)
                many.shrink(hm, n)
        ends = [min(ho.reserved + rng.choice([0, 1, 2, 3, 6, page_size, 2 * page_size + 1, 40]), 120)
                for ho, _ in batch]
        for (ho, _), n in zip(batch, ends):
            one.reserve(ho, n)
        many.reserve_many([hm for _, hm in batch], ends)
        assert [ho.reserved for ho, _ in handles] == [hm.reserved for _, hm in handles]
    assert torch.equal(one.req_to_token.host, many.req_to_token.host)
    assert one.allocator._free == many.allocator._free
    assert torch.equal(many.req_to_token.table, many.req_to_token.host)  # every write reached the mirror


def test_a_batch_reservation_that_cannot_fit_fails_as_one_at_a_time():
    """Past max_context, or short of pages, the batch runs the calls one at a time: the same error, after
    the same earlier handles got their pages."""
    for ends in ([8, 600], [8, 400]):  # past max_context (512); more than the 20 pages
        one, many = cache(16), cache(16)
        for c in (one, many):
            c.allocator = type(c.allocator)(20)
        (a1, b1), (a2, b2) = (one.open(), one.open()), (many.open(), many.open())
        with pytest.raises(Exception) as want:
            for h, n in zip((a1, b1), ends):
                one.reserve(h, n)
        with pytest.raises(type(want.value), match=str(want.value)):
            many.reserve_many([a2, b2], ends)
        assert (a2.reserved, b2.reserved) == (a1.reserved, b1.reserved) == (8, 0)
        assert one.allocator._free == many.allocator._free
