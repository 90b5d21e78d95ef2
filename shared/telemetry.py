"""Health and Prometheus metrics of one service instance, on its own small HTTP server.

``/health`` answers 200 when the instance is ready and 503 (with the state) while it loads, captures
CUDA graphs or drains. ``/metrics`` is the Prometheus text format. Each instance has its own
CollectorRegistry, so several services can live in one process (tests, ``eyrie up``).
"""

from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

STATES = ("loading", "capturing", "ready", "draining")
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class Telemetry:
    def __init__(self, service: str, instance_id: str, host: str = "127.0.0.1", port: int = 0):
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
        self._server = ThreadingHTTPServer((host, port), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name=f"{service}-http", daemon=True)

    @property
    def address(self) -> str:
        host, port = self._server.server_address[:2]
        return f"{host}:{port}"

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    def start(self) -> Telemetry:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

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
        """Count and list the engine's capture failures not seen yet (``shared.cuda_graphs.CaptureFailure``)."""
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

    def _handler(self):
        telemetry = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (the stdlib's name)
                path = self.path.split("?")[0]
                if path == "/health":
                    ok = telemetry.state == "ready"
                    body = json.dumps({"status": telemetry.state, "service": telemetry.service,
                                       "instance_id": telemetry.instance_id,
                                       "graphs": {"capture_failures": list(telemetry.graph_failures)}}).encode()
                    self._send(200 if ok else 503, body, "application/json")
                elif path == "/metrics":
                    self._send(200, generate_latest(telemetry.registry), CONTENT_TYPE_LATEST)
                else:
                    self._send(404, b'{"error": "not found"}', "application/json")

            def _send(self, code: int, body: bytes, ctype: str) -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, fmt, *args):  # keep the stdlib's access log out of the service log
                logging.getLogger("eyrie.http").debug(fmt, *args)

        return Handler
