"""The decode service's relay: one gRPC stream per router for the tokens of every request that router attached.

Per-request ``Stream`` calls cost a thread wake-up and a gRPC message per request per step. Here every attached
request's subscriber in the engine loop is the relay's one ``_Inbox`` (``EngineLoop.redirect`` moves a request's
buffered events there first, in order): the loop hands it a step's events for all of them in one ``put_many``
(one queue item per relay per step); one thread takes whatever the queue holds, builds the messages and sends
them as one ``RelayBatch``: a step's tokens for all of the router's requests in one message. A
request that cannot stream (not here, streamed already, aborted, failed) ends with a ``RelayError`` carrying
the status its ``Stream`` call would have ended with. When the router goes away, its requests are aborted.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field

import grpc

from proto.eyrie.v1 import eyrie_pb2 as pb

RELAY_METADATA = ("eyrie-relay", "1")  # sent first: the router's side knows the relay is open (services/router)


@dataclass
class StreamClock:
    """One stream's timing for the inter-token metric."""

    first: bool = True
    last: float = field(default_factory=time.perf_counter)


@dataclass
class _Ended:
    rid: str
    code: grpc.StatusCode
    details: str


class _Sink:
    """What the engine loop and an abort put for one relayed request: into the relay's queue, tagged."""

    __slots__ = ("q", "rid")

    def __init__(self, q: queue.SimpleQueue, rid: str):
        self.q, self.rid = q, rid

    def put(self, item) -> None:
        if isinstance(item, str):  # an abort's reason
            item = _Ended(self.rid, grpc.StatusCode.ABORTED, f"{self.rid} was aborted on the decode instance: {item}")
        self.q.put(item)


class _Inbox:
    """The engine loop's subscriber for every request of one relay: a step's events come as one list."""

    __slots__ = ("q",)

    def __init__(self, q: queue.SimpleQueue):
        self.q = q

    def put(self, event) -> None:
        self.q.put(event)

    def put_many(self, events: list) -> None:
        self.q.put(events)


_STOP = object()


class DecodeRelay:
    def __init__(self, servicer, context):
        self.servicer, self.context = servicer, context
        self.q: queue.SimpleQueue = queue.SimpleQueue()
        self.inbox = _Inbox(self.q)
        self.attached: dict[str, tuple] = {}  # request id -> (Incoming, StreamClock)
        self._lock = threading.Lock()
        self._gone = False

    def run(self, request_iterator):
        self.context.add_callback(self._on_gone)
        self.context.send_initial_metadata((RELAY_METADATA,))  # the router knows the relay is open
        threading.Thread(target=self._read, args=(request_iterator,), name="decode-relay-attach", daemon=True).start()
        while not self._gone:
            items = [self.q.get()]
            while True:
                try:
                    items.append(self.q.get_nowait())
                except queue.Empty:
                    break
            batch = self._batch(items)
            if batch.messages or batch.errors:
                yield batch

    def _read(self, request_iterator) -> None:
        try:
            for request in request_iterator:
                self._attach(request.request_id)
        except grpc.RpcError:
            pass  # the router went away: _on_gone aborts its requests

    def _attach(self, rid: str) -> None:
        inc, code, details = self.servicer._claim_stream(rid)
        if inc is None:
            self.q.put(_Ended(rid, code, details))
            return
        with self._lock:
            gone = self._gone
            if not gone:
                self.attached[rid] = (inc, StreamClock())
        if gone:
            self.servicer._abort(inc, "the relay's client went away")
            return
        old, sink = inc.events, _Sink(self.q, rid)
        inc.events = sink  # an abort from now on reaches the relay
        self.servicer.loop.redirect(rid, old, self.inbox, first=sink)  # the events buffered so far first
        while True:  # an abort's reason put in the old queue meanwhile
            try:
                sink.put(old.get_nowait())
            except queue.Empty:
                break

    def _batch(self, items: list) -> pb.RelayBatch:
        batch = pb.RelayBatch()
        for item in _flat(items):
            if item is _STOP:
                continue
            entry = self.attached.get(item.rid)
            if isinstance(item, _Ended):
                batch.errors.append(pb.RelayError(request_id=item.rid, code=item.code.value[0], details=item.details))
                if entry is not None:
                    self._end(item.rid)
                continue
            if entry is None:  # ended already
                continue
            inc, clock = entry
            batch.messages.append(self.servicer.stream_message(inc, item, clock))
            if item.finish_reason == "error":
                batch.errors.append(pb.RelayError(request_id=item.rid, code=grpc.StatusCode.INTERNAL.value[0],
                                                  details=f"{item.rid} failed on the decode instance (engine error)"))
            if item.finish_reason is not None:
                self._end(item.rid)
        return batch

    def _end(self, rid: str) -> None:
        with self._lock:
            inc, _ = self.attached.pop(rid)
        self.servicer._forget(inc)
        self.servicer.loop.unsubscribe(rid, self.inbox)  # the loop's subscriber for it (inc.events: its sink)

    def finish(self) -> None:
        """End the call (the service stops: its requests are done): the router sees the relay end normally."""
        with self._lock:
            self._gone = True
        self.q.put(_STOP)

    def _on_gone(self) -> None:
        """The router went away (or the stream ended): its requests still here are aborted."""
        with self._lock:
            self._gone = True
            left, self.attached = list(self.attached.values()), {}
        self.q.put(_STOP)
        for inc, _ in left:
            self.servicer._abort(inc, "the relay's client went away")
            self.servicer._forget(inc)
            self.servicer.loop.unsubscribe(inc.rid, self.inbox)


def _flat(items: list):
    """The queue's items in order, a step's list (``_Inbox.put_many``) item by item."""
    for item in items:
        if type(item) is list:
            yield from item
        else:
            yield item
