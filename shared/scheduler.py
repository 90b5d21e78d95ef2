"""Continuous batching with chunked prefill.

The scheduler decides; the caches allocate; the runners run. A request is admitted only when every
cache can hold its peak footprint (prompt + max_new_tokens + the speculative headroom) on top of
what running requests may still claim, so no forward ever runs out of pages mid-step. A request
that could never fit is refused at submission with an error naming the field.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from shared.memory.kv_cache import KVCache
from shared.request import Phase, Request, RequestError


@dataclass
class Chunk:
    req: Request
    start: int  # first prompt position of this chunk
    end: int  # one past the last

    @property
    def completes_prompt(self) -> bool:
        return self.end == self.req.prompt_len


@dataclass
class StepPlan:
    prefill: list[Chunk] = field(default_factory=list)
    decode: list[Request] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.prefill and not self.decode


class Scheduler:
    def __init__(self, caches: list[KVCache], max_running: int, chunk_size: int | None, headroom: int,
                 prefill_only: bool = False):
        self.caches = caches
        self.prefill_only = prefill_only  # a prefill service never decodes: claims stop at the prompt
        self.max_running = max_running
        self.chunk_size = chunk_size
        self.headroom = headroom  # positions beyond the final length a decode step may touch
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def peak_positions(self, req: Request) -> int:
        if self.prefill_only:
            return req.prompt_len
        return req.prompt_len + req.params.max_new_tokens + self.headroom

    def check_fits(self, req: Request) -> None:
        cache = self.caches[0]
        need, have = cache.pages_for(self.peak_positions(req)), cache.spec.num_pages
        if need <= have:
            return
        # Name the input the user must change: the prompt when it cannot fit even with one new token.
        least = req.prompt_len if self.prefill_only else req.prompt_len + 1 + self.headroom
        if cache.pages_for(least) > have:
            raise RequestError("prompt", f"{req.prompt_len} tokens need {cache.pages_for(least)} pages, "
                               f"the pool has {have}")
        raise RequestError("max_new_tokens", f"prompt + max_new_tokens needs {need} pages, the pool has {have}")

    def submit(self, req: Request) -> None:
        self.check_fits(req)
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def has_work_to_step(self) -> bool:
        """Whether a step would run a forward (requests waiting on a transfer need none)."""
        if any(r.phase in (Phase.PREFILLING, Phase.DECODING) for r in self.running):
            return True
        return bool(self.waiting) and self.can_admit(self.waiting[0])

    def schedule(self) -> StepPlan:
        plan = StepPlan(decode=[r for r in self.running if r.phase is Phase.DECODING])
        budget = self.chunk_size
        for req in [r for r in self.running if r.phase is Phase.PREFILLING]:
            budget = self._add_chunk(plan, req, budget)
            if budget == 0:
                return plan
        headroom = self._headroom() if self.waiting else []
        while self.waiting and len(self.running) < self.max_running and self._admissible(self.waiting[0], headroom):
            req = self.waiting.popleft()
            req.handles = [cache.open() for cache in self.caches]
            req.phase = Phase.PREFILLING
            self.running.append(req)
            budget = self._add_chunk(plan, req, budget)
            # What it reserved left the free pages, the rest of its peak joined the claims: the
            # headroom shrinks by its whole peak (no rescan of the running requests per admission).
            headroom = [h - cache.pages_for(self.peak_positions(req)) for h, cache in zip(headroom, self.caches)]
            if budget == 0:
                break
        return plan

    def _add_chunk(self, plan: StepPlan, req: Request, budget: int | None) -> int | None:
        start = req.kv_len
        end = req.prompt_len if budget is None else min(req.prompt_len, start + budget)
        for cache, handle in zip(self.caches, req.handles):
            cache.reserve(handle, end)
        plan.prefill.append(Chunk(req, start, end))
        return None if budget is None else budget - (end - start)

    def can_admit(self, req: Request) -> bool:
        """Whether ``req`` (not yet holding pages) fits beside what running requests may claim."""
        return len(self.running) < self.max_running and self._admissible(req)

    def _headroom(self) -> list[int]:
        """Per cache, the free pages no running request may still claim (its peak less what it holds)."""
        return [cache.num_free_pages - sum(max(0, cache.pages_for(self.peak_positions(r))
                                               - cache.pages_for(r.handles[i].reserved)) for r in self.running)
                for i, cache in enumerate(self.caches)]

    def _admissible(self, req: Request, headroom: list[int] | None = None) -> bool:
        headroom = self._headroom() if headroom is None else headroom
        return all(cache.num_free_rows > 0 and h >= cache.pages_for(self.peak_positions(req))
                   for h, cache in zip(headroom, self.caches))

    def release(self, req: Request) -> None:
        """Return every page and request row of ``req`` to its cache."""
        for cache, handle in zip(self.caches, req.handles):
            if handle.row:
                cache.close(handle)
        req.handles = []
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
