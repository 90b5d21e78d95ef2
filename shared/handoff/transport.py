"""Hand-off transports: how a request's pages get from a prefill instance to a decode instance.

``Transport`` is the interface the prefill service uses; ``GrpcStreamTransport`` sends page-aligned
chunks over the decode service's ``Transfer`` client stream (works on the CPU and across hosts; gRPC
flow control bounds the bytes in flight, and the chunk generator reads pages lazily). An NCCL
transport between GPUs implements the same two calls.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Protocol

import grpc

from proto.eyrie.v1 import eyrie_pb2 as pb
from proto.eyrie.v1 import eyrie_pb2_grpc as pb_grpc


class Transport(Protocol):
    def reserve(self, address: str, request: pb.ReserveRequest, timeout: float) -> pb.ReserveResponse:
        """Ask the decode instance at ``address`` to claim pages for the request."""

    def transfer(self, address: str, chunks: Iterator[pb.KVChunk], timeout: float) -> pb.TransferAck:
        """Send the request's pages and draft state; returns the acknowledgement."""


class GrpcStreamTransport:
    def __init__(self, max_message_bytes: int = 64 << 20):
        self._channels: dict[str, grpc.Channel] = {}
        self._lock = threading.Lock()
        self._options = [("grpc.max_send_message_length", max_message_bytes),
                         ("grpc.max_receive_message_length", max_message_bytes)]

    def stub(self, address: str) -> pb_grpc.DecodeStub:
        with self._lock:
            ch = self._channels.get(address)
            if ch is None:
                ch = self._channels[address] = grpc.insecure_channel(address, options=self._options)
        return pb_grpc.DecodeStub(ch)

    def handshake(self, address: str, schema: pb.HandoffSchema, timeout: float) -> pb.HandshakeResponse:
        return self.stub(address).Handshake(schema, timeout=timeout)

    def reserve(self, address: str, request: pb.ReserveRequest, timeout: float) -> pb.ReserveResponse:
        return self.stub(address).Reserve(request, timeout=timeout)

    def transfer(self, address: str, chunks: Iterator[pb.KVChunk], timeout: float) -> pb.TransferAck:
        return self.stub(address).Transfer(chunks, timeout=timeout)

    def close(self) -> None:
        with self._lock:
            for ch in self._channels.values():
                ch.close()
            self._channels.clear()
