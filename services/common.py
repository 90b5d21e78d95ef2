"""Pieces every Eyrie service shares: the gRPC server (with health and reflection), API-key auth (server
side on gRPC and HTTP, client side on the services' channels to each other) and the handle a started
service returns (logging: ``services.logs``)."""

from __future__ import annotations

import collections
import uuid
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from proto.eyrie.v1 import eyrie_pb2 as pb
from services.http_server import bearer, key_matches
from services.telemetry import Telemetry
from shared.handoff.transport import ChannelPool

# With an API key set, every gRPC method needs it except the standard health service (load balancers,
# orchestrators and `eyrie up` probe it); server reflection needs it too.
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/",)


def full_name(service: str) -> str:
    return pb.DESCRIPTOR.services_by_name[service].full_name


@dataclass
class ServiceHandle:
    role: str
    instance_id: str
    grpc_address: str
    http_address: str
    stop: Callable[[float], None]
    engine_loop: object | None = None
    extra: dict = field(default_factory=dict)


def new_instance_id(role: str) -> str:
    return f"{role}-{uuid.uuid4().hex[:8]}"


class ApiKeyInterceptor(grpc.ServerInterceptor):
    """Refuses every call without ``authorization: Bearer <key>`` (UNAUTHENTICATED), except grpc.health.v1.

    Covers every service on the server: Eyrie's own, server reflection, and methods it does not know (they
    are refused as unauthenticated rather than answered as unimplemented). ``on_denied`` counts refusals.
    """

    def __init__(self, api_key: str, on_denied: Callable[[], None] | None = None):
        if not api_key:
            raise ValueError("an ApiKeyInterceptor needs a non-empty key")
        self.api_key, self.on_denied = api_key, on_denied

        def deny(_request, context):  # the request (or its iterator) goes unread
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong API key (metadata authorization: "
                                                           "Bearer <key>)")

        # The refusal must have the method's own shape (a client-streaming call is answered as one).
        self._deny = {(False, False): grpc.unary_unary_rpc_method_handler(deny),
                      (False, True): grpc.unary_stream_rpc_method_handler(deny),
                      (True, False): grpc.stream_unary_rpc_method_handler(deny),
                      (True, True): grpc.stream_stream_rpc_method_handler(deny)}

    def intercept_service(self, continuation, handler_call_details):
        if handler_call_details.method.startswith(OPEN_METHOD_PREFIXES):
            return continuation(handler_call_details)
        given = [v for k, v in handler_call_details.invocation_metadata or () if k == "authorization"]
        if len(given) == 1 and isinstance(given[0], str) and key_matches(given[0], self.api_key):
            return continuation(handler_call_details)
        if self.on_denied is not None:
            self.on_denied()
        handler = continuation(handler_call_details)
        if handler is None:
            return self._deny[(False, False)]
        return self._deny[(bool(handler.request_streaming), bool(handler.response_streaming))]


class _CallDetails(collections.namedtuple("_CallDetails", ("method", "timeout", "metadata", "credentials",
                                                           "wait_for_ready", "compression")),
                   grpc.ClientCallDetails):
    """The call details an interceptor passes on (gRPC gives no public constructor for them)."""


class ApiKeyClientInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                              grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds ``authorization: Bearer <key>`` to every call of a channel (the services' calls to each other)."""

    def __init__(self, api_key: str):
        self._metadata = ("authorization", bearer(api_key))

    def _details(self, d: grpc.ClientCallDetails) -> _CallDetails:
        metadata = [m for m in d.metadata or () if m[0] != "authorization"] + [self._metadata]
        return _CallDetails(d.method, d.timeout, metadata, d.credentials, getattr(d, "wait_for_ready", None),
                            getattr(d, "compression", None))

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)


def insecure_channel(address: str, options=(), api_key: str | None = None) -> grpc.Channel:
    """A channel to another Eyrie service; with ``api_key`` every call on it carries the key."""
    channel = grpc.insecure_channel(address, options=list(options))
    return grpc.intercept_channel(channel, ApiKeyClientInterceptor(api_key)) if api_key else channel


def auth_channel_pool(api_key: str | None, max_message_bytes: int = 64 << 20) -> ChannelPool:
    """The prefill side's channels to decode instances (hand-off control and transport), carrying the key."""
    return ChannelPool(max_message_bytes, lambda address, options: insecure_channel(address, options, api_key))


# The telemetry port takes the same key (every path but /health): one class, one auth middleware.
ServiceTelemetry = Telemetry


def start_grpc_server(host: str, port: int, servicers: list[tuple[Callable, object]], service_names: list[str],
                      max_message_bytes: int = 64 << 20, interceptors=(), workers: int = 64,
                      api_key: str | None = None, on_denied: Callable[[], None] | None = None,
                      ) -> tuple[grpc.Server, int, health.HealthServicer]:
    """A started gRPC server with grpc.health.v1 (NOT_SERVING until the caller says so) and reflection;
    with ``api_key`` every method but grpc.health.v1 needs it (``ApiKeyInterceptor``)."""
    if api_key:
        interceptors = [ApiKeyInterceptor(api_key, on_denied), *interceptors]
    options = [("grpc.max_receive_message_length", max_message_bytes),
               ("grpc.max_send_message_length", max_message_bytes),
               ("grpc.so_reuseport", 0)]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers), options=options,
                         interceptors=list(interceptors))
    for add_fn, servicer in servicers:
        add_fn(servicer, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in ["", *service_names]:
        health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    reflection.enable_server_reflection([*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind gRPC on {host}:{port}")
    server.start()
    return server, bound, health_servicer


def set_serving(health_servicer: health.HealthServicer, service_names: list[str], serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ["", *service_names]:
        health_servicer.set(name, status)
