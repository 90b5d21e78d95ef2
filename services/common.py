"""Pieces every Eyrie service shares: the gRPC server (with health and reflection), API-key auth,
the handle a started service returns, and logging set-up."""

from __future__ import annotations

import hmac
import logging
import uuid
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from proto.eyrie.v1 import eyrie_pb2 as pb
from shared.metadata import InstanceInfo

OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


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


@dataclass
class EngineInstanceInfo(InstanceInfo):
    """An engine instance's registry entry, with what the router reports in GetModelInfo: ``dtype``,
    ``page_size`` and ``spec`` (``draft_kind``, ``topk``, ``steps``, ``num_draft_tokens``) of its engine."""

    model: dict = field(default_factory=dict)

    @staticmethod
    def facts(engine) -> dict:
        from shared.handoff import HandoffSchema

        schema = HandoffSchema.from_engine(engine)
        return {"dtype": schema.dtype, "page_size": schema.page_size, "max_context": engine.max_context,
                "spec": {"draft_kind": schema.draft_kind, "topk": schema.topk, "steps": schema.steps,
                         "num_draft_tokens": schema.num_draft_tokens}}


def new_instance_id(role: str) -> str:
    return f"{role}-{uuid.uuid4().hex[:8]}"


class ApiKeyInterceptor(grpc.ServerInterceptor):
    """Refuses every call without ``authorization: Bearer <key>``, except health and reflection."""

    def __init__(self, api_key: str):
        self.expected = f"Bearer {api_key}"

        def deny(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong API key (metadata authorization)")

        self._deny_unary = grpc.unary_unary_rpc_method_handler(deny)
        self._deny_stream = grpc.unary_stream_rpc_method_handler(deny)

    def intercept_service(self, continuation, handler_call_details):
        if handler_call_details.method.startswith(OPEN_METHOD_PREFIXES):
            return continuation(handler_call_details)
        md = dict(handler_call_details.invocation_metadata or ())
        if hmac.compare_digest(md.get("authorization", "").encode(), self.expected.encode()):
            return continuation(handler_call_details)
        handler = continuation(handler_call_details)
        if handler is not None and handler.response_streaming:
            return self._deny_stream
        return self._deny_unary


def start_grpc_server(host: str, port: int, servicers: list[tuple[Callable, object]], service_names: list[str],
                      max_message_bytes: int = 64 << 20, interceptors=(), workers: int = 64,
                      ) -> tuple[grpc.Server, int, health.HealthServicer]:
    """A started gRPC server with grpc.health.v1 (NOT_SERVING until the caller says so) and reflection."""
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


class RequestIdFilter(logging.Filter):
    """Adds ``rid`` to every record (``-`` when a log line is not about one request)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "rid"):
            record.rid = "-"
        return True


def setup_logging(level: str, role: str) -> None:
    handler = logging.StreamHandler()
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(logging.Formatter(
        f"%(asctime)s %(levelname)s {role} %(name)s rid=%(rid)s %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
