"""The router's client-facing gRPC server on ``grpc.aio``: control calls cannot be starved by streams.

The server runs on the router core's event loop. ``Generate`` is a ``Session`` over ``RouterCore.stream``
(asyncio end to end: grpc.aio calls to the engines, Redis on the core's I/O pool), so an open stream holds
no thread; when the client reads slower than the engines write, the tokens that arrived meanwhile go out as
one message. ``Abort`` answers on the loop itself, ``GetModelInfo`` (Redis) from the I/O pool. However
many streams are open, control calls answer promptly. Every method decodes its own request: a message that
does not decode is INVALID_ARGUMENT naming ``request`` (gRPC's deserializer would answer INTERNAL).
"""

from __future__ import annotations

import asyncio
import uuid

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from proto.eyrie.v1 import eyrie_pb2 as pb
from services.common import OPEN_METHOD_PREFIXES, full_name
from services.http_server import key_matches
from services.router.session import Session
from shared.request import RequestError

SERVICES = [full_name("Generation")]


class _AioApiKey(grpc.aio.ServerInterceptor):
    """``services.common.ApiKeyInterceptor`` for the aio server: every method but grpc.health.v1 needs the key."""

    def __init__(self, api_key: str, on_denied=None):
        self.api_key, self.on_denied = api_key, on_denied

        async def deny_unary(_request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong API key (metadata "
                                                                 "authorization: Bearer <key>)")

        async def deny_stream(request, context):
            await deny_unary(request, context)
            yield  # pragma: no cover (abort raised)

        self._deny = {False: grpc.unary_unary_rpc_method_handler(deny_unary),
                      True: grpc.unary_stream_rpc_method_handler(deny_stream)}

    async def intercept_service(self, continuation, details):
        if details.method.startswith(OPEN_METHOD_PREFIXES):
            return await continuation(details)
        given = [v for k, v in details.invocation_metadata or () if k == "authorization"]
        if len(given) == 1 and isinstance(given[0], str) and key_matches(given[0], self.api_key):
            return await continuation(details)
        if self.on_denied is not None:
            self.on_denied()
        handler = await continuation(details)
        return self._deny[bool(handler is not None and handler.response_streaming)]


async def _decode(raw: bytes, message_type, context):
    try:
        return message_type.FromString(raw)
    except DecodeError as e:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                            f"request: not a valid {message_type.DESCRIPTOR.full_name} ({e})")


class AioGeneration:
    """eyrie.v1.Generation over ``RouterCore``."""

    def __init__(self, core):
        self.core = core

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(SERVICES[0], {
            "Generate": grpc.unary_stream_rpc_method_handler(
                self.generate, response_serializer=pb.GenerateResponse.SerializeToString),
            "Abort": grpc.unary_unary_rpc_method_handler(
                self.abort, response_serializer=pb.AbortResponse.SerializeToString),
            "GetModelInfo": grpc.unary_unary_rpc_method_handler(
                self.model_info, response_serializer=pb.ModelInfo.SerializeToString),
        })

    async def generate(self, raw: bytes, context):
        from services.router.server import RouterError

        request = await _decode(raw, pb.GenerateRequest, context)
        if not request.request_id:
            request.request_id = uuid.uuid4().hex
        session = Session(self.core, request)
        try:
            while (msg := await session.next()) is not None:
                yield msg
        except RequestError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except RouterError as e:
            retry = (("retry-after", str(max(1, round(e.retry_after_s)))),) if e.retry_after_s else ()
            await context.abort(e.code, e.message, trailing_metadata=retry)
        finally:  # the client went away (or its deadline passed): end the request now
            await session.close("client disconnected")

    async def abort(self, raw: bytes, context) -> pb.AbortResponse:
        request = await _decode(raw, pb.AbortRequest, context)
        return pb.AbortResponse(found=self.core.abort(request.request_id))  # on the loop: no I/O

    async def model_info(self, raw: bytes, context) -> pb.ModelInfo:
        await _decode(raw, pb.ModelInfoRequest, context)
        return await self.core._io(self.core.model_info)


class RouterGrpc:
    """The aio server on the core's event loop; ``set_serving`` and ``stop`` may be called from any thread."""

    def __init__(self, core, host: str, port: int, max_message_bytes: int, api_key: str | None, on_denied,
                 reuse_port: bool = False):
        self.api = AioGeneration(core)
        self.loop = core.ensure_loop()
        self.reuse_port = reuse_port  # several routers on one port (the kernel spreads connections)
        self.server, self.port, self.health = self._call(self._start(host, port, max_message_bytes, api_key,
                                                                     on_denied))

    def _call(self, coro, timeout: float = 30):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _start(self, host, port, max_message_bytes, api_key, on_denied):
        options = [("grpc.max_receive_message_length", max_message_bytes),
                   ("grpc.max_send_message_length", max_message_bytes), ("grpc.so_reuseport", int(self.reuse_port))]
        server = grpc.aio.server(options=options, interceptors=[_AioApiKey(api_key, on_denied)] if api_key else [])
        server.add_generic_rpc_handlers((self.api.handler(),))
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        for name in ["", *SERVICES]:
            await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        reflection.enable_server_reflection([*SERVICES, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
        bound = server.add_insecure_port(f"{host}:{port}")
        if bound == 0:
            raise OSError(f"cannot bind gRPC on {host}:{port}")
        await server.start()
        return server, bound, health_servicer

    def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING

        async def apply():
            for name in ["", *SERVICES]:
                await self.health.set(name, status)

        self._call(apply(), timeout=5)

    def stop(self, grace: float) -> None:
        """Stop serving (the loop is the core's: ``RouterCore.close`` stops it)."""
        self._call(self.server.stop(grace), timeout=grace + 5)
