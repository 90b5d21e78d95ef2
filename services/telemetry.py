"""Health and Prometheus metrics of one service instance, on its own small HTTP server (FastAPI under
uvicorn: ``services.http_server``).

``/health`` answers 200 when the instance is ready and 503 (with the state) while it loads, captures
CUDA graphs or drains. ``/metrics`` is the Prometheus text format. Each instance has its own
CollectorRegistry, so several services can live in one process (tests, ``eyrie up``). With an API key,
every path but ``/health`` needs ``Authorization: Bearer <key>`` (refusals count in ``errors_total``).
"""

from __future__ import annotations

from fastapi import FastAPI
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException
from starlette.responses import Response

from services.http_server import HttpError, HttpServer, json_response, require_key
from shared.spec.token_counts import SpecTokenCounts

OPEN_PATHS = ("/health",)


STATES = ("loading", "capturing", "warming_up", "ready", "draining")
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
PREFIX = "eyrie_"  # vLLM's names under Eyrie's prefix (not "eyrie:": promtool refuses colons, kept for recording
# rules); every series has model_name and role labels
BASE_LABELS = ("model_name", "role")
# The router's request stages -> the vLLM-named histogram each also feeds.
STAGE_HISTOGRAMS = {"placement": "queue", "prefill": "prefill", "decode": "decode", "total": "e2e"}


class _Bound:
    """A metric with its ``model_name`` and ``role`` labels filled in: ``.labels(*rest)`` for the other
    labels, or ``.inc`` / ``.set`` / ``.observe`` directly when there are none."""

    def __init__(self, metric, base: tuple[str, str]):
        self.metric, self.base = metric, base
        self._child = metric.labels(*base) if len(metric._labelnames) == len(base) else None

    def labels(self, *values: str):
        return self.metric.labels(*self.base, *values)

    def __getattr__(self, name: str):  # inc / set / observe on a metric without further labels
        return getattr(self._child, name)


class _Stages:
    """``stage_seconds.labels(stage).observe(s)``: the stage histogram, and the vLLM-named one it maps to."""

    def __init__(self, stages: _Bound, named: dict[str, _Bound]):
        self.stages, self.named = stages, named

    def labels(self, stage: str):
        targets = [self.stages.labels(stage)]
        if stage in STAGE_HISTOGRAMS:
            targets.append(self.named[STAGE_HISTOGRAMS[stage]])
        return _Fanout(targets)


class _Fanout:
    def __init__(self, targets):
        self.targets = targets

    def observe(self, value: float) -> None:
        for t in self.targets:
            t.observe(value)


def count_totals(counter, totals: dict[str, int], seen: dict[str, int]) -> None:
    """An engine's running totals by label (``totals``) into ``counter``'s increments since ``seen`` (updated)."""
    for label, count in totals.items():
        counter.labels(label).inc(count - seen.get(label, 0))
        seen[label] = count


class Telemetry:
    def __init__(self, service: str, instance_id: str, host: str = "127.0.0.1", port: int = 0,
                 api_key: str | None = None, model_name: str = "eyrie"):
        self.service, self.instance_id, self.model_name = service, instance_id, model_name
        self.state = "loading"
        self.not_ready: str | None = None  # a ready service that cannot serve now says why (the router: Redis away)
        self.registry = r = CollectorRegistry()
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        base = (model_name, service)

        def metric(kind, name: str, doc: str, labels=(), **kw) -> _Bound:
            return _Bound(kind(PREFIX + name, doc, [*BASE_LABELS, *labels], registry=r, **kw), base)

        def seconds(name: str, doc: str, labels=()) -> _Bound:
            return metric(Histogram, name, doc, labels, buckets=LATENCY_BUCKETS)

        # Load (gauges of the current state).
        self.requests_running = metric(Gauge, "num_requests_running", "Requests holding KV pages")
        self.requests_queued = metric(Gauge, "num_requests_waiting", "Requests waiting for admission")
        self.kv_pages_used = metric(Gauge, "kv_pages_used", "KV pages in use", ["cache"])
        self.kv_pages_total = metric(Gauge, "kv_pages_capacity", "KV pages in the pool", ["cache"])
        self.kv_cache_usage = metric(Gauge, "kv_cache_usage_perc", "Fraction of the target KV pages in use (0-1)")
        self._prefix_metrics(metric)
        # Requests (the router sees every request whole; prefill and decode their part).
        self.prompt_tokens = metric(Counter, "prompt_tokens", "Prompt tokens of finished requests")
        self.generation_tokens = metric(Counter, "generation_tokens", "Generated tokens of finished requests")
        self.request_success = metric(Counter, "request_success", "Requests finished, by finish reason",
                                      ["finished_reason"])
        self.request_prompt_tokens = metric(Histogram, "request_prompt_tokens", "Prompt length per finished request",
                                            buckets=TOKEN_BUCKETS)
        self.request_generation_tokens = metric(Histogram, "request_generation_tokens",
                                                "Generated tokens per finished request", buckets=TOKEN_BUCKETS)
        self.requests_total = metric(Counter, "requests", "Requests ended on this instance, by outcome", ["outcome"])
        self.errors_total = metric(Counter, "errors", "Errors and refusals, by kind", ["kind"])
        self.local_prefills_total = metric(Counter, "local_prefills", "Prompts prefilled on their decode instance "
                                           "rather than handed off (EYRIE_LOCAL_PREFILL_MAX_TOKENS)")
        # Latency.
        self.ttft_seconds = seconds("time_to_first_token_seconds", "Time to first token")
        self.inter_token_seconds = seconds("inter_token_latency_seconds", "Time between streamed tokens")
        named = {"queue": seconds("request_queue_time_seconds", "Time from arrival to placement"),
                 "prefill": seconds("request_prefill_time_seconds", "Prefill time of a request"),
                 "decode": seconds("request_decode_time_seconds", "Decode time of a request"),
                 "e2e": seconds("e2e_request_latency_seconds", "Arrival to last token")}
        self.stage_seconds = _Stages(seconds("request_stage_seconds", "Request latency by stage", ["stage"]), named)
        # Hand-off.
        self.handoff_transport = "grpc"  # the label of this instance's hand-off series (set by the service)
        self._handoff_bytes = metric(Counter, "handoff_bytes", "KV + draft-state bytes handed off", ["transport"])
        self._handoff_seconds = seconds("handoff_seconds", "Hand-off duration", ["transport"])
        self.handoff_bytes_total.inc(0), self.handoff_seconds  # the series exist (at 0) before a hand-off
        self._speculation_metrics(metric, seconds)
        self.graph_capture_failures = metric(Counter, "graph_capture_failures", "CUDA graphs that failed to "
                                             "capture, by phase (the phase then runs eagerly)", ["phase"])
        self.graph_failures: list[dict] = []  # served in /health's "graphs" details
        self.gpu_memory_peak = metric(Gauge, "gpu_memory_peak_bytes", "This process's GPU memory at its peak after "
                                      "warm-up, by part (torch: max_memory_reserved; non_torch: NVML's figure less "
                                      "PyTorch's; total)", ["part"])
        self.gpu_memory_budget = metric(Gauge, "gpu_memory_budget_bytes", "gpu_memory_fraction x the GPU's memory")
        self._server = HttpServer(self._app(api_key), host, port, name=f"{service}-http")


    def _prefix_metrics(self, metric) -> None:
        """The prefix cache's (EYRIE_PREFIX_CACHE), in tokens as vLLM's prefix_cache_queries / prefix_cache_hits,
        and the router's prefix-aware placements."""
        self.prefix_queries = metric(Counter, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.prefix_hits = metric(Counter, "prefix_cache_hits", "Prompt tokens found in the prefix cache")
        self.prefix_cached = metric(Gauge, "prefix_cache_pages", "KV pages the prefix cache holds (per pool)")
        self._prefix_seen = (0, 0)
        # The router's prompt placements (a prefill instance, or a decode instance prefilling locally), by
        # reason: "prefix" where the instance's published cache summary held leading pages, else "load".
        self.placements_total = metric(Counter, "router_placements", "Prompt placements by role and reason "
                                       "(prefix: on an instance holding its leading pages; load: least loaded)",
                                       ["role", "reason"])
        self.prefix_matched_tokens = metric(Counter, "router_prefix_matched_tokens", "Prompt tokens the chosen "
                                            "instances' published prefix cache summaries held, by role", ["role"])

    def _speculation_metrics(self, metric, seconds) -> None:
        """Speculative decoding: per request (histograms) and per token (vLLM-shaped counters)."""
        # Per request.
        self.accept_length = metric(Histogram, "spec_decode_accept_length", "Committed tokens per verify, per request",
                                    buckets=(1, 1.25, 1.5, 2, 2.5, 3, 4, 5, 6, 8))
        self.accept_rate = metric(Histogram, "spec_decode_accept_rate", "Accepted / drafted tokens, per request",
                                  buckets=(0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0))
        self.draft_seconds = seconds("spec_decode_draft_seconds", "Draft time per request")
        self.verify_seconds = seconds("spec_decode_verify_seconds", "Verify time per request")
        self.draft_ahead = metric(Counter, "spec_decode_draft_ahead", "Drafts launched ahead of the host's "
                                  "bookkeeping, by outcome: used (partial: for some of their requests) or dropped "
                                  "(mismatched: the next batch was not some of its requests)", ["outcome"])
        self._draft_ahead_seen: dict[str, int] = {}
        self.draft_catch_up = metric(Counter, "spec_decode_draft_catch_up", "The draft's catch-ups over the "
                                     "positions plain steps left it behind on (shared/spec/backlog.py): the extends "
                                     "run (extends) and the positions they ran over (positions)", ["count"])
        self._catch_up_seen: dict[str, int] = {}
        # Token-level speculation counters, named and shaped as vLLM's (shared/spec/token_counts.py), by the tree
        # shape that drafted (``SpecConfig.name``: the adaptive policy's choice, or the one shape of ``fixed``):
        # sum over ``shape`` for vLLM's series.
        self.spec_drafts = metric(Counter, "spec_decode_num_drafts", "Drafts verified (one per request per verify)",
                                  ["shape"])
        self.spec_draft_tokens = metric(Counter, "spec_decode_num_draft_tokens",
                                        "Draft tokens verification could accept (spec steps per draft)", ["shape"])
        self.spec_accepted_tokens = metric(Counter, "spec_decode_num_accepted_tokens", "Draft tokens accepted",
                                           ["shape"])
        self.spec_accepted_per_pos = metric(Counter, "spec_decode_num_accepted_tokens_per_pos",
                                            "Draft tokens accepted at each draft position (0 = the first)",
                                            ["shape", "position"])
        self.spec_steps = metric(Counter, "spec_decode_num_steps", "Decode steps by the kind the speculation policy "
                                 "ran: a tree shape, or plain (no draft)", ["shape"])
        # The engine loop's time (``services.engine_loop.LoopTimes``): where a service's engine thread spends its
        # wall, so a slow layout's cause reads off /metrics (busy share, mean step by kind, calls between steps).
        self.loop_seconds = metric(Counter, "engine_loop_seconds", "Engine thread time by part: step_decode, "
                                   "step_mixed, step_prefill (launch to finish), calls, after_step, idle", ["part"])
        self.engine_steps = metric(Counter, "engine_steps", "Engine steps by kind: decode, mixed (prefill chunks "
                                   "beside decode rows), prefill", ["kind"])
        self.engine_step_rows = metric(Counter, "engine_step_decode_rows", "Decode rows of the engine's steps, by "
                                       "step kind", ["kind"])
        self.engine_prefill_tokens = metric(Counter, "engine_step_prefill_tokens", "Prompt tokens the engine's "
                                            "steps computed")
        self._loop_seen: dict[tuple[int, str | None], float] = {}  # (metric, label) -> the total counted
        self._spec_counted: dict[str, SpecTokenCounts] = {}  # per shape, what the counters above have counted
        self._steps_counted: dict[str, int] = {}  # per kind, the steps counted so far

    @property
    def address(self) -> str:
        return f"{self._server.host}:{self._server.port}"

    @property
    def port(self) -> int:
        return self._server.port

    def start(self) -> Telemetry:
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop()

    def set_state(self, state: str) -> None:
        if state not in STATES:
            raise ValueError(f"state must be one of {STATES}")
        self.state = state

    def observe_load(self, load) -> None:
        """Refresh the gauges from an engine's load snapshot (``shared.engine.EngineLoad``)."""
        self.requests_running.set(load.running)
        self.requests_queued.set(load.queued)
        for i, (free, total) in enumerate(zip(load.free_pages, load.total_pages)):
            name = "target" if i == 0 else f"draft{i - 1}"
            self.kv_pages_total.labels(name).set(total)
            self.kv_pages_used.labels(name).set(total - free)
        count_totals(self.draft_ahead, load.draft_ahead, self._draft_ahead_seen)
        count_totals(self.draft_catch_up, load.draft_catch_up, self._catch_up_seen)
        used, total = load.total_pages[0] - load.free_pages[0], load.total_pages[0]
        self.kv_cache_usage.set(used / total if total else 0.0)
        self.observe_graph_failures(load.graph_failures)
        queries, hits = load.prefix_queries, load.prefix_hits  # the engine's running totals -> increments
        self.prefix_queries.inc(max(0, queries - self._prefix_seen[0]))
        self.prefix_hits.inc(max(0, hits - self._prefix_seen[1]))
        self._prefix_seen = (queries, hits)
        self.prefix_cached.set(load.prefix_pages)
        self._count_spec_tokens(load.spec_shape_tokens, load.spec_steps)

    def observe_loop(self, times) -> None:
        """Advance the engine-loop counters by what ``times`` (``services.engine_loop.LoopTimes``, running
        totals) gained since the last call."""
        totals = [(self.loop_seconds, times.seconds), (self.engine_steps, times.steps),
                  (self.engine_step_rows, times.rows), (self.engine_prefill_tokens, {None: times.prefill_tokens})]
        for metric, by_label in totals:
            for label, total in by_label.items():
                gained = total - self._loop_seen.get((id(metric), label), 0)
                if gained > 0:
                    self._loop_seen[(id(metric), label)] = total
                    (metric if label is None else metric.labels(label)).inc(gained)

    @property
    def handoff_bytes_total(self):
        return self._handoff_bytes.labels(self.handoff_transport)

    @property
    def handoff_seconds(self):
        return self._handoff_seconds.labels(self.handoff_transport)

    def observe_handoff(self, transport: str, nbytes: int, seconds: float) -> None:
        """One hand-off that ``transport`` carried (its name as negotiated: ipc, grpc-stream): bytes and
        duration in that transport's series, so each transport's bandwidth reads off /metrics."""
        self._handoff_bytes.labels(transport).inc(nbytes)
        self._handoff_seconds.labels(transport).observe(seconds)

    def observe_request_end(self, finished_reason: str, prompt_tokens: int, generation_tokens: int) -> None:
        """A request that finished (``stop`` / ``length``): the token counters and length histograms."""
        self.request_success.labels(finished_reason).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generation_tokens)
        self.request_prompt_tokens.observe(prompt_tokens)
        self.request_generation_tokens.observe(generation_tokens)

    def skip_counts(self, load) -> None:
        """Take the engine's running totals so far as seen, without counting them (its warm-up request)."""
        self._draft_ahead_seen.update(load.draft_ahead)
        self._catch_up_seen.update(load.draft_catch_up)
        self._spec_counted = {name: counts.copy() for name, counts in load.spec_shape_tokens.items()}
        self._steps_counted = dict(load.spec_steps)
        self._count_spec_tokens(load.spec_shape_tokens, load.spec_steps)  # every shape's series, at 0

    def observe_footprint(self, fp) -> None:
        """The process's GPU memory peak (``shared.memory.sizing.Footprint``); non_torch absent when unmeasured."""
        self.gpu_memory_peak.labels("torch").set(fp.torch_peak)
        if fp.non_torch is not None:
            self.gpu_memory_peak.labels("non_torch").set(fp.non_torch)
        self.gpu_memory_peak.labels("total").set(fp.peak)
        self.gpu_memory_budget.set(fp.budget)

    def observe_graph_failures(self, failures) -> None:
        """Count and list the engine's capture failures not seen yet (``shared.cuda_graphs.CaptureFailure``)."""
        for failure in failures[len(self.graph_failures):]:
            self.graph_capture_failures.labels(failure.phase).inc()
            self.graph_failures.append(failure.as_dict())

    def _count_spec_tokens(self, shapes: dict[str, SpecTokenCounts], steps: dict[str, int]) -> None:
        """Advance the per-shape speculation counters by what the engine counted since the last call (every
        shape's series exists from the first call, at 0 before it runs)."""
        for shape, now in shapes.items():
            seen = self._spec_counted.get(shape) or SpecTokenCounts(now.steps)
            self.spec_drafts.labels(shape).inc(now.drafts - seen.drafts)
            self.spec_draft_tokens.labels(shape).inc(now.draft_tokens - seen.draft_tokens)
            self.spec_accepted_tokens.labels(shape).inc(now.accepted_tokens - seen.accepted_tokens)
            for pos, (n, before) in enumerate(zip(now.accepted_per_pos, seen.accepted_per_pos)):
                self.spec_accepted_per_pos.labels(shape, str(pos)).inc(n - before)
            self._spec_counted[shape] = now.copy()
        for kind, n in steps.items():
            self.spec_steps.labels(kind).inc(n - self._steps_counted.get(kind, 0))
            self._steps_counted[kind] = n

    def observe_finished(self, req) -> None:
        """Per-request histograms when a request ends on this instance."""
        self.requests_total.labels(req.finish_reason or "abort").inc()
        if req.stats.verify_steps:
            self.accept_length.observe(req.stats.accept_length)
            self.accept_rate.observe(req.stats.accept_rate)
            self.draft_seconds.observe(req.stats.draft_time_s)
            self.verify_seconds.observe(req.stats.verify_time_s)

    def health(self) -> tuple[int, dict]:
        body = {"status": self.state, "service": self.service, "instance_id": self.instance_id,
                "graphs": {"capture_failures": list(self.graph_failures)}}
        if self.state == "ready" and self.not_ready:
            body.update(status="not_serving", reason=self.not_ready)
        return (200 if body["status"] == "ready" else 503), body

    def _app(self, api_key: str | None) -> FastAPI:
        app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)
        require_key(app, api_key, OPEN_PATHS, on_denied=lambda: self.errors_total.labels("unauthenticated").inc())

        @app.get("/health")
        def health():
            status, body = self.health()
            return json_response(body, status)

        @app.get("/metrics")
        def metrics():
            return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)

        @app.exception_handler(HTTPException)
        async def http_error(_request, e: HTTPException):
            code = {404: "unknown_route", 405: "method_not_allowed"}.get(e.status_code)
            return HttpError(e.status_code, str(e.detail), code=code, headers=dict(e.headers or {})).response()

        return app
