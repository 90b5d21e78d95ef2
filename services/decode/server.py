"""The decode service: admits hand-offs (pages first), receives K/V + draft state, runs the EAGLE loop.

A request's life here:
- ``Reserve``: the schema is checked (FAILED_PRECONDITION naming both sides), then pages are claimed in
  every cache (``Engine.reserve_handoff``, on the engine loop), or the request is refused (``accepted=false`` with the
  reason) and the router places it elsewhere. From here on its tokens are buffered for ``Stream``. The
  prefill service reserves as a request's prefill starts, naming no output token: its pages then arrive
  chunk by chunk while the prompt is still being prefilled, and the first token with the last chunk.
- ``Transfer``: (one call, or several in parallel each with a range of the layers: the last one to end
  completes the hand-off) the chunks are written straight into the reserved pages while the request is
  RECEIVING (nothing else touches them; an abort cancels the request's ``PageGuard`` before the pages
  can go back to the pool), checked (checksums, order, sizes, coverage, the draft state's shape), and
  the request is activated: it resumes straight into draft() from the transferred state. The
  acknowledgement lets the prefill side free its copy. A broken or bad transfer frees the reservation.
- ``Stream``: the tokens after the first, then a final message with ``finish`` (usage, speculative
  stats, ttft / latency). A stream whose client goes away, or a reservation nobody streams within
  ``stream_attach_timeout_s``, is aborted and its pages freed. ``Abort`` ends it wherever it is.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import math
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc
from pydantic import ValidationError

from proto.eyrie.v1 import eyrie_pb2 as pb
from proto.eyrie.v1 import eyrie_pb2_grpc as pb_grpc
from services.common import ServiceHandle, full_name
from services.decode.relay import DecodeRelay, StreamClock
from services.engine_loop import EngineLoop, TokenEvent
from services.engine_service import start_engine_service
from services.prefill.server import validation_message
from services.settings import DecodeSettings
from services.telemetry import Telemetry
from shared.engine import Engine
from shared.errors import RequestError
from shared.handoff import (
    GrpcStreamTransport,
    HandoffSchema,
    PageGuard,
    PageSink,
    Received,
    SchemaMismatch,
    TransferCancelled,
    TransferError,
    Transport,
    decode_draft_state,
    sampling_from_pb,
    top_logprobs_pb,
)
from shared.handoff.ipc import export_pools, host_id
from shared.handoff.transport import add_decode_servicer
from shared.request import Request
from shared.sampling import SamplingParams

SERVICES = [full_name("Decode")]
_GONE = object()  # put in a Stream call's queue when its client goes away: the call ends at once


class NoReservation(LookupError):
    pass


class Phase(enum.Enum):
    """Where a handed-off request is in its life on this instance (``Incoming.move`` allows only ``NEXT``)."""

    RESERVED = "reserved"  # pages claimed for the hand-off, no transfer opened yet
    RECEIVING = "receiving"  # a transfer opened (a split hand-off: more may open) and has not ended
    DECODING = "decoding"  # in the engine's batch: activated after its transfer, or admitted to be prefilled here
    DEFERRED = "deferred"  # aborted while an in-place sender may still write: its pages wait for its deadline
    ENDED = "ended"  # released (aborted or finished): nothing held; forgotten once no stream reads it


NEXT = {Phase.RESERVED: {Phase.RECEIVING, Phase.DEFERRED, Phase.ENDED},
        Phase.RECEIVING: {Phase.DECODING, Phase.ENDED},
        Phase.DECODING: {Phase.ENDED},
        Phase.DEFERRED: {Phase.ENDED},
        Phase.ENDED: set()}


class Writer(enum.Enum):
    """Who writes the reserved pages."""

    BYTES = "bytes"  # they arrive as bytes over a transfer (or none come: admitted)
    WRITING = "writing"  # the sender writes them in place (ipc, nixl) and may still be writing
    WRITTEN = "written"  # in place, and the sender writes no page any more (its transfer opened, or it said so)


@dataclass(eq=False)
class Incoming:
    """One handed-off request on this instance, from Reserve (or Admit) to the end of its stream: its ``phase``
    (changed under the servicer's lock by ``move``), who writes its pages, and whether a stream reads it."""

    rid: str
    req: Request  # the engine's request (identity guards against a re-placed request of the same id)
    committed_len: int
    events: queue.Queue  # token events from Reserve on (then, on an abort, the reason as a str); a relay's sink
    # once a relay attached it
    sink: PageSink | None  # writes (or, in place, checks) the reserved pages; stops once ``guard`` is cancelled
    # (None: admitted to be prefilled here, ``Admit``: no transfer comes)
    attach_deadline: float
    phase: Phase = Phase.RESERVED
    writer: Writer = Writer.BYTES
    guard: PageGuard = field(default_factory=PageGuard)
    streaming: bool = False  # a Stream (or a router's relay) reads its tokens
    deferred_reason: str | None = None  # DEFERRED: the abort's reason, given when the pages go back
    first_token_to_come: bool = False  # reserved as the prefill started: the first token comes with the last chunk

    def move(self, to: Phase) -> None:
        """Into phase ``to`` (under the servicer's lock); a move ``NEXT`` does not allow is a bug here."""
        if to not in NEXT[self.phase]:
            raise RuntimeError(f"{self.rid}: no move from {self.phase.value} to {to.value}")
        self.phase = to


class DecodeServicer(pb_grpc.DecodeServicer):
    def __init__(self, loop: EngineLoop, settings: DecodeSettings, telemetry: Telemetry, instance_id: str = "",
                 transport: Transport | None = None):
        self.loop, self.settings, self.telemetry = loop, settings, telemetry
        self.log = loop.log
        self.instance_id = instance_id
        self.schema = loop.schema
        self.transport = transport or GrpcStreamTransport()  # receives both transports' transfers
        forced = settings.handoff_transport
        # Once, for every prefill (a tensor-parallel engine's: its landing cache and draft pools, on rank 0).
        self.exported = export_pools(loop.kv_pools) if forced != "grpc-stream" and loop.kv_pools else b""
        self.offered = [t for t in ("ipc", "grpc-stream") if forced in ("auto", t) and (t != "ipc" or self.exported)]
        self.nixl = b""  # with handoff_transport=nixl: its NIXL agent's metadata and pools (made at start)
        self.nixl_agent = None
        if forced == "nixl":
            from shared.handoff.nixl import NixlAgent

            self.nixl_agent = NixlAgent("decode")  # kept: the agent's connections live as long as it does
            self.nixl = self.nixl_agent.export(loop.kv_pools)
            self.offered = ["nixl", "grpc-stream"]
        self._lock = threading.Lock()
        self._incoming: dict[str, Incoming] = {}
        self._relays: set[DecodeRelay] = set()  # the routers' open relay calls
        self._reserving: set[str] = set()  # request ids between Reserve's checks and its reply
        self._stop = threading.Event()
        self._reap_at = math.inf  # the reaper wakes then (the earliest attach or in-place deadline it knows)
        self._reap_wake = threading.Event()  # set for a deadline earlier than _reap_at, and at close
        self._reaper = threading.Thread(target=self._reap, name="decode-reaper", daemon=True)
        self._reaper.start()

    # ---- admission -------------------------------------------------------------------------------
    def _check_schema(self, msg: pb.HandoffSchema, context, rid: str | None = None) -> None:
        try:
            self.schema.check(HandoffSchema.from_pb(msg), me=f"decode {self.instance_id}".strip(), them="prefill")
        except SchemaMismatch as e:
            self.telemetry.errors_total.labels("schema_mismatch").inc()
            self.log.event("schema_mismatch", rid, logging.WARNING, peer=context.peer(), reason=str(e))
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))

    def Handshake(self, request: pb.HandoffSchema, context):  # noqa: N802
        self._check_schema(request, context)
        return pb.HandshakeResponse(instance_id=self.instance_id, host_id=host_id(), transports=self.offered,
                                    pools=self.exported if "ipc" in self.offered else b"", nixl=self.nixl)

    @staticmethod
    def _params(request: pb.ReserveRequest | pb.AdmitRequest, context) -> SamplingParams:
        """The request's sampling parameters; INVALID_ARGUMENT for an empty id or bad parameters."""
        if not request.request_id:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id: must not be empty")
        try:
            return sampling_from_pb(request.sampling)
        except ValidationError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"sampling.{validation_message(e)}")

    @contextlib.contextmanager
    def _claimed(self, rid: str) -> Iterator[bool]:
        """``rid`` held as being taken in here (True), or False when it is here already or being taken in."""
        with self._lock:
            taken = rid in self._incoming or rid in self._reserving
            if not taken:
                self._reserving.add(rid)
        try:
            yield not taken
        finally:
            if not taken:
                with self._lock:
                    self._reserving.discard(rid)

    def Reserve(self, request: pb.ReserveRequest, context):  # noqa: N802
        rid = request.request_id
        self._check_schema(request.schema, context, rid)
        params = self._params(request, context)
        # The token at committed_len (the bonus) must be known, or be the first token, still to come with the
        # last chunk when the reservation names no output (made as the prefill starts: committed_len = the prompt).
        to_come = 0 if request.output_ids else 1
        known = len(request.prompt_ids) + len(request.output_ids) + to_come
        if not 0 < request.committed_len < known or (to_come and request.committed_len != len(request.prompt_ids)):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"committed_len: {request.committed_len} is not in "
                                                            f"[1, {known}) for {known} known tokens, or not the "
                                                            "prompt's length without an output token")
        with self._claimed(rid) as claimed:
            if not claimed:
                return pb.ReserveResponse(accepted=False, reason=f"request_id: {rid!r} is already here")
            if request.in_place and not {"ipc", "nixl"} & set(self.offered):
                return pb.ReserveResponse(accepted=False,
                                          reason=f"this decode instance offers {self.offered}, not ipc or nixl")
            return self._reserve(rid, request, params)

    def _reserve(self, rid: str, request: pb.ReserveRequest, params) -> pb.ReserveResponse:
        events = self.loop.subscribe(rid)
        guard = PageGuard()

        def reserve(engine: Engine):  # the transfer's sink too: its pages are fixed from here
            req = engine.reserve_handoff(rid, list(request.prompt_ids), list(request.output_ids),
                                         list(request.output_logprobs), params, request.committed_len,
                                         cached=request.skip_cached)
            if req is None:
                return None, None
            sink = engine.page_sink(req, guard, request.in_place)
            if sink is None:  # no room to land it in place now (a tensor-parallel engine): refused as if full
                engine.release(req, "abort")
                return None, None
            return req, sink

        try:
            req, sink = self.loop.call_soon(reserve).result()  # free pages only: served mid-step too
        except RequestError as e:  # this instance can never hold it (or already has it): place elsewhere
            self.loop.unsubscribe(rid, events)
            self.log.event("refused", rid, reason=str(e))
            return pb.ReserveResponse(accepted=False, reason=str(e))
        if req is None:
            self.loop.unsubscribe(rid, events)
            load = self.loop.load  # published right after the refusal
            self.telemetry.errors_total.labels("decode_full").inc()
            reason = f"no room now ({load.free_pages[0]} free target pages, {load.running} running)"
            self.log.event("refused", rid, reason=reason, kind="decode_full")
            return pb.ReserveResponse(accepted=False, reason=reason)
        inc = Incoming(rid, req, request.committed_len, events, sink, guard=guard,
                       writer=Writer.WRITING if request.in_place else Writer.BYTES,
                       attach_deadline=time.monotonic() + self.settings.stream_attach_timeout_s,
                       first_token_to_come=not request.output_ids)
        self._track(inc)
        self.log.event("reserved", rid, prompt_tokens=len(request.prompt_ids), committed_len=request.committed_len,
                       max_new_tokens=params.max_new_tokens, in_place=request.in_place)
        # In place, the sender writes until the attach deadline at the latest (the same host, the same clock).
        return pb.ReserveResponse(accepted=True, pages=[pb.PageList(ids=p) for p in sink.page_ids]
                                  if request.in_place else [],
                                  write_deadline=inc.attach_deadline if request.in_place else 0.0,
                                  cached_pages=sink.held)

    def Admit(self, request: pb.AdmitRequest, context):  # noqa: N802
        """A prompt prefilled here (conditional disaggregation): the engine takes it as a new request and folds
        its prefill into the decode steps, as the single-process engine does; its tokens, the first one
        included, go to ``Stream``. Refused (``accepted=false``) when the engine cannot hold it."""
        rid = request.request_id
        params = self._params(request, context)
        with self._claimed(rid) as claimed:
            if not claimed:
                return pb.ReserveResponse(accepted=False, reason=f"request_id: {rid!r} is already here")
            events = self.loop.subscribe(rid)
            try:  # joins the next step, as a prefill service's request does (served while a step computes)
                req = self.loop.call_soon(lambda engine: engine.add_request(
                    list(request.prompt_ids), params, rid=rid)).result()
            except (RequestError, RuntimeError) as e:  # cannot hold it (or the loop stopped): place it elsewhere
                self.loop.unsubscribe(rid, events)
                self.log.event("refused", rid, reason=str(e), kind="admit")
                return pb.ReserveResponse(accepted=False, reason=str(e))
            inc = Incoming(rid, req, len(request.prompt_ids), events, None, phase=Phase.DECODING,
                           attach_deadline=time.monotonic() + self.settings.stream_attach_timeout_s)
            self._track(inc)
        self.telemetry.local_prefills_total.inc()
        self.log.event("admitted", rid, prompt_tokens=len(request.prompt_ids), max_new_tokens=params.max_new_tokens)
        return pb.ReserveResponse(accepted=True)

    # ---- the transfer ----------------------------------------------------------------------------
    def Transfer(self, request_iterator, context):  # noqa: N802
        t0 = time.perf_counter()
        opened: list[Incoming] = []

        def open_sink(rid: str) -> PageSink:
            with self._lock:
                inc = self._incoming.get(rid)
                another = inc is not None and inc.phase is Phase.RECEIVING and inc.sink is not None \
                    and inc.sink.takes_another_stream()
                if inc is None or inc.sink is None or not (another or inc.phase in (Phase.RESERVED, Phase.DEFERRED)):
                    if inc is None or inc.sink is None or not inc.guard.cancelled:
                        raise NoReservation(f"request_id: {rid!r} has no reservation waiting for a transfer here")
                    raise TransferCancelled(f"{rid} was aborted before its transfer")
                if inc.phase is Phase.RESERVED:
                    inc.move(Phase.RECEIVING)
            opened.append(inc)
            if inc.writer is Writer.WRITING:  # the sender opens the call only after its last write
                self._writer_done(inc)
            if inc.guard.cancelled:
                raise TransferCancelled(f"{rid} was aborted before its transfer")
            return inc.sink

        try:
            received = self.transport.receive(request_iterator, open_sink)
            inc = opened[0]
            if not received.complete:  # one of several streams: the last one to end activates the request
                return pb.TransferAck(bytes=received.bytes, chunks=received.chunks)
            state = decode_draft_state(received.draft_state, self.schema, inc.committed_len, self.loop.device)
            check_first_token(inc, received)
        except NoReservation as e:
            context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        except TransferCancelled as e:
            context.abort(grpc.StatusCode.ABORTED, str(e))
        except TransferError as e:
            self.telemetry.errors_total.labels("transfer").inc()
            self._drop(opened, f"transfer failed: {e}")
            context.abort(grpc.StatusCode.DATA_LOSS, f"hand-off refused: {e}")
        except grpc.RpcError:  # the sender went away mid-transfer (cancelled, deadline, connection lost)
            self.telemetry.errors_total.labels("transfer_broken").inc()
            self._drop(opened, "transfer broken")
            context.abort(grpc.StatusCode.CANCELLED, "the transfer broke off")
        except Exception as e:
            self.log.exception("handoff_failed", opened[0].rid if opened else None, reason=str(e))
            self._drop(opened, f"transfer failed: {e}")
            context.abort(grpc.StatusCode.INTERNAL, f"transfer failed: {e}")

        if not self._activate(inc, state, received):
            context.abort(grpc.StatusCode.ABORTED, f"{inc.rid} was aborted during its transfer")
        dt = time.perf_counter() - t0
        self.telemetry.handoff_bytes_total.inc(received.bytes)
        self.telemetry.handoff_seconds.observe(dt)
        self.log.event("handoff_received", inc.rid, bytes=received.bytes, chunks=received.chunks,
                       seconds=round(dt, 6))
        return pb.TransferAck(bytes=received.bytes, chunks=received.chunks)

    def _activate(self, inc: Incoming, state, received: Received) -> bool:
        """Every page arrived: the request joins the engine's batch (straight into draft(): no pseudo-forward),
        decoding from now on; False when it was aborted meanwhile (its release stands)."""
        def activate(engine: Engine) -> bool:
            return engine.activate_handoff(inc.req, inc.committed_len, state, received.output_ids,
                                           received.output_logprobs)

        if not self.loop.call(activate).result():
            return False
        with self._lock:
            if inc.phase is Phase.RECEIVING:  # (an abort since may have ended it)
                inc.move(Phase.DECODING)
        return True

    def _drop(self, opened: list[Incoming], reason: str) -> None:
        for inc in opened:
            self._abort(inc, reason)

    # ---- streaming -------------------------------------------------------------------------------
    def _claim_stream(self, rid: str) -> tuple[Incoming | None, grpc.StatusCode | None, str]:
        """The request ``rid`` for a stream to attach to (marked streaming), or the status refusing it."""
        with self._lock:
            inc = self._incoming.get(rid)
            if inc is None:
                return None, grpc.StatusCode.NOT_FOUND, f"request_id: {rid!r} is not on this decode instance"
            if inc.streaming:
                return None, grpc.StatusCode.FAILED_PRECONDITION, f"request_id: {rid!r} is already being streamed"
            inc.streaming = True
        self.log.event("stream_attached", rid)
        return inc, None, ""

    def Stream(self, request: pb.StreamRequest, context):  # noqa: N802
        """One request's tokens: the call waits on the request's queue (no polling), so a token goes out as soon
        as the engine loop publishes it; its client going away puts ``_GONE`` there."""
        rid = request.request_id
        inc, code, details = self._claim_stream(rid)
        if inc is None:
            context.abort(code, details)
        if not context.add_callback(lambda: self._client_gone(inc)):  # runs when the call ends (normally: a no-op)
            self._client_gone(inc)  # it ended already
        clock = StreamClock()
        idle_s = self.settings.stream_idle_timeout_s
        try:
            while True:
                try:
                    ev = inc.events.get(timeout=idle_s)
                except queue.Empty:
                    self._abort(inc, "no token for too long")
                    context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"{rid}: no token for {idle_s}s")
                if ev is _GONE:
                    return
                if isinstance(ev, str):  # aborted on this instance
                    context.abort(grpc.StatusCode.ABORTED, f"{rid} was aborted on the decode instance: {ev}")
                msg = self.stream_message(inc, ev, clock)
                if ev.finish_reason == "error":
                    context.abort(grpc.StatusCode.INTERNAL, f"{rid} failed on the decode instance (engine error)")
                yield msg
                if ev.finish_reason is not None:
                    return
        finally:
            self._forget(inc)

    def _client_gone(self, inc: Incoming) -> None:
        """A Stream call ended: a request still running is aborted, and the call, if it still waits, ends."""
        self._abort(inc, "the stream's client went away")
        inc.events.put(_GONE)

    def stream_message(self, inc: Incoming, ev: TokenEvent, clock: StreamClock) -> pb.GenerateResponse:
        """The client's message for one of ``inc``'s token events (its finish filled in and logged at the end)."""
        rid = inc.rid
        now = time.perf_counter()
        if ev.token_ids:
            if not (clock.first and inc.sink is None):  # an admitted prompt's first token: a time to first token
                self.telemetry.inter_token_seconds.observe((now - clock.last) / len(ev.token_ids))
            if clock.first:  # the first token this instance generated (after a hand-off, the prefill side
                self.log.event("first_token", rid, tokens=len(ev.token_ids))  # sampled the one before)
                clock.first = False
        clock.last = now
        msg = pb.GenerateResponse(request_id=rid, token_ids=ev.token_ids, logprobs=ev.logprobs,
                                  top_logprobs=[top_logprobs_pb(t) for t in ev.top_logprobs])
        if ev.finish_reason is None:
            return msg
        if ev.request is not None:
            self.telemetry.observe_finished(ev.request)
            msg.finish.CopyFrom(finish_message(ev.request))
        else:
            msg.finish.reason = ev.finish_reason
        if ev.finish_reason != "error":  # an engine error was logged (failed) by the engine loop
            spec = msg.finish.spec
            self.log.event("finished", rid, reason=ev.finish_reason, output_tokens=msg.finish.usage.completion_tokens,
                           accept_length=round(spec.accept_length, 4), verify_steps=spec.verify_steps,
                           latency_s=round(msg.finish.latency_s, 6))
        return msg

    def Relay(self, request_iterator, context):  # noqa: N802
        """Every token of the requests a router attaches, batched (``services/decode/relay.py``)."""
        relay = DecodeRelay(self, context)
        with self._lock:
            self._relays.add(relay)
        try:
            yield from relay.run(request_iterator)
        finally:
            with self._lock:
                self._relays.discard(relay)

    def end_relays(self) -> None:
        """Drained: every router's relay call ends now (it never ends by itself: the server's graceful stop
        would wait for it to the end of the drain period)."""
        with self._lock:
            relays = list(self._relays)
        for relay in relays:
            relay.finish()

    # ---- aborts and clean-up ---------------------------------------------------------------------
    def Abort(self, request: pb.AbortRequest, context):  # noqa: N802
        with self._lock:
            inc = self._incoming.get(request.request_id)
        if request.resend_as_bytes:
            return pb.AbortResponse(found=inc is not None and self._to_bytes(inc))
        if inc is not None and request.sender_stopped and inc.writer is Writer.WRITING:
            self._writer_done(inc)
        return pb.AbortResponse(found=inc is not None and self._abort(inc, "aborted by request"))

    def _abort(self, inc: Incoming, reason: str) -> bool:
        """Abort ``inc`` wherever it is (reserved, receiving, decoding); True if it was still running."""
        inc.guard.cancel()  # a transfer writes its pages no more (waits for a chunk being written)
        with self._lock:
            # Only before any transfer opened: the sender opens one after its last write.
            defer = inc.writer is Writer.WRITING and time.monotonic() < inc.attach_deadline \
                and inc.phase in (Phase.RESERVED, Phase.DEFERRED)
            if defer and inc.phase is Phase.RESERVED:
                inc.move(Phase.DEFERRED)
                inc.deferred_reason = reason
                self._reap_by(inc.attach_deadline)
        if defer:  # another process may still be writing these pages: they go back at its deadline
            self.log.event("abort_deferred", inc.rid, reason=reason, seconds_left=round(
                inc.attach_deadline - time.monotonic(), 3))
            inc.events.put(reason)
            return True
        return self._release(inc, reason)

    def _to_bytes(self, inc: Incoming) -> bool:
        """The in-place sender's write failed and it stopped writing: the reservation now waits for the pages as
        bytes (the same pages, none counted as written). False when that is no longer possible (aborted, or a
        transfer already opened)."""
        with self._lock:
            if inc.writer is not Writer.WRITING or inc.phase is not Phase.RESERVED or inc.guard.cancelled:
                return False
            inc.writer, inc.sink.in_place = Writer.BYTES, False
        self.log.event("resend_as_bytes", inc.rid, logging.WARNING)
        return True

    def _writer_done(self, inc: Incoming) -> None:
        """The in-place sender writes no page any more: an abort deferred for it completes now."""
        with self._lock:
            inc.writer = Writer.WRITTEN
            reason = inc.deferred_reason if inc.phase is Phase.DEFERRED else None
        if reason is not None:
            self._release(inc, reason)

    def _release(self, inc: Incoming, reason: str) -> bool:
        """The one way a request's pages go back on an abort: ENDED, the engine releases it, an attached stream
        ends with ABORTED; forgotten unless a stream still reads it (it forgets it as it ends)."""
        with self._lock:
            ended = inc.phase is Phase.ENDED
            if not ended:
                inc.move(Phase.ENDED)

        def abort(engine: Engine) -> bool:
            return engine.release(inc.req, "abort")

        try:
            found = False if ended else self.loop.call(abort).result(timeout=30)
        except Exception:  # the loop stopped (shutdown)
            found = False
        if found:
            self.log.event("aborted", inc.rid, reason=reason)
            self.telemetry.requests_total.labels("abort").inc()
            inc.events.put(reason)  # an attached stream ends with ABORTED
        if not inc.streaming:
            self._forget(inc)
        return found

    def _forget(self, inc: Incoming) -> None:
        with self._lock:
            if self._incoming.get(inc.rid) is inc:
                del self._incoming[inc.rid]
        self.loop.unsubscribe(inc.rid, inc.events)

    def _track(self, inc: Incoming) -> None:
        """``inc`` is here from now on; the reaper wakes by its attach deadline."""
        with self._lock:
            self._incoming[inc.rid] = inc
            self._reap_by(inc.attach_deadline)

    def _reap_by(self, deadline: float) -> None:  # under self._lock
        if deadline < self._reap_at:
            self._reap_at = deadline
            self._reap_wake.set()

    def _reap(self) -> None:
        """Aborts what no stream attached to by its deadline, and releases in-place reservations whose sender's
        lease ended; it sleeps until the earliest such deadline (woken for an earlier one), not on a period."""
        while not self._stop.is_set():
            now = time.monotonic()
            with self._lock:
                self._reap_wake.clear()
                deferred = [i for i in self._incoming.values() if i.phase is Phase.DEFERRED]
                waiting = [i for i in self._incoming.values()
                           if not i.streaming and i.phase not in (Phase.DEFERRED, Phase.ENDED)]
                late = [i for i in waiting if i.attach_deadline < now]
                expired = [i for i in deferred if i.attach_deadline < now]
                self._reap_at = min((i.attach_deadline for i in (*waiting, *deferred)
                                     if i.attach_deadline >= now), default=math.inf)
            for inc in expired:  # the in-place sender's lease is over: it writes no page any more
                self._writer_done(inc)
            for inc in late:
                self.telemetry.errors_total.labels("stream_not_attached").inc()
                self._abort(inc, f"no stream attached within {self.settings.stream_attach_timeout_s}s")
            if not late and not expired:
                self._reap_wake.wait(None if self._reap_at == math.inf else self._reap_at - now + 0.001)

    def before_fail(self, rid: str) -> None:
        with self._lock:
            inc = self._incoming.get(rid)
        if inc is not None:
            inc.guard.cancel()

    def after_step(self, engine: Engine) -> None:
        self.telemetry.observe_load(self.loop.load)
        self.telemetry.observe_loop(self.loop.times)

    def while_stepping(self, engine: Engine) -> None:
        """Nothing to start during a step: reservations come as ``call_soon`` calls."""

    def close(self) -> None:
        self._stop.set()
        self._reap_wake.set()
        with self._lock:
            incoming = list(self._incoming.values())
        for inc in incoming:
            inc.guard.cancel()
        self.transport.close()
        if self.nixl_agent is not None:
            self.nixl_agent.close()


def check_first_token(inc: Incoming, received: Received) -> None:
    """The first token arrived with the last chunk exactly when the reservation did not name it."""
    if inc.first_token_to_come and (len(received.output_ids) != 1 or len(received.output_logprobs) != 1):
        raise TransferError(f"the reservation named no output token: the last chunk must carry the first token "
                            f"and its logprob, it carries {len(received.output_ids)} and "
                            f"{len(received.output_logprobs)}")
    if not inc.first_token_to_come and received.output_ids:
        raise TransferError("the reservation named the output tokens; the last chunk carries more")


def finish_message(req: Request) -> pb.Finish:
    end = req.t_finish or time.perf_counter()
    stats = req.stats
    return pb.Finish(
        reason=req.finish_reason or "abort",
        usage=pb.Usage(prompt_tokens=req.prompt_len, completion_tokens=len(req.output_ids),
                       cached_tokens=req.cached_tokens),
        spec=pb.SpecStats(verify_steps=stats.verify_steps, accepted_drafts=stats.accepted_drafts,
                          accept_length=stats.accept_length, accept_rate=stats.accept_rate,
                          draft_time_s=stats.draft_time_s, verify_time_s=stats.verify_time_s),
        ttft_s=(req.t_first_token or end) - req.t_arrival, latency_s=end - req.t_arrival,
    )


def start_decode(settings: DecodeSettings, engine: Engine | None = None) -> ServiceHandle:
    def make(loop: EngineLoop, telemetry: Telemetry, instance_id: str) -> DecodeServicer:
        return DecodeServicer(loop, settings, telemetry, instance_id)

    return start_engine_service("decode", settings, engine, make, add_decode_servicer, SERVICES)
