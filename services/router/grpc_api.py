"""The router's client-facing gRPC server on ``grpc.aio``: control calls cannot be starved by streams.

The server runs on its own event loop thread. ``Generate`` walks ``RouterCore.generate`` (blocking: gRPC
calls to the engines, Redis) one message at a time on a dedicated stream pool, so an open stream holds no
thread of the server; ``Abort`` answers on the event loop itself and ``GetModelInfo`` and the health
service on a small control pool of their own. However many streams are open, control calls answer
promptly. Every method decodes its own request: a message that does not decode is INVALID_ARGUMENT naming
``request`` (gRPC's deserializer would answer INTERNAL).
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from proto.eyrie.v1 import eyrie_pb2 as pb
from services.common import OPEN_METHOD_PREFIXES, full_name
from services.http_server import key_matches
from shared.request import RequestError

SERVICES = [full_name("Generation")]
_END = object()


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

    def __init__(self, core, stream_workers: int, control_workers: int = 4):
        self.core = core
        self.streams = ThreadPoolExecutor(stream_workers, thread_name_prefix="router-stream")
        self.control = ThreadPoolExecutor(control_workers, thread_name_prefix="router-control")

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
        rid, loop = request.request_id, asyncio.get_running_loop()
        cancelled = threading.Event()
        gen = self.core.generate(request, cancelled)
        ended, step = False, None
        try:
            while True:
                step = self.streams.submit(next, gen, _END)
                msg = await asyncio.wrap_future(step, loop=loop)
                if msg is _END:
                    ended = True
                    return
                yield msg
        except RequestError as e:
            ended = True
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except RouterError as e:
            ended = True
            await context.abort(e.code, e.message)
        finally:
            if not ended:  # the client went away (or its deadline passed): end the request now
                self.core.abort(rid, "client disconnected", grpc.StatusCode.CANCELLED)
                cancelled.set()
                # close the generator (recording the end) once its step in flight, if any, has returned
                step.add_done_callback(lambda _: self._submit(gen.close)) if step else self._submit(gen.close)

    def _submit(self, fn) -> None:
        try:
            self.streams.submit(fn)
        except RuntimeError:  # shutting down: close here
            fn()

    async def abort(self, raw: bytes, context) -> pb.AbortResponse:
        request = await _decode(raw, pb.AbortRequest, context)
        return pb.AbortResponse(found=self.core.abort(request.request_id))  # locks and a cancel: no I/O

    async def model_info(self, raw: bytes, context) -> pb.ModelInfo:
        await _decode(raw, pb.ModelInfoRequest, context)
        return await asyncio.get_running_loop().run_in_executor(self.control, self.core.model_info)


class RouterGrpc:
    """The aio server on its own event loop thread; ``set_serving`` and ``stop`` may be called from any thread."""

    def __init__(self, core, host: str, port: int, max_message_bytes: int, api_key: str | None, on_denied,
                 stream_workers: int):
        self.api = AioGeneration(core, stream_workers)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="router-grpc", daemon=True)
        self._thread.start()
        self.server, self.port, self.health = self._call(self._start(host, port, max_message_bytes, api_key,
                                                                     on_denied))

    def _call(self, coro, timeout: float = 30):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _start(self, host, port, max_message_bytes, api_key, on_denied):
        options = [("grpc.max_receive_message_length", max_message_bytes),
                   ("grpc.max_send_message_length", max_message_bytes), ("grpc.so_reuseport", 0)]
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
        try:
            self._call(self.server.stop(grace), timeout=grace + 5)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(5)
            self.api.streams.shutdown(wait=False, cancel_futures=True)
            self.api.control.shutdown(wait=False)
