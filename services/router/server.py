"""The router: the clients' entry. Validates, records in Redis, places on a (prefill, decode) pair,
and streams tokens back.

Every request the router accepts ends in Redis as ``finished``, ``failed`` (with a reason) or
``aborted`` (with a reason); every transition is recorded with its time. Placement picks the live
instances with the least outstanding tokens, counting what this router placed since their last
heartbeat; where instances publish prefix cache summaries, the prompt goes to the one holding most of its
leading pages within a bound on imbalance (``prefix.py``). Until a decode instance holds the request nothing
has reached the client, so the router places the request again when a decode instance is full
(RESOURCE_EXHAUSTED), speaks another speculative config (FAILED_PRECONDITION, while another instance remains)
or is unreachable, and when the prefill instance is unreachable. The first token goes to the client as soon
as the prefill instance says the decode instance holds the request (``decode_reserved``), while the hand-off
goes on. Once tokens streamed, a broken hand-off
or decode stream is a failover: a prefill instance recomputes the prompt plus the tokens the client has and
hands off to another decode instance (the same one when only the prefill side broke); the client's stream
goes on.
A request of several choices (OpenAI's ``n`` / ``best_of``) is walked as that many requests at once, all
preferring one pair of instances, their messages merged with their index (``choices.py``).
Redis can blink: record writes go through ``RecordWriter`` (retried, buffered, flushed on return).

Everything runs on one event loop per router process (``RouterCore.ensure_loop``): the engines are called
over grpc.aio, Redis (blocking) from an I/O pool in batches (``batches.py``), a decode instance's tokens come
through its relay (``relay.py``), and a request that finds every decode instance full waits in ``admission.py``'s
queue.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import logging
import math
import re
import secrets
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import grpc
from pydantic import ValidationError

from proto.eyrie.v1 import eyrie_pb2 as pb
from proto.eyrie.v1 import eyrie_pb2_grpc as pb_grpc
from services.common import ServiceHandle, ServiceTelemetry, new_instance_id
from services.logs import ServiceLog
from services.metadata import InstanceInfo, Registry, RequestStore, connect
from services.router.admission import Admission, wait_any
from services.router.batches import Batches
from services.router.choices import best_choices, choice_counts, choice_params, choice_rid, merged, pump
from services.router.grpc_api import RouterGrpc
from services.router.prefix import PrefixIndex
from services.router.records import CREATE, REDIS_DOWN, RecordsUnavailable, RecordWrite, RecordWriter
from services.router.relay import Inbox, RelayClient
from services.settings import RouterSettings
from services.telemetry import Telemetry
from shared.handoff import sampling_from_pb, sampling_to_pb
from shared.model.config import ModelConfig
from shared.model.tokenizer import Tokenizer
from shared.request import RequestError
from shared.sampling import SamplingParams
from shared.text import TextStream

RID_PATTERN = re.compile(r"[A-Za-z0-9._:-]{1,128}")  # fullmatch: "$" would let a trailing newline through
# Router -> service channels: keepalive finds a peer that vanished without closing its sockets.
# ``use_local_subchannel_pool``: the router's channels connect on their own. gRPC shares a process's connections to
# one address among its channels by default, so a new channel to an address another channel saw refused (an
# instance that died there, its successor now listening) failed at once with the old "Connection refused" until
# that connection's reconnect backoff ran out (tests/unit/services/test_router.py).
CHANNEL_OPTIONS = [("grpc.keepalive_time_ms", 20_000), ("grpc.keepalive_timeout_ms", 10_000),
                   ("grpc.max_receive_message_length", 64 << 20), ("grpc.use_local_subchannel_pool", 1)]


class RouterError(Exception):
    """A failure after validation, with the gRPC status the client gets."""

    def __init__(self, code: grpc.StatusCode, message: str, retry_after_s: float | None = None,
                 http_status: int | None = None):
        super().__init__(message)
        self.code, self.message = code, message
        self.retry_after_s = retry_after_s  # when to try again (HTTP Retry-After), for a refusal that will pass
        self.http_status = http_status  # where the code's usual HTTP status does not fit (429 for the cap)


@dataclass
class _Placed:
    tokens: int
    arrived: int | None = None  # the instance's heartbeat number when the request reached it


class LoadLedger:
    """Tokens this router placed on each instance that the instance's own figure may not include yet.

    An instance's heartbeat reports its outstanding tokens with a sequence number. A placement counts
    on top of that figure until the request leaves the instance, or until a heartbeat newer than the one
    current when the request arrived there (from then on the instance counts it itself).
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._placed: dict[str, dict[int, _Placed]] = {}
        self._beats: dict[str, int] = {}
        self._keys = itertools.count()

    def load(self, info: InstanceInfo) -> int:
        with self._lock:
            return self._load(info)

    def _load(self, info: InstanceInfo) -> int:  # under self._lock
        self._beats[info.instance_id] = max(self._beats.get(info.instance_id, 0), info.beat)
        entries = self._placed.get(info.instance_id, {})
        for key in [k for k, e in entries.items() if e.arrived is not None and info.beat > e.arrived]:
            del entries[key]
        return info.outstanding_tokens + sum(e.tokens for e in entries.values())

    def place(self, instance_id: str, tokens: int, arrived: bool = False) -> int:
        with self._lock:
            return self._place(instance_id, tokens, arrived)

    def _place(self, instance_id: str, tokens: int, arrived: bool) -> int:
        key = next(self._keys)
        entry = _Placed(tokens, self._beats.get(instance_id, 0) if arrived else None)
        self._placed.setdefault(instance_id, {})[key] = entry
        return key

    def choose(self, live: list[InstanceInfo], tokens: int, arrived: bool = False
               ) -> tuple[InstanceInfo, int] | tuple[None, None]:
        """The least loaded of ``live`` with ``tokens`` placed on it, in one step: concurrent requests see
        each other's choices (choosing, then placing, would let a burst pile onto one instance)."""
        if not live:
            return None, None
        with self._lock:
            best = self._least_loaded(live)
            return best, self._place(best.instance_id, tokens, arrived)

    def choose_prefix(self, live: list[InstanceInfo], tokens: int, arrived: bool, matched: dict[str, int],
                      bound: int) -> tuple[InstanceInfo, int, int]:
        """As ``choose`` (``live`` not empty), preferring the instances that hold the prompt's leading tokens
        (``matched``, by instance id): among those whose load is within ``bound`` tokens of the least loaded
        one's, the one whose load less its matched tokens is least (then the longest match, then the id);
        (the instance, its ledger key, its matched tokens). With nothing matched, the least loaded one."""
        with self._lock:
            best = self._best_prefix(live, matched, bound)
            return best, self._place(best.instance_id, tokens, arrived), matched.get(best.instance_id, 0)

    def best_prefix(self, live: list[InstanceInfo], matched: dict[str, int], bound: int) -> InstanceInfo | None:
        """The instance ``choose_prefix`` would take, nothing placed (None when ``live`` is empty)."""
        with self._lock:
            return self._best_prefix(live, matched, bound) if live else None

    def _best_prefix(self, live: list[InstanceInfo], matched: dict[str, int], bound: int) -> InstanceInfo:
        loads = {i.instance_id: self._load(i) for i in live}  # under self._lock
        ceiling = min(loads.values()) + bound
        return min((i for i in live if loads[i.instance_id] <= ceiling),
                   key=lambda i: (loads[i.instance_id] - matched.get(i.instance_id, 0),
                                  -matched.get(i.instance_id, 0), i.instance_id))

    def least_loaded(self, live: list[InstanceInfo]) -> InstanceInfo | None:
        with self._lock:
            return self._least_loaded(live) if live else None

    def _least_loaded(self, live: list[InstanceInfo]) -> InstanceInfo:  # under self._lock
        return min(live, key=lambda i: (self._load(i), i.instance_id))

    def arrived(self, instance_id: str, key: int) -> None:
        with self._lock:
            entry = self._placed.get(instance_id, {}).get(key)
            if entry is not None:
                entry.arrived = self._beats.get(instance_id, 0)

    def done(self, instance_id: str, key: int) -> None:
        with self._lock:
            self._placed.get(instance_id, {}).pop(key, None)

    def pending(self, instance_id: str) -> int:
        with self._lock:
            return sum(e.tokens for e in self._placed.get(instance_id, {}).values())


@dataclass(eq=False)
class Active:
    """A request in flight on this router (touched on the core's event loop only)."""

    rid: str
    ids: list[int] = field(default_factory=list)  # the prompt
    params: SamplingParams | None = None
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)
    reason: str = ""  # why it was cancelled
    code: grpc.StatusCode = grpc.StatusCode.CANCELLED
    call: object | None = None  # the gRPC call (grpc.aio) to cancel on abort
    prefill: InstanceInfo | None = None
    decode: InstanceInfo | None = None
    output_tokens: int = 0
    ttft: float | None = None  # seconds to the first token the client got
    placements: list[dict] = field(default_factory=list)  # each: prefill, decode, reason (recorded in Redis)
    queued_since: float | None = None  # waiting in the admission queue since (monotonic)
    # A request of several choices (``choices.py``): its choices, each an Active of its own (an abort reaches
    # them all), and the instance ids they are placed on when those can take them (role -> id, one dict
    # shared by the choices: their prompt is the same, their pages can be).
    choices: list[Active] = field(default_factory=list)
    prefer: dict[str, str] = field(default_factory=dict)
    prefill_cached: int = 0  # prompt tokens its (last) prefill instance took from its prefix cache


class _Replace(Exception):
    """The current placement did not take the request; ``exclude`` says which instance to avoid."""

    def __init__(self, error: RouterError, role: str, kind: str):
        super().__init__(error.message)
        self.error, self.role, self.kind = error, role, kind  # kind: full | mismatch | unreachable


class _Broken(Exception):
    """A decode stream, or a hand-off, broke after tokens reached the client: the request is placed again
    (failover); ``avoid``: the decode instance is not tried again (False when the prefill side broke)."""

    def __init__(self, error: RouterError, avoid: bool = True):
        super().__init__(error.message)
        self.error, self.avoid = error, avoid


@dataclass(eq=False)
class _Delivered:
    """What a request's walk has handed to its client (touched on the core's event loop only)."""

    detok: TextStream  # the text so far, cut at a stop string
    return_logprobs: bool  # the client asked for them (the walk keeps them anyway, for a failover)
    # The consumer's intake (``Session.put``), or None: messages that need no await go to it straight from the
    # relay's reader (``RouterCore._relay_now``); the others are yielded by the walk.
    deliver: Callable[[pb.GenerateResponse], None] | None = None
    ids: list[int] = field(default_factory=list)  # tokens the client has
    logprobs: list[float] = field(default_factory=list)  # theirs

    def sent(self, out: pb.GenerateResponse) -> pb.GenerateResponse:
        """``out`` goes to the client: its tokens kept for a failover, its logprobs dropped unless asked for."""
        self.ids += out.token_ids
        self.logprobs += out.logprobs
        if not self.return_logprobs:
            del out.logprobs[:]
        return out


@dataclass
class _Handoff:
    """The rest of a Prefill call whose first token went to the client before its hand-off ended."""

    call: object  # the Prefill call (grpc.aio), at the handed_off event still to come
    t0: float  # when its first token arrived


# A decode stream that ends with these (and not by the router's own cancel) broke: the instance died, the
# connection went, or the instance stopped.
BROKEN = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN,
          grpc.StatusCode.INTERNAL, grpc.StatusCode.ABORTED)
MAX_FAILOVERS = 3  # decode instances a request may lose before it fails
GC_THRESHOLD = 50_000  # allocations between young-generation collections in a router process (default 700)


class RouterCore:
    """Validation, records, placement and streaming; the gRPC servicer and the OpenAI HTTP layer wrap it."""

    def __init__(self, settings: RouterSettings, store: RequestStore, registry: Registry,
                 tokenizer: Tokenizer | None, model_config: ModelConfig, telemetry: Telemetry | None = None,
                 instance_id: str = "router"):
        self.settings, self.store, self.registry = settings, store, registry
        self.log = ServiceLog("router", instance_id)
        self.tokenizer, self.model_config, self.telemetry = tokenizer, model_config, telemetry
        self.max_context = min(settings.max_context or model_config.max_position_embeddings,
                               model_config.max_position_embeddings)
        self.ledger = LoadLedger()
        self.prefixes = PrefixIndex(registry)  # the instances' published prefix cache summaries
        self.records = RecordWriter(store, telemetry=telemetry).start()
        self._seen: dict[str, list[InstanceInfo]] = {}  # each role's live instances, as last read from Redis
        self.not_ready: str | None = None  # why the router cannot take requests now (None: it can)
        self.stopping = threading.Event()
        self._active: dict[str, Active] = {}  # on the loop
        self._lock = threading.Lock()  # the loop's start
        self.loop: asyncio.AbstractEventLoop | None = None  # every request's walk runs here (ensure_loop)
        self._io_pool = ThreadPoolExecutor(64, thread_name_prefix="router-io")  # Redis calls (they block)
        # The walks' record writes and registry reads, a batch per hop to the pool and round trip (``batches.py``)
        self._writes = Batches(self.records.write_batch, self._io_pool)
        self._reads = Batches(self._read_registry, self._io_pool)
        self._channels: dict[str, grpc.aio.Channel] = {}  # on the loop
        self._stubs: dict[tuple[type, str], object] = {}  # (stub class, address) -> stub on its channel (on the loop)
        self._relays: dict[str, RelayClient] = {}  # each decode instance's relay (on the loop)
        self._md = (("authorization", f"Bearer {settings.api_key}"),) if settings.api_key else None
        self.admission = Admission(settings.max_queued, settings.queue_timeout_s,
                                   min(0.25, settings.heartbeat_s / 2), RouterError, telemetry)
        self._room = self.admission.room
        self._facts: dict = {}  # the engines' dtype / page size / speculative config, as last seen
        self.draining = threading.Event()  # set when the router stops: new requests are refused

    # ---- validation ------------------------------------------------------------------------------
    def validate(self, req: pb.GenerateRequest) -> tuple[str, list[int], SamplingParams]:
        """(request id, prompt ids, sampling params), or RequestError naming the field."""
        limit = self.settings.max_message_bytes
        if req.ByteSize() > limit:
            raise RequestError("request", f"{req.ByteSize()} bytes exceed the limit of {limit}")
        rid = req.request_id or uuid.uuid4().hex
        if not RID_PATTERN.fullmatch(rid):
            raise RequestError("request_id", "must be 1-128 characters of letters, digits, '.', '_', ':' or '-'")
        self._validate_choices(req)
        kind = req.WhichOneof("prompt")
        if kind is None:
            raise RequestError("prompt", "give text or token_ids")
        field_name = f"prompt.{kind}"
        if kind == "text":
            if self.tokenizer is None:
                raise RequestError(field_name, "this router has no tokenizer: send token_ids")
            if len(req.text) > 8 * self.max_context:  # don't tokenize megabytes to learn they don't fit
                raise RequestError(field_name, f"{len(req.text)} characters cannot fit the context of "
                                               f"{self.max_context} tokens")
            ids = self.tokenizer.encode(req.text)
        else:
            ids = list(req.token_ids.ids)
        vocab = self.model_config.vocab_size
        if not ids:
            raise RequestError(field_name, "the prompt is empty")
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestError(field_name, f"token id {bad} is outside the vocabulary [0, {vocab})")
        if len(ids) >= self.max_context:
            raise RequestError(field_name, f"{len(ids)} tokens leave no room to generate in the context of "
                                           f"{self.max_context}")
        return rid, ids, self._validate_sampling(req.sampling, ids)

    def _validate_choices(self, req: pb.GenerateRequest) -> None:
        """``n`` and ``best_of`` within the router's ``max_n``, best_of not below n; RequestError naming them."""
        n, best_of = choice_counts(req)
        limit = self.settings.max_n
        if n > limit:
            raise RequestError("n", f"{n} choices exceed the limit of {limit} (max_n)")
        if best_of < n:
            raise RequestError("best_of", f"{best_of} is below n ({n}): best_of choices are generated and the n best "
                                          "returned")
        if best_of > limit:
            raise RequestError("best_of", f"{best_of} choices exceed the limit of {limit} (max_n)")

    def _validate_sampling(self, s: pb.SamplingParams, ids: list[int]) -> SamplingParams:
        """The request's sampling parameters after a valid prompt ``ids``, or RequestError naming the field."""
        vocab = self.model_config.vocab_size
        if not math.isfinite(s.temperature) or s.temperature < 0:
            raise RequestError("sampling.temperature", f"{s.temperature} is not a finite number >= 0")
        if not math.isfinite(s.top_p) or not 0 <= s.top_p <= 1:
            raise RequestError("sampling.top_p", f"{s.top_p} is not in (0, 1] (0 means unset)")
        if s.top_k < 0:
            raise RequestError("sampling.top_k", f"{s.top_k} is negative (0 disables it)")
        if s.top_logprobs > 20:
            raise RequestError("sampling.top_logprobs", f"{s.top_logprobs} is above 20 (OpenAI's limit)")
        room = self.max_context - len(ids)
        if s.max_new_tokens > room:
            raise RequestError("sampling.max_new_tokens",
                               f"{s.max_new_tokens} new tokens after a {len(ids)}-token prompt exceed the context "
                               f"of {self.max_context}")
        if len(s.stop) > self.settings.max_stop_strings:
            raise RequestError("sampling.stop", f"{len(s.stop)} stop strings exceed the limit of "
                                                f"{self.settings.max_stop_strings} (max_stop_strings)")
        long = next((x for x in s.stop if len(x) > self.settings.max_stop_length), None)
        if long is not None:
            raise RequestError("sampling.stop", f"a stop string of {len(long)} characters exceeds the limit of "
                                                f"{self.settings.max_stop_length} (max_stop_length)")
        if s.stop and self.tokenizer is None:
            raise RequestError("sampling.stop", "this router has no tokenizer to match stop strings with")
        for name, named in (("stop_token_ids", s.stop_token_ids), ("logit_bias", s.logit_bias),
                            ("allowed_token_ids", s.allowed_token_ids)):
            bad = next((t for t in named if not 0 <= t < vocab), None)
            if bad is not None:
                raise RequestError(f"sampling.{name}", f"token id {bad} is outside the vocabulary [0, {vocab})")
        if s.min_tokens > (s.max_new_tokens or self.settings.default_max_new_tokens):
            raise RequestError("sampling.min_tokens", f"{s.min_tokens} exceeds the output length")
        try:
            params = sampling_from_pb(s, default_max_new_tokens=min(self.settings.default_max_new_tokens, room))
        except ValidationError as e:  # anything the checks above missed still names its field
            err = e.errors()[0]
            raise RequestError(f"sampling.{'.'.join(str(x) for x in err['loc'])}", err["msg"]) from None
        return params

    # ---- placement -------------------------------------------------------------------------------
    def _pick(self, role: str, exclude: set[str], tokens: int = 0, arrived: bool = False, prefer: str | None = None
              ) -> tuple[InstanceInfo, int] | tuple[None, None]:
        """The least loaded live instance of ``role`` (not in ``exclude``), with ``tokens`` placed on it; the
        instance ``prefer`` names instead while it is live and not excluded."""
        live = [i for i in self.live(role) if i.instance_id not in exclude]
        return self.ledger.choose([i for i in live if i.instance_id == prefer] or live, tokens, arrived)

    def _pick_prompt(self, role: str, exclude: set[str], ids: list[int], tokens: int, arrived: bool = False,
                     prefer: str | None = None, seen: list[InstanceInfo] | None = None
                     ) -> tuple[InstanceInfo, int, int] | tuple[None, None, int]:
        """As ``_pick``, for an instance that will compute the prompt ``ids`` (a prefill instance, or a decode
        instance prefilling locally): with ``prefix_routing``, the one holding the most of its leading pages
        within the imbalance bound (``LoadLedger.choose_prefix``); (instance, ledger key, matched tokens).
        ``seen``: the live instances of ``role`` as just read (default: read them now)."""
        live = [i for i in (self.live(role) if seen is None else seen) if i.instance_id not in exclude]
        live = [i for i in live if i.instance_id == prefer] or live
        if not live:
            return None, None, 0
        matched = self.prefixes.matches(role, live, ids) if self.settings.prefix_routing else {}
        return self.ledger.choose_prefix(live, tokens, arrived, matched, self.settings.prefix_balance_tokens)

    def _count_placement(self, role: str, matched: int) -> None:
        """A prompt placed on an instance of ``role`` (it took the request) whose summary held ``matched`` tokens."""
        if self.telemetry:
            self.telemetry.placements_total.labels(role, "prefix" if matched else "load").inc()
            self.telemetry.prefix_matched_tokens.labels(role).inc(matched)

    async def _pick_now(self, role: str, seen: dict[str, list[InstanceInfo]], exclude: set[str], ids: list[int],
                        tokens: int, arrived: bool = False, prefer: str | None = None):
        """``_pick_prompt`` from the instances ``seen`` (``_registry``), on the loop; on the I/O pool where a
        prefix summary is still to be read from Redis."""
        live = seen.get(role, [])
        if self.settings.prefix_routing and not self.prefixes.held(live):
            return await self._io(self._pick_prompt, role, exclude, ids, tokens, arrived, prefer, live)
        return self._pick_prompt(role, exclude, ids, tokens, arrived, prefer, live)

    async def _registry(self) -> dict[str, list[InstanceInfo]]:
        """Each role's live instances, from a registry read begun after this call (one read for the placements
        asking together, ``batches.py``); while Redis is away, the ones last seen."""
        return await self._reads(None)

    def _read_registry(self, asks: list) -> list[dict[str, list[InstanceInfo]]]:
        """(On the I/O pool.) One registry read for every one of ``asks``."""
        try:
            every = self.registry.instances()
        except REDIS_DOWN:
            return [dict(self._seen)] * len(asks)
        seen = {role: [i for i in every if i.role == role] for role in ("prefill", "decode")}
        self._seen.update(seen)
        return [seen] * len(asks)

    async def _record(self, rid: str, state: str, **fields):
        """``RecordWriter.transition`` (or, ``state`` CREATE, ``create``) in the next batch of record writes."""
        return await self._writes(RecordWrite(rid, state, fields, None if state == CREATE else time.time()))

    def _record_soon(self, rid: str, state: str, **fields) -> None:
        """A transition the walk does not wait for (the client's tokens do not wait on Redis), recorded with its
        time now: in the next batch, so before any write the request asks for after it (batches go one at a
        time, in order; the request's end is awaited)."""
        self._writes.ask(RecordWrite(rid, state, fields, time.time())).add_done_callback(self._written)

    def _written(self, fut: asyncio.Future) -> None:
        if not fut.cancelled() and fut.exception() is not None:  # a bug (Redis away buffers the write)
            self.log.event("record_failed", None, logging.ERROR, reason=repr(fut.exception()))

    def live(self, role: str) -> list[InstanceInfo]:
        """The live instances of ``role``; while Redis is away, the ones last seen (requests already accepted
        keep being placed)."""
        try:
            self._seen[role] = self.registry.instances(role)
        except REDIS_DOWN:
            pass
        return self._seen.get(role, [])

    def _stub(self, cls, address: str):
        """A stub on the core's event loop (grpc.aio channels belong to one loop); the internal services ask
        for the key too, sent as call metadata."""
        stub = self._stubs.get((cls, address))
        if stub is None:  # a stub builds a callable per method: one per (service, address), not one per call
            ch = self._channels.get(address)
            if ch is None:
                ch = self._channels[address] = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
            stub = self._stubs[(cls, address)] = cls(ch)
        return stub

    # ---- the event loop ----------------------------------------------------------------------------
    def ensure_loop(self) -> asyncio.AbstractEventLoop:
        """The loop every request of this core runs on: a daemon thread of its own, started on first use
        (``start_router`` serves gRPC and HTTP on it)."""
        with self._lock:
            if self.loop is None:
                self.loop = asyncio.new_event_loop()
                self.loop.set_default_executor(self._io_pool)
                threading.Thread(target=self.loop.run_forever, name="router-loop", daemon=True).start()
        return self.loop

    async def _io(self, fn, *args, **kwargs):
        """``fn`` (Redis: blocks) on the I/O pool; the loop goes on meanwhile."""
        return await asyncio.get_running_loop().run_in_executor(self._io_pool, partial(fn, *args, **kwargs))

    def _on_loop(self, coro, timeout: float = 30):
        """Run ``coro`` on the core's loop from another thread, and wait for it."""
        return asyncio.run_coroutine_threadsafe(coro, self.ensure_loop()).result(timeout)

    # ---- the request's walk ----------------------------------------------------------------------
    def generate(self, req: pb.GenerateRequest, cancelled: threading.Event | None = None
                 ) -> Iterator[pb.GenerateResponse]:
        """``stream`` for a caller outside the loop (a thread): one message at a time, lazily; closing the
        iterator ends the request (the client went away); ``cancelled``, once set, ends it at its next message."""
        loop = self.ensure_loop()
        agen = self.stream(req)
        try:
            while True:
                if cancelled is not None and cancelled.is_set():
                    return
                try:
                    msg = asyncio.run_coroutine_threadsafe(agen.__anext__(), loop).result()
                except StopAsyncIteration:
                    return
                yield msg
        finally:
            asyncio.run_coroutine_threadsafe(agen.aclose(), loop).result(60)

    async def stream(self, req: pb.GenerateRequest, deliver: Callable[[pb.GenerateResponse], None] | None = None
                     ) -> AsyncIterator[pb.GenerateResponse]:
        """Stream the request's responses; the last one carries ``finish``. Runs on the core's loop.

        Raises RequestError (bad input: nothing recorded) or RouterError (recorded as failed/aborted).
        ``abort(rid)`` ends it at once; closing the iterator (or cancelling its task) is the client going away.
        ``deliver`` (a ``Session``'s intake): the messages of the decode's relay that need no await go to it
        straight from the relay's reader, in order with the ones yielded (which the caller gives it too).
        """
        active = await self._admit(req)
        t0 = time.perf_counter()
        n, best_of = choice_counts(req)
        walk = self._walk(active, active.ids, active.params, req.return_logprobs, t0, deliver) if best_of == 1 \
            else self._walk_choices(active, n, best_of, req.return_logprobs, t0)
        async with aclosing(self._recorded(active, walk)) as run:
            async for out in run:
                yield out

    async def _recorded(self, active: Active, walk: AsyncIterator[pb.GenerateResponse], choice: bool = False):
        """``walk``'s messages; its end recorded in Redis (finished by the walk, failed or aborted here) and
        what the services hold for the request freed. ``choice``: one choice of a request of several (the
        request itself is counted and let go by its own walk)."""
        rid = active.rid
        outcome = "failed"
        try:
            async with aclosing(walk):
                async for out in walk:
                    yield out
            outcome = "finished"
        except RouterError as e:
            outcome = "aborted" if active.cancelled.is_set() else "failed"
            await self._end(active, outcome, e.message, e.code)
            if not e.message.startswith("request "):  # a choice's error already names the choice
                e.message = f"request {rid}: {e.message}"  # the client may not know the id the router gave it
            raise
        except (GeneratorExit, asyncio.CancelledError):  # the caller stopped reading: the client went away
            outcome = "aborted"
            await self._end(active, outcome, active.reason or "client went away", None)
            raise
        except Exception as e:
            self.log.exception("internal_error", rid, reason=str(e))
            await self._end(active, outcome, f"internal error: {e}", grpc.StatusCode.INTERNAL)
            raise RouterError(grpc.StatusCode.INTERNAL, f"request {rid}: internal error: {e}") from e
        finally:
            if choice:
                self._room.set()
            elif self._active.get(rid) is active:
                del self._active[rid]
                self._room.set()
            if self.telemetry and not choice:
                self.telemetry.requests_total.labels(outcome).inc()

    async def _walk_choices(self, parent: Active, n: int, best_of: int, return_logprobs: bool, t0: float):
        """A request of ``best_of`` choices (``choices.py``): each walked (and recorded) at once in a task of its
        own, their messages merged with their index; with ``best_of`` > n, the best n once all have ended.
        Whatever ends the walk early ends every choice still running, and waits for them."""
        queue: asyncio.Queue = asyncio.Queue()
        tasks: list[asyncio.Task] = []
        why = "client went away"
        try:
            parent.choices = await self._io(self._create_choices, parent, best_of)
            for c in parent.choices if parent.cancelled.is_set() else ():  # aborted meanwhile
                self._cancel(c, parent.reason, parent.code)
            loop = asyncio.get_running_loop()
            logprobs = return_logprobs or best_of > n  # best_of ranks by them
            tasks = [loop.create_task(pump(self._recorded(c, self._walk(c, c.ids, c.params, logprobs, t0), True),
                                           parent.rid, i, queue)) for i, c in enumerate(parent.choices)]
            async with aclosing(merged(queue, len(tasks))) as messages:
                if best_of == n:
                    async for out in messages:
                        yield out
                else:
                    for out in best_choices([m async for m in messages], n, return_logprobs):
                        yield out
            await self._choices_finished(parent)
        except RouterError as e:
            if parent.cancelled.is_set():  # the request's abort ended its choices: the request's reason
                raise RouterError(parent.code, parent.reason) from None
            why = f"another choice ended: {e.message}"
            raise
        finally:
            for c, task in zip(parent.choices, tasks):
                if not task.done():
                    self._cancel(c, parent.reason or why, parent.code if parent.reason else grpc.StatusCode.CANCELLED)
            if tasks:
                await asyncio.wait(tasks)
            parent.output_tokens = sum(c.output_tokens for c in parent.choices)  # for the request's record

    def _create_choices(self, parent: Active, k: int) -> list[Active]:
        """(On the I/O pool.) The ``k`` choices of ``parent``, each recorded (``req:{rid}#{i}``), and the
        instances they prefer: the least loaded prefill and decode instances now (the prefill instance holding most
        of the prompt's leading pages, within the bound, with prefix-aware placement)."""
        for role in ("prefill", "decode"):
            live = self.live(role)
            if role == "prefill" and self.settings.prefix_routing:
                inst = self.ledger.best_prefix(live, self.prefixes.matches(role, live, parent.ids),
                                               self.settings.prefix_balance_tokens)
            else:
                inst = self.ledger.least_loaded(live)
            if inst is not None:
                parent.prefer[role] = inst.instance_id
        choices = [Active(choice_rid(parent.rid, i), ids=parent.ids, params=choice_params(parent.params, i),
                          prefer=parent.prefer) for i in range(k)]
        for i, c in enumerate(choices):
            try:
                created = self.records.create(c.rid, prompt_tokens=len(c.ids), max_new_tokens=c.params.max_new_tokens,
                                              request=parent.rid, index=i)
            except RecordsUnavailable as e:
                created, why = False, f"the router cannot record requests now: {e}"
            else:
                why = f"the record of choice {c.rid} exists already"
            if not created:
                for made in choices[:i]:
                    self.records.transition(made.rid, "failed", error=why)
                raise RouterError(grpc.StatusCode.UNAVAILABLE, why, retry_after_s=1)
        return choices

    async def _choices_finished(self, parent: Active) -> None:
        """Every choice of ``parent`` finished: so does the request (its record sums their output)."""
        parent.output_tokens = output = sum(c.output_tokens for c in parent.choices)
        self.log.event("finished", parent.rid, choices=len(parent.choices), output_tokens=output)
        await self._record(parent.rid, "finished", output_tokens=output, choices=[c.rid for c in parent.choices])

    async def _admit(self, req: pb.GenerateRequest) -> Active:
        """Validate and record a new request: its ``Active``, or RequestError / RouterError (not recorded)."""
        try:
            rid, ids, params = self.validate(req)
        except RequestError as e:
            self._count_error("invalid_argument")
            self.log.event("refused", req.request_id if RID_PATTERN.fullmatch(req.request_id) else None,
                           field=e.field, message=str(e))
            raise
        if self.draining.is_set():
            self._count_error("unavailable")
            self.log.event("refused", rid, message="draining")
            raise RouterError(grpc.StatusCode.UNAVAILABLE, "the router is shutting down (draining): send the "
                                                           "request to another router")
        active = Active(rid, ids=ids, params=params)
        duplicate = rid in self._active
        if not duplicate:
            self._active[rid] = active
        created = False
        n, best_of = choice_counts(req)
        try:
            created = not duplicate and await self._create(rid, ids, params,
                                                           **(dict(n=n, best_of=best_of) if best_of > 1 else {}))
        finally:
            if (duplicate or not created) and self._active.get(rid) is active:
                del self._active[rid]
        if not created:
            self._count_error("invalid_argument")
            self.log.event("refused", rid, field="request_id", message="already in use")
            raise RequestError("request_id", f"{rid!r} is already in use (ids are unique until their record expires)")
        self.log.event("received", rid, prompt_tokens=len(ids), max_new_tokens=params.max_new_tokens,
                       temperature=params.temperature, text=req.WhichOneof("prompt") == "text")
        return active

    async def _create(self, rid: str, ids: list[int], params: SamplingParams, **fields) -> bool:
        """Record the new request (False: its id is taken), with ``fields``; refused with UNAVAILABLE when it
        cannot be recorded."""
        if self.settings.max_concurrent_requests and len(self._active) > self.settings.max_concurrent_requests:
            self._count_error("resource_exhausted")
            raise RouterError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"request {rid}: the router is at its limit of {self.settings.max_concurrent_requests} "
                              "concurrent requests; try again shortly", retry_after_s=1, http_status=429)
        try:
            return await self._record(rid, CREATE, prompt_tokens=len(ids), max_new_tokens=params.max_new_tokens,
                                      **fields)
        except RecordsUnavailable as e:
            self._count_error("unavailable")
            self.log.event("refused", rid, field=None, message=f"cannot record the request: {e}")
            raise RouterError(grpc.StatusCode.UNAVAILABLE, f"request {rid}: the router cannot record requests now: "
                                                           f"{e}; try again shortly", retry_after_s=1) from None

    async def _end(self, active: Active, state: str, reason: str, code: grpc.StatusCode | None) -> None:
        """Record a failed / aborted end, then free whatever the services still hold for the request."""
        self.log.event(state, active.rid, reason=reason, code=code.name if code is not None else None,
                       output_tokens=active.output_tokens,
                       prefill=active.prefill.instance_id if active.prefill else None,
                       decode=active.decode.instance_id if active.decode else None)
        await self._record(active.rid, state, error=reason, output_tokens=active.output_tokens)
        if code is not None:
            self._count_error(code.name.lower())
        await self._abort_remote(active)

    async def _walk(self, active: Active, ids: list[int], params: SamplingParams, return_logprobs: bool,
                    t0: float, deliver: Callable[[pb.GenerateResponse], None] | None = None):
        """Place, stream, and on a broken decode stream place again: a prefill instance recomputes the prompt
        plus all but the last of the tokens the client has, samples nothing, and hands off with the last as
        the next input: another decode instance resumes at the committed length the lost one had. Every draw
        is a hash of the seed (fixed here) and a position, so it draws what the lost instance would have
        drawn: the client's stream continues without a duplicate or a gap, and its tokens, greedy or sampled,
        are the uninterrupted run's."""
        rid = active.rid
        if params.seed is None:
            params = params.model_copy(update={"seed": secrets.randbits(64)})
        detok = TextStream(self.tokenizer, params.stop, params.include_stop_str_in_output, params.min_tokens)
        given = _Delivered(detok, return_logprobs, deliver)
        sent, sent_logprobs = given.ids, given.logprobs  # tokens the client has, and theirs
        avoid: set[str] = set()  # decode instances whose stream broke
        reason, broken, failovers = "new request", None, 0
        while True:
            try:
                first, handoff = await self._place(active, ids, params, t0, avoid, reason, sent, sent_logprobs)
            except RouterError as e:
                if broken is None or active.cancelled.is_set():
                    raise
                raise RouterError(e.code, f"{broken.message}; no instance took it over: {e.message}") from None
            # A new placement's first token. A failover resumes after the client's tokens, and a prompt prefilled
            # on its decode instance streams its first token from there: neither has one here.
            if first is not None:
                out = await self._first_message(active, len(ids), params, first, detok, return_logprobs, t0)
                yield out
                if out.HasField("finish"):
                    return
                sent.append(first[0])
                sent_logprobs.append(first[1])
            try:
                if handoff is not None:  # the first token went out before the hand-off ended: it ends now
                    await self._await_handoff(active, handoff)
                budget = params.max_new_tokens - len(sent)
                async with aclosing(self._stream(active, len(ids), budget, given, t0)) as stream:
                    async for out in stream:
                        yield out
                return
            except _Broken as b:
                failovers += 1
                if failovers > MAX_FAILOVERS:
                    raise b.error from None
                if b.avoid:
                    avoid.add(active.decode.instance_id)
                broken, reason = b.error, f"failover: {b.error.message}"
                self.log.event("failover", rid, decode=active.decode.instance_id, output_tokens=len(sent),
                               reason=b.error.message)
                self._count_error("failover")
                await self._abort_remote(active)  # a decode instance whose stream broke may still hold the request

    def _first_token(self, active: Active, t0: float) -> float:
        """The first token reaches the client now: its time to first token, kept in ``active.ttft``."""
        active.ttft = ttft = time.perf_counter() - t0
        if self.telemetry:
            self.telemetry.ttft_seconds.observe(ttft)
        self.log.event("first_token", active.rid, ttft_s=round(ttft, 6))
        return ttft

    async def _first_message(self, active: Active, prompt_tokens: int, params: SamplingParams, first: tuple,
                             detok: TextStream, return_logprobs: bool, t0: float) -> pb.GenerateResponse:
        """The client's message for the prefill's first token (with ``finish`` when the request ended there)."""
        token, logprob, finish_reason, top = first
        ttft = self._first_token(active, t0)
        out = pb.GenerateResponse(request_id=active.rid, token_ids=[token],
                                  text=detok.push([token], bool(finish_reason)))
        if return_logprobs:
            out.logprobs.append(logprob)
        if params.top_logprobs:
            out.top_logprobs.append(top)
        active.output_tokens = 1
        if finish_reason:  # ended at this token: the prefill instance kept (and freed) it
            out.finish.CopyFrom(pb.Finish(reason=finish_reason, usage=pb.Usage(
                prompt_tokens=prompt_tokens, completion_tokens=1), ttft_s=ttft,
                latency_s=time.perf_counter() - t0, stop_str=detok.matched or ""))
            await self._finished(active.rid, out.finish)
        return out

    async def _place(self, active: Active, ids: list[int], params: SamplingParams, t0: float,
                     avoid_decode: set[str], reason: str, resume: list[int], resume_logprobs: list[float]):
        """Prefill + hand-off on the best live pair (not on ``avoid_decode``), placing again while nothing of
        this placement has reached the client; Redis records each placement with its ``reason``. ``resume``:
        the tokens the client has (a failover: the decode side goes on after them); returns the first token
        (None when resuming). Every decode instance full: the request waits in the router's bounded queue for
        room (``Admission``), refused past its bound or its time."""
        try:
            return await self._placing(active, ids, params, t0, avoid_decode, reason, resume, resume_logprobs)
        finally:
            self.admission.leave(active)

    async def _placing(self, active: Active, ids: list[int], params: SamplingParams, t0: float,
                       avoid_decode: set[str], reason: str, resume: list[int], resume_logprobs: list[float]):
        left = params.max_new_tokens - len(resume)
        if not resume and self.settings.local_prefill_max_tokens and \
                await self._admit_local(active, ids, params, t0, avoid_decode, reason):
            return None, None
        deadline = time.monotonic() + self.settings.placement_timeout_s
        avoid: dict[str, set[str]] = {"prefill": set(), "decode": set(avoid_decode)}
        full: set[str] = set()  # decode instances that said "no room now": tried again once room frees
        last_error: RouterError | None = None
        attempt = 0
        while True:
            self._check_cancelled(active)
            seen = await self._registry()
            prefill, p_key, matched = await self._pick_now("prefill", seen, avoid["prefill"], ids + resume,
                                                           len(ids) + len(resume), True, active.prefer.get("prefill"))
            # The decode instance too by prefix: with its own prefix cache it holds the pages it has, and the
            # hand-off sends only the rest (``ReserveRequest.skip_cached``).
            decode, d_key, d_matched = await self._pick_now("decode", seen, avoid["decode"] | full, ids + resume,
                                                            left, False, active.prefer.get("decode"))
            if decode is None and full:  # every live instance is full: wait in the queue for room on any
                self._release_keys(prefill, p_key)
                await self.admission.wait_for_room(active, full, last_error, started=bool(resume))
                continue
            if prefill is None or decode is None:
                self._release_keys(prefill, p_key, decode, d_key)
                if last_error is not None and last_error.code == grpc.StatusCode.FAILED_PRECONDITION:
                    raise last_error  # a configuration error: waiting will not fix it
                if time.monotonic() > deadline:
                    raise last_error or RouterError(
                        grpc.StatusCode.UNAVAILABLE,
                        f"no live {'prefill' if prefill is None else 'decode'} instance within "
                        f"{self.settings.placement_timeout_s:g}s")
                await wait_any(active.cancelled, self._room, min(0.25, self.settings.heartbeat_s / 2))
                continue
            attempt += 1
            try:
                return await self._try_pair(active, ids, params, t0, reason, resume, resume_logprobs, prefill,
                                            decode, p_key, attempt, matched, d_matched)
            except _Replace as r:
                last_error = r.error
                self._check_cancelled(active)
                inst = prefill if r.role == "prefill" else decode
                self.log.event("replaced", active.rid, role=r.role, instance=inst.instance_id, kind=r.kind,
                               reason=r.error.message)
                (full if r.kind == "full" else avoid[r.role]).add(inst.instance_id)
                reason = f"replaced: {r.error.message}"
                if r.kind != "full" and time.monotonic() > deadline:
                    raise r.error from None
            finally:  # from here the stream phase accounts for the decode side (or nobody, on failure)
                self._release_keys(prefill, p_key, decode, d_key)

    async def _try_pair(self, active: Active, ids: list[int], params: SamplingParams, t0: float, reason: str,
                        resume: list[int], resume_logprobs: list[float], prefill: InstanceInfo,
                        decode: InstanceInfo, p_key: int, attempt: int, matched: int = 0, decode_matched: int = 0):
        """One placement on (``prefill``, ``decode``): recorded, then prefilled and handed off (``_prefill``).
        ``matched`` / ``decode_matched``: the prompt tokens the prefill / decode instance's published summary
        holds (prefix-aware placement)."""
        active.prefill, active.decode = prefill, decode
        self.log.event("placed", active.rid, prefill=prefill.instance_id, decode=decode.instance_id,
                       attempt=attempt, prefix_tokens=matched, decode_prefix_tokens=decode_matched)
        active.placements.append({"prefill": prefill.instance_id, "decode": decode.instance_id, "reason": reason,
                                  **({"prefix_tokens": matched} if matched else {}),
                                  **({"decode_prefix_tokens": decode_matched} if decode_matched else {})})
        self._record_soon(active.rid, "prefilling", prefill_instance=prefill.instance_id,
                          decode_instance=decode.instance_id, placements=list(active.placements))
        self._count_placement("prefill", matched)
        self._count_placement("decode", decode_matched)
        if self.telemetry:
            self.telemetry.stage_seconds.labels("placement").observe(time.perf_counter() - t0)
        return await self._prefill(active, pb.PrefillRequest(
            request_id=active.rid, prompt_ids=ids, sampling=sampling_to_pb(params),
            decode_address=decode.grpc_address, resume_ids=resume, resume_logprobs=resume_logprobs), p_key)

    def _release_keys(self, *pairs) -> None:
        """Drop ledger entries: (instance or None, key) pairs, flattened."""
        for inst, key in zip(pairs[::2], pairs[1::2]):
            if inst is not None:
                self.ledger.done(inst.instance_id, key)

    async def _admit_local(self, active: Active, ids: list[int], params: SamplingParams, t0: float,
                           avoid_decode: set[str], reason: str) -> bool:
        """Conditional disaggregation: a prompt with few tokens to compute on the decode instance chosen for it
        (at most ``local_prefill_max_tokens`` past the prefix its published cache summary holds: a short prompt,
        or a long one whose prefix it holds, as a follow-up in a conversation) goes straight to that instance,
        which prefills it inside its decode steps (as the single-process engine does: no second forward over
        the weights, no hand-off); its first token then comes through ``Stream``. False (the request goes to a
        prefill instance) when no decode instance is live, the one chosen would compute more, or it refuses or
        cannot be reached."""
        seen, tokens = await self._registry(), len(ids) + params.max_new_tokens
        decode, d_key, matched = await self._pick_now("decode", seen, avoid_decode, ids, tokens, False,
                                                      active.prefer.get("decode"))
        if decode is None:
            return False
        rid = active.rid
        try:
            if len(ids) - (matched or 0) > self.settings.local_prefill_max_tokens:
                return False  # too much to compute there: a prefill instance's forward, then the hand-off
            self._check_cancelled(active)
            active.prefill, active.decode = None, decode  # an abort from here on reaches the decode instance
            lost = False
            try:
                reply = await self._stub(pb_grpc.DecodeStub, decode.grpc_address).Admit(
                    pb.AdmitRequest(request_id=rid, prompt_ids=ids, sampling=sampling_to_pb(params)),
                    timeout=self.settings.placement_timeout_s, metadata=self._md)
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.INVALID_ARGUMENT:  # the engine refused what the router let through
                    raise RouterError(e.code(), e.details() or "") from None
                reply, lost = pb.ReserveResponse(accepted=False, reason=f"{e.code().name}: {e.details()}"), True
            if not reply.accepted:
                if lost:  # a deadline or a broken connection may have left it admitted there
                    await self._abort_remote(active)
                active.decode = None
                self.log.event("replaced", rid, role="decode", instance=decode.instance_id, kind="local_prefill",
                               reason=reply.reason)
                return False
        finally:
            self.ledger.done(decode.instance_id, d_key)
        self.log.event("placed", rid, prefill=None, decode=decode.instance_id, local_prefill=True,
                       prefix_tokens=matched)
        active.placements.append({"prefill": decode.instance_id, "decode": decode.instance_id, "reason": reason,
                                  "local_prefill": True, **({"prefix_tokens": matched} if matched else {})})
        self._record_soon(rid, "prefilling", prefill_instance=decode.instance_id, decode_instance=decode.instance_id,
                          placements=list(active.placements))
        self._count_placement("decode", matched)
        if self.telemetry:
            self.telemetry.stage_seconds.labels("placement").observe(time.perf_counter() - t0)
            self.telemetry.local_prefills_total.inc()
        return True

    async def _prefill(self, active: Active, request: pb.PrefillRequest, p_key: int):
        """Run the prefill + hand-off; returns (the first token: (token, logprob, finish reason, its top
        logprobs), or None for a failover's (``request.resume_ids``: no token is sampled); the ``_Handoff``
        still to await, or None), or raises _Replace. The first token returns as soon as the decode instance
        holds the request (``decode_reserved``), the hand-off then still under way; from a prefill instance
        that does not say so, only once the hand-off ended.

        ``p_key``: this placement's prefill ledger entry; the caller releases it (and it is released here
        already at the first token: the prompt is done there)."""
        rid, prefill, decode = active.rid, active.prefill, active.decode
        t1 = time.perf_counter()
        call = self._stub(pb_grpc.PrefillStub, prefill.grpc_address).Prefill(
            request, timeout=self.settings.stream_timeout_s, metadata=self._md)
        self._attach(active, call)
        first = None
        try:
            while (ev := await call.read()) is not grpc.aio.EOF:
                if ev.HasField("first_token"):
                    self.ledger.done(prefill.instance_id, p_key)
                    ft = ev.first_token
                    first = (ft.token_id, ft.logprob, ft.finish_reason, ft.top_logprobs)
                    if self.telemetry:
                        self.telemetry.stage_seconds.labels("prefill").observe(time.perf_counter() - t1)
                    self.log.event("prefill_done", rid, prefill=prefill.instance_id,
                                   seconds=round(time.perf_counter() - t1, 6), finish_reason=ft.finish_reason or None)
                    if ft.finish_reason:
                        return first, None
                    self._record_soon(rid, "transferring")
                    t1 = time.perf_counter()
                    if ft.decode_reserved:
                        return first, _Handoff(call, t1)
                elif ev.HasField("handed_off") and (first is not None or request.resume_ids):
                    await self._handed_off(active, decode, ev.handed_off, t1)
                    return first, None
        except asyncio.CancelledError:
            self._check_cancelled(active)
            raise
        except grpc.RpcError as e:
            self._check_cancelled(active)
            raise self._classify(e, prefill, decode) from None
        raise RouterError(grpc.StatusCode.UNAVAILABLE,
                          f"prefill instance {prefill.instance_id} ended the call before handing the request off")

    async def _await_handoff(self, active: Active, handoff: _Handoff) -> None:
        """The hand-off of a request whose first token reached the client; _Broken when it fails (the
        request is placed again with that token, as after a broken decode stream)."""
        prefill, decode = active.prefill, active.decode
        try:
            while (ev := await handoff.call.read()) is not grpc.aio.EOF:
                if ev.HasField("handed_off"):
                    await self._handed_off(active, decode, ev.handed_off, handoff.t0)
                    return
        except asyncio.CancelledError:
            self._check_cancelled(active)
            raise
        except grpc.RpcError as e:
            self._check_cancelled(active)
            error = self._classify(e, prefill, decode)
            if isinstance(error, RouterError):
                raise error from None
            raise _Broken(error.error, avoid=error.role == "decode") from None
        raise _Broken(RouterError(grpc.StatusCode.UNAVAILABLE, f"prefill instance {prefill.instance_id} ended the "
                                                               "call before handing the request off"), avoid=False)

    async def _handed_off(self, active: Active, decode: InstanceInfo, done: pb.HandedOff, t0: float) -> None:
        rid = active.rid
        active.prefill_cached = done.cached_tokens
        if self.telemetry:
            self.telemetry.stage_seconds.labels("handoff").observe(time.perf_counter() - t0)
        self.log.event("handoff_done", rid, decode=decode.instance_id, bytes=done.bytes, seconds=round(done.seconds, 6))
        self._record_soon(rid, "decoding", handoff_bytes=done.bytes, handoff_s=round(done.seconds, 6))

    @staticmethod
    def _classify(e: grpc.RpcError, prefill: InstanceInfo, decode: InstanceInfo) -> Exception:
        """A failed Prefill call -> _Replace (place again) or RouterError (fail the request)."""
        code, details = e.code(), e.details() or ""
        msg = f"{code.name}: {details}"
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            return _Replace(RouterError(code, f"no decode instance can hold the request ({msg})"), "decode", "full")
        if code == grpc.StatusCode.FAILED_PRECONDITION:
            return _Replace(RouterError(code, f"decode instance {decode.instance_id} refused prefill instance "
                                              f"{prefill.instance_id}: {details}"), "decode", "mismatch")
        if code == grpc.StatusCode.UNAVAILABLE:
            # The prefill service names the decode address when the decode side was unreachable.
            role = "decode" if decode.grpc_address in details else "prefill"
            inst = decode if role == "decode" else prefill
            return _Replace(RouterError(code, f"{role} instance {inst.instance_id} is unreachable ({msg})"),
                            role, "unreachable")
        if code == grpc.StatusCode.INVALID_ARGUMENT:  # the engine refused what the router let through
            return RouterError(code, details)
        return RouterError(grpc.StatusCode.UNAVAILABLE if code == grpc.StatusCode.UNKNOWN else code,
                           f"prefill instance {prefill.instance_id}: {msg}")

    async def _stream(self, active: Active, prompt_tokens: int, budget: int, given: _Delivered, t0: float):
        """The decode instance's messages as the client's (``given`` keeps what they hand over); _Broken when
        its stream breaks (``budget``: the tokens it may still generate). The first token of a prompt prefilled
        there comes from it too. The messages come through the instance's relay (shared by this router's
        requests there), or through a ``Stream`` call of the request's own where the instance has no relay; from
        a relay, with ``given.deliver``, those that need no await go to the client from the relay's reader."""
        rid, decode = active.rid, active.decode
        d_key = self.ledger.place(decode.instance_id, budget, arrived=True)
        t1 = time.perf_counter()
        # No deadline: a long generation may take minutes; the decode side ends idle streams, keepalive
        # finds a vanished peer, and the client's own deadline cancels this call through abort().
        call = self._open_stream(decode, rid)
        self._attach(active, call)
        if isinstance(call, Inbox) and given.deliver is not None:
            call.direct = partial(self._relay_now, active, given)
        try:
            while True:
                try:
                    async for msg in call:
                        self._check_cancelled(active)
                        final = await self._relay_message(active, msg, prompt_tokens, given.detok, t0, t1)
                        yield given.sent(msg)
                        if final:
                            return
                    break
                except grpc.RpcError as e:
                    if not self._no_relay(decode, call, e):
                        raise
                    call = self._open_stream(decode, rid)  # nothing came yet: the same request over Stream
                    self._attach(active, call)
        except asyncio.CancelledError:
            self._check_cancelled(active)  # an abort cancelled the call: the request's error
            raise  # the task was cancelled: the client went away
        except grpc.RpcError as e:
            self._check_cancelled(active)
            error = RouterError(grpc.StatusCode.UNAVAILABLE if e.code() != grpc.StatusCode.DEADLINE_EXCEEDED
                                else e.code(), f"decode instance {decode.instance_id} failed mid-stream after "
                                               f"{active.output_tokens} tokens: {e.code().name}: {e.details()}")
            raise (_Broken(error) if e.code() in BROKEN else error) from None
        finally:
            self.ledger.done(decode.instance_id, d_key)
            call.cancel()  # no-op when it ended; frees the call when the client went away
        raise _Broken(RouterError(grpc.StatusCode.UNAVAILABLE, f"decode instance {decode.instance_id} ended the "
                                                               "stream without finishing the request"))

    def _open_stream(self, decode: InstanceInfo, rid: str):
        """The request's messages from ``decode``: an ``Inbox`` of its relay, or a ``Stream`` call."""
        relay = self._relays.get(decode.grpc_address)
        if relay is None and self.settings.decode_relay:
            self._stub(pb_grpc.DecodeStub, decode.grpc_address)  # opens the channel
            relay = self._relays[decode.grpc_address] = RelayClient(self._channels[decode.grpc_address], self._md)
        if relay is not None and not relay.unsupported:
            return relay.attach(rid)
        return self._stub(pb_grpc.DecodeStub, decode.grpc_address).Stream(pb.StreamRequest(request_id=rid),
                                                                          metadata=self._md)

    def _no_relay(self, decode: InstanceInfo, call, error: grpc.RpcError) -> bool:
        """True when ``call`` was a relay's that never opened: ``decode`` has none (UNIMPLEMENTED), or it failed
        before anything came through it; the request then streams over ``Stream``."""
        relay = self._relays.get(decode.grpc_address)
        return isinstance(call, Inbox) and relay is not None and relay.never_opened(error)

    @staticmethod
    def _relay_now(active: Active, given: _Delivered, msg: pb.GenerateResponse) -> bool:
        """``_relay_message`` and the hand-over for a message that needs no await (a token after the first,
        not the last), in the relay's reader while the walk waits: it goes to ``given.deliver`` from here, the
        walk's task not woken. False: the walk takes it (and every message after it, in order)."""
        if active.ttft is None or msg.HasField("finish") or active.cancelled.is_set():
            return False
        active.output_tokens += len(msg.token_ids)
        msg.text = given.detok.push(list(msg.token_ids))
        given.deliver(given.sent(msg))
        return True

    async def _relay_message(self, active: Active, msg: pb.GenerateResponse, prompt_tokens: int,
                             detok: TextStream, t0: float, t1: float) -> bool:
        """Turn the decode's message into the client's (in place); True when it is the last."""
        if active.ttft is None and msg.token_ids:  # a prompt prefilled on its decode instance
            self._first_token(active, t0)
            self._record_soon(active.rid, "decoding")
        active.output_tokens += len(msg.token_ids)
        final = msg.HasField("finish")
        msg.text = detok.push(list(msg.token_ids), final)
        if final:
            await self._finish(active, msg, prompt_tokens, detok, t0, t1)
        return final

    async def _finish(self, active: Active, msg: pb.GenerateResponse, prompt_tokens: int, detok: TextStream,
                      t0: float, t1: float) -> None:
        """The decode's final message as the client's: its finish filled in and recorded."""
        finish = msg.finish
        if finish.reason in ("abort", "error"):
            raise RouterError(grpc.StatusCode.ABORTED if finish.reason == "abort" else grpc.StatusCode.INTERNAL,
                              f"decode instance {active.decode.instance_id} ended the request: {finish.reason}")
        finish.stop_str = detok.matched or ""
        finish.ttft_s, finish.latency_s = active.ttft or 0.0, time.perf_counter() - t0
        finish.usage.prompt_tokens = prompt_tokens
        finish.usage.completion_tokens = active.output_tokens
        # A hand-off's prefill instance computed the prompt (the decode instance found nothing cached); a prompt
        # prefilled on its decode instance reports that instance's own.
        finish.usage.cached_tokens = max(finish.usage.cached_tokens, active.prefill_cached)
        if self.telemetry:
            self.telemetry.stage_seconds.labels("decode").observe(time.perf_counter() - t1)
        await self._finished(active.rid, finish)

    async def _finished(self, rid: str, finish: pb.Finish) -> None:
        self.log.event("finished", rid, reason=finish.reason, output_tokens=finish.usage.completion_tokens,
                       ttft_s=round(finish.ttft_s, 6), latency_s=round(finish.latency_s, 6),
                       accept_length=round(finish.spec.accept_length, 4))
        await self._record(rid, "finished", finish_reason=finish.reason, output_tokens=finish.usage.completion_tokens,
                           accept_length=round(finish.spec.accept_length, 4),
                           accept_rate=round(finish.spec.accept_rate, 4), ttft_s=round(finish.ttft_s, 6),
                           latency_s=round(finish.latency_s, 6))
        if self.telemetry:
            self.telemetry.stage_seconds.labels("total").observe(finish.latency_s)
            self.telemetry.observe_request_end(finish.reason or "stop", finish.usage.prompt_tokens,
                                               finish.usage.completion_tokens)
            if finish.spec.verify_steps:
                self.telemetry.accept_length.observe(finish.spec.accept_length)
                self.telemetry.accept_rate.observe(finish.spec.accept_rate)
                self.telemetry.draft_seconds.observe(finish.spec.draft_time_s)
                self.telemetry.verify_seconds.observe(finish.spec.verify_time_s)

    def _count_error(self, kind: str) -> None:
        if self.telemetry:
            self.telemetry.errors_total.labels(kind).inc()

    # ---- aborts ----------------------------------------------------------------------------------
    def _attach(self, active: Active, call) -> None:
        """Make ``call`` the one an abort cancels (cancelled at once if the abort came first)."""
        active.call = call
        if active.cancelled.is_set():
            call.cancel()

    def _check_cancelled(self, active: Active) -> None:
        if active.cancelled.is_set():
            raise RouterError(active.code, active.reason or "the request was cancelled")

    def abort(self, rid: str, reason: str = "aborted by an Abort call",
              code: grpc.StatusCode = grpc.StatusCode.ABORTED) -> bool:
        """End request ``rid`` now (its stream raises ``code``); False when it is not running here. From any
        thread."""
        try:
            on_loop = asyncio.get_running_loop() is self.loop
        except RuntimeError:
            on_loop = False
        if on_loop:
            return self._abort(rid, reason, code)
        if self.loop is None:
            return False

        async def on_the_loop() -> bool:
            return self._abort(rid, reason, code)

        return self._on_loop(on_the_loop())

    def _abort(self, rid: str, reason: str, code: grpc.StatusCode) -> bool:  # on the loop
        active = self._active.get(rid)
        if active is None:
            return False
        for one in (active, *active.choices):
            self._cancel(one, reason, code)
        return True

    @staticmethod
    def _cancel(active: Active, reason: str, code: grpc.StatusCode) -> None:
        """End ``active``'s walk now (its stream raises ``code`` with ``reason``). On the loop."""
        if not active.cancelled.is_set():
            active.reason, active.code = reason, code
            active.cancelled.set()
        if active.call is not None:
            active.call.cancel()

    async def _abort_remote(self, active: Active) -> None:
        """Free the request on both services (either may still hold it; a dead one holds nothing)."""
        for inst, cls in ((active.prefill, pb_grpc.PrefillStub), (active.decode, pb_grpc.DecodeStub)):
            if inst is None:
                continue
            try:
                await self._stub(cls, inst.grpc_address).Abort(pb.AbortRequest(request_id=active.rid), timeout=2,
                                                               metadata=self._md)
            except grpc.RpcError:
                pass  # that instance is gone; its pages went with it

    def in_flight(self) -> int:
        """Requests under way (accepted, not yet ended)."""
        return len(self._active)


    def check_ready(self) -> str | None:
        """Why the router cannot serve now (Redis away, no prefill or no decode instance), or None; kept in
        ``not_ready`` for the health answers."""
        try:
            self.store.client.ping()
        except REDIS_DOWN as e:
            self.not_ready = f"Redis is unreachable: {e}"
            return self.not_ready
        missing = [role for role in ("prefill", "decode") if not self.live(role)]
        self.not_ready = f"no {' and no '.join(missing)} instance is registered" if missing else None
        return self.not_ready

    def engine_facts(self) -> dict:
        """dtype, page size and speculative config of the engines serving this model, from the registry: a live
        decode instance's (the one that generates), else a prefill instance's, else the last ones seen ({} until
        an engine instance registered)."""
        for role in ("decode", "prefill"):
            for inst in self.live(role):
                if inst.model:
                    self._facts = inst.model
                    return inst.model
        return self._facts

    def model_info(self) -> pb.ModelInfo:
        mc = self.model_config
        info = pb.ModelInfo(model=self.settings.model_name, vocab_size=mc.vocab_size, max_context=self.max_context,
                            eos_token_ids=list(mc.eos_token_ids))
        facts = self.engine_facts()
        if facts:
            info.dtype, info.page_size = facts["dtype"], facts["page_size"]
            info.spec.CopyFrom(pb.SpecConfig(**facts["spec"]))
        return info

    def close(self) -> None:
        self.records.stop()
        loop, self.loop = self.loop, None
        if loop is not None and loop.is_running():
            channels, self._channels, self._stubs = list(self._channels.values()), {}, {}

            async def close_channels() -> None:
                for relay in self._relays.values():
                    await relay.close()
                for ch in channels:
                    await ch.close()

            try:
                asyncio.run_coroutine_threadsafe(close_channels(), loop).result(5)
            finally:
                loop.call_soon_threadsafe(loop.stop)
        self._io_pool.shutdown(wait=False)


def _watch_readiness(core: RouterCore, grpc_server: RouterGrpc, telemetry: Telemetry, interval_s: float,
                     last: str | None) -> None:
    """grpc.health.v1 and /health follow ``core.check_ready()``: NOT_SERVING / 503 with the reason."""
    while not core.stopping.wait(max(0.05, min(interval_s, 0.5))):
        last = _show_readiness(core, grpc_server, telemetry, last)


def _show_readiness(core: RouterCore, grpc_server: RouterGrpc, telemetry: Telemetry, last: str | None = ""
                    ) -> str | None:
    reason = core.check_ready()
    if reason != last:
        grpc_server.set_serving(reason is None)
        telemetry.not_ready = reason
        core.log.event("ready" if reason is None else "not_ready", reason=reason)
    return reason


def load_model_files(model: str | None) -> tuple[ModelConfig, Tokenizer | None]:
    """The router reads the model directory's config.json and tokenizer.json, never its weights."""
    if not model:
        raise RequestError("model", "the router needs the model directory (config.json, tokenizer.json)")
    model_dir = Path(model)
    if not (model_dir / "config.json").exists():
        raise RequestError("model", f"{model_dir} has no config.json")
    tokenizer = Tokenizer(model_dir) if (model_dir / "tokenizer.json").exists() else None
    return ModelConfig.from_dir(model_dir), tokenizer


def start_router(settings: RouterSettings) -> ServiceHandle:
    sys.setswitchinterval(settings.gil_switch_interval_ms / 1000)  # the loop gets the GIL back from the I/O pool
    instance_id = settings.instance_id or new_instance_id("router")
    model_config, tokenizer = load_model_files(settings.model)
    telemetry = ServiceTelemetry("router", instance_id, settings.host, settings.http_port, settings.api_key,
                                 model_name=settings.model_name).start()
    client = connect(settings.redis_url)
    core = RouterCore(settings, RequestStore(client, settings.request_ttl_s), Registry(client, settings.registry_ttl_s),
                      tokenizer, model_config, telemetry, instance_id)
    # gRPC refuses messages over 4x the request limit itself (RESOURCE_EXHAUSTED); between 1x and 4x the
    # router answers INVALID_ARGUMENT naming `request`. gRPC and HTTP are served on the core's event loop.
    grpc_server = RouterGrpc(core, settings.host, settings.grpc_port, 4 * settings.max_message_bytes,
                             settings.api_key, lambda: telemetry.errors_total.labels("unauthenticated").inc(),
                             reuse_port=settings.reuse_port)
    port = grpc_server.port
    extra = {"core": core, "telemetry": telemetry}
    openai_server = None
    if settings.openai_port is not None:
        try:
            from services.router.openai_http import start_openai_server
        except ImportError:
            core.log.warning("openai_http_unavailable")
        else:
            openai_server, openai_port = start_openai_server(core, settings)
            extra["openai_address"] = f"{settings.advertised}:{openai_port}"
    telemetry.set_state("ready")
    # Relaying allocates a few short-lived objects per message (protobuf messages, futures) and the cyclic
    # collector's default threshold ran it hundreds of times a second (a sixth of the loop's time, measured
    # with py-spy in bench/bench_router.py): what exists at start is frozen out of it and it runs less often.
    gc.freeze()
    gc.set_threshold(GC_THRESHOLD, 20, 20)
    ready = _show_readiness(core, grpc_server, telemetry)
    watch = threading.Thread(target=_watch_readiness, args=(core, grpc_server, telemetry, settings.heartbeat_s / 2,
                                                            ready),
                             name="router-readiness", daemon=True)
    watch.start()
    grpc_address = f"{settings.advertised}:{port}"
    core.log.event("started", grpc=grpc_address, http=telemetry.address, openai=extra.get("openai_address"))

    def stop(drain_s: float = 2.0) -> None:
        """Drain, then stop: 503 and NOT_SERVING, new requests refused, those in flight finish (up to
        ``drain_s``)."""
        core.log.event("stopping", drain_s=drain_s)
        deadline = time.monotonic() + drain_s
        telemetry.set_state("draining")
        core.stopping.set()
        core.draining.set()
        grpc_server.set_serving(False)
        while core.in_flight() and time.monotonic() < deadline:  # new requests are refused (draining); gRPC's
            time.sleep(0.05)  # and the OpenAI API's requests in flight finish, up to the deadline
        grpc_server.stop(1.0)
        if openai_server is not None:
            openai_server.stop()
        core.close()
        telemetry.stop()
        gc.unfreeze()  # what start froze is the collector's again: at exit extension objects are freed, not leaked
        core.log.event("stopped", drained=not core.in_flight())

    return ServiceHandle(role="router", instance_id=instance_id, grpc_address=grpc_address,
                         http_address=f"{settings.advertised}:{telemetry.port}", stop=stop, extra=extra)
