"""Continuous batching with chunked prefill.

The scheduler decides; the caches allocate; the runners run. A request is admitted only when every
cache can hold its peak footprint (prompt + max_new_tokens + the speculative headroom) on top of
what running requests may still claim, so no forward ever runs out of pages mid-step. A request
that could never fit is refused at submission with an error naming the field.

The scheduler is the one owner of the engine's requests: it creates them (``submit``,
``admit_handoff``), keeps the one table of them by id (``requests``) beside its queues (``waiting``,
``running``), moves them between stages and retires them (``retire``), and alone writes their
``stage`` and page ``handles``.

With a prefix cache (``shared.memory.prefix_cache``) a request starts at its first uncached page: admission
takes the cached pages of its prompt (they count towards its peak, and those no other request holds leave
the free count), each prefill chunk hands the pages it completed over to the cache (``cache_prefix``), and
``retire`` drops the request's references. A hand-off's reservation may take the cached pages of its prompt too
(``admit_handoff`` with ``cached``: the sender skips them), and its prompt pages join the cache at ``activate``.

Requests with one prompt arriving together (a request's n choices) prefill it once: a waiting request whose next
page past its cached prefix is one a prefilling request is computing and will cache (the same key: the same
parent, tokens and, with a draft, successor) stays queued until that page is cached, then is admitted with the
hit (``_in_flight``). It keeps its place and its room (those behind it are admitted only beside it) and lets
them pass meanwhile; it waits only on a running request, whose prefill every step advances, so never on a
waiting one (no cycle) and never longer than that prefill. The decision reads the scheduler's own tables only:
a tensor-parallel follower replays it (``replay``) like any other admission.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from shared.errors import RequestError
from shared.grammar import Grammar, GrammarCompiler
from shared.memory.kv_cache import KVCache
from shared.memory.prefix_cache import CachedPage, PrefixCache
from shared.model.tokenizer import Tokenizer
from shared.request import Request, Stage
from shared.sampling import SamplingParams, request_seed
from shared.spec.state import DraftState
from shared.stepping import Events
from shared.text import TextStream


@dataclass
class Chunk:
    req: Request
    start: int  # first prompt position of this chunk
    end: int  # one past the last

    @property
    def completes_prompt(self) -> bool:
        return self.end == self.req.prefill_len

    @property
    def samples(self) -> bool:
        """Its last row's logits draw the request's next token: it completes the prompt and no token at
        ``end`` is known yet (a resumed request's is)."""
        return self.completes_prompt and self.end == len(self.req.all_ids)


@dataclass
class StepPlan:
    prefill: list[Chunk] = field(default_factory=list)
    decode: list[Request] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.prefill and not self.decode


class Scheduler:
    def __init__(self, caches: list[KVCache], max_running: int, chunk_size: int | None, headroom: int,
                 eos_ids: tuple[int, ...] = (), prefill_only: bool = False, tokenizer: Tokenizer | None = None,
                 grammars: GrammarCompiler | None = None, prefix_cache: PrefixCache | None = None):
        self.caches = caches
        self.prefix_cache = prefix_cache  # the engine's cached prompt pages (None: every prompt computed)
        self.prefill_only = prefill_only  # a prefill service never decodes: claims stop at the prompt
        self.max_running = max_running
        self.chunk_size = chunk_size
        self.headroom = headroom  # positions beyond the final length a decode step may touch
        self.eos_ids = eos_ids  # the model's end-of-sequence tokens, every request's
        self.tokenizer = tokenizer  # detokenizes the outputs of requests with stop strings
        self.grammars = grammars  # compiles the JSON schemas of requests with one (None: refused)
        self.requests: dict[str, Request] = {}  # every request not yet retired, by id (waiting or running)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Released with each request in ``retire``: the tables others keep per request (the logits rows, the
        # draft launched ahead, the hand-off port's staging) are freed here, not found stale later.
        self.on_retire: list[Callable[[Request], None]] = []

    @classmethod
    def over(cls, runner, tokenizer: Tokenizer | None, role: str) -> Scheduler:
        """The scheduler of an engine (or of a tensor-parallel follower's book) over ``runner``'s caches (a
        ``ModelRunner``), with its settings; with ``prefix_cache`` on, its prefix cache; with a tokenizer, the
        grammars of requests with a JSON schema. The tables the runner keeps per request go with it (``retire``)."""
        config, mc = runner.config, runner.model.config
        # With a draft, a cached page's key carries the token after it (the draft's K/V depends on it).
        prefix = PrefixCache(runner.caches, successor=runner.head is not None) if config.prefix_cache else None
        grammars = GrammarCompiler(tokenizer, mc.vocab_size, mc.eos_token_ids) if tokenizer is not None else None
        book = cls(runner.caches, config.max_running, config.chunk_size, config.headroom, mc.eos_token_ids,
                   role == "prefill", tokenizer, grammars, prefix)
        w = runner.speculator
        book.on_retire += [runner.penalty_rows.release] + ([w.ahead.forget] if w is not None else [])
        return book

    # ---- the table -------------------------------------------------------------------------------
    def get(self, rid: str) -> Request | None:
        return self.requests.get(rid)

    def holds(self, req: Request) -> bool:
        """Whether ``req`` is still one of these requests (not retired, nor replaced by a request
        re-placed under the same id)."""
        return self.requests.get(req.rid) is req

    def _new(self, rid: str, prompt_ids: Sequence[int], params: SamplingParams, output_ids: Sequence[int] = (),
             output_logprobs: Sequence[float] = (), resumed: int = 0) -> Request:
        seed = request_seed(params)  # the request's own, also when it gave none: its draws hash it
        return Request(rid=rid, prompt_ids=list(prompt_ids), params=params, eos_ids=self.eos_ids,
                       seed=seed, resumed=resumed, output_ids=list(output_ids),
                       output_logprobs=list(output_logprobs), text=self._text(params, output_ids),
                       grammar=self._grammar(params, prompt_ids, output_ids))

    def _text(self, params: SamplingParams, output_ids: Sequence[int]) -> TextStream | None:
        """The stop-string watch of a request with stop strings, fed the output it arrives with."""
        if not params.stop:
            return None
        if self.tokenizer is None:
            raise RequestError("stop", "stop strings need the model's tokenizer.json beside the weights")
        text = TextStream(self.tokenizer, params.stop, params.include_stop_str_in_output, params.min_tokens)
        text.push(list(output_ids))
        return text

    def _grammar(self, params: SamplingParams, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> Grammar | None:
        """The matcher of a request with a JSON schema, advanced by the output it arrives with: the prompt's
        last ``resumed_tokens`` (a failover's output so far), then ``output_ids``."""
        if params.json_schema is None:
            return None
        if params.resumed_tokens > len(prompt_ids):
            raise RequestError("resumed_tokens", f"{params.resumed_tokens} exceeds the prompt's "
                                                 f"{len(prompt_ids)} tokens")
        if self.grammars is None:
            raise RequestError("json_schema", "structured output needs the model's tokenizer.json beside the weights")
        try:
            grammar = self.grammars.compile(params.json_schema)
        except ValueError as e:
            raise RequestError("json_schema", str(e)) from None
        for tok in [*prompt_ids[len(prompt_ids) - params.resumed_tokens:], *output_ids]:
            grammar.advance(tok)
        return grammar

    def peak_positions(self, req: Request) -> int:
        if self.prefill_only:
            return req.prefill_len
        return req.prompt_len + req.params.max_new_tokens + self.headroom

    def check_fits(self, req: Request) -> None:
        cache = self.caches[0]
        need, have = cache.pages_for(self.peak_positions(req)), cache.layout.num_pages
        if need <= have:
            return
        # Name the input the user must change: the prompt when it cannot fit even with one new token.
        least = req.prompt_len if self.prefill_only else req.prompt_len + 1 + self.headroom
        if cache.pages_for(least) > have:
            raise RequestError("prompt", f"{req.prompt_len} tokens need {cache.pages_for(least)} pages, "
                               f"the pool has {have}")
        raise RequestError("max_new_tokens", f"prompt + max_new_tokens needs {need} pages, the pool has {have}")

    def submit(self, rid: str, prompt_ids: list[int], params: SamplingParams, output_ids: Sequence[int] = (),
               output_logprobs: Sequence[float] = ()) -> Request:
        """A new request, queued for admission (refused now if it could never fit); with ``output_ids``, one
        resuming after them (a failover): its prefill computes them too and samples nothing."""
        req = self._new(rid, prompt_ids, params, output_ids, output_logprobs, resumed=len(output_ids))
        self.check_fits(req)
        self.waiting.append(req)
        self.requests[rid] = req
        return req

    def admit_handoff(self, rid: str, prompt_ids: list[int], output_ids: list[int], output_logprobs: list[float],
                      params: SamplingParams, committed_len: int, cached: bool = False) -> Request | None:
        """Decode role: a request about to arrive, holding pages for its ``committed_len`` positions in
        every cache, RECEIVING until ``activate``; None when it cannot be held now. ``cached``: the sender
        skips the leading pages this side holds, so the request takes its cached prefix (``_handoff_hit``)
        as its first pages (``len(req.prefix_pages)`` of them) and only the rest are its own to fill."""
        req = self._new(rid, prompt_ids, params, output_ids, output_logprobs)
        self.check_fits(req)
        hit = self._handoff_hit(req, committed_len) if cached else []
        if not self.can_admit(req, hit):
            return None
        req.handles = [cache.open() for cache in self.caches]
        self._hold_prefix(req, hit)
        for cache, h in zip(self.caches, req.handles):
            cache.reserve(h, committed_len)
        req.stage = Stage.RECEIVING
        self.running.append(req)
        self.requests[rid] = req
        return req

    def activate(self, req: Request, committed_len: int, state: DraftState | None, output_ids: list[int] = (),
                 output_logprobs: list[float] = ()) -> None:
        """A RECEIVING request's K/V arrived: it decodes from the next step on, straight from ``state``."""
        req.receive(committed_len, state, output_ids, output_logprobs)
        req.stage = Stage.DECODING
        self.cache_prefix(req)  # the prompt pages that arrived, as a prefill's would be (none a decode step wrote)

    def prompt_done(self, req: Request) -> None:
        """The last chunk of ``req``'s prompt ran: it decodes next, or (prefill role) waits for its hand-off."""
        req.stage = Stage.HANDOFF if self.prefill_only else Stage.DECODING

    def prefilled(self) -> list[Request]:
        """Requests with prompt K/V computed (prefill role): still prefilling, or parked for their hand-off."""
        return [r for r in self.running if r.finish_reason is None and (
            r.stage is Stage.HANDOFF or (r.stage is Stage.PREFILLING and r.kv_len > 0))]

    def starts_next(self, req: Request) -> bool:
        """Whether waiting ``req`` gets its first chunk in the next step: it heads the queue, fits beside the
        running requests, and the prompts being prefilled leave room in that step's chunk budget."""
        if not self.waiting or self.waiting[0] is not req or not self.can_admit(req):
            return False
        if self._in_flight(req, self._hit(req)):
            return False
        ahead = sum(r.prompt_len - r.kv_len for r in self.running if r.stage is Stage.PREFILLING)
        return self.chunk_size is None or ahead < self.chunk_size

    def joins_next(self, batch: list[Request]) -> bool:
        """Whether the next decode step will run a request ``batch`` does not: one whose prompt completed
        during this step. Not a hand-off being received: it joins once its pages have come (a call between
        steps, which nobody foresees), and its prompt's prefill takes many steps: a draft launched ahead is
        wasted only by the one step before the join (the next drafts anew), not withheld from them all."""
        these = {id(r) for r in batch}
        return any(r.stage is Stage.DECODING and id(r) not in these for r in self.running)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def has_work_to_step(self) -> bool:
        """Whether a step would run a forward (requests waiting on a transfer need none)."""
        if any(r.stage in (Stage.PREFILLING, Stage.DECODING) for r in self.running):
            return True
        return bool(self.waiting) and self.can_admit(self.waiting[0])

    def schedule(self) -> StepPlan:
        plan = StepPlan(decode=[r for r in self.running if r.stage is Stage.DECODING])
        budget = self.chunk_size
        for req in [r for r in self.running if r.stage is Stage.PREFILLING]:
            budget = self._add_chunk(plan, req, budget)
            if budget == 0:
                return plan
        if self.waiting:
            self._admit_waiting(plan, budget)
        return plan

    def _admit_waiting(self, plan: StepPlan, budget: int | None) -> None:
        """Admit waiting requests in order while they fit and the chunk budget lasts; one waiting for a page in
        flight (``_in_flight``) stays queued, its slot and pages kept from those behind it."""
        unclaimed, slots, kept = self._unclaimed_pages(), self.max_running - len(self.running), 0
        while kept < len(self.waiting):
            req = self.waiting[kept]  # the first ``kept`` wait for pages in flight
            hit = self._hit(req)
            taken = self._peak_pages(req, hit)
            if slots <= 0 or not self._fits(unclaimed, taken):
                return
            # What it reserves leaves the free pages, the rest of its peak joins the claims: the unclaimed
            # shrinks by its whole peak less the cached pages others hold (no rescan of the running requests).
            unclaimed, slots = [h - t for h, t in zip(unclaimed, taken)], slots - 1
            if self._in_flight(req, hit):
                kept += 1
                continue
            del self.waiting[kept]
            self._admit(req, hit)
            budget = self._add_chunk(plan, req, budget)
            if budget == 0:
                return

    def _admit(self, req: Request, hit: list[CachedPage]) -> None:
        """Waiting ``req`` (taken off the queue) runs from this step on, holding its cached prefix ``hit``."""
        req.handles = [cache.open() for cache in self.caches]
        self._take_prefix(req, hit)
        req.stage = Stage.PREFILLING
        self.running.append(req)

    def replay(self, decode: list[str], chunks: list[tuple[str, int, int]]) -> StepPlan:
        """A tensor-parallel follower's step (``shared/replay.py``): rank 0's plan, named by request ids and chunk
        bounds, applied to these tables (the same as rank 0's): the requests rank 0 admitted are admitted here in
        its order and each chunk's pages reserved as rank 0's were, so the pages are the same on every rank."""
        plan = StepPlan(decode=[self.requests[rid] for rid in decode])
        for rid, start, end in chunks:
            req = self.requests[rid]
            if req.stage is Stage.WAITING:
                if req not in self.waiting:
                    raise RuntimeError(f"rank 0 admitted {rid!r}, which is not in this rank's queue")
                self.waiting.remove(req)
                self._admit(req, self._hit(req))
            if req.kv_len != start:
                raise RuntimeError(f"rank 0's chunk of {rid!r} starts at {start}, this rank's at {req.kv_len}")
            self._add_chunk(plan, req, end - start)
        return plan

    def _add_chunk(self, plan: StepPlan, req: Request, budget: int | None) -> int | None:
        start = req.kv_len
        end = req.prefill_len if budget is None else min(req.prefill_len, start + budget)
        for cache, handle in zip(self.caches, req.handles):
            cache.reserve(handle, end)
        plan.prefill.append(Chunk(req, start, end))
        return None if budget is None else budget - (end - start)

    def can_admit(self, req: Request, hit: list[CachedPage] | None = None) -> bool:
        """Whether ``req`` (not yet holding pages) fits beside what running requests may claim, taking the cached
        pages ``hit`` (None: its own cached prefix, ``_hit``, as a request to prefill takes it)."""
        return len(self.running) < self.max_running and self._admissible(req, hit=hit)

    def _unclaimed_pages(self) -> list[int]:
        """Per cache, the free pages no running request may still claim (its peak less what it holds)."""
        return [cache.num_free_pages - sum(max(0, cache.pages_for(self.peak_positions(r))
                                               - cache.pages_for(r.handles[i].reserved)) for r in self.running)
                for i, cache in enumerate(self.caches)]

    def _admissible(self, req: Request, unclaimed: list[int] | None = None,
                    hit: list[CachedPage] | None = None) -> bool:
        unclaimed = self._unclaimed_pages() if unclaimed is None else unclaimed
        return self._fits(unclaimed, self._peak_pages(req, self._hit(req) if hit is None else hit))

    def _fits(self, unclaimed: list[int], need: list[int]) -> bool:
        return all(cache.num_free_rows > 0 and h >= n for h, n, cache in zip(unclaimed, need, self.caches))

    # ---- the prefix cache ------------------------------------------------------------------------
    def _hit(self, req: Request) -> list[CachedPage]:
        """The cached pages a waiting ``req`` would take now: its longest cached prefix, at least its last
        prefill position left to compute (its logits draw the next token, its draft row the draft state)."""
        if self.prefix_cache is None:
            return []
        return self.prefix_cache.match(req.all_ids, req.prefill_len - 1)

    def _in_flight(self, req: Request, hit: list[CachedPage]) -> bool:
        """Whether waiting ``req``'s next page past its cached prefix ``hit`` is one a prefilling request will
        cache: it holds the same chain ``hit``, its next page has the same key, and its prefill (which runs a
        chunk every step) reaches that page. ``req`` then waits for it rather than computing it again."""
        pc = self.prefix_cache
        if pc is None or len(hit) >= pc.pages_within(req.all_ids, req.prefill_len - 1):
            return False
        key = pc.next_key(hit, req.all_ids)
        return any(r.stage is Stage.PREFILLING and len(r.prefix_pages) == len(hit)
                   and (not hit or r.prefix_pages[-1] is hit[-1])
                   and len(hit) < pc.pages_within(r.all_ids, r.prefill_len)
                   and pc.next_key(r.prefix_pages, r.all_ids) == key for r in self.running)

    def _handoff_hit(self, req: Request, committed_len: int) -> list[CachedPage]:
        """The cached pages a hand-off of ``committed_len`` positions need not carry: whole pages of its longest
        cached prefix (keyed as at a prefill's admission), never the one holding its last position (the prefill
        computes that one, and the draft's K/V there waits for the first token)."""
        if self.prefix_cache is None:
            return []
        return self.prefix_cache.match(req.all_ids, committed_len - 1)

    def _peak_pages(self, req: Request, hit: list[CachedPage]) -> list[int]:
        """Per cache, the free pages admitting ``req`` with ``hit`` takes: its peak less the cached pages it
        takes, plus those of them no request holds (counted free until then)."""
        shared = len(hit) - sum(1 for node in hit if node.refs == 0)
        return [cache.pages_for(self.peak_positions(req)) - shared for cache in self.caches]

    def _take_prefix(self, req: Request, hit: list[CachedPage]) -> None:
        """Admission: ``req`` holds its cached prefix ``hit`` (``_hit``) and starts after it."""
        if self.prefix_cache is not None:
            self.prefix_cache.lookups += min(req.prefill_len, req.prompt_len)
        if not hit:
            return
        self._hold_prefix(req, hit)
        req.advance(len(hit) * self.prefix_cache.page_size)
        req.cached_tokens = min(req.kv_len, req.prompt_len)
        self.prefix_cache.hits += req.cached_tokens

    def _hold_prefix(self, req: Request, hit: list[CachedPage]) -> None:
        """``req`` (its handles open, empty) holds the cached pages ``hit`` as its first ones."""
        if not hit:
            return
        self.prefix_cache.lock(hit)
        req.prefix_pages = hit
        for c, (cache, handle) in enumerate(zip(self.caches, req.handles)):
            cache.attach(handle, [node.pages[c] for node in hit])

    def flush_prefix_cache(self) -> int:
        """Evict every cached page no request holds; how many (0 without a prefix cache)."""
        return self.prefix_cache.flush() if self.prefix_cache is not None else 0

    def page_ids(self, req: Request) -> list[list[int]]:
        """Per cache (target first), ``req``'s page ids in position order (the hand-off port's page API)."""
        return [cache.pages_of(h, 0, cache.pages_for(h.reserved)) for cache, h in zip(self.caches, req.handles)]

    def cache_prefix(self, req: Request) -> None:
        """After a prefill chunk of ``req`` (its target and draft K/V written): hand every page it completed
        over to the prefix cache, each once its successor token is known; ``req`` holds them from now on.
        Stops at a page cached already by another request (``req`` keeps its own copy of it and what follows)."""
        pc = self.prefix_cache
        if pc is None or not req.handles:
            return
        tokens = req.all_ids
        done = pc.pages_within(tokens, min(req.kv_len, req.prefill_len))
        parent = req.prefix_pages[-1] if req.prefix_pages else pc.root
        for i in range(len(req.prefix_pages), done):
            node = pc.insert(parent, tokens, i, tuple(cache.pages_of(h, i, i + 1)[0]
                                                      for cache, h in zip(self.caches, req.handles)))
            if node is None:
                break
            req.prefix_pages.append(node)
            for cache, h in zip(self.caches, req.handles):
                cache.share(h, i + 1)
            parent = node

    def commit(self, plan: StepPlan, events: Events) -> Events:
        """After a step ran ``plan`` (``events``: per request it touched, the tokens it committed): each chunk's
        completed pages go to the prefix cache, a chunk that completed its prompt moves its request on (a chunk
        that did not is an event of its request's, with no token), and the requests the step ended retire."""
        for ch in plan.prefill:
            self.cache_prefix(ch.req)  # its completed pages, target and draft K/V written
            if ch.completes_prompt:
                self.prompt_done(ch.req)
            elif not any(r is ch.req for r, _ in events):
                events.append((ch.req, []))
        for req, _ in events:
            if req.finish_reason is not None and req.stage is not Stage.FINISHED:
                self.retire(req)
        return events

    def retire(self, req: Request, reason: str | None = None) -> None:
        """End ``req`` (with ``reason`` unless a stop condition ended it first): it leaves the table and
        its queue, and every page and request row it holds goes back to its cache."""
        req.end(reason)
        req.stage = Stage.FINISHED
        for cache, handle in zip(self.caches, req.handles):
            if handle.row:
                cache.close(handle)
        req.handles = []
        if req.prefix_pages:
            self.prefix_cache.unlock(req.prefix_pages)
            req.prefix_pages = []
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if self.holds(req):
            del self.requests[req.rid]
        for release in self.on_retire:
            release(req)
