"""The prefill service: chunked prefill + the first draft extend, the first token, then the hand-off.

``Prefill`` streams two events: ``first_token`` once the prompt's last chunk ran, the first token was
sampled and the decode instance holds the request's pages (``decode_reserved``: from here a failure is
a failover, so the router streams the token at once), then ``handed_off`` once the decode instance
acknowledged the request's pages and draft state. A request with max_new_tokens=1 is never handed off;
one that ends at its first token (EOS, a stop token) stops the hand-off under way and frees the decode
side's reservation.

The hand-off overlaps the prefill. It starts on the engine thread as the request arrives when its first
chunk runs in the next step, else while that chunk computes (``while_stepping``; ``after_step`` where
the step sampled nothing), so the first token seldom waits for the reservation, and runs on a hand-off
worker: ``Decode.Handshake`` (once per decode address), ``Decode.Reserve`` (refused -> RESOURCE_EXHAUSTED
before the first token, so the router places the request elsewhere; the prefill stops there), then the
transport sends each increment the engine thread feeds it after each of the request's steps (the pages
that step completed, then, once the prompt is done, the draft state and the first token) while the next
chunk computes (pages an increment names are written no more, so reading them off the engine thread is
safe; an abort first cancels the request's ``PageGuard``). The pages are freed after the
acknowledgement, or on any failure; a failure after a successful Reserve also aborts it on the decode
side. A client that goes away, or ``Prefill.Abort``, aborts the request wherever it is.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for
from dataclasses import dataclass

import grpc
from pydantic import ValidationError

from proto.eyrie.v1 import eyrie_pb2 as pb
from proto.eyrie.v1 import eyrie_pb2_grpc as pb_grpc
from services.common import ServiceHandle, auth_channel_pool, full_name
from services.engine_loop import EngineLoop, TokenEvent
from services.engine_service import start_engine_service
from services.settings import PrefillSettings
from services.telemetry import Telemetry
from shared.engine import Engine
from shared.errors import RequestError
from shared.handoff import (
    ChannelPool,
    DecodeClient,
    GrpcStreamTransport,
    InPlaceTarget,
    IpcTransport,
    NixlTransport,
    PageSource,
    TransferCancelled,
    TransferError,
    Transport,
    TransportFailed,
    negotiate,
    sampling_from_pb,
    sampling_to_pb,
    top_logprobs_pb,
)
from shared.handoff.wire import chunk_pages
from shared.request import Request

SERVICES = [full_name("Prefill")]
IN_PLACE = ("ipc", "nixl")  # transports that write the reserved pages themselves (the reservation says so)
POLL_S = 0.25  # how often a waiting RPC checks that its client is still there


def held_pages(reply: pb.ReserveResponse, reserve: pb.ReserveRequest, page_size: int) -> int:
    """The leading pages the decode side holds (its prefix cache's: the hand-off skips them), checked: never the
    page holding the last position it reserved for (TransferError)."""
    if reply.cached_pages * page_size >= reserve.committed_len:
        raise TransferError(f"the decode side holds {reply.cached_pages} pages of {page_size} positions, the "
                            f"hand-off carries {reserve.committed_len}: it cannot hold the last one")
    return reply.cached_pages


def validation_message(e: ValidationError) -> str:
    """``field: message`` of the first pydantic error (INVALID_ARGUMENT details name the field)."""
    err = e.errors()[0]
    return f"{'.'.join(str(x) for x in err['loc'])}: {err['msg']}"


@dataclass
class HandoffOutcome:
    """What the hand-off worker reports to the Prefill RPC."""

    ack: pb.TransferAck | None = None
    seconds: float = 0.0  # what the hand-off added after the prompt's last chunk (it overlaps the prefill)
    code: grpc.StatusCode | None = None  # set on failure
    transport: str = ""  # the transport that carried it
    message: str = ""


@dataclass
class Reserved:
    """The hand-off worker's word that the decode instance holds the request's pages: from here a failure is a
    failover, so the first token may reach the client."""


class Phase(enum.Enum):
    """Where a Prefill call's request is (``Job.move`` allows only ``AFTER``; the last two are final)."""

    PREFILLING = "prefilling"  # its prompt computes; no hand-off under way yet
    HANDING_OFF = "handing_off"  # a hand-off worker reserves on the decode instance, then sends as chunks compute
    RESERVED = "reserved"  # the decode instance holds its pages: a failure from here is a failover
    HANDED_OFF = "handed_off"  # the decode instance has every byte: released here, the request is the decode's
    ENDED = "ended"  # aborted, failed, or finished at its first token: released here


AFTER = {Phase.PREFILLING: {Phase.HANDING_OFF, Phase.ENDED}, Phase.HANDING_OFF: {Phase.RESERVED, Phase.ENDED},
         Phase.RESERVED: {Phase.HANDED_OFF, Phase.ENDED}, Phase.HANDED_OFF: set(), Phase.ENDED: set()}


@dataclass
class Job:
    """One Prefill RPC: its request, its ``phase``, where it goes, and the queue its events arrive on."""

    rid: str
    decode_address: str
    events: queue.Queue  # the engine loop's token events, Reserved, then one HandoffOutcome
    req: Request | None = None  # the engine's request (identity guards against a re-placed same id)
    source: PageSource | None = None  # set when the hand-off starts (on arrival, or as the first chunk computes)
    fed: int = 0  # the request's committed length when the last increment was fed to the source
    t_prompt_done: float = 0.0  # when the last increment (the prompt done) was fed
    phase: Phase = Phase.PREFILLING

    def move(self, to: Phase) -> bool:
        """Into ``to`` (under the servicer's lock); False once final (a later word on an ended call, from another
        thread, changes nothing); a move ``AFTER`` does not allow otherwise is a bug here."""
        if not AFTER[self.phase]:
            return False
        if to not in AFTER[self.phase]:
            raise RuntimeError(f"{self.rid}: no move from {self.phase.value} to {to.value}")
        self.phase = to
        return True


class PrefillServicer(pb_grpc.PrefillServicer):
    def __init__(self, loop: EngineLoop, settings: PrefillSettings, telemetry: Telemetry,
                 transport: Transport | None = None, channels: ChannelPool | None = None):
        self.loop, self.settings, self.telemetry = loop, settings, telemetry
        self.log = loop.log
        self.schema = loop.schema
        for per_page in self.schema.page_bytes():  # a chunk size below one page fails now, not per request
            chunk_pages(per_page, settings.handoff_chunk_bytes)
        self.channels = channels or auth_channel_pool(settings.api_key)  # the decode side asks for the key too
        self.client = DecodeClient(self.channels, self.schema)
        # The transports, one chosen per decode instance at its handshake (``transport``: always that one).
        self.transports: dict[str, Transport] = {
            "grpc-stream": GrpcStreamTransport(self.channels, settings.handoff_chunk_bytes, settings.handoff_streams),
            "ipc": IpcTransport(self.channels), "nixl": NixlTransport(self.channels)}
        self.fixed_transport = transport
        self._chosen: dict[str, str] = {}  # decode address -> the transport logged for it
        self._proven: set[tuple[str, str]] = set()  # (decode address, transport) that carried a hand-off there
        self._unusable: dict[str, dict[str, str]] = {}  # decode address -> transports failed at first use -> why
        self._jobs: dict[str, Job] = {}
        self._lock = threading.Lock()
        self._workers = ThreadPoolExecutor(max_workers=settings.handoff_workers, thread_name_prefix="handoff")
        self._closed = False

    # ---- the RPCs --------------------------------------------------------------------------------
    def Prefill(self, request: pb.PrefillRequest, context):  # noqa: N802
        rid = request.request_id
        if not rid:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id: must not be empty")
        if not request.decode_address:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "decode_address: must not be empty")
        try:
            params = sampling_from_pb(request.sampling)
        except ValidationError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"sampling.{validation_message(e)}")
        job = Job(rid, request.decode_address, self.loop.subscribe(rid))
        with self._lock:
            if rid in self._jobs or self._closed:
                self.loop.unsubscribe(rid, job.events)
                context.abort(grpc.StatusCode.INVALID_ARGUMENT if not self._closed else grpc.StatusCode.UNAVAILABLE,
                              f"request_id: {rid!r} is already running here" if not self._closed else "shutting down")
            self._jobs[rid] = job
        context.add_callback(lambda: self._end(job))
        def add(engine: Engine) -> None:  # job.req is set on the loop thread: an abort queued behind sees it
            job.req = engine.add_request(list(request.prompt_ids), params, rid=rid, output_ids=list(request.resume_ids),
                                         output_logprobs=list(request.resume_logprobs))
            if params.max_new_tokens > 1 and engine.starts_next(job.req):  # else: as its first chunk computes
                self._start_hand_off(engine, job, job.req)

        # Added while a step computes (``call_soon``): the request joins the next step instead of waiting for
        # this one to end first (a prompt's time to first token). A split engine's loop serves it between steps
        # (its ranks replay calls in order: ``services/followers.py``).
        try:
            self.loop.call_soon(add).result()
        except RequestError as e:
            self._forget(job)
            self.log.event("refused", rid, field=e.field, message=str(e))
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except RuntimeError as e:  # the loop stopped under us
            self._forget(job)
            self.log.event("refused", rid, message=str(e))
            context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        self.log.event("received", rid, prompt_tokens=len(request.prompt_ids), decode=request.decode_address,
                       max_new_tokens=params.max_new_tokens, resume_tokens=len(request.resume_ids))
        try:
            yield from self._run(job, context)
        finally:
            self._forget(job)

    def _run(self, job: Job, context):
        if job.req.resumed:  # a failover's: nothing to sample, the decode side resumes after the client's tokens
            yield from self._handed_off(job, context)
            return
        t0 = time.perf_counter()
        ev = self._first_token(job, context)
        if ev is None:
            return  # the client went away (its callback aborts the request)
        seconds = time.perf_counter() - t0
        self.telemetry.stage_seconds.labels("prefill").observe(seconds)
        self.telemetry.ttft_seconds.observe(time.perf_counter() - job.req.t_arrival)
        self.log.event("prefill_done", job.rid, seconds=round(seconds, 6), first_token=ev.token_ids[0],
                       finish_reason=ev.finish_reason)
        first = pb.FirstToken(token_id=ev.token_ids[0], logprob=ev.logprobs[0], finish_reason=ev.finish_reason or "",
                              decode_reserved=ev.finish_reason is None)
        if ev.top_logprobs:
            first.top_logprobs.CopyFrom(top_logprobs_pb(ev.top_logprobs[0]))
        yield pb.PrefillEvent(first_token=first)
        if ev.finish_reason is not None:  # ended at its first token: nothing to hand off
            self._move(job, Phase.ENDED)
            if job.source is not None:  # the hand-off under way stops (and frees the decode side's pages)
                job.source.guard.cancel()
            self.telemetry.requests_total.labels(ev.finish_reason).inc()
            self.log.event("finished", job.rid, reason=ev.finish_reason, output_tokens=1)
            return
        yield from self._handed_off(job, context)

    def _handed_off(self, job: Job, context):
        """The ``handed_off`` event once the hand-off succeeded (or the call's end with its error)."""
        outcome = self._next(job, context)
        while isinstance(outcome, Reserved):  # a resumed request's reservation: its outcome comes next
            outcome = self._next(job, context)
        if outcome is None:
            return
        if isinstance(outcome, TokenEvent):  # aborted, or an engine error, before the hand-off ended
            code = grpc.StatusCode.INTERNAL if outcome.finish_reason == "error" else grpc.StatusCode.ABORTED
            context.abort(code, f"request {job.rid} ended before its hand-off ({outcome.finish_reason})")
        if outcome.code is not None:
            context.abort(outcome.code, outcome.message)
        self.telemetry.observe_handoff(outcome.transport, outcome.ack.bytes, outcome.seconds)
        self.telemetry.stage_seconds.labels("handoff").observe(outcome.seconds)
        self.telemetry.requests_total.labels("handed_off").inc()
        yield pb.PrefillEvent(handed_off=pb.HandedOff(bytes=outcome.ack.bytes, seconds=outcome.seconds,
                                                      chunks=outcome.ack.chunks,
                                                      cached_tokens=job.req.cached_tokens if job.req else 0))

    def _first_token(self, job: Job, context) -> TokenEvent | None:
        """The first token once it may reach the client: the decode instance holds the request's pages
        (``Reserved``), or the request ends at this token. A hand-off that failed before, or a request that
        ended during its prefill, ends the call here (nothing has reached the client: the router places
        it again). None once the client is gone."""
        first, reserved = None, False
        while first is None or not (reserved or first.finish_reason is not None):
            ev = self._next(job, context)
            if ev is None:
                return None
            if isinstance(ev, Reserved):
                reserved = True
            elif isinstance(ev, HandoffOutcome):  # the hand-off failed (the request was released)
                context.abort(ev.code or grpc.StatusCode.INTERNAL, ev.message or "the hand-off ended early")
            elif first is None and ev.token_ids:
                first = ev
            else:  # an abort or an engine error, during the prefill or while the reservation was under way
                reason = ev.finish_reason or "aborted"
                code = grpc.StatusCode.INTERNAL if reason == "error" else grpc.StatusCode.ABORTED
                context.abort(code, f"request {job.rid} ended during prefill ({reason})")
        return first

    def _next(self, job: Job, context):
        """The job's next event (a TokenEvent or a HandoffOutcome); None once the client is gone."""
        while context.is_active():
            try:
                return job.events.get(timeout=POLL_S)
            except queue.Empty:
                continue
        return None

    def Abort(self, request: pb.AbortRequest, context):  # noqa: N802
        with self._lock:
            job = self._jobs.get(request.request_id)
        return pb.AbortResponse(found=job is not None and self._abort(job, "aborted by an Abort call"))

    # ---- the hand-off ----------------------------------------------------------------------------
    def while_stepping(self, engine: Engine) -> None:
        """Loop thread, while the device computes a step: start the hand-off of each request whose first
        chunk that step computes, so that the decode side's reservation is under way during the chunk
        (the first token waits for it). Changes no engine state: the step in flight is left alone."""
        for req in engine.prefilled():
            with self._lock:
                job = self._jobs.get(req.rid)
            if job is not None and job.req is req and job.source is None and req.params.max_new_tokens > 1:
                self._start_hand_off(engine, job, req)

    def after_step(self, engine: Engine) -> None:
        """Loop thread: feed each prefilling request's hand-off the pages its last step completed (starting
        the hand-off at its first chunk where ``while_stepping`` did not)."""
        self.telemetry.observe_load(self.loop.load)
        self.telemetry.observe_loop(self.loop.times)
        for req in engine.prefilled():
            with self._lock:
                job = self._jobs.get(req.rid)
            if job is None or job.req is not req:  # its RPC is gone: nobody to hand it to
                engine.release(req, "abort")
                continue
            if req.params.max_new_tokens == 1 or req.kv_len == job.fed:
                continue  # it ends at its first token, or nothing new since the last increment
            if job.source is None and not self._start_hand_off(engine, job, req):
                self._move(job, Phase.ENDED)
                engine.release(req, "abort")
                continue
            if job.source.guard.cancelled and not job.fed:  # its start failed during the step (shutting down)
                continue
            if req.kv_len == req.prefill_len:  # (set before the worker can see the last increment)
                job.t_prompt_done = time.perf_counter()
            job.source.feed.put(engine.handoff_increment(req))
            job.fed = req.kv_len

    def _start_hand_off(self, engine: Engine, job: Job, req: Request) -> bool:
        """Loop thread: reserve on the decode side and send as the prefill goes (a hand-off worker); False
        when the workers are shut down (the Prefill call is told)."""
        job.source = engine.page_source(req, fed=True)
        self._move(job, Phase.HANDING_OFF)
        # The first token comes with the last chunk; a resumed request's outputs are all known now.
        reserve = pb.ReserveRequest(request_id=req.rid, prompt_ids=req.prompt_ids, sampling=sampling_to_pb(req.params),
                                    committed_len=req.prefill_len, output_ids=req.output_ids[:req.resumed],
                                    output_logprobs=req.output_logprobs[:req.resumed], skip_cached=True)
        try:
            self._workers.submit(self._hand_off, job, reserve)
        except RuntimeError:  # shutting down
            job.source.guard.cancel()
            job.events.put(HandoffOutcome(code=grpc.StatusCode.UNAVAILABLE, message="prefill shutting down"))
            return False
        return True

    def _hand_off(self, job: Job, reserve: pb.ReserveRequest) -> None:
        """Worker thread: reserve on the decode instance, send, release after the acknowledgement."""
        address, timeout, t0 = job.decode_address, self.settings.handoff_timeout_s, time.perf_counter()
        reserved, outcome = False, None
        try:
            if job.source.guard.cancelled:
                raise TransferCancelled(job.rid)
            transport = self._transport_to(address, self.client.handshake(address, timeout))
            reserve.in_place = transport.name in IN_PLACE
            reply = self.client.reserve(address, reserve, timeout)
            if not reply.accepted:
                self.telemetry.errors_total.labels("decode_full").inc()
                self.log.event("handoff_refused", job.rid, decode=address, reason=reply.reason)
                outcome = HandoffOutcome(code=grpc.StatusCode.RESOURCE_EXHAUSTED,
                                         message=f"decode {address} cannot hold the request now: {reply.reason}")
                return
            reserved = True
            self._move(job, Phase.RESERVED)  # (an abort since has cancelled the guard: the send stops)
            job.events.put(Reserved())
            job.source.held = held_pages(reply, reserve, job.source.caches[0].page_size)
            ack, transport = self._send(job, address, transport, reply, timeout)
            # Only now: the decode side has every byte. Queued, not awaited: the loop runs it before any call
            # queued after it (the call's end aborts what is still held), so the router hears at once.
            self._move(job, Phase.HANDED_OFF)
            self._release(job, "handed_off", wait=False)
            now = time.perf_counter()  # the hand-off's own time: what it added after the prompt's last chunk
            outcome = HandoffOutcome(ack=ack, seconds=now - max(job.t_prompt_done, t0), transport=transport.name)
            self.log.event("handoff_sent", job.rid, decode=address, bytes=ack.bytes, chunks=ack.chunks,
                           transport=transport.name, seconds=round(outcome.seconds, 6),
                           with_prefill_s=round(now - t0, 6))
        except TransferCancelled:
            outcome = HandoffOutcome(code=grpc.StatusCode.ABORTED, message=f"{job.rid} was aborted during its hand-off")
        except TransferError as e:  # a forced transport the two sides cannot use, or the in-place lease ran out
            self.telemetry.errors_total.labels("handoff").inc()
            outcome = HandoffOutcome(code=grpc.StatusCode.FAILED_PRECONDITION,
                                     message=f"hand-off to decode {address} failed: {e}")
            self.log.event("handoff_failed", job.rid, logging.WARNING, decode=address, reason=outcome.message)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.UNAVAILABLE:
                self.client.forget(address)  # it may come back restarted, with other pools
            kind = "schema_mismatch" if e.code() == grpc.StatusCode.FAILED_PRECONDITION else "handoff"
            self.telemetry.errors_total.labels(kind).inc()
            code = e.code() if e.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.RESOURCE_EXHAUSTED,
                                            grpc.StatusCode.DEADLINE_EXCEEDED) else grpc.StatusCode.UNAVAILABLE
            outcome = HandoffOutcome(code=code, message=f"hand-off to decode {address} failed: "
                                                        f"{e.code().name}: {e.details()}")
            self.log.event("handoff_failed", job.rid, logging.WARNING, decode=address, code=code.name,
                           reason=outcome.message)
        except Exception as e:  # a bug: report it rather than leave the RPC waiting
            self.log.exception("handoff_failed", job.rid, decode=address, reason=str(e))
            self.telemetry.errors_total.labels("handoff").inc()
            outcome = HandoffOutcome(code=grpc.StatusCode.INTERNAL, message=f"hand-off failed: {e}")
        finally:
            if outcome is None or outcome.code is not None:
                job.source.guard.cancel()
                if reserved:
                    self.client.abort(address, job.rid)
                self._move(job, Phase.ENDED)
                self._release(job, "abort")
            job.events.put(outcome)

    def _send(self, job: Job, address: str, transport: Transport, reply: pb.ReserveResponse,
              timeout: float) -> tuple[pb.TransferAck, Transport]:
        """Send the job's pages over ``transport``; one that fails at its first use for ``address`` (before it
        ever carried a hand-off there) is marked unusable for it, and the same reservation is sent again over
        the transport negotiated next (grpc-stream), the pages from the first one on: the request is served,
        not failed. The acknowledgement and the transport that carried it."""
        while True:
            source = job.source
            if transport.name in IN_PLACE:  # a copy sharing the guard: an abort still stops the writes
                handshake = self.client.handshake(address, timeout)
                target = InPlaceTarget(handshake.pools if transport.name == "ipc" else handshake.nixl,
                                       [list(p.ids) for p in reply.pages], reply.write_deadline)
                source = dataclasses.replace(source, in_place=target)
            try:
                ack = transport.send(address, source, timeout)
            except TransportFailed as e:
                transport = self._fall_back(job, address, transport, e)
                continue
            with self._lock:
                self._proven.add((address, transport.name))
            return ack, transport

    def _fall_back(self, job: Job, address: str, failed: Transport, error: TransportFailed) -> Transport:
        """After ``failed`` failed on ``job``'s hand-off: the transport to send it over again, or TransferError
        (``failed`` had carried hand-offs to ``address`` before, was forced, or the decode side cannot switch)."""
        with self._lock:
            proven = (address, failed.name) in self._proven
        if proven or self.fixed_transport is not None or self.settings.handoff_transport != "auto":
            raise TransferError(f"{failed.name} failed: {error}")
        with self._lock:
            self._unusable.setdefault(address, {})[failed.name] = str(error)
            self._chosen.pop(address, None)  # the next choice is logged with its reason
        self.telemetry.errors_total.labels("transport_unusable").inc()
        self.log.event("transport_unusable", job.rid, logging.WARNING, decode=address, transport=failed.name,
                       reason=str(error))
        if not self.client.resend_as_bytes(address, job.rid):
            raise TransferError(f"{failed.name} failed ({error}) and the decode side cannot take the pages "
                                "as bytes instead")
        if job.source.feed is not None:
            job.source.feed.rewind()
        return self._transport_to(address, self.client.handshake(address, self.settings.handoff_timeout_s))

    def _transport_to(self, address: str, reply: pb.HandshakeResponse) -> Transport:
        if self.fixed_transport is not None:
            return self.fixed_transport
        with self._lock:
            unusable = dict(self._unusable.get(address, {}))
        name, why = negotiate(self.settings.handoff_transport, reply, self.loop.device, unusable)
        if address not in self._chosen:
            self._chosen[address] = name
            self.log.event("transport_chosen", decode=address, transport=name, reason=why)
        return self.transports[name]

    def _release(self, job: Job, reason: str, wait: bool = True) -> None:
        def release(engine: Engine) -> bool:
            return job.req is not None and engine.release(job.req, reason)

        def check(done: Future) -> None:  # a stopped loop (shutdown) fails it: the pages go with the process
            if done.exception() is not None:
                self.log.warning("release_failed", job.rid, reason=str(done.exception()))

        done = self.loop.call(release)
        done.add_done_callback(check)
        if wait:
            wait_for([done], timeout=30)

    # ---- aborts and clean-up ---------------------------------------------------------------------
    def _abort(self, job: Job, reason: str) -> bool:
        """Abort the job's request wherever it is; True if it was still running."""
        if job.source is not None:
            job.source.guard.cancel()  # stop the transfer early (it touches the pages no more)

        def abort(engine: Engine) -> bool:
            if job.source is not None:  # set on this thread: a hand-off that started after the check above
                job.source.guard.cancel()
            self._move(job, Phase.ENDED)  # (none once handed off: the request is the decode instance's)
            return job.req is not None and engine.release(job.req, "abort")

        try:
            found = self.loop.call(abort).result(timeout=30)
        except Exception:
            return False
        if found:
            self.telemetry.requests_total.labels("abort").inc()
            self.log.event("aborted", job.rid, reason=reason)
            job.events.put(TokenEvent(job.rid, [], [], "abort"))  # a waiting RPC ends at once
        return found

    def _move(self, job: Job, to: Phase) -> bool:
        with self._lock:
            return job.move(to)

    def _end(self, job: Job) -> None:
        """RPC termination callback (normal end, error, or the client went away)."""
        self._abort(job, "the Prefill call ended (client gone or cancelled)")  # no-op once handed off or released
        self._forget(job)

    def _forget(self, job: Job) -> None:
        with self._lock:
            if self._jobs.get(job.rid) is job:
                del self._jobs[job.rid]
        self.loop.unsubscribe(job.rid, job.events)

    def before_fail(self, rid: str) -> None:
        with self._lock:
            job = self._jobs.get(rid)
        if job is not None and job.source is not None:
            job.source.guard.cancel()

    def close(self) -> None:
        """Shutdown: stop every transfer and the workers (the RPCs end with the server)."""
        with self._lock:
            self._closed = True
            jobs = list(self._jobs.values())
        for job in jobs:
            if job.source is not None:
                job.source.guard.cancel()
        self._workers.shutdown(wait=False, cancel_futures=True)
        for transport in self.transports.values():
            transport.close()
        self.channels.close()


def start_prefill(settings: PrefillSettings, engine: Engine | None = None) -> ServiceHandle:
    def make(loop: EngineLoop, telemetry: Telemetry, instance_id: str) -> PrefillServicer:
        return PrefillServicer(loop, settings, telemetry)  # its log is the loop's (service and instance)

    return start_engine_service("prefill", settings, engine, make, pb_grpc.add_PrefillServicer_to_server, SERVICES)
