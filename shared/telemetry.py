"""Health and Prometheus metrics of one service instance, on its own small HTTP server.

``/health`` answers 200 when the instance is ready and 503 (with the state) while it loads, captures
CUDA graphs or drains. ``/metrics`` is the Prometheus text format. Each instance has its own
CollectorRegistry, so several services can live in one process (tests, ``eyrie up``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from shared.spec.token_counts import SpecTokenCounts

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
        # Token-level speculation counters, named and shaped as vLLM's (shared/spec/token_counts.py).
        self.spec_drafts = Counter("eyrie:spec_decode_num_drafts", "Drafts verified (one per request per verify)",
                                   registry=r)
        self.spec_draft_tokens = Counter("eyrie:spec_decode_num_draft_tokens",
                                         "Draft tokens verification could accept (spec steps per draft)", registry=r)
        self.spec_accepted_tokens = Counter("eyrie:spec_decode_num_accepted_tokens", "Draft tokens accepted",
                                            registry=r)
        self.spec_accepted_per_pos = Counter("eyrie:spec_decode_num_accepted_tokens_per_pos",
                                             "Draft tokens accepted at each draft position (0 = the first)",
                                             ["position"], registry=r)
        self._spec_counted: SpecTokenCounts | None = None  # what the counters above have counted so far
        self.requests_total = Counter("eyrie_requests", "Requests ended, by outcome", ["outcome"], registry=r)
        self.errors_total = Counter("eyrie_errors", "Errors by kind", ["kind"], registry=r)
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

    def observe_engine(self, engine) -> None:
        """Refresh the gauges from an Engine (call on the engine thread, e.g. after each step)."""
        sched = engine.scheduler
        self.requests_running.set(len(sched.running))
        self.requests_queued.set(len(sched.waiting))
        for i, cache in enumerate(sched.caches):
            name = "target" if i == 0 else f"draft{i - 1}"
            self.kv_pages_total.labels(name).set(cache.spec.num_pages)
            self.kv_pages_used.labels(name).set(cache.spec.num_pages - cache.num_free_pages)
        if engine.spec is not None:
            for outcome in ("used", "partial", "dropped", "mismatched"):
                self.draft_ahead.labels(outcome).set(getattr(engine.spec, f"ahead_{outcome}"))
            self._count_spec_tokens(engine.spec.token_counts)

    def _count_spec_tokens(self, now: SpecTokenCounts) -> None:
        """Advance the token-level counters by what the engine counted since the last call."""
        seen = self._spec_counted or SpecTokenCounts(now.steps)
        self.spec_drafts.inc(now.drafts - seen.drafts)
        self.spec_draft_tokens.inc(now.draft_tokens - seen.draft_tokens)
        self.spec_accepted_tokens.inc(now.accepted_tokens - seen.accepted_tokens)
        for pos, (n, before) in enumerate(zip(now.accepted_per_pos, seen.accepted_per_pos)):
            self.spec_accepted_per_pos.labels(str(pos)).inc(n - before)
        self._spec_counted = dataclasses.replace(now, accepted_per_pos=list(now.accepted_per_pos))

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
                                       "instance_id": telemetry.instance_id}).encode()
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
