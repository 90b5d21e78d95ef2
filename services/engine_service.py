"""Start-up and shutdown shared by the two engine services (prefill and decode).

Order matters for health: telemetry answers 503 ("loading") from the first moment, the engine loads,
CUDA graphs are captured (503 "capturing", when on and the engine can capture ahead), one warm-up request
runs and the memory peak is checked (503 "warming_up", ``services/warmup.py``: a failure stops start-up
here), its loop starts,
gRPC starts with every health status NOT_SERVING, the instance registers in Redis, and only then do
gRPC health and ``/health`` turn to SERVING / 200. ``stop`` reverses it: draining
(503, NOT_SERVING), deregistered, the requests in flight finish (up to the drain deadline), what is left
cancelled, gRPC stopped, loop stopped.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from typing import Protocol

from services.common import (
    ServiceHandle,
    ServiceTelemetry,
    new_instance_id,
    set_serving,
    start_grpc_server,
)
from services.engine_loop import EngineLoop
from services.followers import Leader, start_engine
from services.logs import ServiceLog
from services.metadata import Heartbeat, InstanceInfo, Registry, connect
from services.settings import EngineSettings
from services.telemetry import Telemetry
from services.warmup import check_ready
from shared.cuda_graphs import capture_progress, default_buckets
from shared.engine import Engine, EngineLoad


class EngineServicer(Protocol):
    """What an engine service's servicer offers the start-up code."""

    def after_step(self, engine: Engine) -> None: ...  # on the loop thread, after each step
    def while_stepping(self, engine: Engine) -> None: ...  # on the loop thread, while the device runs a step
    def before_fail(self, rid: str) -> None: ...  # on the loop thread, before an engine error aborts rid
    def close(self) -> None: ...  # cancel in-flight work (hand-offs, streams) at shutdown


def registry_load(load: EngineLoad, role: str) -> dict:
    """Load figures for the registry: tokens still to compute (the prompt tokens still to prefill on a
    prefill instance, the tokens the running requests may still generate on a decode instance),
    requests holding pages, free target pages."""
    outstanding = load.decode_tokens if role == "decode" else load.prefill_tokens
    return {"outstanding_tokens": outstanding, "running": load.running, "free_pages": load.free_pages[0]}


class SummaryPublisher:
    """The heartbeat's prefix cache summary (``Heartbeat.summary_fn``): computed on the engine loop's thread
    (``Engine.prefix_summary``, the digests of the ``limit`` most recently used cached pages) when the cache
    gained or lost a page since the last one, and encoded here. It never holds a heartbeat up for long: a
    summary the loop has not computed within ``wait_s`` goes out with a later beat."""

    def __init__(self, loop: EngineLoop, limit: int, wait_s: float, log: ServiceLog):
        self.loop, self.limit, self.wait_s, self.log = loop, limit, wait_s, log
        self.version: int | None = None  # the version published
        self._pending: Future | None = None

    def __call__(self) -> tuple[int, str | None] | None:
        if self._pending is None and self.loop.load.prefix_version != self.version:
            # a read of the cache: call_soon's rule holds (it may run while the device computes a step)
            self._pending = self.loop.call_soon(lambda engine: engine.prefix_summary(self.limit))
        fresh = None
        if self._pending is not None and wait_futures([self._pending], self.wait_s).done:
            done, self._pending = self._pending, None
            try:
                summary = done.result()
            except Exception as e:  # the loop stopped: nothing to publish
                self.log.warning("prefix_summary_failed", reason=str(e))
            else:
                self.version, fresh = summary.version, summary.to_json()
        return None if self.version is None else (self.version, fresh)


def start_heartbeat(registry: Registry, info: InstanceInfo, loop: EngineLoop, role: str, settings: EngineSettings,
                    log: ServiceLog) -> Heartbeat:
    """The instance's heartbeat: its load (``registry_load``) and, with a prefix cache and
    ``prefix_summary_pages`` > 0, its cache summary (``SummaryPublisher``)."""
    summary = None
    if settings.prefix_cache and settings.prefix_summary_pages:
        summary = SummaryPublisher(loop, settings.prefix_summary_pages, settings.heartbeat_s / 2, log)
    return Heartbeat(registry, info, settings.heartbeat_s, lambda: registry_load(loop.load, role), summary).start()


def engine_facts(engine: Engine) -> dict:
    """What the registry entry tells the router's GetModelInfo: dtype, page size, context and the
    speculative config (``draft_kind``, ``topk``, ``steps``, ``num_draft_tokens``) of the engine."""
    schema = engine.handoff_schema()
    return {"dtype": schema.dtype, "page_size": schema.page_size, "max_context": engine.max_context,
            "spec": {"draft_kind": schema.draft_kind, "topk": schema.topk, "steps": schema.steps,
                     "num_draft_tokens": schema.num_draft_tokens}}


def capture_graphs(engine: Engine, enabled: bool, telemetry: Telemetry, log: ServiceLog) -> None:
    """With CUDA graphs on, capture them before serving (``Engine.capture_graphs``), with ``/health``
    answering 503 ``capturing`` meanwhile (gRPC health is not up yet)."""
    if not enabled:
        return
    telemetry.set_state("capturing")
    log.event("capturing_graphs")
    t0 = time.perf_counter()
    with capture_progress(engine.phase_graphs()):
        count = engine.capture_graphs()  # a poisoned CUDA state raises: the service does not start
    for failure in engine.graph_failures:  # contained: those phases run eagerly
        log.warning("graph_capture_failed", **failure.as_dict())
    telemetry.observe_graph_failures(engine.graph_failures)
    largest = max((max(g.captured_sizes, default=0) for g in engine.phase_graphs()), default=0)
    wanted = max(default_buckets(engine.config.graph_max_bs), default=0)
    if count and largest < wanted:  # the memory fraction left no room for the larger ones (CaptureBudget)
        log.warning("graphs_capped", largest_batch=largest, graph_max_bs=engine.config.graph_max_bs,
                    reason="gpu_memory_fraction: larger batches run eagerly")
    timed = {f"{kind}@{bs}": round(1e3 * s, 3) for (kind, bs), s in sorted(engine.graph_costs.items())}
    log.event("graphs_captured", seconds=round(time.perf_counter() - t0, 3), graphs=count, largest_batch=largest,
              failed=len(engine.graph_failures), phase_seconds=engine.graph_capture_s(),
              **({"step_ms": timed} if timed else {}), **torch_memory(engine))


def policy_summary(engine) -> dict:
    """What an engine's speculation policy learnt (its step costs, its shapes' expected tokens, the steps of each),
    for the log once its loop has stopped; nothing without a policy."""
    policy = getattr(engine, "spec_policy", None)
    return {"spec_policy": policy.summary()} if policy is not None else {}


def torch_memory(engine: Engine) -> dict:
    """On a GPU: what PyTorch's allocator holds now and its peak so far (GiB), else nothing."""
    if engine.device.type != "cuda":
        return {}
    import torch

    return {"torch_reserved_gib": round(torch.cuda.memory_reserved(engine.device) / 2**30, 3),
            "torch_peak_gib": round(torch.cuda.max_memory_reserved(engine.device) / 2**30, 3)}


def prepare(engine: Engine | Leader, settings: EngineSettings, telemetry: Telemetry, log: ServiceLog) -> None:
    """Before serving: CUDA graphs captured, one warm-up request, the memory peak checked (``check_ready``)."""
    capture_graphs(engine, settings.cuda_graph, telemetry, log)
    check_ready(engine, settings.gpu_memory_fraction is not None, telemetry, log)


def idle(load: EngineLoad) -> bool:
    """No request holds pages or waits for admission."""
    return load.running == 0 and load.queued == 0


def wait_until(condition: Callable[[], bool], deadline: float, poll_s: float = 0.05) -> bool:
    """Poll ``condition`` until it holds (True) or ``deadline`` (``time.monotonic()``) passes (False)."""
    while not condition():
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)
    return True


def service_engine(role: str, settings: EngineSettings, engine: Engine | None,
                   started: list[Callable[[], None]]) -> Engine | Leader:
    """``engine``, or the one ``settings`` describe (under tensor parallelism rank 0's, its followers started
    and their end added to ``started``, run after the loop has stopped: the undo list runs backwards)."""
    if engine is None:
        engine = start_engine(role, settings)
        if isinstance(engine, Leader):
            started.append(engine.close)
    elif engine.role != role:
        raise ValueError(f"a {role} service needs an engine of role {role!r}, got {engine.role!r}")
    return engine


def start_engine_service(role: str, settings: EngineSettings, engine: Engine | None,
                         make_servicer: Callable[[EngineLoop, Telemetry, str], EngineServicer],
                         add_fn: Callable, services: list[str]) -> ServiceHandle:
    instance_id = settings.instance_id or new_instance_id(role)
    log = ServiceLog(role, instance_id)
    telemetry = ServiceTelemetry(role, instance_id, settings.host, settings.http_port, settings.api_key,
                                 model_name=settings.model_name).start()
    telemetry.set_state("loading")
    started: list[Callable[[], None]] = [telemetry.stop]  # undo list, should start-up fail half-way
    try:
        engine = service_engine(role, settings, engine, started)
        prepare(engine, settings, telemetry, log)
        loop, servicer = start_loop(engine, role, make_servicer, log, telemetry, instance_id, started)
        server, port, health = start_grpc_server(
            settings.host, settings.grpc_port, [(add_fn, servicer)], services, api_key=settings.api_key,
            on_denied=lambda: telemetry.errors_total.labels("unauthenticated").inc())
        started.append(lambda: server.stop(0))
        grpc_address = f"{settings.advertised}:{port}"
        http_address = f"{settings.advertised}:{telemetry.port}"
        registry = Registry(connect(settings.redis_url), settings.registry_ttl_s)
        facts = engine_facts(engine)
        info = InstanceInfo(instance_id=instance_id, role=role, grpc_address=grpc_address,
                            http_address=http_address, started_at=time.time(), model=facts)
        heartbeat = start_heartbeat(registry, info, loop, role, settings, log)
    except BaseException:
        for undo in reversed(started):
            undo()
        raise
    telemetry.observe_load(loop.load)
    set_serving(health, services, True)
    telemetry.set_state("ready")
    log.event("started", grpc=grpc_address, http=http_address, **facts)
    fatal, stopping = threading.Event(), threading.Event()  # fatal: the service cannot serve any more
    if isinstance(engine, Leader):  # out of service: gRPC health, and out of the registry (no more placements)
        out_of_service = lambda: (set_serving(health, services, False), heartbeat.stop())  # noqa: E731
        threading.Thread(target=watch_group, args=(engine, stopping, log, telemetry, out_of_service, fatal),
                         name=f"{role}-tp-watch", daemon=True).start()

    def stop(drain_s: float = 2.0) -> None:
        """Drain (503, out of the registry, in-flight requests finish up to ``drain_s``), then stop."""
        log.event("stopping", drain_s=drain_s)
        stopping.set()
        t0 = time.monotonic()
        telemetry.set_state("draining")
        set_serving(health, services, False)
        heartbeat.stop()
        drained = wait_until(lambda: idle(loop.load), t0 + drain_s)
        if drained:  # in-flight calls (a stream's last message) complete; new ones are refused
            getattr(servicer, "end_relays", lambda: None)()  # a decode instance's relays end only when told
            server.stop(max(0.5, t0 + drain_s - time.monotonic())).wait(drain_s + 1)
        servicer.close()
        server.stop(0).wait(1)
        loop.stop()
        getattr(engine, "close", lambda: None)()  # a Leader's followers end with the loop's last call
        telemetry.stop()
        log.event("stopped", drained=drained, seconds=round(time.monotonic() - t0, 3), **policy_summary(engine))

    return ServiceHandle(role=role, instance_id=instance_id, grpc_address=grpc_address, http_address=http_address,
                         stop=stop, engine_loop=loop, extra={"servicer": servicer, "telemetry": telemetry,
                                                             "fatal": fatal})


def start_loop(engine: Engine | Leader, role: str, make_servicer: Callable, log: ServiceLog, telemetry: Telemetry,
               instance_id: str, started: list[Callable[[], None]]) -> tuple[EngineLoop, EngineServicer]:
    """The service's engine loop, running, and its servicer wired to it (both added to the undo list)."""
    loop = EngineLoop(engine, log=log, hold_tokens=role != "prefill")  # a prefill's first tokens go out at once
    servicer = make_servicer(loop, telemetry, instance_id)
    loop.after_step, loop.before_fail = servicer.after_step, servicer.before_fail
    loop.while_stepping = servicer.while_stepping
    loop.start()
    started.append(loop.stop)
    started.append(servicer.close)
    return loop, servicer


def watch_group(leader: Leader, stopping: threading.Event, log: ServiceLog, telemetry: Telemetry,
                out_of_service: Callable[[], object], fatal: threading.Event, poll_s: float = 0.5) -> None:
    """Until ``stopping``: when ``leader``'s group breaks (a follower exited), whether or not a step or call ran
    into it yet (an idle service would otherwise look healthy with a dead rank), take the service out of service
    (health, registry) at once and set ``fatal``: the process should exit (``eyrie serve`` exits 1, and its
    supervisor, compose or ``eyrie up``, starts it again)."""
    while not stopping.wait(poll_s):
        reason = leader.group_failure()
        if reason is not None:
            log.event("tensor_parallel_group_broken", level=logging.ERROR, reason=reason)
            telemetry.errors_total.labels("tensor_parallel_group_broken").inc()
            telemetry.not_ready = f"the tensor-parallel group is broken: {reason}"
            out_of_service()
            fatal.set()
            return
