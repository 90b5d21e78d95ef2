"""The router's side of the decode relay: one ``Decode.Relay`` stream per decode instance, shared by every
request of this router streaming from it.

``RelayClient.attach(rid)`` sends the request's id on the instance's relay (opened on first use, opened again
after it broke) and returns an ``Inbox``: the request's messages as the relay's reader dispatches them from each
``RelayBatch``. An ``Inbox`` reads like a grpc.aio ``Stream`` call: ``async for`` over its messages, a
``grpc.RpcError`` (``RelayRpcError``) where the call would have ended with a status (a broken relay breaks every
request on it, each then failed over), ``asyncio.CancelledError`` once ``cancel()``-ed. A decode instance without
the relay (UNIMPLEMENTED) is remembered: its requests use ``Stream``.

While the request's walk waits on its inbox, the reader may hand a message to the inbox's ``direct`` instead
(``RouterCore._relay_now``: a token that needs no await goes to the client's session from the reader itself),
so a relay batch wakes each stream's client once and the walk's task not at all. A message ``direct`` refuses,
and every message after it until the walk waits again, queues for the walk: their order is kept.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable

import grpc

from proto.eyrie.v1 import eyrie_pb2 as pb
from proto.eyrie.v1 import eyrie_pb2_grpc as pb_grpc


class RelayRpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str, established: bool = True):
        super().__init__(details)
        self._code, self._details = code, details
        self.established = established  # False: the relay never opened (nothing came through it)

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


_CODES = {c.value[0]: c for c in grpc.StatusCode}
RELAY_METADATA = ("eyrie-relay", "1")  # the decode service's relay sends it first: the relay is open


class Inbox:
    __slots__ = ("_conn", "rid", "_items", "_wake", "_error", "_cancelled", "direct", "_waiting")

    def __init__(self, conn: _Conn, rid: str):
        self._conn, self.rid = conn, rid
        self._items: collections.deque = collections.deque()
        self._wake = asyncio.Event()
        self._error: BaseException | None = None
        self._cancelled = False
        # Takes a message while the walk waits (True: it went on to the client; False: the walk takes it).
        self.direct: Callable[[pb.GenerateResponse], bool] | None = None
        self._waiting = False  # the walk waits in __anext__ with nothing queued: ``direct`` may take messages

    def push(self, msg: pb.GenerateResponse) -> None:
        if self._waiting:
            try:
                if self.direct(msg):
                    return
            except Exception as e:  # noqa: BLE001 (the walk raises it: the request fails, the relay goes on)
                self.fail(e)
                return
            self._waiting = False  # this one queues for the walk, and whatever follows it too
        self._items.append(msg)
        self._wake.set()

    def fail(self, error: BaseException) -> None:
        self._error = error
        self._waiting = False
        self._wake.set()

    def cancel(self) -> None:
        self._cancelled = True
        self._waiting = False
        # ``direct`` holds the request's walk state, which holds this inbox: a reference cycle per request that
        # only the cyclic GC would free (20-50 ms pauses of the router's loop at 512 streams, docs/benchmarks.md)
        self.direct = None
        self._wake.set()
        self._conn.inboxes.pop(self.rid, None)

    def __aiter__(self) -> Inbox:
        return self

    async def __anext__(self) -> pb.GenerateResponse:
        while not self._items:
            if self._cancelled:
                raise asyncio.CancelledError()
            if self._error is not None:
                raise self._error
            self._wake.clear()
            self._waiting = self.direct is not None
            try:
                await self._wake.wait()
            finally:
                self._waiting = False
        return self._items.popleft()


class _Conn:
    """One opened relay call: its requests' inboxes and the ids to attach."""

    def __init__(self, stub: pb_grpc.DecodeStub, metadata):
        self.inboxes: dict[str, Inbox] = {}
        self.outgoing: asyncio.Queue = asyncio.Queue()
        self.call = stub.Relay(self._requests(), metadata=metadata)
        self.broken: grpc.RpcError | None = None
        self.established = False  # the instance answered with the relay's metadata: it has a relay
        self.reader = asyncio.get_running_loop().create_task(self._read())

    async def _requests(self):
        while True:
            yield await self.outgoing.get()

    async def _read(self) -> None:
        try:
            metadata = await self.call.initial_metadata()
            self.established = any(k == RELAY_METADATA[0] for k, _ in metadata or ())
            while (batch := await self.call.read()) is not grpc.aio.EOF:
                for msg in batch.messages:
                    inbox = self.inboxes.get(msg.request_id)
                    if inbox is not None:
                        inbox.push(msg)
                for err in batch.errors:
                    inbox = self.inboxes.pop(err.request_id, None)
                    if inbox is not None:
                        inbox.fail(RelayRpcError(_CODES.get(err.code, grpc.StatusCode.UNKNOWN), err.details))
            error = RelayRpcError(grpc.StatusCode.UNAVAILABLE, "the decode instance ended the relay")
        except grpc.RpcError as e:
            error = RelayRpcError(e.code(), e.details() or "")
        except asyncio.CancelledError:
            error = RelayRpcError(grpc.StatusCode.CANCELLED, "the relay was closed")
        error.established = self.established
        self.broken = error
        inboxes, self.inboxes = list(self.inboxes.values()), {}
        for inbox in inboxes:
            inbox.fail(error)


class RelayClient:
    def __init__(self, channel: grpc.aio.Channel, metadata):
        self.stub, self.metadata = pb_grpc.DecodeStub(channel), metadata
        self.unsupported = False  # the instance answered UNIMPLEMENTED: its requests use Stream
        self._conn: _Conn | None = None

    def attach(self, rid: str) -> Inbox:
        conn = self._conn
        if conn is None or conn.broken is not None:
            conn = self._conn = _Conn(self.stub, self.metadata)
        inbox = conn.inboxes[rid] = Inbox(conn, rid)
        conn.outgoing.put_nowait(pb.StreamRequest(request_id=rid))
        return inbox

    def never_opened(self, error: grpc.RpcError) -> bool:
        """True when ``error`` ended a relay that never opened (nothing came through it: the request may go
        over ``Stream`` instead); an instance that has no relay (UNIMPLEMENTED, or a call that ended before
        the relay's metadata) is remembered."""
        if not isinstance(error, RelayRpcError) or error.established:
            return False
        self.unsupported = True
        return True

    async def close(self) -> None:
        if self._conn is not None:
            self._conn.call.cancel()
            self._conn.reader.cancel()
