"""The prefill service: chunked prefill + the first draft extend, first token, then the hand-off.

``Prefill`` streams two events: ``first_token`` once the prompt's last chunk is done and the first
token sampled, then ``handed_off`` once the decode instance acknowledged the request's pages and
draft state. The pages are freed only after that acknowledgement (or when anything fails).
"""

from __future__ import annotations

import logging
import queue
import time

import grpc
from pydantic import ValidationError

from proto.eyrie.v1 import eyrie_pb2 as pb
from proto.eyrie.v1 import eyrie_pb2_grpc as pb_grpc
from services.common import ServiceHandle, full_name, new_instance_id, set_serving, start_grpc_server
from services.engine_loop import EngineLoop
from services.settings import PrefillSettings
from shared.engine import Engine
from shared.handoff import engine_schema, iter_chunks, sampling_from_pb, sampling_to_pb
from shared.handoff.transport import GrpcStreamTransport
from shared.metadata import Heartbeat, InstanceInfo, Registry, connect
from shared.request import Phase, RequestError
from shared.telemetry import Telemetry

log = logging.getLogger("eyrie.prefill")
SERVICES = [full_name("Prefill")]


def validation_message(e: ValidationError) -> str:
    err = e.errors()[0]
    return f"{'.'.join(str(x) for x in err['loc'])}: {err['msg']}"


class PrefillServicer(pb_grpc.PrefillServicer):
    def __init__(self, loop: EngineLoop, settings: PrefillSettings, telemetry: Telemetry, transport):
        self.loop, self.settings, self.telemetry, self.transport = loop, settings, telemetry, transport
        self.schema = engine_schema(loop.engine)

    def Prefill(self, request: pb.PrefillRequest, context):  # noqa: N802
        rid = request.request_id
        if not rid:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id: empty")
        try:
            params = sampling_from_pb(request.sampling)
        except ValidationError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, validation_message(e))
        events = self.loop.subscribe(rid)
        t0 = time.perf_counter()
        try:
            self.loop.call(lambda e: e.add_request(list(request.prompt_ids), params, rid=rid)).result()
        except RequestError as e:
            self.loop.unsubscribe(rid)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        context.add_callback(lambda: self._abort_if_running(rid))
        try:
            yield from self._run(rid, request, events, context, t0)
        finally:
            self.loop.unsubscribe(rid)

    def _run(self, rid, request, events, context, t0):
        try:
            ev = events.get(timeout=self.settings.handoff_timeout_s)
        except queue.Empty:
            self._release(rid, "timeout")
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "prefill did not finish in time")
        if ev.finish_reason in ("abort", "error") and not ev.token_ids:
            context.abort(grpc.StatusCode.ABORTED if ev.finish_reason == "abort" else grpc.StatusCode.INTERNAL,
                          f"request {ev.finish_reason}ed during prefill")
        self.telemetry.stage_seconds.labels("prefill").observe(time.perf_counter() - t0)
        yield pb.PrefillEvent(first_token=pb.FirstToken(token_id=ev.token_ids[0], logprob=ev.logprobs[0],
                                                        finish_reason=ev.finish_reason or ""))
        if ev.finish_reason is not None:  # ended at its first token: nothing to hand off
            self.telemetry.requests_total.labels(ev.finish_reason).inc()
            return
        t1 = time.perf_counter()
        try:
            ack = self._hand_off(rid, request, context)
        finally:
            self._release(rid, "handed_off")
        dt = time.perf_counter() - t1
        self.telemetry.handoff_bytes_total.inc(ack.bytes)
        self.telemetry.handoff_seconds.observe(dt)
        self.telemetry.requests_total.labels("handed_off").inc()
        yield pb.PrefillEvent(handed_off=pb.HandedOff(bytes=ack.bytes, seconds=dt, chunks=ack.chunks))

    def _hand_off(self, rid: str, request: pb.PrefillRequest, context) -> pb.TransferAck:
        def snapshot(engine: Engine):
            req = engine.requests.get(rid)
            if req is None or req.phase is not Phase.HANDOFF:
                return None
            state = req.draft_state
            if state is not None and req.generator is not None:
                state.rng_state = req.generator.get_state()
            state_bytes = state.to_bytes() if state is not None else b""
            reserve = pb.ReserveRequest(
                request_id=rid, prompt_ids=req.prompt_ids, output_ids=req.output_ids,
                output_logprobs=req.output_logprobs, sampling=sampling_to_pb(req.params),
                committed_len=req.kv_len, schema=self.schema)
            return reserve, engine.page_ids(req), state_bytes

        snap = self.loop.call(snapshot).result()
        if snap is None:
            context.abort(grpc.StatusCode.ABORTED, "request aborted before the hand-off")
        reserve, page_ids, state_bytes = snap
        address, timeout = request.decode_address, self.settings.handoff_timeout_s
        try:
            reply = self.transport.reserve(address, reserve, timeout)
        except grpc.RpcError as e:
            self.telemetry.errors_total.labels("handoff_reserve").inc()
            context.abort(e.code(), f"decode {address}: {e.details()}")
        if not reply.accepted:
            self.telemetry.errors_total.labels("decode_full").inc()
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"decode {address} cannot hold the request: {reply.reason}")
        caches = self.loop.engine.scheduler.caches
        chunks = iter_chunks(rid, caches, page_ids, state_bytes, self.settings.handoff_chunk_bytes)
        try:
            return self.transport.transfer(address, chunks, timeout)
        except grpc.RpcError as e:
            self.telemetry.errors_total.labels("handoff_transfer").inc()
            context.abort(e.code(), f"hand-off to {address} failed: {e.details()}")

    def _release(self, rid: str, reason: str) -> None:
        def release(engine: Engine):
            req = engine.requests.get(rid)
            if req is not None:
                engine.release(req, reason)

        self.loop.call(release).result()

    def _abort_if_running(self, rid: str) -> None:
        self.loop.call(lambda e: e.abort(rid))

    def Abort(self, request: pb.AbortRequest, context):  # noqa: N802
        return pb.AbortResponse(found=self.loop.call(lambda e: e.abort(request.request_id)).result())


def engine_load(engine: Engine) -> dict:
    sched = engine.scheduler
    outstanding = sum(r.prompt_len - r.kv_len for r in [*sched.running, *sched.waiting])
    return {"outstanding_tokens": outstanding, "running": len(sched.running),
            "free_pages": engine.cache.num_free_pages}


def start_engine_service(role: str, settings, engine: Engine | None, servicer_factory, add_fn,
                         services: list[str]) -> ServiceHandle:
    """Load the engine, start its loop, gRPC, telemetry and the registry heartbeat (shared with decode)."""
    instance_id = settings.instance_id or new_instance_id(role)
    telemetry = Telemetry(role, instance_id, settings.host, settings.http_port).start()
    telemetry.set_state("loading")
    if engine is None:
        engine = Engine(settings.model, settings.draft, settings.engine_config(), role=role)
    loop = EngineLoop(engine, after_step=telemetry.observe_engine).start()
    servicer = servicer_factory(loop, settings, telemetry)
    server, port, health = start_grpc_server(settings.host, settings.grpc_port, [(add_fn, servicer)], services)
    grpc_address = f"{settings.advertised}:{port}"
    http_address = f"{settings.advertised}:{telemetry.port}"
    registry = Registry(connect(settings.redis_url), settings.registry_ttl_s)
    info = InstanceInfo(instance_id=instance_id, role=role, grpc_address=grpc_address, http_address=http_address,
                        started_at=time.time())
    heartbeat = Heartbeat(registry, info, settings.heartbeat_s,
                          lambda: loop.call(servicer.load if hasattr(servicer, "load") else engine_load).result(5))
    telemetry.observe_engine(engine)
    heartbeat.start()
    set_serving(health, services, True)
    telemetry.set_state("ready")
    log.info("%s %s serving gRPC on %s, HTTP on %s", role, instance_id, grpc_address, http_address)

    def stop(grace: float = 2.0) -> None:
        telemetry.set_state("draining")
        set_serving(health, services, False)
        heartbeat.stop()
        server.stop(grace).wait(grace + 1)
        loop.stop()
        if hasattr(servicer, "close"):
            servicer.close()
        telemetry.stop()

    return ServiceHandle(role=role, instance_id=instance_id, grpc_address=grpc_address, http_address=http_address,
                         stop=stop, engine_loop=loop, extra={"servicer": servicer, "telemetry": telemetry})


def start_prefill(settings: PrefillSettings, engine: Engine | None = None) -> ServiceHandle:
    transport = GrpcStreamTransport()

    def make(loop, s, telemetry):
        servicer = PrefillServicer(loop, s, telemetry, transport)
        servicer.close = transport.close
        return servicer

    return start_engine_service("prefill", settings, engine, make, pb_grpc.add_PrefillServicer_to_server, SERVICES)
