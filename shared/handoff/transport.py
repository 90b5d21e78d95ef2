"""Hand-off transports: how a request's pages get from a prefill instance to a decode instance.

Control and data are separate. Control (``DecodeClient``: the schema handshake, the page
reservation, aborts) is always gRPC. Data goes through a ``Transport``:

- sending side: ``send(address, source, timeout) -> TransferAck`` moves one request's pages and draft
  state (a ``PageSource``) to the decode instance at ``address``;
- receiving side: ``receive(messages, open_sink) -> Received`` writes them into the pages the decode
  side reserved (``open_sink(rid)`` returns the request's ``PageSink``).

``GrpcStreamTransport`` streams page-aligned chunks over the ``Decode.Transfer`` client stream (works
on the CPU and across hosts; gRPC flow control bounds the bytes in flight). An NCCL transport between
GPUs implements the same two calls: ``send`` would post the request's page slices as NCCL sends and
use a control message for the count and the draft state, ``receive`` the matching receives straight
into the sink's pages.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator

import grpc

from proto.eyrie.v1 import eyrie_pb2 as pb
from proto.eyrie.v1 import eyrie_pb2_grpc as pb_grpc
from shared.handoff.schema import HandoffSchema
from shared.handoff.wire import PageSink, PageSource, Received, TransferCancelled, TransferError, iter_chunks


class ChannelPool:
    """One gRPC channel per decode address, shared by the control client and the transport."""

    def __init__(self, max_message_bytes: int = 64 << 20,
                 open_channel: Callable[[str, list], grpc.Channel] | None = None):
        """``open_channel(address, options)`` makes each channel (the services pass one that adds the
        API key to every call); default ``grpc.insecure_channel``."""
        self._channels: dict[str, grpc.Channel] = {}
        self._lock = threading.Lock()
        self._options = [("grpc.max_send_message_length", max_message_bytes),
                         ("grpc.max_receive_message_length", max_message_bytes)]
        self._open = open_channel or (lambda address, options: grpc.insecure_channel(address, options=options))

    def decode_stub(self, address: str) -> pb_grpc.DecodeStub:
        with self._lock:
            ch = self._channels.get(address)
            if ch is None:
                ch = self._channels[address] = self._open(address, self._options)
        return pb_grpc.DecodeStub(ch)

    def close(self) -> None:
        with self._lock:
            for ch in self._channels.values():
                ch.close()
            self._channels.clear()


class DecodeClient:
    """The prefill side's control calls to decode instances."""

    def __init__(self, channels: ChannelPool, schema: HandoffSchema):
        self.channels, self.schema = channels, schema
        self._agreed: set[str] = set()  # addresses whose handshake passed

    def handshake(self, address: str, timeout: float) -> None:
        """Check schemas once per address; raises grpc.RpcError (FAILED_PRECONDITION naming both sides)."""
        if address in self._agreed:
            return
        self.channels.decode_stub(address).Handshake(self.schema.to_pb(), timeout=timeout)
        self._agreed.add(address)

    def reserve(self, address: str, request: pb.ReserveRequest, timeout: float) -> pb.ReserveResponse:
        request.schema.CopyFrom(self.schema.to_pb())  # checked again: the instance may have restarted
        return self.channels.decode_stub(address).Reserve(request, timeout=timeout)

    def abort(self, address: str, rid: str, timeout: float = 2.0) -> bool:
        """Best effort (the decode side also frees reservations nobody streams)."""
        try:
            return self.channels.decode_stub(address).Abort(pb.AbortRequest(request_id=rid), timeout=timeout).found
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

    def __init__(self, channels: ChannelPool | None = None, chunk_bytes: int = 4 << 20):
        self.channels = channels or ChannelPool()
        self.chunk_bytes = chunk_bytes

    def send(self, address: str, source: PageSource, timeout: float) -> pb.TransferAck:
        call = self.channels.decode_stub(address).Transfer.future(self._messages(source), timeout=timeout)
        while True:
            try:
                return call.result(timeout=0.05)
            except grpc.FutureTimeoutError:
                if source.guard.cancelled:
                    call.cancel()
                    raise TransferCancelled(f"{source.rid}: released during its transfer") from None
            except grpc.FutureCancelledError:
                raise TransferCancelled(f"{source.rid}: transfer cancelled") from None

    def _messages(self, source: PageSource) -> Iterator[pb.KVChunk]:
        # A cancelled transfer just stops sending: the receiver sees an incomplete transfer and frees
        # its reservation, and ``send`` cancels the call (no exception inside gRPC's sending thread).
        try:
            yield from iter_chunks(source, self.chunk_bytes)
        except TransferCancelled:
            return

    def receive(self, messages: Iterator[pb.KVChunk], open_sink: Callable[[str], PageSink]) -> Received:
        sink, last = None, None
        for chunk in messages:
            if sink is None:
                if not chunk.request_id:
                    raise TransferError("the first chunk names no request_id")
                sink = open_sink(chunk.request_id)
            sink.write(chunk)
            last = chunk
            if chunk.last:
                break
        if sink is None:
            raise TransferError("the transfer carried no chunk")
        return sink.finish(last)

    def close(self) -> None:
        self.channels.close()
