"""The single-process engine: continuous batching, chunked prefill, optional EAGLE speculation.

A step: the scheduler plans it (``shared/scheduler.py``), the policy picks its kind (a speculative shape, or
plain: ``shared/spec/policy.py``), the model runner runs it (``shared/model_runner.py``: the device, the
graphs, tensor parallelism), and the scheduler commits what it did.

``Engine.generate`` is the Python API. The services drive the same engine from their engine loop
(``services/engine_loop.py``) through the narrow API of the last sections: ``add_request`` and ``step``
(prefill), ``reserve_handoff`` / ``page_sink`` / ``activate_handoff`` and ``step`` (decode), ``prefilled`` /
``page_source`` / ``handoff_increment`` / ``release`` (the prefill side of a hand-off, which starts with the
prompt's first chunk), ``release`` with an identity check for aborts, and ``load``, the snapshot the loop
publishes after each step. The requests themselves belong to the scheduler: the engine asks it to create,
move and retire them.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType

from shared.config import EngineConfig
from shared.cuda_graphs import PhaseGraphs
from shared.errors import RequestError
from shared.handoff.port import HandoffPort
from shared.model.drafts import DraftHead
from shared.model.llama import LlamaForCausalLM
from shared.model.tokenizer import Tokenizer
from shared.model_runner import ModelRunner
from shared.outputs import EngineLoad, GenerationResult
from shared.parallel import TPGroup
from shared.request import Request
from shared.request_checks import RequestChecks
from shared.sampling import SamplingParams
from shared.scheduler import Scheduler, StepPlan
from shared.spec.policy import MeasuredCost, SpecPolicy
from shared.spec.state import DraftState
from shared.spec.stats import SpecRecorder
from shared.stepping import Events, InFlight, StepFacts, Stepping


class Engine:
    def __init__(self, model: str | Path | LlamaForCausalLM, draft: str | Path | DraftHead | None = None,
                 config: EngineConfig | None = None, tokenizer: Tokenizer | None = None,
                 role: str = "both", tp: TPGroup | None = None, channel=None):
        """``tp``: under tensor parallelism (``config.tensor_parallel`` > 1, ``shared/parallel.py``) this rank's
        group, of which this engine is rank 0: its runner's calls reach the other ranks' ``Follower``s
        (``shared/follower.py``) over ``channel`` (``ModelRunner``'s)."""
        if role not in ("both", "prefill", "decode"):
            raise ValueError(f"role must be both, prefill or decode, got {role!r}")
        self.role = role
        self.runner = runner = ModelRunner(model, draft, config or EngineConfig(), role, tp, channel)
        if runner.rank != 0:
            raise ValueError(f"rank {runner.rank} of a tensor-parallel group follows rank 0's engine: a Follower")
        self.config, self.device, self.max_context = runner.config, runner.device, runner.max_context
        mc = self.model.config
        self.tokenizer = tokenizer = tokenizer or Tokenizer.beside(model)
        self.checks = RequestChecks(mc.vocab_size, self.max_context, tokenizer)
        self.spec_policy = None if runner.speculator is None else SpecPolicy.of(
            self.config.spec_policy, [s.spec for s in runner.speculator.shapes.values()], MeasuredCost())
        self._decode_end: float | None = None  # when the last decode step ended (the policy's step costs)
        self.last_step: StepFacts | None = None  # what the step launched last ran (the loop's accounting)
        # Under tensor parallelism the scheduler sends its changes to the other ranks (``ModelRunner.leading``).
        self.scheduler = runner.leading(Scheduler.over(runner, tokenizer, role))
        self.prefix_cache = self.scheduler.prefix_cache
        self.handoff = HandoffPort(self.scheduler, self.device, runner.on_device, self.config, mc.vocab_size,
                                   mc.num_key_value_heads, runner if runner.distributed else None,
                                   runner.landing_pages(), runner.head, self.speculator and self.speculator.spec)
        self.scheduler.on_retire.append(self.handoff.forget)  # its tables go with the request (``Scheduler.retire``)
        self._ids = itertools.count()

    @property
    def requests(self) -> Mapping[str, Request]:
        """Every request of this engine by id, read-only (the scheduler's table)."""
        return MappingProxyType(self.scheduler.requests)

    spec_stats: SpecRecorder | None = property(  # the speculative statistics (None without a draft)
        lambda self: self.speculator.stats if self.speculator is not None else None)

    # ---- requests --------------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    rid: str | None = None, output_ids: list[int] = (), output_logprobs: list[float] = ()) -> Request:
        """Queue a request; with ``output_ids`` (and their logprobs), one resuming after the output tokens a
        client already has (a failover): its prefill computes them too and samples nothing, so the next
        token is drawn where and as the request's first run would have drawn it."""
        return self.scheduler.submit(*self._checked(prompt, params, rid, output_ids, output_logprobs))

    def _checked(self, prompt: str | list[int], params: SamplingParams | None, rid: str | None,
                 output_ids: list[int], output_logprobs: list[float]) -> tuple:
        """The request's id, prompt ids, parameters and resumed outputs."""
        ids = self.checks.request(prompt, params := params or SamplingParams(), output_ids, output_logprobs)
        rid = rid or f"req-{next(self._ids)}"
        if self.scheduler.get(rid) is not None:
            raise RequestError("request_id", f"{rid!r} is already running")
        return rid, ids, params, list(output_ids), list(output_logprobs)

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

    def live_requests(self) -> list[Request]:  # every request not yet ended, waiting or running
        return list(self.scheduler.requests.values())

    # ---- stepping: schedule -> the policy picks the kind -> the runner runs -> commit -----------------
    def on_device(self) -> contextlib.AbstractContextManager:
        """This engine's GPU as the calling thread's current CUDA device (``ModelRunner.on_device``)."""
        return self.runner.on_device()

    def has_work_to_step(self) -> bool:  # whether a step would run a forward (a transfer's wait needs none)
        return self.scheduler.has_work_to_step()

    def step(self) -> Events:
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
                return InFlight(self.on_device, None, done.value)
        return InFlight(self.on_device, running)

    def _step(self) -> Stepping:
        plan = self.scheduler.schedule()
        shape = self._choose_shape(plan) if plan.decode and self.spec_policy is not None else None
        counts = self.speculator.stats.tokens.copy() if shape is not None else None
        self.last_step = StepFacts.of(plan, shape)
        events = yield from self.runner.run(plan, shape, self.scheduler.joins_next)
        if self.spec_policy is not None and not plan.empty:
            self._record(plan, shape, counts)
        return self.scheduler.commit(plan, events)

    def _choose_shape(self, plan: StepPlan) -> str | None:
        """The shape the policy picks for ``plan``'s decode rows, None for a plain step. A sampled request with
        its own seed pins the configured shape while it runs: its draws follow the shape, and its seed promises
        one output in any batch."""
        pinned = self.spec_policy.kind != "fixed" and any(r.params.seed is not None and not r.params.greedy
                                                          for r in plan.decode)
        left = None if plan.prefill or self.spec_policy.kind == "fixed" else [  # (fixed has no use for them)
            r.params.max_new_tokens - len(r.output_ids) for r in plan.decode]
        return self.spec_policy.choose(len(plan.decode), pinned=pinned, mixed=bool(plan.prefill), left=left)

    def _record(self, plan: StepPlan, shape: str | None, before) -> None:
        """Tell the policy what a step's decode ran: a speculative step's acceptance, and the kind's cost, the
        time from one decode step's end to the next's (everything a step of it costs the loop: the host's work
        on its tokens, the caller's between steps). A step with prefill chunks is not timed: a plain step's
        forward ran them too, a speculative one's waited for their forward (``SpecPolicy.ran``)."""
        if not plan.decode:
            self._decode_end = None
            return
        if shape is not None:
            now = self.speculator.stats.tokens
            self.spec_policy.observe(shape, now.drafts - before.drafts,
                                     [a - b for a, b in zip(now.accepted_per_pos, before.accepted_per_pos)])
        end, last = time.perf_counter(), self._decode_end
        self._decode_end = end
        self.spec_policy.ran(shape or "plain", len(plan.decode), 0.0 if last is None else end - last,
                             not plan.prefill and last is not None, mixed=bool(plan.prefill))

    # ---- disaggregation: the hand-off's port (``shared/handoff/port.py``) -------------------------
    def handoff_schema(self):  # what this engine's hand-offs carry; the other side must agree on all of it
        return self.handoff.schema

    def prefilled(self) -> list[Request]:
        """Prefill role: requests whose prompt K/V is (partly) computed, still prefilling or parked for
        their hand-off: each one's hand-off may start (``page_source(req, fed=True)``)."""
        return self.scheduler.prefilled()

    def starts_next(self, req: Request) -> bool:
        """Prefill role: whether waiting ``req``'s first chunk runs in the next step (its hand-off may start
        now: the decode side's reservation then overlaps what is left of this step)."""
        return self.scheduler.starts_next(req)

    def page_source(self, req: Request, fed: bool = False):  # prefill role: the sending side of a hand-off
        return self.handoff.page_source(req, fed)

    def handoff_increment(self, req: Request):  # prefill role: ``req``'s pages completed so far
        return self.handoff.increment(req)

    def reserve_handoff(self, rid: str, prompt_ids: list[int], output_ids: list[int], output_logprobs: list[float],
                        params: SamplingParams, committed_len: int, cached: bool = False) -> Request | None:
        """Decode role: claim pages for a request about to arrive (None: not now); ``cached``: the sender skips the
        pages this engine's prefix cache holds (under TP every rank's cache holds the same, from the same calls)."""
        if self.scheduler.get(rid) is not None:
            raise RequestError("request_id", f"{rid!r} is already here")
        return self.scheduler.admit_handoff(rid, prompt_ids, output_ids, output_logprobs, params, committed_len, cached)

    def page_sink(self, req: Request, guard, in_place: bool = False):  # decode role: the receiving side
        return self.handoff.page_sink(req, guard, in_place)

    def kv_pools(self):  # decode role: per cache, the K/V pool exported to a same-host prefill
        return self.handoff.pools()

    def activate_handoff(self, req: Request, committed_len: int, draft_state: DraftState | None = None,
                         output_ids: list[int] = (), output_logprobs: list[float] = ()) -> bool:
        """Decode role: the K/V arrived, ``req`` decodes on (``HandoffPort.activate``); False: it was aborted."""
        return self.handoff.activate(req, committed_len, draft_state, output_ids, output_logprobs)

    # ---- what the engine holds -------------------------------------------------------------------
    def load(self) -> EngineLoad:
        """The snapshot the engine loop publishes after each step (computed on the engine's thread)."""
        return EngineLoad.of(self.scheduler, self.speculator, self.spec_policy, self.prefix_cache, self.graph_failures)

    def prefix_summary(self, limit: int):  # the digests of the most recently used cached pages; None: no cache
        return self.prefix_cache.summary(limit) if self.prefix_cache is not None else None

    def flush_prefix_cache(self) -> int:  # evict every cached page no request holds; how many, per cache
        return self.scheduler.flush_prefix_cache()

    def is_idle_and_clean(self) -> bool:
        """True when no request runs and every cache is full again (the no-leak invariant)."""
        return (not self.scheduler.has_work() and all(c.is_full() for c in self.scheduler.caches)
                and self.handoff.is_clean())

    # ---- the device's facts and CUDA graphs (the runner's) ----------------------------------------
    # Read-only facts of the runner's (tests, benchmarks and the services' start-up read them).
    model = property(lambda self: self.runner.model)  # the target
    cache = property(lambda self: self.runner.cache)  # the target's KV cache
    speculator = property(lambda self: self.runner.speculator)  # the draft's worker (None without a draft)
    distributed = property(lambda self: self.runner.distributed)  # one rank of a tensor-parallel group
    graph_failures = property(lambda self: self.runner.graph_failures)  # CUDA graphs that failed to capture
    graph_costs = property(lambda self: self.runner.graph_costs)  # (kind, batch) -> seconds, timed at capture
    decode_graphs = property(lambda self: self.runner.decode_graphs)  # a plain engine's decode step's graphs
    memory_plan = property(lambda self: self.runner.memory_plan)  # what the pools were sized by (a GPU)
    load_peak = property(lambda self: self.runner.load_peak)  # bytes reserved after loading (a GPU)
    step_peaks = property(lambda self: self.runner.step_peaks)  # the profile run's peaks (a GPU)

    def capture_graphs(self) -> int:
        """Capture every enabled CUDA graph now, so serving starts without capture pauses (the services do
        this while /health says ``capturing``); none off CUDA or on a prefill engine (``ModelRunner``'s)."""
        return self.runner.capture_graphs(self.spec_policy)

    def phase_graphs(self) -> list[PhaseGraphs]:
        """The CUDA graph phases ``capture_graphs`` captures (the speculator's, else the target decode's)."""
        return self.runner.phase_graphs()

    def graph_capture_s(self) -> dict[str, float]:
        """Seconds spent capturing each phase's CUDA graphs so far, by phase (those with a graph)."""
        return {g.name: round(g.capture_s, 3) for g in self.phase_graphs() if g.captured_sizes}

    def release_followers(self) -> None:  # under tensor parallelism: the other ranks return from ``follow``
        self.runner.send("done")

    def release_graphs(self) -> None:  # before its split group ends: NCCL's destroy hangs while a graph lives
        self.runner.release_graphs()

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
        return GenerationResult.of(req, self.tokenizer, self.speculator is not None)
