"""The router's writes to the ``req:{id}`` records, kept through a Redis outage.

A request's transitions are written in order. A write that fails for want of Redis is retried with a
short backoff; if Redis stays away it joins a bounded buffer, and once anything is buffered every later
write queues behind it (a request's states must land in order). A flusher thread drains the buffer,
oldest first, when Redis answers again. A full buffer drops the oldest non-terminal write first (the
terminal ones are what "nothing lost" rests on). Only ``create`` raises: a new request the router cannot
record is refused (``RecordsUnavailable``), never accepted unrecorded. A create that failed may still have
landed (Redis ran the script, the answer was lost): a discard of that record (``RequestStore.discard``: only
if still ``queued`` and created then) joins the buffer, so a refused request leaves no record behind.

Metrics: ``eyrie_records_buffered`` (writes waiting for Redis), ``eyrie_records_flushed_total``,
``eyrie_records_dropped_total``, ``eyrie_redis_errors_total``.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass, field

import redis
from prometheus_client import Counter, Gauge

from services.metadata import TERMINAL, RequestStore

REDIS_DOWN = (redis.ConnectionError, redis.TimeoutError)  # Redis away, not a bug in the write
DISCARD = "discard"  # a buffered write that deletes a refused request's record, if its create landed
CREATE = "create"  # a write of ``write_batch`` that records a new request (``create``)


class RecordsUnavailable(Exception):
    """Redis cannot be reached: a new request cannot be recorded, so it is not accepted."""


@dataclass
class RecordWrite:
    rid: str
    state: str  # a state to record, CREATE or DISCARD
    fields: dict = field(default_factory=dict)
    at: float | None = None  # a create's time (set when it is first sent); a transition's (None: when written)


class RecordWriter:
    def __init__(self, store: RequestStore, max_buffered: int = 100_000,
                 backoff_s: tuple[float, ...] = (0.02, 0.05, 0.1), flush_interval_s: float = 0.1, telemetry=None):
        self.store, self.max_buffered, self.backoff_s = store, max_buffered, backoff_s
        self.flush_interval_s = flush_interval_s
        self._buffer: collections.deque[RecordWrite] = collections.deque()
        self._lock = threading.Lock()  # the buffer
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="records-flusher", daemon=True)
        self.last_error: str | None = None  # the last Redis failure, while the buffer is not empty
        self.flushed = self.dropped = 0
        self._metrics(telemetry)

    def _metrics(self, telemetry) -> None:
        self._m = None
        if telemetry is None:
            return
        base, labels = (telemetry.model_name, telemetry.service), ["model_name", "role"]
        reg = telemetry.registry
        self._m = {"buffered": Gauge("eyrie_records_buffered", "Record writes waiting for Redis", labels,
                                     registry=reg).labels(*base),
                   "flushed": Counter("eyrie_records_flushed", "Buffered record writes written once Redis returned",
                                      labels, registry=reg).labels(*base),
                   "dropped": Counter("eyrie_records_dropped", "Buffered record writes dropped (buffer full)",
                                      labels, registry=reg).labels(*base),
                   "errors": Counter("eyrie_redis_errors", "Redis calls that failed for want of Redis", labels,
                                     registry=reg).labels(*base)}

    def start(self) -> RecordWriter:
        self._thread.start()
        return self

    def stop(self, flush_timeout_s: float = 2.0) -> None:
        """Stop the flusher after a last attempt (within ``flush_timeout_s``) to write what is buffered."""
        deadline = time.monotonic() + flush_timeout_s
        while self.buffered and time.monotonic() < deadline and self.flush():
            pass
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(2)

    @property
    def buffered(self) -> int:
        return len(self._buffer)

    # ---- writes --------------------------------------------------------------------------------------
    def create(self, rid: str, **fields) -> bool:
        """``RequestStore.create`` (False: the id is taken); RecordsUnavailable when Redis cannot be reached."""
        if self._buffer:
            raise RecordsUnavailable(f"Redis is unreachable ({self.last_error})")
        now = time.time()
        try:
            return self._retrying(lambda: self.store.create(rid, created_at=now, **fields))
        except REDIS_DOWN as e:
            self.last_error = str(e)
            with self._lock:  # it may have landed, its answer lost: undone once Redis answers
                self._push(RecordWrite(rid, DISCARD, {"created_at": repr(now)}))
            raise RecordsUnavailable(f"Redis is unreachable ({e})") from None

    def transition(self, rid: str, state: str, **fields) -> None:
        """Record ``state`` now, or as soon as Redis answers; never raises for want of Redis."""
        write = RecordWrite(rid, state, fields)
        # No lock on the way to Redis (writes of different requests need no order between them); a request's
        # own writes come from one thread in turn, so once one of them is buffered the next one queues too.
        if not self._buffer:
            try:
                self._retrying(lambda: self._apply(write))
                return
            except REDIS_DOWN as e:
                self.last_error = str(e)
        with self._lock:
            self._push(write)

    def write_batch(self, writes: list[RecordWrite]) -> list:
        """``writes`` (of different requests: no order among them is kept but theirs) in one round trip; per
        write, what ``create`` returns (True, or False: the id is taken) or raises (RecordsUnavailable, returned
        here), or None for a transition (buffered when Redis stays away, as ``transition`` does). Blocks."""
        tried = not self._buffer
        if tried:  # as in ``transition``: no lock on the way to Redis
            now = time.time()
            for w in writes:
                if w.state == CREATE:
                    w.at = now
            try:
                done = self._retrying(lambda: self.store.write_many([self._op(w) for w in writes]))
                return [d if w.state == CREATE else None for w, d in zip(writes, done)]
            except REDIS_DOWN as e:
                self.last_error = str(e)
        with self._lock:
            return [self._defer(w, tried) for w in writes]

    def _defer(self, write: RecordWrite, tried: bool):  # under self._lock
        """A write Redis did not take: a transition buffered (None), a create refused (``tried``: it may have
        landed, its answer lost, so its record's discard is buffered)."""
        if write.state != CREATE:
            self._push(write)
            return None
        if tried:
            self._push(RecordWrite(write.rid, DISCARD, {"created_at": repr(write.at)}))
        return RecordsUnavailable(f"Redis is unreachable ({self.last_error})")

    @staticmethod
    def _op(write: RecordWrite) -> tuple:
        if write.state == CREATE:
            return "create", write.rid, write.at, write.fields
        if write.state == DISCARD:
            return "discard", write.rid, write.fields["created_at"]
        return "transition", write.rid, write.state, write.fields, write.at

    def _retrying(self, fn):
        for delay in (*self.backoff_s, None):
            try:
                return fn()
            except REDIS_DOWN:
                self._count("errors")
                if delay is None:
                    raise
                time.sleep(delay)

    def _apply(self, write: RecordWrite) -> None:
        if write.state == DISCARD:
            self.store.discard(write.rid, **write.fields)
        else:
            self.store.transition(write.rid, write.state, **write.fields)

    def _push(self, write: RecordWrite) -> None:  # under self._lock
        if len(self._buffer) >= self.max_buffered:
            victim = next((w for w in self._buffer if w.state not in TERMINAL and w.state != DISCARD),
                          self._buffer[0])
            self._buffer.remove(victim)
            self.dropped += 1
            self._count("dropped")
        self._buffer.append(write)
        self._gauge()

    # ---- the flusher ---------------------------------------------------------------------------------
    def flush(self) -> bool:
        """Write what is buffered, oldest first, until Redis fails again; True when something was written."""
        wrote = False
        with self._lock:
            while self._buffer:
                try:
                    self._apply(self._buffer[0])
                except REDIS_DOWN as e:
                    self.last_error = str(e)
                    self._count("errors")
                    break
                self._buffer.popleft()
                self.flushed += 1
                self._count("flushed")
                wrote = True
            self._gauge()
        return wrote

    def _run(self) -> None:
        while not self._stop.wait(self.flush_interval_s):
            if self._buffer:
                self.flush()

    def _count(self, name: str) -> None:
        if self._m is not None:
            self._m[name].inc()

    def _gauge(self) -> None:
        if self._m is not None:
            self._m["buffered"].set(len(self._buffer))
