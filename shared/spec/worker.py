"""The EAGLE speculative loop: draft extend, tree draft, verify, accept, compact, draft extend.

Positions are computed from committed lengths, never advanced in place (seed 002): for a request
with committed length L, draft step i runs at position L + i and tree node n is verified at
position L + depth(n). Every forward batch is built from the cache of the runner executing it
(seed 001). One function gives the draft extend's shifted tokens, whatever the draft kind or the
chunking (seed 000). Every per-token output of verification is gathered by one accept index
(seed 004). Empty batches run the same code as full ones, with widths from the draft (seed 003).

A decode step (``SpecWorker.step``) reads top to bottom: reserve pages, draft (or take the
draft launched ahead: ``shared/spec/draft_ahead.py``), verify and extend, launch the next step's draft
ahead, commit, record the statistics (``shared/spec/stats.py``).

An adaptive engine's worker runs several tree shapes (``SpecShape``: the configured one and narrower or
shallower ones, ``EngineConfig.spec_shapes``), one per step as the policy chooses. Every shape drafts from
and leaves the same draft state (the first level at the configured topk, ``SpecPhases.state_topk``), reserves
pages for the configured one (the widest) and extends the draft over every committed position on every draft
cache, so the next step may run any shape. Each has its own phases and CUDA graphs.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from kernels.spec_sampling import SamplingRows
from shared.config import EngineConfig, SpecConfig
from shared.cuda_graphs import CaptureFailure, GraphPool, PhaseGraphs, pad_rows, tree_map
from shared.forward_batch import build_forward_batch
from shared.logits_process import LogitsRows, RowsCache, add_grammar, uses_processing
from shared.memory.kv_cache import KVCache, flush_tables
from shared.memory.sizing import make_cache
from shared.model.drafts import DraftHead, load_draft
from shared.model.llama import LlamaForCausalLM, TargetOutput
from shared.request import Request
from shared.sampling import sampling_ints, sampling_rows_from, to_device, top_pairs
from shared.scheduler import Chunk
from shared.spec.backlog import DraftBacklog, behind
from shared.spec.draft_ahead import DraftAhead, Drafted
from shared.spec.phases import DecodeInputs, SpecPhases, StepOutput
from shared.spec.state import DraftState
from shared.spec.stats import SpecRecorder
from shared.spec.tree import DraftTree
from shared.stepping import Events, Stepping, drive


def shifted_tokens(req: Request, start: int, end: int) -> list[int]:
    """Draft input ids for draft positions [start, end): tokens start+1 .. end.

    The tail token (at ``end``) is the next prompt token when the chunk stops inside the prompt and
    the token the target sampled when it does not: both are simply the request's token at ``end``.
    """
    ids = req.all_ids
    if end >= len(ids):
        raise ValueError(f"{req.rid}: tail token at {end} is not known yet ({len(ids)} tokens)")
    return ids[start + 1:end + 1]


ADAPTIVE_GRAPH_TOKENS = 512  # verified tokens per step up to which an adaptive engine's shapes get CUDA graphs


def shape_graph_rows(spec: SpecConfig, max_bs: int, adaptive: bool) -> int:
    """The largest batch a shape's graphs are captured for: ``max_bs`` under the fixed policy; under the adaptive
    one, as many rows as keep a step within ``ADAPTIVE_GRAPH_TOKENS`` verified tokens (the 16-token tree to 32
    rows, a chain of 3 to 128): past that its verify costs more than its tokens gain (an H100 at the 8B shape:
    the tree's eager steps at 57-64 rows took 67-252 ms against 12-24 ms for a plain step), and its graphs'
    memory is better spent on the shapes the policy runs there. The policy then picks among the shapes whose
    graphs cover a batch (``SpecPolicy.graphed``)."""
    if not adaptive:
        return max_bs
    return max(1, min(max_bs, ADAPTIVE_GRAPH_TOKENS // spec.num_draft_tokens))


@dataclass
class RowsExtend:
    """A target step's draft work between ``SpecWorker.launch_rows`` (queued before the host's wait) and
    ``finish_rows`` (after the step's tokens are committed)."""

    kept: list[Request]  # decoded rows whose features go to the backlog
    kept_features: torch.Tensor | None
    spans: list[tuple[Request, int, int]]  # the positions the draft ran over, per request
    ends: list[bool]  # spans whose request may resume from the extend's last row
    launched: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # (hidden, top-k p, ids) of the ends


@dataclass
class SpecShape:
    """One tree shape the worker can run a decode step with: its phases and their CUDA graphs."""

    spec: SpecConfig
    phases: SpecPhases
    graphs: dict[str, PhaseGraphs]  # draft, verify, extend, verify_extend (the configured shape's: plain's too)


class SpecWorker:
    def __init__(self, target: LlamaForCausalLM, target_cache: KVCache, draft: DraftHead, spec: SpecConfig,
                 config: EngineConfig, max_context: int, graph_failures: list[CaptureFailure] | None = None,
                 penalty_rows: RowsCache | None = None, graph_pool: GraphPool | None = None):
        self.target = target
        self.target_cache = target_cache
        self.draft = draft
        self.spec = spec
        self.max_running = config.max_running
        if draft.kind == "mtp" and draft.num_caches < spec.steps:
            raise ValueError(f"spec steps: the multi-layer draft has {draft.num_caches} layers, "
                             f"steps={spec.steps} needs one per step")
        self.caches = [make_cache(draft.config, draft.layers_per_cache, config, max_context)
                       for _ in range(self.cache_count(draft, spec))]
        self.capture_mode = "aux" if draft.kind == "eagle3" else "last"
        self.aux_layers = getattr(draft, "aux_layers", ())
        self.stats = SpecRecorder(spec.steps)
        # Each processed request's penalty rows, on the device across steps (the engine's: its prefill
        # samples with the same rows)
        self.penalty_rows = RowsCache() if penalty_rows is None else penalty_rows
        on = set(config.cuda_graph_phases) if config.cuda_graph else set()
        failures = [] if graph_failures is None else graph_failures  # the engine's: /health reads it
        self.graph_pool = GraphPool() if graph_pool is None else graph_pool  # every phase's and shape's graphs
        def flush() -> None:  # the step's slot reservations, on the device before a graph reads them
            flush_tables([target_cache, *self.caches])

        # The configured shape first (its graphs keep the phases' own names), then the policy's others.
        adaptive = config.spec_policy == "adaptive"
        self.shapes = {s.name: self._shape(s, on, shape_graph_rows(s, config.graph_max_bs, adaptive), failures,
                                           flush, s != spec)
                       for s in dict.fromkeys([spec, *config.spec_shapes()[1:]])}
        self.phases, self.graphs = self.shapes[spec.name].phases, self.shapes[spec.name].graphs
        self.stats.track_shapes({name: sh.spec.steps for name, sh in self.shapes.items()})
        # Plain steps (the adaptive policy's; fixed never runs one) leave the draft behind, up to a limit.
        self.backlog = DraftBacklog(target_cache.layout.max_reqs, config.spec_draft_backlog) if (
            config.spec_policy == "adaptive" and config.spec_draft_backlog) else None
        if config.spec_policy == "adaptive":  # its plain steps' graphs
            self.graphs.update(self._plain_graphs(on, config.graph_max_bs, failures, flush))
        ahead = config.spec_draft_ahead
        enabled = target_cache.layout.device.type == "cuda" if ahead is None else ahead
        room = min(cache.layout.max_context - self._draft_reach(c) for c, cache in enumerate(self.caches))
        self.ahead = DraftAhead(enabled, spec.steps, room, self.dtype)

    def _shape(self, spec: SpecConfig, on: set[str], max_bs: int, failures: list[CaptureFailure],
               flush: Callable[[], None], suffixed: bool) -> SpecShape:
        """The phases of tree shape ``spec`` (states as wide as the configured shape's) and their graphs;
        ``suffixed``: the graphs' names end with the shape's (``draft.chain1``), all but the configured's."""
        if not self.spec.holds(spec):
            raise ValueError(f"spec shape {spec.name} does not fit the configured {self.spec.name}")
        phases = SpecPhases(self.target, self.target_cache, self.draft, self.caches, spec, self.capture_mode,
                            self.aux_layers, state_topk=self.spec.topk)
        tag = f".{spec.name}" if suffixed else ""
        graphs = {name: PhaseGraphs(name + tag, getattr(phases, name), name in on, max_bs, failures,
                                    before_replay=flush, pool=self.graph_pool)
                  for name in ("draft", "verify", "extend")}
        # Verify + acceptance + extend run as one graph when both phases are on, whatever the batch samples.
        graphs["verify_extend"] = PhaseGraphs("verify_extend" + tag, phases.verify_extend, {"verify", "extend"} <= on,
                                              max_bs, failures, before_replay=flush, pool=self.graph_pool)
        return SpecShape(spec, phases, graphs)

    def phase_graphs(self) -> list[PhaseGraphs]:
        """Every shape's CUDA graph phases, and the plain step's."""
        return list(self.graphs.values()) + [g for s in list(self.shapes.values())[1:] for g in s.graphs.values()]

    def _plain_graphs(self, on: set[str], max_bs: int, failures: list[CaptureFailure],
                      flush: Callable[[], None]) -> dict[str, PhaseGraphs]:
        """A plain decode step's phases (``ModelRunner._plain_step``): the target's decode forward with the
        draft's features, graph-shaped with the decode phase on; without a backlog, the draft over its one
        position, with the extend phase on too."""
        graphs = {"plain": PhaseGraphs("plain", self.phases.plain_decode, "decode" in on, max_bs, failures,
                                       before_replay=flush, pool=self.graph_pool)}
        if self.backlog is None:
            graphs["plain_extend"] = PhaseGraphs("plain_extend", self.phases.plain_extend, {"decode", "extend"} <= on,
                                                 max_bs, failures, before_replay=flush, pool=self.graph_pool)
        return graphs

    @staticmethod
    def cache_count(draft: DraftHead, spec: SpecConfig) -> int:
        """The draft's KV pools: one per step for a multi-layer draft (step i runs layer i), else one."""
        return spec.steps if draft.kind == "mtp" else 1

    @classmethod
    def load(cls, path: str | Path | DraftHead, target: LlamaForCausalLM, target_cache: KVCache,
             config: EngineConfig, max_context: int,
             graph_failures: list[CaptureFailure] | None = None, penalty_rows: RowsCache | None = None,
             graph_pool: GraphPool | None = None) -> SpecWorker:
        """``path``: a draft checkpoint directory, or a draft head already built on the target."""
        spec = config.spec or SpecConfig()
        target.config.check_tree_depth(spec.steps)
        draft = path if isinstance(path, DraftHead) else load_draft(path, target, config.dtype, config.device)
        return cls(target, target_cache, draft, spec, config, max_context, graph_failures, penalty_rows, graph_pool)

    @property
    def dtype(self) -> torch.dtype:
        return self.target.lm_head.weight.dtype

    # ---- draft extend ----------------------------------------------------------------------------
    def features(self, out: TargetOutput) -> torch.Tensor:
        return out.features()

    def draft_extend_prefill(self, chunks: list[Chunk], out: TargetOutput) -> None:
        """Run the draft over each prefill chunk; requests whose prompt completed get a DraftState."""
        self.draft_extend_rows([], [], chunks, out)

    def draft_extend_rows(self, decoded: list[Request], starts: list[int], chunks: list[Chunk],
                          out: TargetOutput) -> None:
        """Run the draft over a target step's rows in order: each plain-decoded request's one position
        (``starts``: where it wrote), then each prefill chunk. A decoded request still running, and one
        whose prompt completed, get a DraftState (the next speculative step resumes from it). With a backlog
        the decoded positions' features wait in it instead (``leave_behind``)."""
        self.finish_rows(self.launch_rows(decoded, starts, chunks, out))

    def launch_rows(self, decoded: list[Request], starts: list[int], chunks: list[Chunk], out: TargetOutput,
                    sampled: torch.Tensor | None = None) -> RowsExtend:
        """``draft_extend_rows`` up to the host's wait: the draft's extend over the chunks (and, without a
        backlog, the decoded positions) is queued behind the target's forward, its input tokens the ones the
        host knows and, where it does not yet (a decoded row's next token, a completed prompt's first), the
        step's ``sampled`` tokens on the device (the i-th sampling row of the step: decoded rows, then the
        chunks that sample). ``finish_rows``, after the tokens are committed, sets the draft states."""
        features = self.features(out) if decoded or chunks else None
        keep = bool(self.backlog is not None and decoded)  # the decoded rows' features wait in the backlog
        spans = [] if keep else [(r, s, s + 1) for r, s in zip(decoded, starts)]
        spans += [(c.req, c.start, c.end) for c in chunks]
        sample_row = [] if keep else list(range(len(decoded)))
        n_sampling = len(decoded)
        for c in chunks:
            sample_row.append(n_sampling if c.samples else None)
            n_sampling += int(c.samples)
        ends = [True] * (0 if keep else len(decoded)) + [c.completes_prompt for c in chunks]
        launched = self.launch_extend(spans, features[len(decoded):] if keep else features, ends,
                                      sampled, sample_row) if spans else None
        return RowsExtend(decoded if keep else [], features[:len(decoded)] if keep else None, spans, ends,
                          launched)

    def finish_rows(self, rows: RowsExtend) -> None:
        """After the step's tokens are committed: the decoded rows' features into the backlog, then the states
        of the requests the extend ended (still running) from its outputs."""
        if rows.kept:
            self.leave_behind(rows.kept, rows.kept_features)
        if rows.launched is not None:
            self.finish_extend(rows.spans, rows.ends, rows.launched)

    def draft_extend(self, spans: list[tuple[Request, int, int]], features: torch.Tensor,
                     finals: list[bool]) -> None:
        """Draft positions [start, end) of each request, fed target features [sum(end-start), W]; each request
        with ``finals[i]`` still running resumes from the draft state it leaves."""
        self.finish_extend(spans, finals, self.launch_extend(spans, features, finals))

    def launch_extend(self, spans: list[tuple[Request, int, int]], features: torch.Tensor, ends: list[bool],
                      sampled: torch.Tensor | None = None, sample_row: list[int | None] | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The draft over positions [start, end) of each span, queued: every draft cache runs the extend (a
        multi-layer draft keeps all its layers' KV complete); the first tree level of the next step comes from
        cache 0's layer at the last row of each span with ``ends[i]``. A span's tail token the host does not
        know yet is ``sampled[sample_row[i]]`` (``launch_rows``). Returns that level (hidden, top-k
        probabilities, target ids) for the ``ends`` spans, in order, on the device."""
        q_lens = [e - s for _, s, e in spans]
        host_ids, fill_at, fill_from = [], [], []
        for i, (r, s, e) in enumerate(spans):
            tail = sample_row[i] if sampled is not None and sample_row and e >= len(r.all_ids) else None
            if tail is None:
                host_ids += shifted_tokens(r, s, e)  # (raises when the tail is not known and not sampled)
            else:  # the tail: this step's sampled token, filled on the device
                host_ids += shifted_tokens(r, s, e - 1)
                fill_at.append(len(host_ids))
                fill_from.append(tail)
                host_ids.append(0)
        ids = torch.tensor(host_ids, dtype=torch.int64)
        pos = torch.cat([torch.arange(s, e) for _, s, e in spans]) if spans else torch.zeros(0, dtype=torch.int64)
        last_rows = (torch.tensor(q_lens, dtype=torch.int64).cumsum(0) - 1)[torch.tensor(ends, dtype=torch.bool)]
        state_out = state_rows = None
        for c, cache in enumerate(self.caches):
            rows = [r.handles[1 + c].row for r, _, _ in spans]
            cache.reserve_many([r.handles[1 + c] for r, _, _ in spans], [e for _, _, e in spans])
            batch = build_forward_batch(cache, rows, [s for _, s, _ in spans], q_lens, ids, pos, pos,
                                        logits_rows=last_rows)
            if fill_at:  # the same tokens every cache reads: filled once, in the batch's own copy of the ids
                index = torch.tensor([fill_at, fill_from], dtype=torch.int64)
                index = index.pin_memory().to(sampled.device, non_blocking=True) if sampled.is_cuda else index
                batch.input_ids[index[0]] = sampled[index[1]].to(batch.input_ids.dtype)
                ids, fill_at = batch.input_ids, []
            o = self.draft(batch, cache, c, features, from_target=True)
            if c == 0:  # the rows as the batch copied them to the device: a host index would wait for the device
                state_out, state_rows = o, batch.logits_rows
        return (state_out.hidden[state_rows], *self.phases.first_level(state_out.logits))

    def finish_extend(self, spans: list[tuple[Request, int, int]], ends: list[bool],
                      launched: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
        """Each ``ends`` span's request, if still running, resumes from its row of ``launched``."""
        ended = [r for (r, _, _), end in zip(spans, ends) if end]
        running = [i for i, r in enumerate(ended) if r.finish_reason is None]
        self._resume([ended[i] for i in running], *launched, running)

    @staticmethod
    def _resume(reqs: list[Request], hidden: torch.Tensor, topk_p: torch.Tensor, topk_ids: torch.Tensor,
                rows: list[int] | None = None) -> None:
        """Each request resumes from its row of the draft's outputs (``rows``, default 0, 1, ..), at its
        cached length."""
        for req, i in zip(reqs, range(len(reqs)) if rows is None else rows):
            req.resume_from(DraftState(bonus_token=req.all_ids[req.kv_len], committed_len=req.kv_len,
                                       hidden=hidden[i], topk_p=topk_p[i], topk_ids=topk_ids[i]))

    def plain_extend(self, reqs: list[Request], lengths: torch.Tensor, feats: torch.Tensor) -> None:
        """After a graph-shaped plain decode step (``ModelRunner._plain_step``): the draft over the position
        each request wrote (``lengths`` [bs], the step's padded rows), fed that position's target feature
        ([bs, W]) and the token the step committed; the requests still running resume from the draft state
        it leaves, as they do after ``draft_extend_rows`` (the eager plain step)."""
        n, bs, c = len(reqs), lengths.shape[0], len(self.caches)
        for i, cache in enumerate(self.caches):  # the written position, kv_len - 1
            cache.reserve_many([r.handles[1 + i] for r in reqs], [r.kv_len for r in reqs])
        # One host-to-device copy: the committed tokens, then each draft cache's rows (padding: 0, row 0).
        host = torch.zeros(1 + c, bs, dtype=torch.int64, pin_memory=lengths.is_cuda)
        host[:, :n] = torch.tensor([[shifted_tokens(r, r.kv_len - 1, r.kv_len)[0] for r in reqs],
                                    *([r.handles[1 + i].row for r in reqs] for i in range(c))], dtype=torch.int64)
        ints = host.to(lengths.device, non_blocking=True)
        out = self.graphs["plain_extend"](ints[1:].t(), lengths, ints[0], feats)
        running = [i for i, r in enumerate(reqs) if r.finish_reason is None]  # rows picked by the host: no sync
        self._resume([reqs[i] for i in running], out.hidden, out.topk_p, out.topk_ids, running)

    def leave_behind(self, reqs: list[Request], features: torch.Tensor) -> None:
        """After a plain step (its tokens committed): each request of ``reqs`` wrote its last position with target
        features ``features[i]``; they wait in the backlog, the draft not run. When a running request's backlog
        is full, every request of the step catches up (``shared/spec/backlog.py``)."""
        self.backlog.put(reqs, features)
        if self.backlog.full(reqs):
            self.catch_up(reqs)

    def catch_up(self, reqs: list[Request]) -> None:
        """The draft over every position plain steps left it behind on, for each running request of ``reqs``,
        in one extend; each resumes from the draft state it leaves."""
        late = [r for r in reqs if r.finish_reason is None and behind(r) > 0] if self.backlog is not None else []
        if late:
            features = self.backlog.take(late)
            self.stats.caught_up(len(features))
            self.draft_extend([(r, r.draft_state.committed_len, r.kv_len) for r in late], features, [True] * len(late))

    # ---- one decode step -------------------------------------------------------------------------
    def decode_step(self, reqs: list[Request], next_grows: bool = False, shape: str | None = None) -> Events:
        """One decode step (``step``) run through, nothing beside it at its host wait."""
        return drive(self.step(reqs, next_grows, shape))

    def step(self, reqs: list[Request], next_grows: bool = False, shape: str | None = None) -> Stepping:
        """Draft, verify, accept, compact and extend for ``reqs``: host bookkeeping around four pure
        tensor phases (each can be replayed from a CUDA graph); yields once the device work is queued,
        before the host waits for it (``shared/stepping.py``). ``next_grows``: the next decode step
        runs a request this one does not (then no draft is launched ahead for it). ``shape``: the tree
        shape's name (``self.shapes``; None: the configured one)."""
        sh = self.shapes[shape or self.spec.name]
        # Penalties, filters and grammar masks change only the target's logits at verify: the draft
        # launched ahead serves a batch using them too (their rows are built from the committed tokens).
        processed = any(uses_processing(r.params) for r in reqs)
        caps = self.ahead.caps(reqs, next_grows)
        self._reserve(reqs, caps)
        t0 = time.perf_counter()
        drafted = self.ahead.take(reqs, sh.spec.name) or self._draft(reqs, sh)
        t1 = time.perf_counter()
        top_n = max((r.params.top_logprobs for r in reqs), default=0)  # an empty batch runs the same path
        out, inp = self._verify(drafted, sh, reqs if processed else None, top_n)
        # The per-token outputs the host needs start on their way to it (the one sync of the step) ...
        host, ready = self._to_host(out)
        # ... and the next step's draft goes to the device behind them, timed as that step's draft.
        ahead_s = self.ahead.launch(reqs, inp, out, caps, sh.graphs["draft"], sh.spec.name) if caps is not None \
            else 0.0
        yield  # the device computes the step: the engine loop publishes and serves meanwhile
        if ready is not None:
            ready.synchronize()
        out = dataclasses.replace(out, **host)
        t2 = time.perf_counter() - ahead_s
        verified = out.accept_len.tolist()
        events = self._commit(reqs, inp, out)
        self.ahead.committed(reqs)
        self.stats.record(events, verified, draft_s=t1 - t0 + drafted.earlier_s, verify_s=t2 - t1, steps=sh.spec.steps,
                          shape=sh.spec.name)
        return events

    def _verify_extend(self, inp: DecodeInputs, tree: DraftTree, sh: SpecShape, processing: LogitsRows | None = None,
                       top_n: int = 0) -> StepOutput:
        """Verify, accept and extend: one graph, or the verify and extend graphs with the acceptance
        between them (eager) when only one of those phases is captured, or when the batch has penalties,
        filters or grammar masks (``processing``) or asks for ``top_n`` log-probabilities: those apply
        eagerly to the verify graph's logits (the one-graph path holds no buffers for them: batches
        without pay nothing)."""
        g = sh.graphs
        split = processing is not None or top_n > 0 or (
            not g["verify_extend"].enabled and (g["verify"].enabled or g["extend"].enabled))
        if not split:
            return g["verify_extend"](inp, tree)
        logits, feats = g["verify"](inp, tree)
        return sh.phases.accept_extend(inp, tree, logits, feats, processing, top_n, extend=g["extend"])

    def drop_ahead(self) -> None:
        """No decode step is coming: forget the draft launched ahead."""
        self.ahead.drop()

    def _draft(self, reqs: list[Request], sh: SpecShape | None = None) -> Drafted:
        """Draft the tree of shape ``sh`` (the configured one by default) from the requests' committed
        states. Padded rows: request row 0, length 0; an empty batch runs one such row, the same path."""
        sh = sh or self.shapes[self.spec.name]
        n = len(reqs)
        bs = sh.graphs["draft"].bucket(n) or max(n, 1)
        inp = tree_map(lambda t: pad_rows(t, bs), self._inputs(reqs))
        return Drafted(inp, sh.graphs["draft"](inp), n)

    def _verify(self, d: Drafted, sh: SpecShape, processed: list[Request] | None = None,
                top_n: int = 0) -> tuple[StepOutput, DecodeInputs]:
        """Verify the tree, accept (every row by its own rule, on the device), compact and extend; the
        requests' rows of the output and inputs. ``processed``: the requests whose penalties, filters
        and grammar masks apply (built now, from the committed tokens and grammar states, whoever drafted
        the tree); ``top_n``: the top log-probabilities the batch asks for."""
        rows = None if processed is None else self._logits_rows(processed, d)
        out = self._verify_extend(d.inp, d.tree, sh, rows, top_n)
        return tree_map(d.take, out), tree_map(d.take, d.inp)

    def _logits_rows(self, reqs: list[Request], d: Drafted) -> LogitsRows | None:
        """The penalties, filters and grammar masks of ``reqs``, each at its row of the drafted batch (the
        first rows, or ``d.index`` for a draft launched ahead that some requests left); padding rows neutral.
        The rows live on the device across steps (``self.penalty_rows``): gathered, not rebuilt."""
        vocab, bs, dev = self.target.config.vocab_size, d.inp.L.shape[0], d.inp.L.device
        rows = self.penalty_rows.rows(reqs, vocab, bs, dev, d.index)
        if rows is None:
            return None
        return add_grammar(rows, reqs, d.tree if d.index is None else tree_map(d.take, d.tree), d.index)

    @staticmethod
    def _to_host(out: StepOutput) -> tuple[dict, torch.cuda.Event | None]:
        """Start copying the host's share of ``out`` to pinned memory; the event marks their arrival
        (None on the CPU, where they are already there)."""
        names = ("accept_len", "accept_index", "tokens", "logprobs") + (
            ("top_logprobs", "top_ids") if out.top_logprobs is not None else ())
        if not out.accept_len.is_cuda:
            return {k: getattr(out, k) for k in names}, None
        host = {k: getattr(out, k).to("cpu", non_blocking=True) for k in names}
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(out.accept_len.device))  # the copies' stream, on their GPU
        return host, ready

    def _draft_reach(self, c: int) -> int:
        """Positions past the committed length a step writes in draft cache ``c``."""
        return max(self.phases.scratch_len(c), self.spec.steps + 1)

    def capture_graphs(self, room: Callable[[int], bool] | None = None) -> int:
        """Capture each enabled phase at every bucket on padding inputs (rows 0, lengths 0), in the
        order a decode step runs them, smallest batch first; ``room(bs)`` False (the memory budget,
        ``CaptureBudget``) stops every phase before ``bs``. Returns how many graphs exist afterwards."""
        g = self.graphs
        for bs in sorted(set().union(*(p.buckets for p in self.phase_graphs()))):
            if room is not None and not room(bs):
                for p in self.phase_graphs():
                    p.stop_at(bs)
                break
            inp = self.padding_inputs(bs)
            for sh in self.shapes.values():
                if bs in sh.graphs["draft"].buckets:  # an adaptive engine's wide shapes stop earlier
                    self._capture_shape(sh, inp)
            if "plain" in g and g["plain"].capture and bs in g["plain"].buckets:
                self.plain_padding_step(inp)
        return sum(len(p.captured_sizes) for p in self.phase_graphs())

    def graphed_batches(self) -> dict[str, int]:
        """Per shape, the largest batch size its step runs as graphs (every graph-enabled phase of it has that
        bucket; 0: none, as after a contained capture failure, which runs the phase eagerly); ``plain`` too under
        an adaptive policy. A shape whose phases are all configured eager is not limited (``max_running``)."""
        def largest(phases: list[PhaseGraphs]) -> int:
            on = [p for p in phases if p.enabled]
            return min((max(p.captured_sizes, default=0) if p.capture else 0 for p in on),
                       default=self.max_running)

        out = {name: largest([sh.graphs["draft"], sh.graphs["verify_extend"]]
                             if sh.graphs["verify_extend"].enabled
                             else [sh.graphs[k] for k in ("draft", "verify", "extend")])
               for name, sh in self.shapes.items()}
        if "plain" in self.graphs:
            out["plain"] = largest([self.graphs[k] for k in ("plain", "plain_extend") if k in self.graphs])
        return out

    def padding_inputs(self, bs: int) -> DecodeInputs:
        """A decode step's inputs of ``bs`` padding rows (request row 0, length 0: the sink page), as capture
        runs the phases on."""
        dev, k, c = self.target_cache.layout.device, self.spec.topk, len(self.caches)
        ints = torch.zeros(bs, dtype=torch.int64, device=dev)
        return DecodeInputs(target_rows=ints, draft_rows=torch.zeros(bs, c, dtype=torch.int64, device=dev),
                            L=ints.clone(), bonus=ints.clone(),
                            hidden=torch.zeros(bs, self.draft.hidden_width, dtype=self.dtype, device=dev),
                            topk_p=torch.zeros(bs, k, device=dev), topk_ids=torch.zeros(bs, k, dtype=torch.int64,
                                                                                       device=dev),
                            sampling=SamplingRows(temperature=torch.zeros(bs, device=dev), top_k=ints.clone(),
                                                  top_p=torch.zeros(bs, device=dev), seed=ints.clone()))

    def plain_padding_step(self, inp: DecodeInputs) -> None:
        """A plain step's phases (target decode, then the draft over its position) on padding rows ``inp``."""
        g, ints = self.graphs, torch.zeros_like(inp.L)
        logits, feats = g["plain"](ints, ints.clone(), ints.clone())
        if "plain_extend" in g:  # without a backlog
            g["plain_extend"](inp.draft_rows, ints.clone(), ints.clone(), feats)

    def padding_step(self, shape: str, inp: DecodeInputs) -> None:
        """A speculative step of ``shape`` on padding rows ``inp``: its draft, then its verify, acceptance and
        extend as a decode step runs them (one graph where captured)."""
        sh = self.shapes[shape]
        self._verify_extend(inp, sh.graphs["draft"](inp), sh)

    @staticmethod
    def _capture_shape(sh: SpecShape, inp: DecodeInputs) -> None:
        """One shape's graphs at ``inp``'s batch size (padding rows), in the order a decode step runs them."""
        g = sh.graphs
        tree = g["draft"](inp)
        if g["verify_extend"].capture:
            g["verify_extend"](inp, tree)
        if g["verify"].capture or g["extend"].capture:
            logits, feats = g["verify"](inp, tree)
            g["extend"](inp, tree, sh.phases.accept(inp, tree, logits), logits, feats)

    def _reserve(self, reqs: list[Request], caps: list[int] | None = None) -> None:
        """Pages for every position this step may write: verify nodes, tree scratch, extend; with
        ``caps`` (drafting ahead), also the next step's draft scratch past each request's cap."""
        lens = [r.draft_state.committed_len for r in reqs]
        n = self.spec.num_draft_tokens
        self.target_cache.reserve_many([r.handles[0] for r in reqs], [L + n for L in lens])
        starts = lens if not caps else [max(L, cap) for L, cap in zip(lens, caps)]
        for c, cache in enumerate(self.caches):  # one call per cache (each its own pages)
            reach = self._draft_reach(c)
            cache.reserve_many([r.handles[1 + c] for r in reqs], [s + reach for s in starts])

    def _inputs(self, reqs: list[Request]) -> DecodeInputs:
        dev = self.target_cache.layout.device
        states = [r.draft_state for r in reqs]
        n, k = len(reqs), self.spec.topk

        def stack(tensors: list[torch.Tensor], width: int, dtype: torch.dtype) -> torch.Tensor:
            # An empty batch gets the same shapes, widths from the draft (seed 003), not from a tensor.
            if not tensors:
                return torch.zeros(0, width, dtype=dtype, device=dev)
            if all(t.dtype == dtype and t.device == ints.device for t in tensors):  # usually: no copy per row
                return torch.stack(tensors)
            return torch.stack([t.to(dev, dtype) for t in tensors])

        # The host integers of the batch travel in one copy, one row per field (each row contiguous):
        # target rows, committed lengths, bonus tokens, each draft cache's rows, then top-k and seeds.
        c = len(self.caches)
        params = [r.params for r in reqs]
        ints = torch.tensor([[r.handles[0].row for r in reqs], [st.committed_len for st in states],
                             [st.bonus_token for st in states], *([r.handles[1 + i].row for r in reqs]
                                                                 for i in range(c)),
                             *sampling_ints(params, [r.seed for r in reqs])],
                            dtype=torch.int64).view(5 + c, n)
        ints = to_device(ints, dev)
        return DecodeInputs(
            target_rows=ints[0], L=ints[1], bonus=ints[2],
            draft_rows=ints[3:3 + c].t(),  # [B, C]: column c (what a draft step reads) is row 3 + c, contiguous
            hidden=stack([st.hidden for st in states], self.draft.hidden_width, self.dtype),
            topk_p=stack([st.topk_p for st in states], k, torch.float32),
            topk_ids=stack([st.topk_ids for st in states], k, torch.int64),
            sampling=sampling_rows_from(params, ints[3 + c], ints[4 + c], dev),
        )

    def _commit(self, reqs: list[Request], inp: DecodeInputs, out: StepOutput) -> list[tuple[Request, list[int]]]:
        """Host side: hand tokens to requests, release what they no longer need, keep the state.
        ``out``'s accept lengths, accept index, tokens and logprobs are on the host."""
        lens = out.accept_len.tolist()
        toks, lps = out.tokens.tolist(), out.logprobs.tolist()
        tops = self._top_pairs(reqs, out)
        self._sync_host_rows(reqs, out.accept_index.tolist(), lens)
        scratch = self.ahead.pending is not None  # a draft launched ahead writes its scratch past the length
        reach = [self._draft_reach(c) if scratch else 0 for c in range(len(self.caches))]
        drafts = list(zip(self.caches, reach))
        # Each request's rows of the draft state as views, one call per tensor (indexing per request cost
        # three tensor ops each: ~0.3 ms a step at 128 rows on the CPU)
        hidden, topk_p, topk_ids = out.hidden.unbind(0), out.topk_p.unbind(0), out.topk_ids.unbind(0)
        events = []
        for b, req in enumerate(reqs):
            n = lens[b]
            L = req.draft_state.committed_len
            events.append((req, req.commit(toks[b][:n], lps[b][:n], tops[b])))  # a stop inside the run cuts it
            if req.finish_reason is not None:
                continue  # the engine returns all its pages
            self.target_cache.shrink(req.handles[0], L + n)
            for c, (cache, r) in enumerate(drafts):
                cache.shrink(req.handles[1 + c], L + n + r)
            req.resume_from(DraftState(bonus_token=toks[b][n - 1], committed_len=L + n, hidden=hidden[b],
                                       topk_p=topk_p[b], topk_ids=topk_ids[b]))
        return events

    @staticmethod
    def _top_pairs(reqs: list[Request], out: StepOutput) -> list[list[list[tuple[int, float]]] | None]:
        """Per request, its committed slots' top log-probabilities as (token id, log p) pairs, the first
        ``top_logprobs`` of each; None for a request that did not ask."""
        if out.top_logprobs is None:
            return [None] * len(reqs)
        values, ids = out.top_logprobs.tolist(), out.top_ids.tolist()
        return [top_pairs(values[b], ids[b], r.params.top_logprobs) if r.params.top_logprobs else None
                for b, r in enumerate(reqs)]

    def _sync_host_rows(self, reqs: list[Request], accept_index: list[list[int]], lens: list[int]) -> None:
        """Page size 1 compacts by permuting the device table (``SpecPhases._compact_target``); the
        host mirror gets the same permutation from the accept index (nothing read from the device):
        the accepted nodes' slots in path order, then the other nodes' slots in node order."""
        if self.target_cache.page_size != 1:
            return
        table = self.target_cache.req_to_token
        if table.table is table.host:  # on the CPU the table is its own mirror
            return
        n = self.spec.num_draft_tokens  # the widest tree's: a smaller one's nodes past its own stay in place
        for b, r in enumerate(reqs):
            path = accept_index[b][:lens[b]]
            if path == list(range(len(path))):
                continue  # the accepted nodes already lead in order: nothing moved
            taken = set(path)
            order = torch.tensor(path + [m for m in range(n) if m not in taken], dtype=torch.int64)
            row, L = r.handles[0].row, r.draft_state.committed_len
            table.host[row, L:L + n] = table.host[row, L + order]
