"""The single-process engine: continuous batching, chunked prefill, optional EAGLE speculation.

``Engine.generate`` is the Python API. The services drive the same engine from their engine loop
(``services/engine_loop.py``) through the narrow API of the last two sections: ``add_request`` and
``step`` (prefill), ``reserve_handoff`` / ``page_sink`` / ``activate_handoff`` and ``step`` (decode),
``prefilled`` / ``page_source`` / ``handoff_increment`` / ``release`` (the prefill side
of a hand-off, which starts with the prompt's first chunk), ``release`` with an
identity check for aborts, and ``load``, the snapshot the loop publishes after each step. The requests
themselves belong to the scheduler (``shared/scheduler.py``): the engine asks it to create, move and
retire them.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import time
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

import torch

from shared.config import DEFAULT_GPU_MEMORY_FRACTION, EngineConfig, SpecConfig
from shared.cuda_graphs import CaptureFailure, PhaseGraphs
from shared.errors import RequestError
from shared.forward_batch import build_forward_batch, build_uniform_batch
from shared.grammar import GrammarCompiler
from shared.handoff.port import HandoffPort, landing_pages
from shared.logits_process import RowsCache, add_grammar, process_logits
from shared.memory.kv_cache import KVCache, flush_tables
from shared.memory.prefix_cache import PrefixCache
from shared.memory.profile import profile_steps
from shared.memory.sizing import (
    POOL_MARGIN,
    activation_reserve,
    default_pages,
    device_memory,
    draft_phase_reserve,
    graph_target_phases,
    make_cache,
    page_bytes,
    pages_within_budget,
    profiled_reserve,
)
from shared.model.drafts import DraftHead, load_draft
from shared.model.llama import LlamaForCausalLM, TargetOutput
from shared.model.loader import load_target
from shared.model.shard_loader import load_target_shard, read_lm_head
from shared.model.tokenizer import Tokenizer
from shared.parallel import (
    TPGroup,
    local_config,
    rank_device,
    shard_target,
)
from shared.request import Request, Stage
from shared.sampling import SamplingParams, request_seed, sample, top_logprobs, top_pairs
from shared.scheduler import Scheduler, StepPlan
from shared.spec.graph_costs import seed_costs
from shared.spec.policy import MeasuredCost, SpecPolicy
from shared.spec.state import DraftState
from shared.spec.stats import SpecRecorder
from shared.spec.token_counts import SpecTokenCounts
from shared.spec.worker import SpecWorker
from shared.stepping import Events, Stepping, drive


@dataclass
class GenerationResult:
    rid: str
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]  # with params.top_logprobs: each token's alternatives
    text: str | None
    finish_reason: str
    stop_str: str | None  # the stop string that ended the generation, if one did
    ttft_s: float
    latency_s: float
    spec_stats: dict | None  # the request's speculative statistics (SpecStats.as_dict), None without a draft
    cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache (not computed)

    def as_json(self) -> dict:
        return {"request_id": self.rid, "token_ids": self.token_ids, "text": self.text,
                "finish_reason": self.finish_reason, "stop_str": self.stop_str, "prompt_tokens": len(self.prompt_ids),
                "cached_tokens": self.cached_tokens,
                "timing": {"ttft_s": round(self.ttft_s, 6), "latency_s": round(self.latency_s, 6)},
                **({"spec": self.spec_stats} if self.spec_stats is not None else {})}


@dataclass(frozen=True)
class EngineLoad:
    """What an engine holds: the snapshot its loop publishes after each step and call, read from any
    thread by health, metrics, the registry's placement figures and the decode service's refusals."""

    running: int  # requests holding pages
    queued: int  # requests waiting for admission
    prefill_tokens: int  # prompt tokens still to prefill, running and queued requests
    decode_tokens: int  # tokens the running requests may still generate (max_new_tokens left)
    free_pages: tuple[int, ...]  # per cache, target first
    total_pages: tuple[int, ...]  # per cache, target first
    draft_ahead: dict[str, int] = field(default_factory=dict)  # drafts launched ahead, by outcome
    graph_failures: tuple[CaptureFailure, ...] = ()  # CUDA graphs that failed to capture (phase eager)
    spec_tokens: SpecTokenCounts | None = None  # token-level speculation counts so far (None without a draft)
    spec_shape_tokens: dict[str, SpecTokenCounts] = field(default_factory=dict)  # the same per tree shape
    spec_steps: dict[str, int] = field(default_factory=dict)  # decode steps per shape and "plain" (with a draft)
    # With a prefix cache: prompt tokens looked up and found so far, and the pages it holds now (per cache)
    prefix_queries: int = 0
    prefix_hits: int = 0
    prefix_pages: int = 0


class InFlight:
    """A step whose device work is queued (``Engine.launch``): ``finish`` waits for it and commits."""

    __slots__ = ("engine", "running", "events")

    def __init__(self, engine: Engine, running: Stepping | None, events: Events | None = None):
        self.engine, self.running, self.events = engine, running, events

    def finish(self) -> Events:
        """Wait for the step's device work, commit its tokens and retire the requests it ended."""
        if self.running is not None:
            with self.engine.on_device():
                self.events = drive(self.running)
            self.running = None
        return self.events


class Engine:
    def __init__(self, model: str | Path | LlamaForCausalLM, draft: str | Path | None = None,
                 config: EngineConfig | None = None, tokenizer: Tokenizer | None = None,
                 role: str = "both", tp: TPGroup | None = None):
        """``tp``: this rank's tensor-parallel group when ``config.tensor_parallel`` > 1 (``shared/parallel.py``);
        every rank builds its engine alike and calls the same methods, rank 0's arguments winning."""
        if role not in ("both", "prefill", "decode"):
            raise ValueError(f"role must be both, prefill or decode, got {role!r}")
        self.role = role
        config = config or EngineConfig()
        if (tp.size if tp is not None else 1) != config.tensor_parallel:
            raise ValueError(f"tensor_parallel={config.tensor_parallel} needs a group of that many ranks "
                             f"(got {tp.size if tp is not None else 'none'})")
        self.tp = tp
        if tp is not None:  # rank r takes the r-th GPU from the configured one
            config = config.model_copy(update={"device": rank_device(config.device, tp.rank)})
        if role == "decode" and not config.shareable_kv:  # a same-host prefill writes into its pools
            config = config.model_copy(update={"shareable_kv": True})
        self.config = config
        self.device = torch.device(config.device)
        if config.device.startswith("cuda") and not torch.cuda.is_available():
            raise RequestError("device", "cuda was asked for but no CUDA device is available")
        reserved = torch.cuda.memory_reserved(self.device) if self.device.type == "cuda" else 0  # before the weights
        self.model, lm_head = self._load_target(model, config, tp)
        if tokenizer is None and not isinstance(model, LlamaForCausalLM) and (Path(model) / "tokenizer.json").exists():
            tokenizer = Tokenizer(model)
        self.tokenizer = tokenizer
        mc = self.model.config
        self.max_context = min(config.max_context or mc.max_position_embeddings, mc.max_position_embeddings)
        head = draft if draft is None or isinstance(draft, DraftHead) else load_draft(
            draft, self.model, config.dtype, config.device, lm_head)  # before the pools: sized after the weights
        if tp is not None:  # a target passed in whole: split after the draft's load, which may copy its LM head
            shard_target(self.model, tp, self.device)
        self.load_peak, self.step_peaks = 0, None  # on one GPU: set by the profile run (``_step_reserve``)
        self.memory_plan: dict | None = None  # on a GPU without num_pages: the figures the pools were sized by
        self.config = config = self._fit_pools(config, head, reserved)
        self.cache = make_cache(local_config(mc, tp), mc.num_hidden_layers, config, self.max_context)
        self.graph_failures: list[CaptureFailure] = []  # CUDA graphs that failed to capture (phase eager)
        self.penalty_rows = RowsCache()  # requests' penalty rows, on the device across steps (and the speculator's)
        self.speculator = None if head is None else SpecWorker.load(
            head, self.model, self.cache, config, self.max_context, self.graph_failures, self.penalty_rows)
        self._decode_end: float | None = None  # when the last decode step ended (the policy's step costs)
        self.graph_costs: dict[tuple[str, int], float] = {}  # (kind, batch) -> seconds, timed at capture
        self.spec_policy = None if head is None else SpecPolicy.of(
            config.spec_policy, [s.spec for s in self.speculator.shapes.values()], MeasuredCost())
        caches = [self.cache] + (self.speculator.caches if self.speculator else [])
        # With a draft, a cached page's key carries the token after it (the draft's K/V depends on it).
        self.prefix_cache = PrefixCache(caches, successor=head is not None) if config.prefix_cache else None
        self.scheduler = Scheduler(caches, config.max_running, config.chunk_size, config.headroom,
                                   eos_ids=mc.eos_token_ids, prefill_only=role == "prefill", tokenizer=tokenizer,
                                   grammars=GrammarCompiler(tokenizer, mc.vocab_size, mc.eos_token_ids)
                                   if tokenizer is not None else None, prefix_cache=self.prefix_cache)
        self.handoff = HandoffPort(self, config, mc.vocab_size, mc.num_key_value_heads, tp, self._landing_pages(config),
                                   head, self.speculator.spec if self.speculator else None)
        # The per-request tables beside the scheduler's go with the request (``Scheduler.retire``).
        self.scheduler.on_retire += [self.penalty_rows.release, self.handoff.forget] + (
            [self.speculator.ahead.forget] if self.speculator else [])
        graphs_on = set(config.cuda_graph_phases) if config.cuda_graph else set()
        self.decode_graphs = PhaseGraphs("decode", self._decode_phase, "decode" in graphs_on, config.cuda_graph_max_bs,
                                         self.graph_failures, before_replay=lambda: flush_tables([self.cache]))
        self._ids = itertools.count()

    @staticmethod
    def _load_target(model: str | Path | LlamaForCausalLM, config: EngineConfig, tp: TPGroup | None
                     ) -> tuple[LlamaForCausalLM, Callable | None]:
        """The target (under tensor parallelism from a checkpoint: this rank's share only, read slice by slice)
        and, then, a reader of the whole target's LM head for a draft that copies it (else None)."""
        if isinstance(model, LlamaForCausalLM):
            return model, None
        if tp is None:
            return load_target(model, config.dtype, config.device), None
        return load_target_shard(model, tp, config.dtype, config.device), functools.partial(read_lm_head, model)

    def _landing_pages(self, config: EngineConfig) -> int:
        """The hand-off port's landing cache's pages (``shared.handoff.port.landing_pages``)."""
        return landing_pages(self.tp, self.role, self.max_context + config.headroom, config.page_size)

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
        landing = self._landing_pages(config) * page_bytes(mc, mc.num_hidden_layers, config)  # whole heads
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
        return profiled_reserve(self.step_peaks, graph_target_phases(config) if decodes else 0, draft)

    @property
    def requests(self) -> Mapping[str, Request]:
        """Every request of this engine by id, read-only (the scheduler's table)."""
        return MappingProxyType(self.scheduler.requests)

    @property
    def spec_stats(self) -> SpecRecorder | None:
        """The speculative statistics (None without a draft)."""
        return self.speculator.stats if self.speculator is not None else None

    # ---- requests --------------------------------------------------------------------------------
    def validate_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("prompt", "text prompts need a tokenizer.json beside the model")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise RequestError("prompt", "the prompt is empty")
        vocab = self.model.config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise RequestError("prompt", f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
        if len(ids) >= self.max_context:
            raise RequestError("prompt", f"{len(ids)} tokens do not fit the context of {self.max_context}")
        return ids

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    rid: str | None = None, output_ids: list[int] = (), output_logprobs: list[float] = ()) -> Request:
        """Queue a request; with ``output_ids`` (and their logprobs), one resuming after the output tokens a
        client already has (a failover): its prefill computes them too and samples nothing, so the next
        token is drawn where and as the request's first run would have drawn it. Under tensor parallelism
        every rank calls this, and rank 0's request (its prompt, parameters with the seed rank 0 chose, id)
        or rank 0's refusal is every rank's."""
        if self.tp is None:
            return self.scheduler.submit(*self._checked(prompt, params, rid, output_ids, output_logprobs))
        agreed = None
        if self.tp.rank == 0:
            try:
                agreed = ("ok", *self._checked(prompt, params, rid, output_ids, output_logprobs))
            except RequestError as e:
                agreed = ("refused", e.field, str(e).removeprefix(f"{e.field}: "))
        agreed = self.tp.broadcast(agreed)
        if agreed[0] == "refused":
            raise RequestError(agreed[1], agreed[2])
        return self.scheduler.submit(*agreed[1:])

    def _checked(self, prompt: str | list[int], params: SamplingParams | None, rid: str | None,
                 output_ids: list[int] = (), output_logprobs: list[float] = ()) -> tuple:
        """The request's id, prompt ids, parameters (under tensor parallelism with a seed: rank 0's
        choice, drawn by every rank alike) and resumed outputs; a ``RequestError`` naming the field at fault."""
        params = params or SamplingParams()
        params = self._seeded(params)
        ids = self.validate_prompt(prompt)
        self._check_resume(output_ids, output_logprobs, params)
        if len(ids) + params.max_new_tokens > self.max_context:
            raise RequestError("max_new_tokens", f"prompt ({len(ids)}) + max_new_tokens "
                               f"({params.max_new_tokens}) exceeds the context of {self.max_context}")
        bad = next((t for t in params.token_ids_used() if not 0 <= t < self.model.config.vocab_size), None)
        if bad is not None:
            raise RequestError("sampling", f"token id {bad} is outside the vocabulary")
        rid = rid or f"req-{next(self._ids)}"
        if self.scheduler.get(rid) is not None:
            raise RequestError("request_id", f"{rid!r} is already running")
        return rid, ids, params, list(output_ids), list(output_logprobs)

    def _check_resume(self, output_ids: list[int], output_logprobs: list[float], params: SamplingParams) -> None:
        if len(output_logprobs) != len(output_ids):
            raise RequestError("resume_logprobs", f"{len(output_logprobs)} logprobs for {len(output_ids)} tokens")
        if len(output_ids) >= params.max_new_tokens:
            raise RequestError("resume_ids", f"{len(output_ids)} tokens leave none of max_new_tokens "
                                             f"({params.max_new_tokens}) to generate")
        bad = next((t for t in output_ids if not 0 <= t < self.model.config.vocab_size), None)
        if bad is not None:
            raise RequestError("resume_ids", f"token id {bad} is outside the vocabulary")

    def _seeded(self, params: SamplingParams) -> SamplingParams:
        """Under tensor parallelism, ``params`` with a seed (the request's own, or one chosen here, on rank 0)."""
        if self.tp is None or params.seed is not None:
            return params
        return params.model_copy(update={"seed": request_seed(params)})

    def abort(self, rid: str, reason: str = "abort") -> bool:
        """End request ``rid`` now and free its pages; False when no such request runs."""
        req = self.scheduler.get(rid)
        return req is not None and self.release(req, reason)

    def release(self, req: Request, reason: str = "handed_off") -> bool:
        """End ``req`` now and free its pages: after the decode side acknowledged its hand-off, or on an
        abort or failure (``reason``). False when ``req`` is no longer this engine's: it ended, or a
        request re-placed under its id took its place."""
        if not self.scheduler.holds(req):
            return False
        self.scheduler.retire(req, reason)
        return True

    def holds(self, req: Request) -> bool:
        """Whether ``req`` is still this engine's request (not ended, nor replaced by one under its id)."""
        return self.scheduler.holds(req)

    def live_requests(self) -> list[Request]:
        """Every request not yet ended, waiting or running."""
        return list(self.scheduler.requests.values())

    # ---- stepping --------------------------------------------------------------------------------
    def on_device(self) -> contextlib.AbstractContextManager:
        """This engine's GPU as the calling thread's current CUDA device (a no-op off CUDA). Triton
        launches, CUDA events, streams and graph capture all use the current device, not the device of
        the tensors they touch: an engine on ``cuda:1`` run from a thread whose current device is 0
        (every new thread's) would launch its kernels and record its events on the wrong GPU."""
        return torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()

    def has_work_to_step(self) -> bool:
        """Whether a step would run a forward (requests waiting on a transfer need none)."""
        return self.scheduler.has_work_to_step()

    def step(self) -> list[tuple[Request, list[int]]]:
        """Run one scheduling step; returns (request, tokens it committed) for each request touched."""
        return self.launch().finish()

    def launch(self) -> InFlight:
        """Run the next step up to its host wait: its device work is queued, its tokens not yet known. The
        engine loop publishes the previous step's tokens and serves what may run beside a step in flight
        (``EngineLoop.call_soon``), then ``finish``es it."""
        with self.on_device():
            running = self._step()
            try:
                next(running)
            except StopIteration as done:  # nothing to wait for (an empty plan)
                return InFlight(self, None, done.value)
        return InFlight(self, running)

    def _step(self) -> Stepping:
        """One step: the plan's prefill chunks and decode rows in one target forward where they can share it
        (a plain engine's step, an engine with a draft whose policy picks a plain step: ``_run_with_draft``)."""
        plan = self.scheduler.schedule()
        if self.tp is not None:
            self.tp.agree(self._plan_digest(plan), "the step plan")
        if self.speculator is not None and not plan.decode:
            self.speculator.drop_ahead()  # no decode step now: a draft launched ahead would wait in vain
        if plan.empty:
            return []
        if self.speculator is None and not plan.prefill and self.decode_graphs.enabled:
            events = yield from self._run_decode_step(plan.decode)
        elif self.speculator is None:
            events = yield from self._run_target_step(plan)
        else:
            events = yield from self._run_with_draft(plan)
        for req, _ in events:
            if req.finish_reason is not None and req.stage is not Stage.FINISHED:
                self.scheduler.retire(req)
        return events

    def _plan_digest(self, plan: StepPlan) -> int:
        """A checksum of what a step does and of the pools it starts from (the ranks compare them)."""
        key = ([(r.rid, r.kv_len) for r in plan.decode], [(c.req.rid, c.start, c.end) for c in plan.prefill],
               [c.num_free_pages for c in self.scheduler.caches])
        return zlib.crc32(repr(key).encode())

    def _run_with_draft(self, plan: StepPlan) -> Stepping:
        """A step of an engine with a draft. When the policy picks a plain decode step, the prefill chunks
        of requests arriving while others decode run in its target forward, as a plain engine's step does:
        one forward, not a prefill forward and then a decode one (on an H100 at 8B shape, ~23 ms per arriving
        request against a plain engine's ~4.6 ms). Before a speculative step (whose verify forward has a tree
        shape of its own) they run in a forward of their own. Every row's draft state is left as the
        separate forwards would leave it (``SpecWorker.draft_extend_rows``), so the output is unchanged."""
        if not plan.decode:
            self._decode_end = None
            return (yield from self._run_target_step(plan))
        shape = self._choose_shape(plan.decode)
        if shape is None and plan.prefill:
            self.speculator.drop_ahead()  # a draft launched ahead is stale after a plain step
            events = yield from self._run_target_step(plan)
            self._ran("plain", len(plan.decode), timed=False)  # a prefill's rows in it: not a plain step's time
            return events
        events = (yield from self._run_target_step(StepPlan(prefill=plan.prefill))) if plan.prefill else []
        # Timed for the policy only without a prefill before it (see ``SpecPolicy.ran``).
        return events + (yield from self._run_spec_or_plain(plan.decode, shape, timed=not plan.prefill))

    def _choose_shape(self, reqs: list[Request]) -> str | None:
        """The shape the policy picks for a decode step of ``reqs``, None for a plain step
        (``shared/spec/policy.py``); under tensor parallelism rank 0's, as the choice is timed. A sampled request
        with its own seed pins the configured shape while it runs: its draws follow the shape, and its seed
        promises one output in any batch."""
        pinned = self.spec_policy.kind != "fixed" and any(r.params.seed is not None and not r.params.greedy
                                                          for r in reqs)
        shape = self.spec_policy.choose(len(reqs), pinned=pinned)
        if self.tp is not None and self.config.spec_policy != "fixed":
            shape = self.tp.broadcast(shape)
        return shape

    def _run_spec_or_plain(self, reqs: list[Request], shape: str | None, timed: bool = True) -> Stepping:
        """A speculative decode step of ``shape``, or a plain one (None); each is timed for the policy's
        costs, and a speculative step's acceptance counted."""
        policy, counts = self.spec_policy, self.speculator.stats.tokens
        if shape is not None:
            drafts, reached = counts.drafts, list(counts.accepted_per_pos)
            events = yield from self.speculator.step(reqs, self.scheduler.joins_next(reqs), shape)
            policy.observe(shape, counts.drafts - drafts, [a - b for a, b in zip(counts.accepted_per_pos, reached)])
        else:
            self.speculator.drop_ahead()  # a draft launched ahead is stale after a plain step
            events = yield from self._run_plain_step(reqs)
        self._ran(shape or "plain", len(reqs), timed)
        return events

    def _ran(self, kind: str, batch: int, timed: bool) -> None:
        """Tell the policy a decode step of ``kind`` ran; this decode step ends now. A kind's cost is the time
        from one decode step's end to the next's: everything a step of it costs the loop (the host's work on
        its tokens, the caller's between steps), not only its own call."""
        now, last = time.perf_counter(), self._decode_end
        self._decode_end = now
        self.spec_policy.ran(kind, batch, 0.0 if last is None else now - last, timed and last is not None)

    def _run_plain_step(self, reqs: list[Request]) -> Stepping:
        """A plain decode step of an engine with a draft: graph-shaped (padded to a bucket, replayed where
        captured) as a plain engine's, its target forward capturing the draft's features, then the draft
        over the one new position; eager (``_run_target_step``) with the plain graphs off. Both leave the
        same draft state, so the next speculative step is the same."""
        w = self.speculator
        graphs = w.graphs.get("plain")  # an adaptive engine's only
        if graphs is None or not graphs.enabled:
            return (yield from self._run_target_step(StepPlan(decode=reqs)))
        n = len(reqs)
        rows, lengths, tokens = self._decode_inputs(reqs, graphs.bucket(n) or n)
        logits, feats = graphs(rows, lengths, tokens)
        for req in reqs:
            req.advance(req.kv_len + 1)
        events = yield from self._sample_and_commit(TargetOutput(logits=logits[:n]), reqs)
        w.plain_extend(reqs, lengths, feats)  # after the host's wait: the device runs it while the next step is planned
        return events

    def _run_target_step(self, plan: StepPlan) -> Stepping:
        """One target forward over the decode tokens and prefill chunks of ``plan``. With a draft, its
        features extend the draft over every row (a decode row: the one position it wrote)."""
        starts = [req.kv_len for req in plan.decode]
        rows, prefix, q_lens, ids, pos, sample_rows, sampled_reqs = [], [], [], [], [], [], []
        for req in plan.decode:
            self.cache.reserve(req.handles[0], req.kv_len + 1)
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
        capture = self.speculator.capture_mode if self.speculator is not None else "none"
        aux_layers = self.speculator.aux_layers if self.speculator else ()
        out = self.model(batch, self.cache, capture=capture, aux_layers=aux_layers)
        for req in plan.decode:
            req.advance(req.kv_len + 1)
        for ch in plan.prefill:
            ch.req.advance(ch.end)
        events = yield from self._sample_and_commit(out, sampled_reqs)
        if self.speculator is not None:
            self.speculator.draft_extend_rows(plan.decode, starts, plan.prefill, out)
        for ch in plan.prefill:
            self.scheduler.cache_prefix(ch.req)  # its completed pages, target and draft K/V written
            if ch.completes_prompt:
                self.scheduler.prompt_done(ch.req)
            elif not any(r is ch.req for r, _ in events):
                events.append((ch.req, []))
        return events

    def _decode_phase(self, rows: torch.Tensor, lengths: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Pure tensor decode forward (graph-capturable): one token per request at its length."""
        batch = build_uniform_batch(self.cache, rows, lengths, 1, 1, tokens, lengths, lengths.unsqueeze(1))
        return self.model(batch, self.cache).logits

    def _run_decode_step(self, reqs: list[Request]) -> Stepping:
        n = len(reqs)
        logits = self.decode_graphs(*self._decode_inputs(reqs, self.decode_graphs.bucket(n) or n))[:n]
        for req in reqs:
            req.advance(req.kv_len + 1)
        return (yield from self._sample_and_commit(TargetOutput(logits=logits), reqs))

    def _decode_inputs(self, reqs: list[Request], bs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A decode step's rows, lengths and tokens ([bs] each, on the device; padding rows are row 0,
        length 0, token 0), the target slot each request writes reserved."""
        for req in reqs:
            self.cache.reserve(req.handles[0], req.kv_len + 1)
        # One host-to-device copy for the step's inputs.
        host = torch.zeros(3, bs, dtype=torch.int64, pin_memory=self.device.type == "cuda")
        host[:, :len(reqs)] = torch.tensor([[r.handles[0].row for r in reqs], [r.kv_len for r in reqs],
                                            [r.all_ids[r.kv_len] for r in reqs]], dtype=torch.int64)
        rows, lengths, tokens = host.to(self.device, non_blocking=True)
        return rows, lengths, tokens

    def _sample_and_commit(self, out: TargetOutput, reqs: list[Request]) -> Stepping:
        """Sample ``reqs``' next tokens from ``out``; the host waits for them after the one yield (the loop's
        overlap: ``launch``), then commits them."""
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
        yield  # the device computes the step: the engine loop publishes and serves meanwhile
        tops = [None] * len(reqs) if top is None else [
            top_pairs(v, i, r.params.top_logprobs) if r.params.top_logprobs else None
            for r, v, i in zip(reqs, top[0].unsqueeze(1).tolist(), top[1].unsqueeze(1).tolist())]
        return [(r, r.commit([t], [lp], tp)) for r, t, lp, tp in zip(reqs, tokens.tolist(), logprobs.tolist(), tops)]

    # ---- disaggregation: the hand-off's port (``shared/handoff/port.py``) -------------------------
    @property
    def caches(self) -> list[KVCache]:
        """The engine's KV caches, target first (the port's page API)."""
        return self.scheduler.caches

    def page_ids(self, req: Request) -> list[list[int]]:
        """Per cache (target first), the request's page ids in position order."""
        return [cache.pages_of(h, 0, cache.pages_for(h.reserved))
                for cache, h in zip(self.scheduler.caches, req.handles)]

    def activate(self, req: Request, committed_len: int, draft_state: DraftState | None,
                 output_ids: list[int], output_logprobs: list[float]) -> None:
        """The port's page API: ``req``'s K/V is in its pages; it resumes decoding (the scheduler's move)."""
        self.scheduler.activate(req, committed_len, draft_state, output_ids, output_logprobs)

    def handoff_schema(self):
        """What this engine's hand-offs carry; the other side of a hand-off must agree on all of it."""
        return self.handoff.schema

    def prefilled(self) -> list[Request]:
        """Prefill role: requests whose prompt K/V is (partly) computed, still prefilling or parked for
        their hand-off: each one's hand-off may start (``page_source(req, fed=True)``)."""
        return self.scheduler.prefilled()

    def starts_next(self, req: Request) -> bool:
        """Prefill role: whether waiting ``req``'s first chunk runs in the next step (its hand-off may start
        now: the decode side's reservation then overlaps what is left of this step)."""
        return self.scheduler.starts_next(req)

    def page_source(self, req: Request, fed: bool = False):
        """Prefill role: the sending side of ``req``'s hand-off (``HandoffPort.page_source``)."""
        return self.handoff.page_source(req, fed)

    def handoff_increment(self, req: Request):
        """Prefill role: ``req``'s pages completed so far (``HandoffPort.increment``)."""
        return self.handoff.increment(req)

    def reserve_handoff(self, rid: str, prompt_ids: list[int], output_ids: list[int],
                        output_logprobs: list[float], params: SamplingParams, committed_len: int) -> Request | None:
        """Decode role: claim pages for a request about to arrive; None when it cannot be held now. Under
        tensor parallelism every rank calls this, and rank 0's arguments (its seed chosen) are every rank's."""
        if self.tp is not None:
            rid, prompt_ids, output_ids, output_logprobs, params, committed_len = self.tp.broadcast(
                (rid, prompt_ids, output_ids, output_logprobs, params and self._seeded(params), committed_len))
        if self.scheduler.get(rid) is not None:
            raise RequestError("request_id", f"{rid!r} is already here")
        return self.scheduler.admit_handoff(rid, prompt_ids, output_ids, output_logprobs, params, committed_len)

    def page_sink(self, req: Request, guard, in_place: bool = False):
        """Decode role: the receiving side of ``req``'s transfer (``HandoffPort.page_sink``)."""
        return self.handoff.page_sink(req, guard, in_place)

    def kv_pools(self) -> list[torch.Tensor]:
        """Per cache, the K/V pool a decode engine exports to a same-host prefill (``HandoffPort.pools``)."""
        return self.handoff.pools()

    def activate_handoff(self, req: Request, committed_len: int, draft_state: DraftState | None = None,
                         output_ids: list[int] = (), output_logprobs: list[float] = ()) -> bool:
        """Decode role: the K/V has arrived, ``req`` resumes decoding (``HandoffPort.activate``); False when
        it is no longer this engine's request waiting for its K/V (it was aborted)."""
        return self.handoff.activate(req, committed_len, draft_state, output_ids, output_logprobs)

    # ---- what the engine holds -------------------------------------------------------------------
    def load(self) -> EngineLoad:
        """The snapshot the engine loop publishes after each step (computed on the engine's thread)."""
        s = self.scheduler
        return EngineLoad(
            running=len(s.running), queued=len(s.waiting),
            prefill_tokens=sum(r.prompt_len - r.kv_len for r in [*s.running, *s.waiting]),
            decode_tokens=sum(max(0, r.params.max_new_tokens - len(r.output_ids)) for r in s.running),
            free_pages=tuple(c.num_free_pages for c in s.caches),
            total_pages=tuple(c.layout.num_pages for c in s.caches),
            draft_ahead=self.speculator.ahead.counts() if self.speculator is not None else {},
            graph_failures=tuple(self.graph_failures),
            spec_tokens=self.speculator.stats.tokens.copy() if self.speculator is not None else None,
            spec_shape_tokens={n: c.copy() for n, c in self.speculator.stats.by_shape.items()}
            if self.speculator is not None else {},
            spec_steps=self.spec_policy.steps_by_kind() if self.spec_policy is not None else {},
            **self._prefix_load())

    def _prefix_load(self) -> dict:
        """The prefix cache's figures in the load snapshot (none without one)."""
        pc = self.prefix_cache
        return {} if pc is None else dict(prefix_queries=pc.lookups, prefix_hits=pc.hits, prefix_pages=len(pc))

    def flush_prefix_cache(self) -> int:
        """Evict every cached page no request holds (none without a prefix cache); how many pages, per cache."""
        return self.prefix_cache.flush() if self.prefix_cache is not None else 0

    def is_idle_and_clean(self) -> bool:
        """True when no request runs and every cache is full again (the no-leak invariant)."""
        return (not self.scheduler.has_work() and all(c.is_full() for c in self.scheduler.caches)
                and self.handoff.is_clean())

    # ---- the Python API --------------------------------------------------------------------------
    def run_until_done(self, max_steps: int | None = None) -> None:
        for _ in range(max_steps) if max_steps else itertools.count():
            if not self.scheduler.has_work():
                return
            self.step()

    def generate(self, prompts: list[str | list[int]] | str | list[int],
                 params: SamplingParams | list[SamplingParams] | None = None) -> list[GenerationResult]:
        single = isinstance(prompts, str) or (prompts and isinstance(prompts[0], int))
        prompts = [prompts] if single else list(prompts)
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        reqs = []
        try:
            for p, sp in zip(prompts, plist):
                reqs.append(self.add_request(p, sp))
        except RequestError:
            for r in reqs:
                self.abort(r.rid)
            raise
        self.run_until_done()
        return [self.result(r) for r in reqs]

    def result(self, req: Request) -> GenerationResult:
        text = self.tokenizer.decode(req.output_ids) if self.tokenizer else None
        if req.text is not None:  # cut at its stop string
            req.text.push([], final=True)
            text = req.text.text
        end = req.t_finish or time.perf_counter()
        return GenerationResult(
            rid=req.rid, prompt_ids=req.prompt_ids, token_ids=list(req.output_ids),
            logprobs=list(req.output_logprobs), top_logprobs=list(req.output_top_logprobs),
            text=text, finish_reason=req.finish_reason or "abort",
            stop_str=req.stop_str,
            ttft_s=(req.t_first_token or end) - req.t_arrival, latency_s=end - req.t_arrival,
            spec_stats=req.stats.as_dict() if self.speculator is not None else None,
            cached_tokens=req.cached_tokens,
        )

    def capture_graphs(self) -> int:
        """Capture every enabled CUDA graph of every batch-size bucket now, so serving starts without
        capture pauses (the services do this while /health says ``capturing``). Runs on padding rows
        only (request row 0, length 0: the sink page), as capture always does. Returns how many graphs
        exist afterwards; nothing happens off CUDA, nor on a prefill engine (it runs no decode step: its pools
        were sized without graph memory). An adaptive engine then times each shape's graphs and the plain
        step's at each captured batch size: its policy's costs from the first step (``shared/spec/graph_costs.py``)."""
        if self.device.type != "cuda" or self.role == "prefill":
            return 0
        with self.on_device():
            count = self._capture_graphs()
            policy = self.spec_policy
            if policy is not None and policy.kind == "adaptive" and isinstance(policy.cost, MeasuredCost):
                self.graph_costs = seed_costs(self.speculator, policy.cost)  # the policy's costs on this device
            # Each capture's two eager warm-up runs left their blocks cached for the capture stream, where
            # no other step can reuse them: released, or they would sit beside the default stream's blocks
            # (the reserve counts one eager step's, not two). The graphs' private pools stay.
            torch.cuda.empty_cache()
            return count

    def phase_graphs(self) -> list[PhaseGraphs]:
        """The CUDA graph phases ``capture_graphs`` captures (the speculator's, else the target decode's)."""
        return self.speculator.phase_graphs() if self.speculator is not None else [self.decode_graphs]

    def graph_capture_s(self) -> dict[str, float]:
        """Seconds spent capturing each phase's CUDA graphs so far, by phase (those with a graph)."""
        return {g.name: round(g.capture_s, 3) for g in self.phase_graphs() if g.captured_sizes}

    def _capture_graphs(self) -> int:
        if self.speculator is not None:
            return self.speculator.capture_graphs()
        g = self.decode_graphs
        if g.capture:
            for bs in g.buckets:
                zeros = torch.zeros(bs, dtype=torch.int64, device=self.device)
                g(zeros, zeros.clone(), zeros.clone())
        return len(g.captured_sizes)
