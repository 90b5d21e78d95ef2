"""The EAGLE speculative loop: draft extend, tree draft, verify, accept, compact, draft extend.

Positions are computed from committed lengths, never advanced in place (seed 002): for a request
with committed length L, draft step i runs at position L + i and tree node n is verified at
position L + depth(n). Every forward batch is built from the cache of the runner executing it
(seed 001). One function gives the draft extend's shifted tokens, whatever the draft kind or the
chunking (seed 000). Every per-token output of verification is gathered by one accept index
(seed 004). Empty batches run the same code as full ones, with widths from the draft (seed 003).

Statistics (per request in ``Request.stats``, per engine in ``SpecWorker.totals``, per verify step in
``SpecWorker.batches``; definitions in ``shared.request.SpecStats``): accept length is committed
tokens per verify, the accepted drafts plus the bonus token, cut where EOS, a stop token or
max_new_tokens ends a request inside an accepted run (the discarded rest is not counted). Accept
rate is the drafts verification accepted over the ``steps`` drafts each verify could accept. A
step's draft time runs to the end of tree drafting, its verify time from there to the end of the
extend that follows; a request's share of each is the step's time over the step's batch size. A
draft launched ahead (``decode_step``) is timed where it is launched and counted as the draft time of
the step that uses it.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from pathlib import Path

import torch

from kernels.spec_sampling import SamplingRows
from shared.batch import build_forward_batch
from shared.config import EngineConfig, SpecConfig
from shared.memory.kv_cache import KVCache
from shared.model.drafts import DraftHead, load_draft
from shared.model.llama import TargetOutput
from shared.request import Phase, Request, SpecStats
from shared.runner import PhaseGraphs, pad_rows, tree_map
from shared.sampling import sampling_rows
from shared.scheduler import Chunk
from shared.spec.phases import DecodeInputs, SpecPhases, StepOutput
from shared.spec.state import DraftState
from shared.spec.token_counts import SpecTokenCounts
from shared.spec.tree import DraftTree


def shifted_tokens(req: Request, start: int, end: int) -> list[int]:
    """Draft input ids for draft positions [start, end): tokens start+1 .. end.

    The tail token (at ``end``) is the next prompt token when the chunk stops inside the prompt and
    the token the target sampled when it does not: both are simply the request's token at ``end``.
    """
    ids = req.all_ids
    if end >= len(ids):
        raise ValueError(f"{req.rid}: tail token at {end} is not known yet ({len(ids)} tokens)")
    return ids[start + 1:end + 1]


@dataclasses.dataclass
class SpecBatchStats:
    """One verify step of the engine: the requests it verified together and what each committed."""

    step: int  # the engine's verify-step counter (0, 1, ...), kept across generate calls
    request_ids: list[str]
    committed: list[int]  # per request: tokens this verify committed (bonus included, cut at a stop)
    verified: list[int]  # per request: accepted drafts + bonus as verification found them (before a cut)
    drafts_per_request: int  # spec steps: drafts each request could have accepted
    draft_time_s: float
    verify_time_s: float

    @property
    def batch_size(self) -> int:
        return len(self.request_ids)

    def totals(self) -> SpecStats:
        """This step as ``SpecStats`` summed over its requests (the definitions live there)."""
        n = self.batch_size
        return SpecStats(verify_steps=n, accepted_drafts=sum(self.verified) - n,
                         proposed_drafts=self.drafts_per_request * n, committed_tokens=sum(self.committed),
                         draft_time_s=self.draft_time_s, verify_time_s=self.verify_time_s)

    @property
    def accept_length(self) -> float:
        """Committed tokens per verify, averaged over the batch's requests."""
        return self.totals().accept_length

    @property
    def accept_rate(self) -> float:
        """Drafts verification accepted over the drafts the batch's requests could accept."""
        return self.totals().accept_rate

    def as_dict(self) -> dict:
        return {"step": self.step, "batch_size": self.batch_size, "request_ids": list(self.request_ids),
                "committed": list(self.committed), "verified": list(self.verified),
                "accept_length": round(self.accept_length, 4), "accept_rate": round(self.accept_rate, 4),
                "draft_time_s": round(self.draft_time_s, 6), "verify_time_s": round(self.verify_time_s, 6)}


def summarize_batches(batches: list[SpecBatchStats]) -> dict:
    """Totals over verify steps (for example those of one prompt batch): the same definitions."""
    total = SpecStats()
    for b in batches:
        total.add(b.totals())
    steps = total.verify_steps  # request-verifies
    return {"verify_batches": len(batches), "verify_steps": steps,
            "mean_batch_size": round(steps / len(batches), 4) if batches else 0.0,
            "accepted_drafts": total.accepted_drafts, "committed_tokens": total.committed_tokens,
            "accept_length": round(total.accept_length, 4), "accept_rate": round(total.accept_rate, 4),
            "draft_time_s": round(total.draft_time_s, 6), "verify_time_s": round(total.verify_time_s, 6)}


def as_padding(inp: DecodeInputs, rows: list[int]) -> DecodeInputs:
    """``inp`` with ``rows`` turned into padding rows (request row 0, length 0, zeros): whatever
    tree they carry, they then read and write only the sink slots."""
    index = torch.tensor(rows, dtype=torch.int64, device=inp.L.device)
    return tree_map(lambda t: t.index_fill(0, index, 0), inp)


@dataclasses.dataclass
class DraftAhead:
    """The next step's draft, launched before this step's tokens reached the host. The next step uses
    it when it runs these requests (or some of them: the rows of those that ended become padding), in
    this order, from the states this step left them."""

    reqs: list[Request]
    states: list[DraftState | None]  # each request's draft state it was drafted from (set at commit)
    inp: DecodeInputs  # padded to the bucket, on the device
    tree: DraftTree
    seconds: float  # host time of launching it: the draft time of the step that uses it

    def rows_for(self, reqs: list[Request]) -> list[int] | None:
        """Each request's row here when ``reqs`` are some of this draft's requests, in its order, each
        from the state it was drafted from (the others ended since); otherwise None."""
        where = {id(r): i for i, r in enumerate(self.reqs)}
        rows = [where.get(id(r)) for r in reqs]
        if not reqs or None in rows or rows != sorted(rows):
            return None
        return rows if all(r.draft_state is self.states[i] for r, i in zip(reqs, rows)) else None


BATCH_LOG = 4096  # verify steps ``SpecWorker.batches`` keeps (a serving engine runs forever)


class SpecWorker:
    def __init__(self, engine, draft: DraftHead, spec: SpecConfig, config: EngineConfig):
        from shared.engine import make_cache

        self.engine = engine
        self.target = engine.model
        self.target_cache: KVCache = engine.cache
        self.draft = draft
        self.spec = spec
        if draft.kind == "mtp" and draft.num_caches < spec.steps:
            raise ValueError(f"spec steps: the multi-layer draft has {draft.num_caches} layers, "
                             f"steps={spec.steps} needs one per step")
        n_caches = spec.steps if draft.kind == "mtp" else 1
        self.caches = [make_cache(draft.config, draft.layers_per_cache, config, engine.max_context)
                       for _ in range(n_caches)]
        self.capture_mode = "aux" if draft.kind == "eagle3" else "last"
        self.aux_layers = getattr(draft, "aux_layers", ())
        self.phases = SpecPhases(self)
        self.totals = SpecStats()  # the whole engine's, batch after batch
        self.batches: deque[SpecBatchStats] = deque(maxlen=BATCH_LOG)  # the latest verify steps
        self.num_batches = 0  # verify steps run so far (``batches_since`` takes a mark of it)
        self.token_counts = SpecTokenCounts(spec.steps)  # drafts, draft / accepted tokens (the /metrics counters)
        on = set(config.cuda_graph_phases) if config.cuda_graph else set()
        self.graphs = {name: PhaseGraphs(name, getattr(self.phases, name), name in on, config.cuda_graph_max_bs)
                       for name in ("draft", "verify", "extend")}
        # Verify + acceptance + extend run as one graph when both phases are on, whatever the batch samples.
        self.graphs["verify_extend"] = PhaseGraphs("verify_extend", self.phases.verify_extend,
                                                   {"verify", "extend"} <= on, config.cuda_graph_max_bs)
        ahead = config.spec_draft_ahead
        self.draft_ahead = engine.device.type == "cuda" if ahead is None else ahead
        self._ahead: DraftAhead | None = None  # the draft launched for the next step, if any
        # Drafts launched ahead that a step used (of them, for only some of their requests) / did not use
        # (of them, because the next batch was not some of its requests: a join nobody foresaw).
        self.ahead_used = self.ahead_partial = self.ahead_dropped = self.ahead_mismatched = 0

    def keep_batches(self, limit: int | None) -> None:
        """Keep the latest ``limit`` verify steps' statistics (None: all, for a bounded run)."""
        self.batches = deque(self.batches, maxlen=limit)

    def batches_since(self, mark: int) -> list[SpecBatchStats]:
        """The kept verify steps numbered ``mark`` and later (``mark`` = ``num_batches`` read earlier)."""
        return [b for b in self.batches if b.step >= mark]

    @classmethod
    def load(cls, path: str | Path | DraftHead, engine, config: EngineConfig) -> SpecWorker:
        """``path``: a draft checkpoint directory, or a draft head already built on the target."""
        draft = path if isinstance(path, DraftHead) else load_draft(path, engine.model, config.dtype, config.device)
        return cls(engine, draft, config.spec or SpecConfig(), config)

    @property
    def dtype(self) -> torch.dtype:
        return self.target.lm_head.weight.dtype

    def cache_of_step(self, step: int) -> int:
        """Draft step ``step`` (0 = the extend that produces the first tree level) -> cache index."""
        return self.draft.cache_for_step(step) if self.draft.kind == "mtp" else 0

    # ---- draft extend ----------------------------------------------------------------------------
    def features(self, out: TargetOutput) -> torch.Tensor:
        return out.aux_hidden if self.capture_mode == "aux" else out.hidden

    def draft_extend_prefill(self, chunks: list[Chunk], out: TargetOutput) -> None:
        """Run the draft over each prefill chunk; requests whose prompt completed get a DraftState."""
        spans = [(c.req, c.start, c.end) for c in chunks]
        finals = [c.completes_prompt and c.req.finish_reason is None for c in chunks]
        self.draft_extend(spans, self.features(out), finals)

    def draft_extend(self, spans: list[tuple[Request, int, int]], features: torch.Tensor,
                     finals: list[bool]) -> None:
        """Draft positions [start, end) of each request, fed target features [sum(end-start), W].

        Every draft cache runs the extend (a multi-layer draft keeps all its layers' KV complete);
        the first tree level of the next step comes from cache 0's layer at each span's last row.
        """
        q_lens = [e - s for _, s, e in spans]
        ids = torch.tensor([t for r, s, e in spans for t in shifted_tokens(r, s, e)], dtype=torch.int64)
        pos = torch.cat([torch.arange(s, e) for _, s, e in spans]) if spans else torch.zeros(0, dtype=torch.int64)
        ends = torch.tensor(q_lens, dtype=torch.int64).cumsum(0) - 1
        last_rows = ends[torch.tensor(finals, dtype=torch.bool)] if spans else ends
        state_out = None
        for c, cache in enumerate(self.caches):
            rows = [r.handles[1 + c].row for r, _, _ in spans]
            for r, _, e in spans:
                cache.reserve(r.handles[1 + c], e)
            batch = build_forward_batch(cache, rows, [s for _, s, _ in spans], q_lens, ids, pos, pos,
                                        logits_rows=last_rows)
            o = self.draft(batch, cache, c, features, from_target=True)
            if c == 0:
                state_out = o
        finishing = [r for (r, _, e), f in zip(spans, finals) if f]
        self._set_states(finishing, state_out.hidden[last_rows], state_out.logits)

    def _set_states(self, reqs: list[Request], hidden: torch.Tensor, logits: torch.Tensor) -> None:
        topk_p, topk_draft = torch.softmax(logits, dim=-1).topk(self.spec.topk, dim=-1)
        topk_ids = self.draft.to_target_ids(topk_draft)
        for i, req in enumerate(reqs):
            req.draft_state = DraftState(
                bonus_token=req.all_ids[req.kv_len], committed_len=req.kv_len, hidden=hidden[i],
                topk_p=topk_p[i], topk_ids=topk_ids[i],
            )

    # ---- one decode step -------------------------------------------------------------------------
    def decode_step(self, reqs: list[Request]) -> list[tuple[Request, list[int]]]:
        """Draft, verify, accept, compact and extend for ``reqs``; host bookkeeping around four
        pure tensor phases (each can be replayed from a CUDA graph).

        Drafting ahead: the next step's draft needs only device tensors of this step's output, so it
        is launched right after this step's verify and extend, and the host does this step's
        bookkeeping while the device drafts. The next step uses it when it runs these requests, or
        some of them, from the states this step left them (``DraftAhead.rows_for``); otherwise it
        drafts anew (the draft ahead wrote only scratch positions past the committed lengths).
        """
        caps = self._ahead_caps(reqs) if self.draft_ahead and reqs and not self._batch_grows(reqs) else None
        self._reserve(reqs, caps)
        n = len(reqs)
        ahead, self._ahead = self._ahead, None
        rows = ahead.rows_for(reqs) if ahead is not None else None
        t0 = time.perf_counter()
        ahead_s = 0.0  # time spent here on the draft of the next step (its draft time, not this verify's)
        index = None  # the requests' rows of the batch, when they are not its first n
        if rows is not None:  # drafted during the last step
            inp, tree = ahead.inp, ahead.tree
            self.ahead_used += 1
            t0 -= ahead.seconds
            if len(rows) < len(ahead.reqs):  # the rows of requests that ended since become padding
                inp = as_padding(inp, sorted(set(range(len(ahead.reqs))) - set(rows)))
                index = torch.tensor(rows, dtype=torch.int64, device=inp.L.device)
                self.ahead_partial += 1
        else:
            self.ahead_dropped += ahead is not None
            self.ahead_mismatched += ahead is not None
            # Padded rows: request row 0, length 0. An empty batch runs one such row, the same path.
            bs = self.graphs["draft"].bucket(n) or max(n, 1)
            inp = tree_map(lambda t: pad_rows(t, bs), self._inputs(reqs))
            tree = self.graphs["draft"](inp)

        def take(t: torch.Tensor) -> torch.Tensor:
            return t[:n] if index is None else t.index_select(0, index)
        t1 = time.perf_counter()
        out = self._verify_extend(inp, tree)
        out, inp = tree_map(take, out), tree_map(take, inp)
        # The per-token outputs the host needs start on their way to it (the one sync of the step) ...
        host, ready = self._to_host(out)
        if caps is not None:  # ... and the next step's draft goes to the device behind them
            ta = time.perf_counter()
            bs = self.graphs["draft"].bucket(n) or n
            nxt = tree_map(lambda t: pad_rows(t, bs), self._next_inputs(inp, out, caps))
            tree_next = self.graphs["draft"](nxt)
            ahead_s = time.perf_counter() - ta
            self._ahead = DraftAhead(list(reqs), [None] * n, nxt, tree_next, ahead_s)
        if ready is not None:
            ready.synchronize()
        out = dataclasses.replace(out, **host)
        t2 = time.perf_counter() - ahead_s
        verified = out.accept_len.tolist()
        events = self._commit(reqs, inp, out)
        if self._ahead is not None:  # the states it drafted from (those of requests that ended are not used)
            self._ahead.states = [r.draft_state for r in reqs]
            if all(r.finish_reason is not None for r in reqs):
                self.drop_ahead()  # every request ended: nothing will use it
        for req in reqs:
            req.stats.draft_time_s += (t1 - t0) / len(reqs)
            req.stats.verify_time_s += (t2 - t1) / len(reqs)
        batch = SpecBatchStats(step=self.num_batches, request_ids=[r.rid for r in reqs],
                               committed=[len(toks) for _, toks in events], verified=verified,
                               drafts_per_request=self.spec.steps, draft_time_s=t1 - t0, verify_time_s=t2 - t1)
        self.totals.add(batch.totals())
        self.token_counts.record(verified)
        if reqs:  # an empty step verifies nothing: no batch to report
            self.batches.append(batch)
            self.num_batches += 1
        return events

    def _verify_extend(self, inp: DecodeInputs, tree: DraftTree) -> StepOutput:
        """Verify, accept and extend: one graph, or two with the acceptance between them when only one of
        the verify and extend phases is captured."""
        g = self.graphs
        if g["verify_extend"].enabled or not (g["verify"].enabled or g["extend"].enabled):
            return g["verify_extend"](inp, tree)
        logits, feats = g["verify"](inp, tree)
        return g["extend"](inp, tree, self.phases.accept(inp, tree, logits), logits, feats)

    def drop_ahead(self) -> None:
        """Forget the draft launched ahead (no decode step is going to use it): it keeps no request
        alive; its device work is ordered before anything launched later."""
        if self._ahead is not None:
            self._ahead = None
            self.ahead_dropped += 1

    @staticmethod
    def _to_host(out: StepOutput) -> tuple[dict, torch.cuda.Event | None]:
        """Start copying the host's share of ``out`` to pinned memory; the event marks their arrival
        (None on the CPU, where they are already there)."""
        names = ("accept_len", "accept_index", "tokens", "logprobs")
        if not out.accept_len.is_cuda:
            return {k: getattr(out, k) for k in names}, None
        host = {k: getattr(out, k).to("cpu", non_blocking=True) for k in names}
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(out.accept_len.device))  # the copies' stream, on their GPU
        return host, ready

    def _next_inputs(self, inp: DecodeInputs, out: StepOutput, caps: list[int]) -> DecodeInputs:
        """On the device, the inputs ``_inputs`` will build from the states ``_commit`` leaves (a
        request that does not finish commits its whole accepted run). Committed lengths are clamped
        to ``caps``, which only a request that finishes in this step can exceed: its row, never used,
        then stays within the pages reserved for it."""
        last = (out.accept_len - 1).unsqueeze(1)
        cap = torch.tensor(caps, dtype=torch.int64).to(inp.L.device, non_blocking=True)
        L = torch.minimum(inp.L + out.accept_len, cap)
        return DecodeInputs(target_rows=inp.target_rows, draft_rows=inp.draft_rows, L=L,
                            bonus=out.tokens.gather(1, last).squeeze(1), hidden=out.hidden.to(self.dtype),
                            topk_p=out.topk_p.float(), topk_ids=out.topk_ids, sampling=inp.sampling)

    def _batch_grows(self, reqs: list[Request]) -> bool:
        """Whether the next decode step will run a request this one does not: one whose prompt
        completed during this step, or a hand-off being received (a draft ahead would be wasted)."""
        these = {id(r) for r in reqs}
        return any(r.phase in (Phase.DECODING, Phase.RECEIVING) and id(r) not in these
                   for r in self.engine.scheduler.running)

    def _ahead_caps(self, reqs: list[Request]) -> list[int] | None:
        """Per request, the largest committed length after this step with which it still runs the
        next one: the longest accepted run, or one token short of max_new_tokens (reaching it ends
        the request). The next step's draft, launched ahead, writes at most ``_draft_reach`` past it,
        which stays within the peak the scheduler budgeted for the request (prompt + max_new_tokens
        + headroom), so drafting ahead claims no page another request may need. None when a draft
        cache's max_context would cut it (drafting ahead is then skipped)."""
        caps = [min(r.draft_state.committed_len + self.spec.steps + 1, r.prompt_len + r.params.max_new_tokens - 2)
                for r in reqs]
        reach = max(self._draft_reach(c) - cache.spec.max_context for c, cache in enumerate(self.caches))
        return caps if max(caps) + reach <= 0 else None

    def _draft_reach(self, c: int) -> int:
        """Positions past the committed length a step writes in draft cache ``c``."""
        return max(self.phases.scratch_len(c), self.spec.steps + 1)

    def capture_graphs(self) -> int:
        """Capture each enabled phase at every bucket on padding inputs (rows 0, lengths 0), in the
        order a decode step runs them; returns how many graphs exist afterwards."""
        dev, k, c = self.target_cache.spec.device, self.spec.topk, len(self.caches)
        g = self.graphs
        for bs in g["draft"].buckets:
            ints = torch.zeros(bs, dtype=torch.int64, device=dev)
            inp = DecodeInputs(target_rows=ints, draft_rows=torch.zeros(bs, c, dtype=torch.int64, device=dev),
                               L=ints.clone(), bonus=ints.clone(),
                               hidden=torch.zeros(bs, self.draft.hidden_width, dtype=self.dtype, device=dev),
                               topk_p=torch.zeros(bs, k, device=dev), topk_ids=torch.zeros(bs, k, dtype=torch.int64,
                                                                                          device=dev),
                               sampling=SamplingRows(temperature=torch.zeros(bs, device=dev), top_k=ints.clone(),
                                                     top_p=torch.zeros(bs, device=dev), seed=ints.clone()))
            tree = g["draft"](inp)
            if g["verify_extend"].capture:
                g["verify_extend"](inp, tree)
            if g["verify"].capture or g["extend"].capture:
                logits, feats = g["verify"](inp, tree)
                g["extend"](inp, tree, self.phases.accept(inp, tree, logits), logits, feats)
        return sum(len(p.captured_sizes) for p in g.values())

    def _reserve(self, reqs: list[Request], caps: list[int] | None = None) -> None:
        """Pages for every position this step may write: verify nodes, tree scratch, extend; with
        ``caps`` (drafting ahead), also the next step's draft scratch past each request's cap."""
        s = self.spec
        for i, r in enumerate(reqs):
            L = r.draft_state.committed_len
            self.target_cache.reserve(r.handles[0], L + s.num_draft_tokens)
            for c, cache in enumerate(self.caches):
                cache.reserve(r.handles[1 + c], max(L, caps[i] if caps else 0) + self._draft_reach(c))

    def _inputs(self, reqs: list[Request]) -> DecodeInputs:
        dev = self.target_cache.spec.device
        states = [r.draft_state for r in reqs]
        n, k = len(reqs), self.spec.topk

        def stack(tensors: list[torch.Tensor], width: int, dtype: torch.dtype) -> torch.Tensor:
            # An empty batch gets the same shapes, widths from the draft (seed 003), not from a tensor.
            return torch.stack([t.to(dev, dtype) for t in tensors]) if tensors else torch.zeros(
                0, width, dtype=dtype, device=dev)

        # The host integers of the batch travel in one copy, one row per field (each row contiguous):
        # target rows, committed lengths, bonus tokens, then each draft cache's rows.
        c = len(self.caches)
        ints = torch.tensor([[r.handles[0].row for r in reqs], [st.committed_len for st in states],
                             [st.bonus_token for st in states], *([r.handles[1 + i].row for r in reqs]
                                                                 for i in range(c))],
                            dtype=torch.int64).view(3 + c, n).to(dev)
        return DecodeInputs(
            target_rows=ints[0], L=ints[1], bonus=ints[2],
            draft_rows=ints[3:].t(),  # [B, C]: column c (what a draft step reads) is row 3 + c, contiguous
            hidden=stack([st.hidden for st in states], self.draft.hidden_width, self.dtype),
            topk_p=stack([st.topk_p for st in states], k, torch.float32),
            topk_ids=stack([st.topk_ids for st in states], k, torch.int64),
            sampling=sampling_rows([r.params for r in reqs], [r.seed for r in reqs], dev),
        )

    def _commit(self, reqs: list[Request], inp: DecodeInputs, out: StepOutput) -> list[tuple[Request, list[int]]]:
        """Host side: hand tokens to requests, release what they no longer need, keep the state.
        ``out``'s accept lengths, accept index, tokens and logprobs are on the host."""
        lens = out.accept_len.tolist()
        toks, lps = out.tokens.tolist(), out.logprobs.tolist()
        self._sync_host_rows(reqs, out.accept_index.tolist(), lens)
        events = []
        for b, req in enumerate(reqs):
            n = lens[b]
            L = req.draft_state.committed_len
            taken = req.commit(toks[b][:n], lps[b][:n])  # a stop inside the run cuts it
            events.append((req, taken))
            req.stats.verify_steps += 1
            req.stats.accepted_drafts += n - 1
            req.stats.committed_tokens += len(taken)  # a stop inside the run: only up to it
            req.stats.proposed_drafts += self.spec.steps
            if req.finish_reason is not None:
                continue  # the engine returns all its pages
            req.kv_len = L + n
            self.target_cache.shrink(req.handles[0], L + n)
            for c, cache in enumerate(self.caches):  # a draft launched ahead writes its scratch there
                cache.shrink(req.handles[1 + c], L + n + (self._draft_reach(c) if self._ahead is not None else 0))
            req.draft_state = DraftState(bonus_token=toks[b][n - 1], committed_len=L + n, hidden=out.hidden[b],
                                         topk_p=out.topk_p[b], topk_ids=out.topk_ids[b])
        return events

    def _sync_host_rows(self, reqs: list[Request], accept_index: list[list[int]], lens: list[int]) -> None:
        """Page size 1 compacts by permuting the device table (``SpecPhases._compact_target``); the
        host mirror gets the same permutation from the accept index (nothing read from the device):
        the accepted nodes' slots in path order, then the other nodes' slots in node order."""
        if self.target_cache.page_size != 1:
            return
        table = self.target_cache.req_to_token
        if table.table is table.host:  # on the CPU the table is its own mirror
            return
        n = self.spec.num_draft_tokens
        for b, r in enumerate(reqs):
            path = accept_index[b][:lens[b]]
            if path == list(range(len(path))):
                continue  # the accepted nodes already lead in order: nothing moved
            taken = set(path)
            order = torch.tensor(path + [m for m in range(n) if m not in taken], dtype=torch.int64)
            row, L = r.handles[0].row, r.draft_state.committed_len
            table.host[row, L:L + n] = table.host[row, L + order]
