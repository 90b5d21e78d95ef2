"""Health and Prometheus metrics of one service instance, on its own small HTTP server (FastAPI under
uvicorn: ``shared.http_server``).

``/health`` answers 200 when the instance is ready and 503 (with the state) while it loads, captures
CUDA graphs or drains. ``/metrics`` is the Prometheus text format. Each instance has its own
CollectorRegistry, so several services can live in one process (tests, ``eyrie up``). With an API key,
every path but ``/health`` needs ``Authorization: Bearer <key>`` (refusals count in ``errors_total``).
"""

from __future__ import annotations

from fastapi import FastAPI
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException
from starlette.responses import Response

from shared.http_server import HttpError, HttpServer, json_response, require_key

OPEN_PATHS = ("/health",)

STATES = ("loading", "capturing", "ready", "draining")
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class Telemetry:
    def __init__(self, service: str, instance_id: str, host: str = "127.0.0.1", port: int = 0,
                 api_key: str | None = None):
        self.service, self.instance_id = service, instance_id
        self.state = "loading"
        self.registry = r = CollectorRegistry()
        self.requests_running = Gauge("eyrie_requests_running", "Requests holding KV pages", registry=r)
        self.requests_queued = Gauge("eyrie_requests_queued", "Requests waiting for admission", registry=r)
        self.kv_pages_used = Gauge("eyrie_kv_pages_used", "KV pages in use", ["cache"], registry=r)
        self.kv_pages_total = Gauge("eyrie_kv_pages_total", "KV pages in the pool", ["cache"], registry=r)
        self.ttft_seconds = Histogram("eyrie_ttft_seconds", "Time to first token", buckets=LATENCY_BUCKETS, registry=r)
        self.inter_token_seconds = Histogram("eyrie_inter_token_seconds", "Time between streamed tokens",
                                             buckets=LATENCY_BUCKETS, registry=r)
        self.stage_seconds = Histogram("eyrie_stage_seconds", "Request latency by stage", ["stage"],
                                       buckets=LATENCY_BUCKETS, registry=r)
        self.handoff_bytes_total = Counter("eyrie_handoff_bytes", "KV + draft-state bytes handed off", registry=r)
        self.handoff_seconds = Histogram("eyrie_handoff_seconds", "Hand-off duration", buckets=LATENCY_BUCKETS,
                                         registry=r)
        self.accept_length = Histogram("eyrie_accept_length", "Committed tokens per verify, per request",
                                       buckets=(1, 1.25, 1.5, 2, 2.5, 3, 4, 5, 6, 8), registry=r)
        self.accept_rate = Histogram("eyrie_accept_rate", "Accepted / drafted tokens, per request",
                                     buckets=(0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0), registry=r)
        self.draft_seconds = Histogram("eyrie_draft_seconds", "Draft time per request", buckets=LATENCY_BUCKETS,
                                       registry=r)
        self.verify_seconds = Histogram("eyrie_verify_seconds", "Verify time per request", buckets=LATENCY_BUCKETS,
                                        registry=r)
        self.draft_ahead = Gauge("eyrie_spec_draft_ahead", "Drafts launched ahead of the host's bookkeeping, by "
                                 "outcome: used (partial: for some of their requests) or dropped (mismatched: "
                                 "the next batch was not some of its requests)", ["outcome"], registry=r)
        self.requests_total = Counter("eyrie_requests", "Requests ended, by outcome", ["outcome"], registry=r)
        self.errors_total = Counter("eyrie_errors", "Errors by kind", ["kind"], registry=r)
        self.graph_capture_failures = Counter("eyrie_graph_capture_failures", "CUDA graphs that failed to "
                                              "capture, by phase (the phase then runs eagerly)", ["phase"],
                                              registry=r)
        self.graph_failures: list[dict] = []  # served in /health's "graphs" details
        self._server = HttpServer(self._app(api_key), host, port, name=f"{service}-http")

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
        for outcome, count in load.draft_ahead.items():
            self.draft_ahead.labels(outcome).set(count)
        self.observe_graph_failures(load.graph_failures)

    def observe_graph_failures(self, failures) -> None:
        """Count and list the engine's capture failures not seen yet (``shared.runner.CaptureFailure``)."""
        for failure in failures[len(self.graph_failures):]:
            self.graph_capture_failures.labels(failure.phase).inc()
            self.graph_failures.append(failure.as_dict())

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
        return (200 if self.state == "ready" else 503), body

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
