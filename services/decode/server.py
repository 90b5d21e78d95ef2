"""The decode service: admits hand-offs (pages first), receives K/V + draft state, runs the EAGLE loop.

A request's life here: ``Reserve`` (schema check, then pages claimed, or a refusal the router
re-places on) -> ``Transfer`` (chunks written straight into the reserved pages; the acknowledgement
lets the prefill side free its copy) -> the request resumes into draft() from the transferred
state -> ``Stream`` (tokens buffered from Reserve on, so none are lost before the router attaches).
A request nobody streams within ``stream_attach_timeout_s``, or whose stream goes away, is aborted
and its pages freed.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

import grpc
from pydantic import ValidationError

from proto.eyrie.v1 import eyrie_pb2 as pb
from proto.eyrie.v1 import eyrie_pb2_grpc as pb_grpc
from services.common import ServiceHandle, full_name
from services.engine_loop import EngineLoop
from services.prefill.server import engine_load, start_engine_service, validation_message
from services.settings import DecodeSettings
from shared.engine import Engine
from shared.handoff import ChunkWriter, SchemaMismatch, TransferError, check_schema, engine_schema, sampling_from_pb
from shared.request import RequestError
from shared.spec.state import DraftState
from shared.telemetry import Telemetry

log = logging.getLogger("eyrie.decode")
SERVICES = [full_name("Decode")]


class DecodeServicer(pb_grpc.DecodeServicer):
    def __init__(self, loop: EngineLoop, settings: DecodeSettings, telemetry: Telemetry, instance_id: str = ""):
        self.loop, self.settings, self.telemetry = loop, settings, telemetry
        self.instance_id = instance_id
        self.schema = engine_schema(loop.engine)
        self._lock = threading.Lock()
        self._streams: dict[str, queue.Queue] = {}  # rid -> token events, from Reserve on
        self._unattached: dict[str, float] = {}  # rid -> deadline for a Stream to attach
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap, name="decode-reaper", daemon=True)
        self._reaper.start()

    # ---- admission -------------------------------------------------------------------------------
    def Handshake(self, request: pb.HandoffSchema, context):  # noqa: N802
        try:
            check_schema(self.schema, request)
        except SchemaMismatch as e:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        return pb.HandshakeResponse(instance_id=self.instance_id)

    def Reserve(self, request: pb.ReserveRequest, context):  # noqa: N802
        try:
            check_schema(self.schema, request.schema)
        except SchemaMismatch as e:
            self.telemetry.errors_total.labels("schema_mismatch").inc()
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        try:
            params = sampling_from_pb(request.sampling)
        except ValidationError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, validation_message(e))
        rid = request.request_id
        events = self.loop.subscribe(rid)

        def reserve(engine: Engine):
            return engine.reserve_handoff(rid, list(request.prompt_ids), list(request.output_ids),
                                          list(request.output_logprobs), params, request.committed_len)

        try:
            req = self.loop.call(reserve).result()
        except RequestError as e:  # this instance can never hold it (or already has it): place elsewhere
            self.loop.unsubscribe(rid)
            return pb.ReserveResponse(accepted=False, reason=str(e))
        if req is None:
            self.loop.unsubscribe(rid)
            free = self.loop.engine.cache.num_free_pages
            return pb.ReserveResponse(accepted=False, reason=f"no room now ({free} free pages)")
        with self._lock:
            self._streams[rid] = events
            self._unattached[rid] = time.monotonic() + self.settings.stream_attach_timeout_s
        return pb.ReserveResponse(accepted=True)

    def Transfer(self, request_iterator, context):  # noqa: N802
        rid, writer, last, t0 = None, None, None, time.perf_counter()
        try:
            for chunk in request_iterator:
                if writer is None:
                    rid = chunk.request_id
                    page_ids = self.loop.call(lambda e: self._receiving_pages(e, rid)).result()
                    if page_ids is None:
                        context.abort(grpc.StatusCode.NOT_FOUND, f"request_id: {rid!r} has no reservation here")
                    writer = ChunkWriter(self.loop.engine.scheduler.caches, page_ids)
                writer.write(chunk)
                last = chunk
                if chunk.last:
                    break
            if writer is None:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "empty transfer")
            writer.finish(last)
            state = DraftState.from_bytes(last.draft_state, self.loop.engine.device) if last.draft_state else None
        except (TransferError, ValueError) as e:
            self._drop(rid, "transfer")
            self.telemetry.errors_total.labels("transfer").inc()
            context.abort(grpc.StatusCode.DATA_LOSS, f"hand-off of {rid}: {e}")
        except grpc.RpcError:  # the sender went away mid-transfer
            self._drop(rid, "transfer_broken")
            raise
        if state is None and self.loop.engine.spec is not None:
            self._drop(rid, "transfer")
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "a speculative decode needs the draft state")

        def activate(engine: Engine) -> bool:
            req = engine.requests.get(rid)
            if req is None:
                return False
            engine.activate_handoff(req, req.handles[0].reserved if state is None else state.committed_len, state)
            return True

        if not self.loop.call(activate).result():
            context.abort(grpc.StatusCode.ABORTED, f"{rid} was aborted during its transfer")
        self.telemetry.handoff_bytes_total.inc(writer.bytes)
        self.telemetry.handoff_seconds.observe(time.perf_counter() - t0)
        return pb.TransferAck(bytes=writer.bytes, chunks=writer.received)

    @staticmethod
    def _receiving_pages(engine: Engine, rid: str):
        req = engine.requests.get(rid)
        if req is None or req.phase.name != "RECEIVING":
            return None
        return engine.page_ids(req)

    # ---- streaming -------------------------------------------------------------------------------
    def Stream(self, request: pb.StreamRequest, context):  # noqa: N802
        rid = request.request_id
        with self._lock:
            events = self._streams.get(rid)
            self._unattached.pop(rid, None)
        if events is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"request_id: {rid!r} is not on this decode instance")
        context.add_callback(lambda: self._drop(rid, "abort"))
        last = time.perf_counter()
        try:
            while True:
                try:
                    ev = events.get(timeout=self.settings.stream_idle_timeout_s)
                except queue.Empty:
                    context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "no token for too long")
                now = time.perf_counter()
                if ev.token_ids:
                    self.telemetry.inter_token_seconds.observe((now - last) / len(ev.token_ids))
                last = now
                msg = pb.GenerateResponse(request_id=rid, token_ids=ev.token_ids, logprobs=ev.logprobs)
                if ev.finish_reason is not None:
                    req = ev.request
                    if req is not None:
                        self.telemetry.observe_finished(req)
                        msg.finish.CopyFrom(finish_message(req))
                    else:
                        msg.finish.reason = ev.finish_reason
                    yield msg
                    return
                yield msg
        finally:
            self._forget(rid)

    # ---- aborts and clean-up ---------------------------------------------------------------------
    def Abort(self, request: pb.AbortRequest, context):  # noqa: N802
        found = self.loop.call(lambda e: e.abort(request.request_id)).result()
        self._forget(request.request_id)
        return pb.AbortResponse(found=found)

    def _drop(self, rid: str | None, reason: str) -> None:
        if rid is None:
            return
        self.loop.call(lambda e: e.abort(rid))
        self._forget(rid)

    def _forget(self, rid: str) -> None:
        with self._lock:
            self._streams.pop(rid, None)
            self._unattached.pop(rid, None)
        self.loop.unsubscribe(rid)

    def _reap(self) -> None:
        while not self._stop.wait(0.5):
            now = time.monotonic()
            with self._lock:
                late = [rid for rid, deadline in self._unattached.items() if deadline < now]
            for rid in late:
                log.warning("no stream attached in time; aborting", extra={"rid": rid})
                self.telemetry.errors_total.labels("stream_not_attached").inc()
                self._drop(rid, "abort")

    def load(self, engine: Engine) -> dict:
        out = engine_load(engine)
        out["outstanding_tokens"] = sum(max(0, r.params.max_new_tokens - len(r.output_ids))
                                        for r in engine.scheduler.running)
        return out

    def close(self) -> None:
        self._stop.set()


def finish_message(req) -> pb.Finish:
    end = req.t_finish or time.perf_counter()
    stats = req.stats
    return pb.Finish(
        reason=req.finish_reason or "abort",
        usage=pb.Usage(prompt_tokens=req.prompt_len, completion_tokens=len(req.output_ids)),
        spec=pb.SpecStats(verify_steps=stats.verify_steps, accepted_drafts=stats.accepted_drafts,
                          accept_length=stats.accept_length, accept_rate=stats.accept_rate,
                          draft_time_s=stats.draft_time_s, verify_time_s=stats.verify_time_s),
        ttft_s=(req.t_first_token or end) - req.t_arrival, latency_s=end - req.t_arrival,
    )


def start_decode(settings: DecodeSettings, engine: Engine | None = None) -> ServiceHandle:
    holder = {}

    def make(loop, s, telemetry):
        holder["servicer"] = DecodeServicer(loop, s, telemetry, telemetry.instance_id)
        return holder["servicer"]

    return start_engine_service("decode", settings, engine, make, pb_grpc.add_DecodeServicer_to_server, SERVICES)
