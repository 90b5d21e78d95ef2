"""Paged KV cache: a page allocator, a request-to-token map and per-layer K/V pools.

Every model runner (the target, and each draft layer of a multi-layer draft) owns one
``KVCache``. A forward batch is always built from the cache of the runner that executes it, so no
step can read another step's pools (seed 001).

Slots are token-granular: ``slot = page * page_size + offset``. Page 0 is never handed out; its
slots absorb the writes of padding rows. A request's row in the request-to-token map lists, for each
position ``p < reserved``, the slot holding its K/V. The host mirror of that table is the truth for
bookkeeping (which pages a request owns), so freeing never reads the device.

A request's first pages may be the prefix cache's (``shared.memory.prefix_cache``): ``attach`` maps them,
``share`` hands the request's own leading pages over to it, and ``close`` and ``shrink`` free only the
request's own pages (``KVHandle.shared`` counts the others). The allocator evicts unreferenced cached pages
when it runs short (``PageAllocator.spare``), and ``num_free_pages`` counts them as free.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch


class OutOfPages(RuntimeError):
    """Raised only on a scheduler bug: it admits a request only when its peak pages are free."""


class PageAllocator:
    def __init__(self, num_pages: int):
        self.num_pages = num_pages  # allocatable pages, ids 1..num_pages
        self._free = list(range(num_pages, 0, -1))
        # Pages held elsewhere that may be taken back when the free list runs short: the prefix cache's
        # unreferenced pages (``evictable`` of them; ``evict(n)`` frees up to n into every allocator).
        self.spare = None

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free) and self.spare is not None:
            self.spare.evict(n - len(self._free))
        if n > len(self._free):
            raise OutOfPages(f"asked for {n} pages, {len(self._free)} free")
        pages = self._free[-n:] if n else []
        del self._free[len(self._free) - n:]
        return pages[::-1]

    def free(self, pages: list[int]) -> None:
        self._free.extend(pages)


def flush_tables(caches: list[KVCache]) -> None:
    """Bring the caches' device tables up to date with their host writes: what runs before a CUDA graph
    replays (a graph reads the tables without Python running; eager code reads ``table``, which flushes)."""
    for cache in caches:
        cache.req_to_token.flush()


class ReqToTokenMap:
    """Rows of slots per request; row 0 is the padding row (all slots 0).

    The host copy is the one written (``write``); on a GPU the device table takes the writes made since
    it was last read in one host-to-device copy and one scatter when it is next read (``table``): a decode
    step reserves one slot per request, and a copy per request cost a device synchronisation each (pageable
    memory), a handful of GIL hand-offs each in a service, and the sum grew with the batch."""

    def __init__(self, max_reqs: int, max_context: int, device: torch.device):
        self.max_context = max_context
        self.host = torch.zeros(max_reqs + 1, max_context, dtype=torch.int64)
        self._host_np = self.host.numpy()  # the same memory: numpy writes from lists without torch dispatch
        self._table = self.host if device.type == "cpu" else self.host.to(device)
        self._free_rows = list(range(max_reqs, 0, -1))
        self._pending_rows: list[int] = []  # (row, position) of host entries the device table lacks
        self._pending_cols: list[int] = []

    @property
    def table(self) -> torch.Tensor:
        """[max_reqs + 1, max_context] int64 on the device, up to date with every write."""
        self.flush()
        return self._table

    @property
    def num_free_rows(self) -> int:
        return len(self._free_rows)

    @property
    def num_rows(self) -> int:
        return self.host.shape[0] - 1

    def alloc_row(self) -> int:
        if not self._free_rows:
            raise OutOfPages("no free request slot")
        return self._free_rows.pop()

    def free_row(self, row: int) -> None:
        self.host[row].zero_()
        if self._table is not self.host:
            self.table[row].zero_()  # after the pending writes (some may be this row's)
        self._free_rows.append(row)

    def write(self, row: int, start: int, slots: list[int] | torch.Tensor) -> None:
        n = len(slots)
        self._host_np[row, start:start + n] = slots.numpy() if isinstance(slots, torch.Tensor) else slots
        if self._table is not self.host and n:
            self._pending_rows.extend([row] * n)
            self._pending_cols.extend(range(start, start + n))

    def write_at(self, rows: np.ndarray, cols: np.ndarray, slots: np.ndarray) -> None:
        """Entries ``(rows[i], cols[i])`` take ``slots[i]``: scattered writes, e.g. a batch's reservations."""
        self._host_np[rows, cols] = slots
        if self._table is not self.host and len(rows):
            self._pending_rows.extend(rows.tolist())
            self._pending_cols.extend(cols.tolist())

    def flush(self) -> None:
        """One copy of the writes the device table lacks (nothing when none)."""
        if not self._pending_rows:
            return
        rows, cols = self._pending_rows, self._pending_cols
        self._pending_rows, self._pending_cols = [], []
        entries = np.empty((3, len(rows)), dtype=np.int64)
        entries[0], entries[1] = rows, cols
        entries[2] = self._host_np[entries[0], entries[1]]
        host = torch.from_numpy(entries)
        dev = (host.pin_memory() if self._table.is_cuda else host).to(self._table.device, non_blocking=True)
        self._table[dev[0], dev[1]] = dev[2]


@dataclass
class CacheLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    page_size: int
    num_pages: int
    max_reqs: int
    max_context: int
    shareable: bool = False  # another process may map the pools (the decode side of a same-host hand-off)
    # The engine's context without the decode step's headroom (0: max_context): the attention sizes its key
    # splits from it, so an engine with a draft (more headroom) splits as the same engine without one.
    context: int = 0


@dataclass
class KVHandle:
    """One request's claim on one cache."""

    row: int  # row in the request-to-token map
    reserved: int = 0  # positions [0, reserved) have slots
    shared: int = 0  # its first pages are the prefix cache's, not its own (never freed by it)


def allocate_pool(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, shareable: bool) -> torch.Tensor:
    """A zeroed pool. ``shareable`` on the CPU: in named shared memory from the start (torch's file_system
    sharing, so an unrelated process can map it by name: ``shared.handoff.ipc``); CUDA memory is always
    shareable through CUDA IPC handles."""
    pool = torch.zeros(shape, dtype=dtype, device=device)
    if shareable and pool.device.type == "cpu":
        deadline = time.monotonic() + SHARE_WAIT_S
        while True:
            try:
                pool.untyped_storage()._share_filename_cpu_()
                break
            except RuntimeError as e:  # torch's shared-memory manager (a daemon) can miss its answer's deadline on a
                if "Shared memory manager" not in str(e) or time.monotonic() > deadline:  # loaded host: ask again
                    raise
    return pool


# How long a pool's share into named memory is asked for again while torch's manager times out (its own answer
# deadline is short: under the stress runs' CPU hogs three attempts in a row timed out once in five runs).
SHARE_WAIT_S = 60.0


class KVCache:
    def __init__(self, layout: CacheLayout):
        if layout.page_size < 1:
            raise ValueError("page_size must be >= 1")
        self.layout = layout
        self.page_size = layout.page_size
        num_slots = (layout.num_pages + 1) * layout.page_size
        # One allocation per cache, [K/V, layer, slot, kv head, head dim]: one handle shares it all.
        self.pool = allocate_pool((2, layout.num_layers, num_slots, layout.num_kv_heads, layout.head_dim), layout.dtype,
                                  layout.device, layout.shareable)
        self.k = list(self.pool[0])  # per layer [slots, kv heads, head dim], views of the pool
        self.v = list(self.pool[1])
        self.allocator = PageAllocator(layout.num_pages)
        self.req_to_token = ReqToTokenMap(layout.max_reqs, layout.max_context, layout.device)

    # ---- counters the scheduler and the tests read -------------------------------------------
    @property
    def num_free_pages(self) -> int:
        """Free pages, the prefix cache's unreferenced ones included (evicted when needed)."""
        spare = self.allocator.spare
        return self.allocator.num_free + (spare.evictable if spare is not None else 0)

    @property
    def num_free_rows(self) -> int:
        return self.req_to_token.num_free_rows

    def is_full(self) -> bool:
        """True when every page and request row is back in its pool."""
        return (self.num_free_pages == self.layout.num_pages
                and self.req_to_token.num_free_rows == self.req_to_token.num_rows)

    def pages_for(self, n_positions: int) -> int:
        return -(-n_positions // self.page_size)

    def pages_needed(self, handle: KVHandle | None, n_positions: int) -> int:
        have = self.pages_for(handle.reserved) if handle is not None else 0
        return max(0, self.pages_for(n_positions) - have)

    # ---- request lifetime ------------------------------------------------------------------------
    def open(self) -> KVHandle:
        return KVHandle(row=self.req_to_token.alloc_row())

    def reserve(self, h: KVHandle, n_positions: int) -> None:
        """Give positions [h.reserved, n_positions) slots, allocating pages as needed."""
        if n_positions <= h.reserved:
            return
        if n_positions > self.layout.max_context:
            raise OutOfPages(f"{n_positions} positions exceed max_context {self.layout.max_context}")
        ps = self.page_size
        new_pages = self.allocator.alloc(self.pages_needed(h, n_positions))
        first_new_page = self.pages_for(h.reserved)
        # Slots from ints, page by page (``list.extend(range)`` runs in C): a decode step reserves a
        # few positions per request and cache, where a dozen small torch ops per call cost ~100 us of
        # host time (13 ms a step at batch 64 with one draft cache); a long prompt's thousands stay cheap.
        slots = []
        if h.reserved < first_new_page * ps:  # the tail of the last partially filled page
            page_start = (first_new_page - 1) * ps
            shift = int(self.req_to_token.host[h.row, page_start]) // ps * ps - page_start  # slot - position
            slots.extend(range(h.reserved + shift, min(n_positions, first_new_page * ps) + shift))
        for page in new_pages:
            slots.extend(range(page * ps, page * ps + ps))
        del slots[n_positions - h.reserved:]  # the last new page may be partly used
        self.req_to_token.write(h.row, h.reserved, slots)
        h.reserved = n_positions

    def reserve_many(self, handles: list[KVHandle], ends: list[int]) -> None:
        """``reserve(h, n)`` for each (distinct) handle and end, in one pass over the batch (a decode step
        reserves a few positions for each of its requests: a call each cost ~10 us of host time, 2.6 ms a step
        at 128 rows with one draft cache). The same pages, in the same order, and the same slots as those
        calls one at a time; where they would raise or evict cached pages, they run one at a time."""
        todo = [(h, n) for h, n in zip(handles, ends) if n > h.reserved]
        if not todo:
            return
        ps = self.page_size
        have = np.fromiter((h.reserved for h, _ in todo), dtype=np.int64, count=len(todo))
        want = np.fromiter((n for _, n in todo), dtype=np.int64, count=len(todo))
        have_pages = -(-have // ps)
        need = -(-want // ps) - have_pages  # new pages per handle
        total = int(need.sum())
        if int(want.max()) > self.layout.max_context or total > self.allocator.num_free:
            for h, n in todo:
                self.reserve(h, n)
            return
        pages = np.array(self.allocator.alloc(total), dtype=np.int64)  # handle i's: after those of the ones before
        counts = want - have
        pos = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts - have, counts)
        rows = np.repeat(np.fromiter((h.row for h, _ in todo), dtype=np.int64, count=len(todo)), counts)
        page_index = pos // ps
        # A position on a page the handle holds (the tail of its last one) keeps that page; the others take
        # their new pages in order: handle i's first new page (index have_pages[i]) is pages[sum(need[:i])].
        first = np.repeat(np.cumsum(need) - need - have_pages, counts)
        old = page_index < np.repeat(have_pages, counts)
        page = np.empty_like(pos)
        page[old] = self.req_to_token.host.numpy()[rows[old], page_index[old] * ps] // ps
        page[~old] = pages[first[~old] + page_index[~old]]
        self.req_to_token.write_at(rows, pos, page * ps + pos % ps)
        for h, n in todo:
            h.reserved = n

    def shrink(self, h: KVHandle, n_positions: int) -> None:
        """Release every page not needed for positions [0, n_positions)."""
        if n_positions >= h.reserved:
            return
        keep, have = max(self.pages_for(n_positions), h.shared), self.pages_for(h.reserved)
        if keep < have:  # (most decode steps free no page: no tensor read)
            self.allocator.free(self.pages_of(h, keep, have))
        h.reserved = n_positions

    def close(self, h: KVHandle) -> None:
        self.allocator.free(self.pages_of(h, h.shared, self.pages_for(h.reserved)))
        self.req_to_token.free_row(h.row)
        h.reserved = 0
        h.row = 0
        h.shared = 0

    def attach(self, h: KVHandle, pages: list[int]) -> None:
        """Map ``pages`` (the prefix cache's) as the first positions of a handle that holds none yet."""
        if h.reserved:
            raise ValueError("attach: the handle already holds positions")
        ps = self.page_size
        self.req_to_token.write(h.row, 0, [s for page in pages for s in range(page * ps, page * ps + ps)])
        h.reserved, h.shared = len(pages) * ps, len(pages)

    def share(self, h: KVHandle, n_pages: int) -> list[int]:
        """Hand the handle's pages up to page index ``n_pages`` over to the prefix cache (it no longer frees
        them); the page ids handed over."""
        if n_pages * self.page_size > h.reserved:
            raise ValueError(f"share: {n_pages} pages, the handle holds {self.pages_for(h.reserved)}")
        pages = self.pages_of(h, h.shared, n_pages)
        h.shared = max(h.shared, n_pages)
        return pages

    def pages_of(self, h: KVHandle, first: int, last: int) -> list[int]:
        """Page ids of the request's page indices [first, last)."""
        ps = self.page_size
        return [slot // ps for slot in self.req_to_token.host[h.row, first * ps:last * ps:ps].tolist()]

    def slots(self, h: KVHandle, start: int, end: int) -> torch.Tensor:
        return self.req_to_token.table[h.row, start:end]
