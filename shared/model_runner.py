"""The device side of an engine: weights, KV pools, CUDA graphs, the forwards of a step, and tensor parallelism.

``ModelRunner`` loads the target (this rank's share under tensor parallelism) and its draft head, sizes the
pools to the GPU (``shared/memory/sizing.py``), makes the KV caches and the speculative worker, captures the
CUDA graphs and runs one step's forwards: ``run(plan, shape)`` takes the scheduler's plan and the policy's
choice (a speculative shape, or None for a plain step) and yields once, where the host would wait for the
step's tokens (``shared/stepping.py``). It knows no scheduler: what a step leaves the scheduler to do (a
prompt done, pages for the prefix cache, requests to retire) is the engine's commit, after the run.

Tensor parallelism is this class's seam (with ``shared/parallel.py``): every rank builds its runner alike;
rank 0's engine alone decides, and its runner sends each call that touches the device (``run``,
``capture_graphs``, the hand-off's gathers and scatters) to the other ranks before running it (``send``),
which run the same method (``shared/replay.py``). The model's split layers hold the group for their
all-reduces; nothing above the runner names it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable
from pathlib import Path

import torch

from shared.config import (
    DEFAULT_GPU_MEMORY_FRACTION,
    DTYPES,
    EngineConfig,
    SpecConfig,
    checkpoint_dtype,
    resolve_dtype,
)
from shared.cuda_graphs import CaptureBudget, CaptureFailure, GraphPool, PhaseGraphs
from shared.errors import RequestError
from shared.forward_batch import attention_split_len, build_forward_batch, build_uniform_batch
from shared.handoff.port import landing_pages
from shared.logits_process import RowsCache, add_grammar, process_logits
from shared.memory.kv_cache import KVCache, flush_tables
from shared.memory.profile import profile_steps
from shared.memory.sizing import (
    POOL_MARGIN,
    activation_reserve,
    default_pages,
    device_memory,
    draft_backlog_reserve,
    draft_phase_reserve,
    graph_output_reserve,
    graph_target_phases,
    make_cache,
    page_bytes,
    pages_within_budget,
    profiled_reserve,
)
from shared.mixed_graphs import MixedGraphs, reserve_bytes, step_tokens
from shared.model.drafts import DraftHead, load_draft
from shared.model.fp8 import mark_same_rows
from shared.model.layers import Attention
from shared.model.llama import LlamaForCausalLM, TargetOutput
from shared.model.loader import load_target
from shared.model.shard_loader import load_target_shard, read_lm_head
from shared.parallel import (
    GroupChannel,
    TPGroup,
    gather_pages,
    gather_pages_into,
    local_config,
    rank_device,
    scatter_pages,
    shard_target,
    share_pages,
)
from shared.replay import Leading, described
from shared.request import Request
from shared.sampling import sample, top_logprobs, top_pairs
from shared.scheduler import Scheduler, StepPlan
from shared.spec.graph_costs import seed_costs
from shared.spec.policy import MeasuredCost, SpecPolicy
from shared.spec.worker import SpecWorker
from shared.stepping import Stepping

log = logging.getLogger("eyrie.weights")


class ModelRunner:
    def __init__(self, model: str | Path | LlamaForCausalLM, draft: str | Path | DraftHead | None,
                 config: EngineConfig, role: str, tp: TPGroup | None = None, channel=None):
        """``tp``: this rank's group when ``config.tensor_parallel`` > 1; rank r runs on the r-th GPU from the
        configured one; ``channel``: how rank 0's calls reach the others (``send(message)`` on rank 0,
        ``receive()`` on the others, None at its end; the group's own host group by default). ``config`` as the
        runner fits it (``num_pages`` chosen on a GPU) is ``self.config``."""
        if (tp.size if tp is not None else 1) != config.tensor_parallel:
            raise ValueError(f"tensor_parallel={config.tensor_parallel} needs a group of that many ranks "
                             f"(got {tp.size if tp is not None else 'none'})")
        self.tp, self.role = tp, role
        self.channel = channel or (GroupChannel(tp) if tp is not None else None)
        self.leads = tp is not None and tp.rank == 0  # rank 0 of a split group: sends its calls (``send``)
        if tp is not None:
            config = config.model_copy(update={"device": rank_device(config.device, tp.rank)})
        if role == "decode" and not config.shareable_kv:  # a same-host prefill writes into its pools
            config = config.model_copy(update={"shareable_kv": True})
        self.device = torch.device(config.device)
        if config.device.startswith("cuda") and not torch.cuda.is_available():
            raise RequestError("device", "cuda was asked for but no CUDA device is available")
        config = resolved_dtype(config, model)  # from here on the dtype the weights and pools are in, never auto
        reserved = torch.cuda.memory_reserved(self.device) if self.device.type == "cuda" else 0  # before the weights
        self.model, lm_head = self._load_target(model, config)
        mc = self.model.config
        self.max_context = min(config.max_context or mc.max_position_embeddings, mc.max_position_embeddings)
        self.head = draft if draft is None or isinstance(draft, DraftHead) else load_draft(
            draft, self.model, config.dtype, config.device, lm_head)  # before the pools: sized after the weights
        if tp is not None:  # a target passed in whole: split after the draft's load, which may copy its LM head
            shard_target(self.model, tp, self.device)
        if config.batch_invariant:  # a row's product the same bits at every row count (after the split's copies)
            mark_same_rows(self.model, every_row_count=True)
        self.load_peak, self.step_peaks = 0, None  # on one GPU: set by the profile run (``_step_reserve``)
        self.memory_plan: dict | None = None  # on a GPU without num_pages: the figures the pools were sized by
        self.config = config = self._fit_pools(config, self.head, reserved)
        self.cache = make_cache(local_config(mc, tp), mc.num_hidden_layers, config, self.max_context)
        self.graph_failures: list[CaptureFailure] = []  # CUDA graphs that failed to capture (phase eager)
        self.graph_pool = GraphPool()  # the memory every graph of this runner captures into
        self.penalty_rows = RowsCache()  # requests' penalty rows, on the device across steps (and the speculator's)
        self.speculator = None if self.head is None else SpecWorker.load(
            self.head, self.model, self.cache, config, self.max_context, self.graph_failures, self.penalty_rows,
            self.graph_pool)
        self.caches: list[KVCache] = [self.cache] + (self.speculator.caches if self.speculator else [])
        self.graph_costs: dict[tuple[str, int], float] = {}  # (kind, batch) -> seconds, timed at capture
        self.graphs_stopped_at: int | None = None  # the batch size graph captures stopped at (memory), if any
        graphs_on = set(config.cuda_graph_phases) if config.cuda_graph else set()
        self.decode_graphs = PhaseGraphs("decode", self._decode_phase, "decode" in graphs_on, config.graph_max_bs,
                                         self.graph_failures, before_replay=lambda: flush_tables([self.cache]),
                                         pool=self.graph_pool)
        w = self.speculator
        self.mixed_graphs = MixedGraphs(  # steps with prefill chunks: the target in pieces between its attentions
            self.model, self.cache, step_tokens(config),
            config.cuda_graph and config.cuda_graph_mixed and self.device.type == "cuda" and not config.batch_invariant,
            aux_layers=w.aux_layers if w is not None and w.capture_mode == "aux" else (), pool=self.graph_pool,
            failures=self.graph_failures)

    # ---- loading and sizing ----------------------------------------------------------------------
    def _load_target(self, model: str | Path | LlamaForCausalLM, config: EngineConfig
                     ) -> tuple[LlamaForCausalLM, Callable | None]:
        """The target (under tensor parallelism from a checkpoint: this rank's share only, read slice by slice)
        and, then, a reader of the whole target's LM head for a draft that copies it (else None)."""
        if isinstance(model, LlamaForCausalLM):
            return model, None
        if self.tp is None:
            return load_target(model, config.dtype, config.device), None
        return load_target_shard(model, self.tp, config.dtype, config.device), functools.partial(read_lm_head, model)

    def landing_pages(self, config: EngineConfig | None = None) -> int:
        """The hand-off port's landing cache's pages (``shared.handoff.port.landing_pages``)."""
        config = config or self.config
        return landing_pages(self.leads and self.role == "decode",
                             self.max_context + config.headroom, config.page_size)

    def _fit_pools(self, config: EngineConfig, head: DraftHead | None, reserved_before: int) -> EngineConfig:
        """On a GPU without ``num_pages``: the page count that keeps this engine, weights (loaded since the
        allocator held ``reserved_before``), reserve, margin and every pool, within ``gpu_memory_fraction`` of
        the device (under tensor parallelism a collective: the least of the ranks' counts)."""
        if self.device.type != "cuda" or config.num_pages is not None:
            return config
        mc, positions = self.model.config, self.max_context + config.headroom
        per_page = page_bytes(local_config(mc, self.tp), mc.num_hidden_layers, config)
        if head is not None:
            per_page += (SpecWorker.cache_count(head, config.spec or SpecConfig())
                         * page_bytes(head.config, head.layers_per_cache, config))
        landing = self.landing_pages(config) * page_bytes(mc, mc.num_hidden_layers, config)  # whole heads
        reserve = self._step_reserve(config, head) + landing
        memory = device_memory(self.device, reserved_before)  # after the profile run: its blocks released
        fraction = config.gpu_memory_fraction or DEFAULT_GPU_MEMORY_FRACTION
        pages = pages_within_budget(fraction, memory, reserve, per_page, -(-positions // config.page_size),
                                    most_pages=default_pages(config, positions), margin=POOL_MARGIN)
        if self.tp is not None:  # the ranks' pools must hold the same pages: the least free GPU sizes them all
            pages = self.tp.least(pages)
        gib = lambda n: round(n / 2**30, 3)  # noqa: E731
        self.memory_plan = {"budget_gib": gib(fraction * memory.total), "weights_gib": gib(memory.weights),
                            "reserve_gib": gib(reserve), "margin_gib": gib(POOL_MARGIN * fraction * memory.total),
                            "pools_gib": gib((pages + 1) * per_page), "pages": pages, "free_gib": gib(memory.free)}
        return config.model_copy(update={"num_pages": pages})

    def _step_reserve(self, config: EngineConfig, head: DraftHead | None) -> int:
        """The bytes the steps need beside weights and pools: measured by a profile run of the largest steps
        on one GPU (``shared/memory/profile.py``), estimated from the shapes under tensor parallelism (whose
        forwards are collectives)."""
        mc = self.model.config
        if self.tp is not None:
            return activation_reserve(mc, config, self.max_context)
        self.load_peak = torch.cuda.max_memory_reserved(self.device)  # the profile resets the peak statistics
        capture = "none" if head is None else ("aux" if head.kind == "eagle3" else "last")
        decodes = self.role != "prefill"  # a prefill engine runs no decode step and captures no graph
        try:
            with self.on_device():
                self.step_peaks = profile_steps(self.model, config, self.max_context, capture,
                                                tuple(getattr(head, "aux_layers", ())), decodes=decodes)
        except torch.OutOfMemoryError as e:
            torch.cuda.empty_cache()  # the failed step's blocks: what is free is what the pools could have
            free, total = torch.cuda.mem_get_info(self.device)
            raise RequestError("gpu_memory_fraction", (
                f"the profile run of the largest steps (a {config.chunk_size or self.max_context}-token chunk, "
                f"{config.max_running} decode rows) ran out of memory with {free / 2**30:.2f} of "
                f"{total / 2**30:.2f} GiB free after the weights: lower chunk_size or max_running, or give the "
                f"engine more of the GPU")) from e
        draft = draft_phase_reserve(head.config if head is not None else mc, config) if decodes else 0
        features = 0 if head is None else mc.hidden_size * max(1, len(getattr(head, "aux_layers", ())))
        outputs = graph_output_reserve(mc, config, features) if decodes else 0
        backlog = draft_backlog_reserve(config, features) if decodes else 0
        mixed = reserve_bytes(mc, config, len(getattr(head, "aux_layers", ())) if capture == "aux" else 0,
                              self.step_peaks.prefill)
        return profiled_reserve(self.step_peaks, graph_target_phases(config) if decodes else 0,
                                draft + outputs + backlog + mixed)

    def on_device(self) -> contextlib.AbstractContextManager:
        """This runner's GPU as the calling thread's current CUDA device (a no-op off CUDA). Triton
        launches, CUDA events, streams and graph capture all use the current device, not the device of
        the tensors they touch: an engine on ``cuda:1`` run from a thread whose current device is 0
        (every new thread's) would launch its kernels and record its events on the wrong GPU."""
        return torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()

    # ---- tensor parallelism: rank 0's calls, replayed by the others (``shared/replay.py``) ----------
    @property
    def distributed(self) -> bool:
        """Whether this runner is one rank of a tensor-parallel group."""
        return self.tp is not None

    @property
    def rank(self) -> int:  # this runner's rank in its group (0 on one rank)
        return 0 if self.tp is None else self.tp.rank

    def send(self, name: str, *args) -> None:
        """On rank 0 of a split group, the call ``name(*args)`` to every other rank, before rank 0 runs it; a
        no-op on one rank and on the others (which run it from ``receive``)."""
        if self.leads:
            self.channel.send((name, *args))

    def receive(self) -> tuple | None:
        """On a rank other than 0, rank 0's next call (``send``); None when its channel ended."""
        return self.channel.receive()

    def leading(self, scheduler: Scheduler) -> Scheduler:
        """The engine's scheduler as rank 0 of a split group uses it: each change to its tables made between
        steps sent to the other ranks, whose books must stay rank 0's (``shared.replay.Leading``)."""
        return Leading(scheduler, self.send) if self.leads else scheduler

    # The hand-off's collectives under tensor parallelism (``shared.handoff.port.SplitPages``): K/V pages
    # between this rank's share of the KV heads and rank 0's staging caches of every head.
    def gather_pages(self, cache: KVCache, pages: list[int]) -> KVCache | None:
        self.send("gather_pages", pages)
        return gather_pages(cache, pages, self.tp)

    def gather_pages_into(self, staging: KVCache | None, first: int, cache: KVCache, pages: list[int]) -> None:
        self.send("gather_pages_into", first, pages)
        gather_pages_into(staging, first, cache, pages, self.tp)

    def scatter_pages(self, staging: KVCache | None, staged: list[int] | None, cache: KVCache,
                      pages: list[int]) -> None:
        self.send("scatter_pages", pages)
        scatter_pages(staging, staged, cache, pages, self.tp)

    def share_pages(self, cache: KVCache, pages: list[int]) -> None:
        self.send("share_pages", next(i for i, c in enumerate(self.caches) if c is cache), pages)
        share_pages(cache, pages, self.tp)

    # ---- a step ----------------------------------------------------------------------------------
    def run(self, plan: StepPlan, shape: str | None = None,
            joins_next: Callable[[list[Request]], bool] | None = None) -> Stepping:
        """The forwards of ``plan``: its prefill chunks and decode rows in one target forward where they can
        share it (a plain engine's step; with a draft, a plain step the policy chose (``shape`` None): the
        chunks of requests arriving while others decode then cost no forward of their own, ~23 ms against
        ~4.6 ms per arriving request at 8B shape on an H100). Before a speculative step, whose verify forward
        has a tree shape of its own, the chunks run in a forward of their own. Every row's draft state is left
        as separate forwards would leave it (``SpecWorker.draft_extend_rows``), so the output is the same.
        ``joins_next(batch)``: whether the next decode step runs a request ``batch`` does not (asked after the
        chunks ran; a draft launched ahead is for this batch only). Returns (request, tokens it committed). Rank 0
        of a split group sends the plan (its request ids and chunk bounds) and ``shape`` to the others first."""
        if self.leads:  # (the plan's description is built only where it is sent)
            self.send("run", described(plan, self.caches), shape)
        w = self.speculator
        if w is not None and (not plan.decode or shape is None):
            w.drop_ahead()  # no speculative step now: a draft launched ahead would be stale or wait in vain
        if plan.empty:
            return []
        if w is None and not plan.prefill and self.decode_graphs.enabled:
            return (yield from self._decode_step(plan.decode))
        if w is None or not plan.decode or (shape is None and plan.prefill):
            return (yield from self._target_step(plan))
        events = (yield from self._target_step(StepPlan(prefill=plan.prefill))) if plan.prefill else []
        if shape is None:
            return events + (yield from self._plain_step(plan.decode))
        w.catch_up(plan.decode)  # the positions plain steps left the draft behind on (``shared/spec/backlog.py``)
        # A prompt completed by this step's chunks decodes from the next step on.
        joins = any(ch.completes_prompt for ch in plan.prefill) or (joins_next is not None and joins_next(plan.decode))
        return events + (yield from w.step(plan.decode, joins, shape))

    def _plain_step(self, reqs: list[Request]) -> Stepping:
        """A plain decode step of an engine with a draft: graph-shaped (padded to a bucket, replayed where
        captured) as a plain engine's, its target forward capturing the draft's features, which wait in the
        draft's backlog (``shared/spec/backlog.py``; without one, the draft runs over the one new position);
        eager (``_target_step``) with the plain graphs off. Both leave the same draft state, so the next
        speculative step is the same."""
        w = self.speculator
        graphs = w.graphs.get("plain")  # an adaptive engine's only
        if graphs is None or not graphs.enabled:
            return (yield from self._target_step(StepPlan(decode=reqs)))
        n = len(reqs)
        rows, lengths, tokens = self._decode_inputs(reqs, graphs.bucket(n) or n)
        logits, feats = graphs(rows, lengths, tokens)
        for req in reqs:
            req.advance(req.kv_len + 1)
        events = yield from self._sample_and_commit(TargetOutput(logits=logits[:n]), reqs)
        if w.backlog is not None:  # after the host's wait (the tokens the draft would read are committed)
            w.leave_behind(reqs, feats)
        else:  # after the host's wait: the device runs it while the next step is planned
            w.plain_extend(reqs, lengths, feats)
        return events

    def _target_step(self, plan: StepPlan) -> Stepping:
        """One target forward over the decode tokens and prefill chunks of ``plan``. With a draft, its
        features extend the draft over every row (a decode row: the one position it wrote)."""
        starts = [req.kv_len for req in plan.decode]
        rows, prefix, q_lens, ids, pos, sample_rows, sampled_reqs = [], [], [], [], [], [], []
        self.cache.reserve_many([req.handles[0] for req in plan.decode], [n + 1 for n in starts])
        for req in plan.decode:
            rows.append(req.handles[0].row), prefix.append(req.kv_len), q_lens.append(1)
            ids.append(req.all_ids[req.kv_len]), pos.append(req.kv_len)
            sample_rows.append(len(ids) - 1), sampled_reqs.append(req)
        for ch in plan.prefill:
            rows.append(ch.req.handles[0].row), prefix.append(ch.start), q_lens.append(ch.end - ch.start)
            ids.extend(ch.req.all_ids[ch.start:ch.end]), pos.extend(range(ch.start, ch.end))
            if ch.samples:
                sample_rows.append(len(ids) - 1), sampled_reqs.append(ch.req)
        positions = torch.tensor(pos, dtype=torch.int64)
        batch = build_forward_batch(self.cache, rows, prefix, q_lens, torch.tensor(ids), positions, positions,
                                    logits_rows=torch.tensor(sample_rows, dtype=torch.int64))
        w = self.speculator
        forward = self.mixed_graphs.forward if self.mixed_graphs.applies(batch) else self.model
        out = forward(batch, self.cache, capture=w.capture_mode if w else "none", aux_layers=w.aux_layers if w else ())
        for req in plan.decode:
            req.advance(req.kv_len + 1)
        for ch in plan.prefill:
            ch.req.advance(ch.end)
        draft = []  # the draft's extend, queued behind the forward before the host waits (its tokens: on the device)
        ahead = None if w is None else lambda sampled: draft.append(
            w.launch_rows(plan.decode, starts, plan.prefill, out, sampled))
        events = yield from self._sample_and_commit(out, sampled_reqs, ahead)
        if w is not None:
            w.finish_rows(draft[0] if draft else w.launch_rows(plan.decode, starts, plan.prefill, out))
        return events

    def _decode_phase(self, rows: torch.Tensor, lengths: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Pure tensor decode forward (graph-capturable): one token per request at its length."""
        batch = build_uniform_batch(self.cache, rows, lengths, 1, 1, tokens, lengths, lengths.unsqueeze(1))
        return self.model(batch, self.cache).logits

    def _decode_step(self, reqs: list[Request]) -> Stepping:
        """A plain engine's decode step through its CUDA graphs."""
        n = len(reqs)
        logits = self.decode_graphs(*self._decode_inputs(reqs, self.decode_graphs.bucket(n) or n))[:n]
        for req in reqs:
            req.advance(req.kv_len + 1)
        return (yield from self._sample_and_commit(TargetOutput(logits=logits), reqs))

    def _decode_inputs(self, reqs: list[Request], bs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A decode step's rows, lengths and tokens ([bs] each, on the device; padding rows are row 0,
        length 0, token 0), the target slot each request writes reserved."""
        self.cache.reserve_many([r.handles[0] for r in reqs], [r.kv_len + 1 for r in reqs])
        # One host-to-device copy for the step's inputs.
        host = torch.zeros(3, bs, dtype=torch.int64, pin_memory=self.device.type == "cuda")
        host[:, :len(reqs)] = torch.tensor([[r.handles[0].row for r in reqs], [r.kv_len for r in reqs],
                                            [r.all_ids[r.kv_len] for r in reqs]], dtype=torch.int64)
        rows, lengths, tokens = host.to(self.device, non_blocking=True)
        return rows, lengths, tokens

    def _sample_and_commit(self, out: TargetOutput, reqs: list[Request],
                           ahead: Callable[[torch.Tensor], None] | None = None) -> Stepping:
        """Sample ``reqs``' next tokens from ``out``; the host waits for them after the one yield (the loop's
        overlap: ``Engine.launch``), then commits them. ``ahead(tokens)``: more device work queued before the
        wait, given the sampled tokens on the device."""
        if not reqs:
            return []
        rows = self.penalty_rows.rows(reqs, out.logits.shape[-1], len(reqs), out.logits.device)
        rows = None if rows is None else add_grammar(rows, reqs)
        logits = out.logits if rows is None else process_logits(out.logits.unsqueeze(1), rows).squeeze(1)
        tokens = sample(logits, [r.params for r in reqs], [r.seed for r in reqs],
                        [r.prompt_len + len(r.output_ids) for r in reqs])
        logp = torch.log_softmax(logits.float(), dim=-1)  # the distribution the tokens were drawn from
        logprobs = logp.gather(1, tokens.unsqueeze(1)).squeeze(1)
        top_n = max((r.params.top_logprobs for r in reqs), default=0)
        top = top_logprobs(logp, top_n) if top_n else None
        if ahead is not None:
            ahead(tokens)
        yield  # the device computes the step: the engine loop publishes and serves meanwhile
        tops = [None] * len(reqs) if top is None else [
            top_pairs(v, i, r.params.top_logprobs) if r.params.top_logprobs else None
            for r, v, i in zip(reqs, top[0].unsqueeze(1).tolist(), top[1].unsqueeze(1).tolist())]
        return [(r, r.commit([t], [lp], tp)) for r, t, lp, tp in zip(reqs, tokens.tolist(), logprobs.tolist(), tops)]

    # ---- CUDA graphs -----------------------------------------------------------------------------
    def capture_graphs(self, policy: SpecPolicy | None = None, timed: bool | None = None) -> int:
        """Capture every enabled CUDA graph of every batch-size bucket now (``Engine.capture_graphs``), on
        padding rows only (request row 0, length 0: the sink page). Under an adaptive ``policy`` with measured
        costs (``timed``: a follower replaying rank 0's capture, which has no policy), then time each shape's
        graphs and the plain step's at each captured batch size: the policy's costs from the first step
        (``shared/spec/graph_costs.py``). Returns how many graphs exist."""
        if self.device.type != "cuda":
            return 0
        if timed is None:  # rank 0: the other ranks warm (and, on a decode engine, capture) with it
            timed = self.role != "prefill" and policy is not None and policy.kind == "adaptive" and isinstance(
                policy.cost, MeasuredCost)
            self.send("capture_graphs", timed)
        self.warm_attention()
        with self.on_device():
            mixed = self.mixed_graphs.capture_all()
        if self.role == "prefill":
            return mixed
        room = self._capture_budget()
        with self.on_device():
            if self.speculator is not None:
                count = self.speculator.capture_graphs(room)
            else:
                g = self.decode_graphs
                if g.capture:
                    for bs in list(g.buckets):
                        if room is not None and not room(bs):
                            g.stop_at(bs)
                            break
                        zeros = torch.zeros(bs, dtype=torch.int64, device=self.device)
                        g(zeros, zeros.clone(), zeros.clone())
                count = len(g.captured_sizes)
            self.graphs_stopped_at = None if room is None else room.stopped_at
            if policy is not None and policy.kind == "adaptive" and count:  # shapes chosen where they are graphed
                policy.graphed = self.speculator.graphed_batches()
            if timed:  # the policy's costs on this device (a follower's are thrown away: rank 0 chooses)
                self.graph_costs = seed_costs(self.speculator, policy.cost if policy is not None else MeasuredCost())
            # Each capture's two eager warm-up runs left their blocks cached for the capture stream, where
            # no other step can reuse them: released, or they would sit beside the default stream's blocks
            # (the reserve counts one eager step's, not two). The graphs' private pools stay.
            torch.cuda.empty_cache()
            return count + mixed

    def warm_attention(self) -> int:
        """Compile the eager attention launches a step may take (``kernels.attention.warm_launches``) for each
        distinct attention of the target and the draft over its cache, before serving: Triton compiles a launch
        the first time its shapes meet, and a step paying it stalls every stream (1.3 s, H100). Returns the
        launches run (none off CUDA)."""
        from kernels.attention import warm_launches

        if self.device.type != "cuda":
            return 0
        pairs = [(m, self.cache) for m in self.model.modules() if isinstance(m, Attention)]
        if self.speculator is not None:
            pairs += [(m, c) for c in self.speculator.caches for m in self.head.modules() if isinstance(m, Attention)]
        seen, launches = set(), 0
        with self.on_device():
            for m, cache in pairs:
                k, v = cache.k[m.cache_layer], cache.v[m.cache_layer]
                split_len = attention_split_len(cache)
                key = (m.num_heads, k.dtype, tuple(k.shape[1:]), k.stride(), v.stride(), m.window, split_len,
                       self.config.dtype)
                if key in seen:
                    continue
                seen.add(key)
                launches += warm_launches(getattr(torch, self.config.dtype), m.num_heads, k, v, split_len, m.window)
        return launches

    def _capture_budget(self) -> CaptureBudget | None:
        """When the pools were sized by the memory fraction: the budget graph captures stop within (past it the
        larger batches run eagerly, and the process stays within the fraction it was given)."""
        if self.memory_plan is None or self.tp is not None:  # ranks must capture the same sizes: not by their own
            return None
        outside = (self.step_peaks.non_torch or 0) if self.step_peaks is not None else 0
        return CaptureBudget(self.device, int(self.memory_plan["budget_gib"] * 2**30), outside)

    def phase_graphs(self) -> list[PhaseGraphs]:
        """The CUDA graph phases ``capture_graphs`` captures (the speculator's, else the target decode's)."""
        return self.speculator.phase_graphs() if self.speculator is not None else [self.decode_graphs]

    def release_graphs(self) -> None:
        """Drop every CUDA graph (steps run eagerly after): a rank does so before it leaves its group."""
        for g in self.phase_graphs():
            g.release()


def resolved_dtype(config: EngineConfig, model: str | Path | LlamaForCausalLM) -> EngineConfig:
    """``config`` with ``dtype="auto"`` resolved for the target ``model`` (``resolve_dtype``: the checkpoint's
    own dtype on a GPU when it is half, else bfloat16; float32 on the CPU), logged as a ``dtype_resolved`` event.
    A target passed in built keeps its weights' dtype: the caches and the draft head are made to match it. Every
    tensor-parallel rank resolves alike (the same checkpoint, the same kind of device)."""
    if config.dtype != "auto":
        return config
    if isinstance(model, LlamaForCausalLM):
        stored = str(model.lm_head.weight.dtype).removeprefix("torch.")  # never FP8: the LM head stays unquantized
        dtype = stored if stored in DTYPES else resolve_dtype("auto", config.device, None)
    else:
        stored = checkpoint_dtype(model)
        dtype = resolve_dtype("auto", config.device, stored)
    resolved = config.model_copy(update={"dtype": dtype})
    fields = {"configured": "auto", "dtype": resolved.dtype, "checkpoint": stored, "device": config.device}
    log.info("dtype_resolved", extra={"event": "dtype_resolved", "fields": fields})
    return resolved
