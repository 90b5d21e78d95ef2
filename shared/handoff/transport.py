"""Hand-off transports: how a request's pages get from a prefill instance to a decode instance.

Control and data are separate. Control (``DecodeClient``: the schema handshake, the page
reservation, aborts) is always gRPC. Data goes through a ``Transport``:

- sending side: ``send(address, source, timeout) -> TransferAck`` moves one request's pages and draft
  state (a ``PageSource``) to the decode instance at ``address``;
- receiving side: ``receive(messages, open_sink) -> Received`` writes them into the pages the decode
  side reserved (``open_sink(rid)`` returns the request's ``PageSink``).

Transports, chosen per decode address at the handshake (``negotiate``):

- ``IpcTransport`` ("ipc"): same host. The decode side exported its pools in its handshake reply; the
  prefill side writes the pages straight into the reserved ones (``shared.handoff.ipc``: CUDA IPC on
  the same or a peer GPU, shared memory on the CPU), each prefill step's pages as the step ends, then
  sends one ``in_place`` message with the draft state and the first token over ``Decode.Transfer``
  and waits for the acknowledgement.
- ``GrpcStreamTransport`` ("grpc-stream"): any network. Page-aligned chunks over the
  ``Decode.Transfer`` client stream, opened as the prefill starts: each prefill step's pages are sent
  while the next step computes (gRPC flow control bounds the bytes in flight). One stream in Python tops
  out near 1-2 GB/s, so a hand-off is split over ``streams`` parallel calls, each on a connection of its
  own with a range of the (cache, layer) planes (``shared.handoff.wire.Lane``); the receiver completes it
  when the last call ends, and any call failing fails the whole hand-off.

Both send from a ``PageSource``'s increments (``shared.handoff.wire``): one per prefill step of the
request, the last with the draft state; a source built after the prompt ran has one increment.

The receiving side is one code path for both (``receive``): an in-place message marks every page
written, a byte chunk is copied into its pages (on a thread of the call's own, off the engine's thread and its
CUDA stream: ``shared.handoff.wire.scatter``).

A transport whose own data path fails (``TransportFailed``: the ipc copy refused or a CUDA error) before it
ever carried a hand-off to that decode instance is marked unusable for it by the prefill service, and the
request goes again over the next one that ``negotiate`` picks, on the same reservation.

``NixlTransport`` ("nixl", forced on both services): NIXL (UCX: RDMA, NVLink, tcp) writes the pages into the
decode pools (``shared.handoff.nixl``), then the in-place message as ipc.
"""

from __future__ import annotations

import queue
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc

from proto.eyrie.v1 import eyrie_pb2 as pb
from proto.eyrie.v1 import eyrie_pb2_grpc as pb_grpc
from shared.handoff.ipc import Written, host_id, open_pools, reachable, write_in_place
from shared.handoff.schema import HandoffSchema
from shared.handoff.wire import (
    FEED_POLL_S,
    Lane,
    PageSink,
    PageSource,
    Received,
    TransferCancelled,
    TransferError,
    as_wire,
    iter_chunks,
    parse_wire,
    split_lanes,
)

_DECODE = pb.DESCRIPTOR.services_by_name["Decode"]
TRANSFER_METHOD = f"/{_DECODE.full_name}/{_DECODE.methods_by_name['Transfer'].name}"
_HANDLERS = {(False, False): grpc.unary_unary_rpc_method_handler, (True, False): grpc.stream_unary_rpc_method_handler,
             (False, True): grpc.unary_stream_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}


def add_decode_servicer(servicer, server: grpc.Server) -> None:
    """Register a ``Decode`` servicer as the generated ``add_DecodeServicer_to_server`` does, but with
    ``Transfer``'s messages read by ``parse_wire`` (their K and V are not copied out of what arrived)."""
    handlers = {}
    for method in _DECODE.methods:
        parse = parse_wire if method.name == "Transfer" else getattr(pb, method.input_type.name).FromString
        make = _HANDLERS[method.client_streaming, method.server_streaming]
        handlers[method.name] = make(getattr(servicer, method.name), request_deserializer=parse,
                                     response_serializer=getattr(pb, method.output_type.name).SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(_DECODE.full_name, handlers),))
    server.add_registered_method_handlers(_DECODE.full_name, handlers)


class ChannelPool:
    """One gRPC channel per decode address, shared by the control client and the transport."""

    def __init__(self, max_message_bytes: int = 64 << 20,
                 open_channel: Callable[[str, list], grpc.Channel] | None = None):
        """``open_channel(address, options)`` makes each channel (the services pass one that adds the
        API key to every call); default ``grpc.insecure_channel``."""
        self._channels: dict[tuple[str, int], grpc.Channel] = {}  # (address, lane) -> its channel
        self._lock = threading.Lock()
        self._options = [("grpc.max_send_message_length", max_message_bytes),
                         ("grpc.max_receive_message_length", max_message_bytes)]
        self._open = open_channel or (lambda address, options: grpc.insecure_channel(address, options=options))

    def channel(self, address: str, lane: int = 0) -> grpc.Channel:
        """The channel to ``address``; ``lane`` > 0: one more channel with a TCP connection of its own (a
        hand-off's parallel streams on one connection would share its one reading thread)."""
        with self._lock:
            ch = self._channels.get((address, lane))
            if ch is None:
                # every channel connects on its own (a lane: a TCP connection of its own; lane 0: never a
                # connection another channel of the process left in backoff, services/router/server.py)
                options = self._options + [("grpc.use_local_subchannel_pool", 1)]
                ch = self._channels[(address, lane)] = self._open(address, options)
        return ch

    def decode_stub(self, address: str) -> pb_grpc.DecodeStub:
        return pb_grpc.DecodeStub(self.channel(address))

    def transfer_call(self, address: str, lane: int = 0) -> grpc.StreamUnaryMultiCallable:
        """``Decode.Transfer`` taking messages already serialized (``shared.handoff.wire.as_wire``)."""
        return self.channel(address, lane).stream_unary(TRANSFER_METHOD, request_serializer=None,
                                                  response_deserializer=pb.TransferAck.FromString)

    def close(self) -> None:
        with self._lock:
            for ch in self._channels.values():
                ch.close()
            self._channels.clear()


class DecodeClient:
    """The prefill side's control calls to decode instances."""

    def __init__(self, channels: ChannelPool, schema: HandoffSchema):
        self.channels, self.schema = channels, schema
        self._agreed: dict[str, pb.HandshakeResponse] = {}  # addresses whose handshake passed, their replies
        self._lock = threading.Lock()

    def handshake(self, address: str, timeout: float) -> pb.HandshakeResponse:
        """Check schemas once per address (raises grpc.RpcError: FAILED_PRECONDITION naming both sides);
        returns the decode instance's reply (its host, the transports it accepts, its exported pools)."""
        with self._lock:
            reply = self._agreed.get(address)
        if reply is None:
            reply = self.channels.decode_stub(address).Handshake(self.schema.to_pb(), timeout=timeout)
            with self._lock:
                self._agreed[address] = reply
        return reply

    def forget(self, address: str) -> None:
        """Handshake again next time (the instance may have restarted with other pools)."""
        with self._lock:
            self._agreed.pop(address, None)

    def resend_as_bytes(self, address: str, rid: str, timeout: float = 5.0) -> bool:
        """After an in-place write failed: the decode side keeps ``rid``'s reservation for a byte transfer
        (False: it could not, e.g. the request was aborted meanwhile)."""
        try:
            msg = pb.AbortRequest(request_id=rid, resend_as_bytes=True)
            return self.channels.decode_stub(address).Abort(msg, timeout=timeout).found
        except grpc.RpcError:
            return False

    def reserve(self, address: str, request: pb.ReserveRequest, timeout: float) -> pb.ReserveResponse:
        request.schema.CopyFrom(self.schema.to_pb())  # checked again: the instance may have restarted
        return self.channels.decode_stub(address).Reserve(request, timeout=timeout)

    def abort(self, address: str, rid: str, timeout: float = 2.0) -> bool:
        """Best effort (the decode side also frees reservations nobody streams). The sender calls it once
        it writes no page any more, so an in-place reservation is freed at once."""
        try:
            msg = pb.AbortRequest(request_id=rid, sender_stopped=True)
            return self.channels.decode_stub(address).Abort(msg, timeout=timeout).found
        except grpc.RpcError:
            return False


class Transport(ABC):
    name: str

    @abstractmethod
    def send(self, address: str, source: PageSource, timeout: float) -> pb.TransferAck:
        """Move ``source``'s pages and draft state to the decode instance at ``address``.

        Returns the decode side's acknowledgement (after which the sender may free its pages).
        Raises grpc.RpcError when the receiver refused or the link broke, TransferCancelled when
        ``source.guard`` was cancelled (the request was aborted) before the acknowledgement.
        """

    @abstractmethod
    def receive(self, messages: Iterator, open_sink: Callable[[str], PageSink]) -> Received:
        """Receiving side: write the arriving pages through ``open_sink(rid)``; raises TransferError."""

    def close(self) -> None:  # noqa: B027 (optional: a transport without connections has nothing to close)
        """Release connections (channels, communicators)."""


class GrpcStreamTransport(Transport):
    name = "grpc-stream"

    def __init__(self, channels: ChannelPool | None = None, chunk_bytes: int = 4 << 20, streams: int = 1):
        """``streams``: the parallel Transfer calls a hand-off is split over (by ranges of its (cache, layer)
        planes, each call on a connection of its own; at most one per plane)."""
        self.channels = channels or ChannelPool()
        self.chunk_bytes = chunk_bytes
        if streams < 1:
            raise ValueError(f"handoff_streams must be at least 1, got {streams}")
        self.streams = streams

    def send(self, address: str, source: PageSource, timeout: float) -> pb.TransferAck:
        lanes = split_lanes(source, self.streams)
        streams = [self._messages(source)] if len(lanes) == 1 else [self._messages(source, lane) for lane in lanes]
        calls = [self.channels.transfer_call(address, lane).future(messages, timeout=timeout)
                 for lane, messages in enumerate(streams)]
        return await_acks(calls, source)

    def _messages(self, source: PageSource, lane: Lane | None = None) -> Iterator[bytes]:
        """One stream's serialized chunks: the whole hand-off's, or (``lane``) its share of the planes."""
        # Serialized here, each chunk's payload copied once from the pages. A cancelled transfer just stops
        # sending: the receiver sees an incomplete transfer and frees its reservation, and ``send`` cancels
        # the call (no exception inside gRPC's sending thread).
        try:
            yield from read_ahead(iter_chunks(source, self.chunk_bytes, encode=as_wire, lane=lane), READ_AHEAD)
        except TransferCancelled:
            return

    def receive(self, messages: Iterator[pb.KVChunk], open_sink: Callable[[str], PageSink]) -> Received:
        """Each chunk is checked and written on a thread of its own while the next one is read out of gRPC (one
        write in flight, in order); the first failure stops the reading, and no write outlives the call."""
        sink, last, writing = None, None, None
        with ThreadPoolExecutor(1, thread_name_prefix="handoff-write") as writer:
            for chunk in messages:
                if sink is None:
                    if not chunk.request_id:
                        raise TransferError("the first chunk names no request_id")
                    sink = open_sink(chunk.request_id)
                if writing is not None:
                    writing.result()
                writing = writer.submit(sink.write, chunk)
                last = chunk
                if chunk.last:
                    break
            if writing is not None:
                writing.result()
        if sink is None:
            raise TransferError("the transfer carried no chunk")
        return sink.finish(last)

    def close(self) -> None:
        self.channels.close()


READ_AHEAD = 2  # serialized chunks ready beyond the one gRPC is sending (bounds the memory in flight)
_END = object()


def read_ahead(messages: Iterator, depth: int) -> Iterator:
    """``messages``, produced on a thread of their own up to ``depth`` ahead: the next chunk is read,
    checksummed and serialized while gRPC sends this one (gRPC asks for the next message only once the
    last was written). An exception of the producer is raised here; closing this generator stops it."""
    ready: queue.Queue = queue.Queue(depth)
    stop = threading.Event()

    def put(item) -> bool:
        while not stop.is_set():
            try:
                ready.put(item, timeout=FEED_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for message in messages:
                if not put(message):
                    return
            put(_END)
        except BaseException as e:  # handed to the consumer
            put(e)

    threading.Thread(target=produce, name="handoff-read-ahead", daemon=True).start()
    try:
        while (item := ready.get()) is not _END:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()


def await_acks(calls: list, source: PageSource) -> pb.TransferAck:
    """The acknowledgement of a hand-off sent over ``calls`` (its parallel streams): the first call to fail
    cancels the others and raises; a cancelled guard cancels them all (TransferCancelled). Each stream's
    acknowledgement counts its own bytes, the one that completed the hand-off every stream's: that one is
    returned."""
    changed = threading.Event()
    for call in calls:
        call.add_done_callback(lambda _: changed.set())
    try:
        while True:
            changed.clear()
            if all(call.done() for call in calls):
                return max((_ack(call, source) for call in calls), key=lambda ack: ack.bytes)
            for call in calls:
                if call.done():
                    _ack(call, source)  # raises if it failed
            if source.guard.cancelled:
                raise TransferCancelled(f"{source.rid}: released during its transfer")
            changed.wait(0.05)
    finally:
        for call in calls:
            call.cancel()  # no-op on a call that ended


def _ack(call, source: PageSource) -> pb.TransferAck:
    """A finished call's acknowledgement, or its failure as the sender raises it."""
    try:
        return call.result()
    except grpc.FutureCancelledError:
        raise TransferCancelled(f"{source.rid}: transfer cancelled") from None
    except grpc.RpcError:  # the receiver's answer to a transfer that stopped short because it was cancelled
        if source.guard.cancelled:
            raise TransferCancelled(f"{source.rid}: released during its transfer") from None
        raise


class IpcTransport(GrpcStreamTransport):
    """Same host: pages written straight into the decode pools; control (the in-place message carrying
    the draft state, and the acknowledgement) over ``Decode.Transfer``. Receives like the gRPC stream."""

    name = "ipc"

    def __init__(self, channels: ChannelPool | None = None):
        super().__init__(channels)
        self._pools: dict[str, tuple[bytes, list]] = {}  # address -> (its export, the mapped pools)
        self._lock = threading.Lock()

    def pools(self, address: str, exported: bytes) -> list:
        """The decode instance's pools, mapped once per export (a restarted instance exports new ones)."""
        with self._lock:
            known = self._pools.get(address)
        if known is not None and known[0] == exported:
            return known[1]
        pools = open_pools(exported)
        with self._lock:
            self._pools[address] = (exported, pools)
        return pools

    def send(self, address: str, source: PageSource, timeout: float) -> pb.TransferAck:
        target = source.in_place
        if target is None:
            raise TransferError(f"{source.rid}: the ipc transport needs the decode side's reserved pages")
        written = self._write(address, source, target)
        msg = pb.KVChunk(request_id=source.rid, seq=0, last=True, total_chunks=1, in_place=True,
                         in_place_bytes=written.bytes, draft_state=written.last.draft_state,
                         output_ids=written.last.output_ids, output_logprobs=written.last.output_logprobs)
        call = self.channels.decode_stub(address).Transfer.future(iter([msg]), timeout=timeout)
        return await_acks([call], source)

    def _write(self, address: str, source: PageSource, target) -> Written:
        return write_in_place(source, self.pools(address, target.exported), target.page_ids, target.deadline)

    def close(self) -> None:
        with self._lock:
            self._pools.clear()
        super().close()


class NixlTransport(IpcTransport):
    """Any host with NIXL on both sides: the pages written into the decode pools by NIXL (``shared.handoff.nixl``,
    UCX's transports as ``UCX_TLS`` allows), then the in-place message, as ipc. Never chosen by ``auto`` yet: forced
    with ``handoff_transport=nixl`` on both services."""

    name = "nixl"

    def __init__(self, channels: ChannelPool | None = None):
        super().__init__(channels)
        self._agent = None

    def agent(self):
        from shared.handoff.nixl import NixlAgent

        with self._lock:
            if self._agent is None:
                self._agent = NixlAgent("prefill")
            return self._agent

    def close(self) -> None:
        super().close()
        with self._lock:
            agent, self._agent = self._agent, None
        if agent is not None:
            agent.close()

    def _write(self, address: str, source: PageSource, target) -> Written:
        from shared.handoff.nixl import write_pages

        return write_pages(self.agent(), source, target.exported, target.page_ids, target.deadline)


TRANSPORTS = ("ipc", "grpc-stream", "nixl")


def negotiate(forced: str, reply: pb.HandshakeResponse, device, unusable: dict[str, str] | None = None
              ) -> tuple[str, str]:
    """The transport to a decode instance from its handshake reply: (name, why). ``forced`` is "auto" or
    a name; a forced transport the two sides cannot use raises TransferError naming why. ``unusable``: the
    transports that failed at their first use for this instance, with why (never chosen again for it). For a
    peer GPU, ipc is chosen only once a copy into the peer's memory was proven (``shared.handoff.peer``)."""
    if forced not in ("auto", *TRANSPORTS):
        raise TransferError(f"handoff_transport: {forced!r} is not one of auto, {', '.join(TRANSPORTS)}")
    offered = list(reply.transports) or ["grpc-stream"]  # an older decode instance offers only the stream
    why_not_ipc = None
    if "ipc" not in offered:
        why_not_ipc = "the decode instance does not offer ipc"
    elif reply.host_id != host_id():
        why_not_ipc = "the decode instance runs on another host"
    elif unusable and "ipc" in unusable:
        why_not_ipc = f"ipc failed at its first use for this instance ({unusable['ipc']})"
    else:
        why_not_ipc = reachable(reply.pools, device)
    if forced == "ipc" and why_not_ipc:
        raise TransferError(f"handoff_transport ipc was forced, but {why_not_ipc}")
    if forced == "nixl":
        from shared.handoff.nixl import nixl_api

        if "nixl" not in offered or not reply.nixl:
            raise TransferError("handoff_transport nixl was forced, but the decode instance does not offer nixl")
        if nixl_api() is None:
            raise TransferError("handoff_transport nixl was forced, but NIXL is not installed here")
    if forced == "grpc-stream" and "grpc-stream" not in offered:
        raise TransferError("handoff_transport grpc-stream was forced, but the decode instance does not offer it")
    if forced != "auto":
        return forced, "forced"
    if why_not_ipc is None:
        return "ipc", "same host, pools reachable"
    return "grpc-stream", why_not_ipc
