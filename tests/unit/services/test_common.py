"""services.common: gRPC server with health (NOT_SERVING until told) and reflection; API-key auth on every
method shape (health open, reflection guarded) and on the services' own channels to each other."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from proto.eyrie.v1 import eyrie_pb2 as pb
from proto.eyrie.v1 import eyrie_pb2_grpc as pb_grpc
from services.common import (
    ApiKeyInterceptor,
    auth_channel_pool,
    full_name,
    insecure_channel,
    set_serving,
    start_grpc_server,
)

GEN = full_name("Generation")


class EchoGeneration(pb_grpc.GenerationServicer):
    def Generate(self, request, context):  # noqa: N802
        yield pb.GenerateResponse(request_id=request.request_id, token_ids=[1])

    def GetModelInfo(self, request, context):  # noqa: N802
        return pb.ModelInfo(model="echo")


@pytest.fixture(params=[None, "s3cret"], ids=["open", "api-key"])
def server(request):
    interceptors = [ApiKeyInterceptor(request.param)] if request.param else []
    srv, port, health = start_grpc_server("127.0.0.1", 0, [(pb_grpc.add_GenerationServicer_to_server,
                                                            EchoGeneration())], [GEN], interceptors=interceptors)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield channel, health, request.param
    channel.close()
    srv.stop(0)


def test_health_is_not_serving_until_the_service_says_so(server):
    channel, health, _ = server
    stub = health_pb2_grpc.HealthStub(channel)
    for name in ("", GEN):
        assert stub.Check(health_pb2.HealthCheckRequest(service=name)).status == \
            health_pb2.HealthCheckResponse.NOT_SERVING
    set_serving(health, [GEN], True)
    for name in ("", GEN):
        assert stub.Check(health_pb2.HealthCheckRequest(service=name)).status == health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(grpc.RpcError) as err:
        stub.Check(health_pb2.HealthCheckRequest(service="eyrie.v1.Nope"))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_reflection_lists_the_services(server):
    channel, _, key = server
    md = [("authorization", f"Bearer {key}")] if key else None  # reflection needs the key when one is set
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    (reply,) = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                         metadata=md)
    names = {s.name for s in reply.list_services_response.service}
    assert {GEN, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= names
    (reply,) = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(file_containing_symbol=GEN)]),
                                         metadata=md)
    assert reply.file_descriptor_response.file_descriptor_proto, "a client can fetch the service's descriptor"
    if key:
        with pytest.raises(grpc.RpcError) as err:
            list(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_api_key_guards_generation_but_not_health(server):
    channel, health, key = server
    stub = pb_grpc.GenerationStub(channel)
    calls = [lambda md: stub.GetModelInfo(pb.ModelInfoRequest(), metadata=md).model,
             lambda md: [m.token_ids[0] for m in stub.Generate(pb.GenerateRequest(text="x"), metadata=md)]]
    for call in calls:
        if key is None:
            assert call(None)
            continue
        for md in (None, [("authorization", "Bearer wrong")], [("authorization", key)]):
            with pytest.raises(grpc.RpcError) as err:
                call(md)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "authorization" in err.value.details()
        assert call([("authorization", f"Bearer {key}")])
    set_serving(health, [GEN], True)
    assert health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest()).status == \
        health_pb2.HealthCheckResponse.SERVING


class RecordingDecode(pb_grpc.DecodeServicer):
    """Every method shape (unary, client-streaming, server-streaming), recording the metadata it was called with."""

    def __init__(self):
        self.seen = []

    def _record(self, context):
        self.seen.append(dict(context.invocation_metadata()).get("authorization"))

    def Abort(self, request, context):  # noqa: N802
        self._record(context)
        return pb.AbortResponse(found=True)

    def Transfer(self, request_iterator, context):  # noqa: N802
        self._record(context)
        return pb.TransferAck(chunks=sum(1 for _ in request_iterator))

    def Stream(self, request, context):  # noqa: N802
        self._record(context)
        yield pb.GenerateResponse(request_id=request.request_id, token_ids=[3])


@pytest.fixture
def keyed_decode():
    denied = []
    servicer = RecordingDecode()
    srv, port, _ = start_grpc_server("127.0.0.1", 0, [(pb_grpc.add_DecodeServicer_to_server, servicer)],
                                     [full_name("Decode")], api_key="k3y", on_denied=lambda: denied.append(1))
    yield f"127.0.0.1:{port}", servicer, denied
    srv.stop(0)


def calls(stub):
    return [lambda: stub.Abort(pb.AbortRequest(request_id="r"), timeout=5).found,
            lambda: stub.Transfer(iter([pb.KVChunk(request_id="r")] * 3), timeout=5).chunks,
            lambda: [m.token_ids[0] for m in stub.Stream(pb.StreamRequest(request_id="r"), timeout=5)]]


def test_every_method_shape_is_refused_without_the_key_and_counted(keyed_decode):
    address, servicer, denied = keyed_decode
    channel = grpc.insecure_channel(address)
    for call in calls(pb_grpc.DecodeStub(channel)):
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert servicer.seen == [] and len(denied) == 3  # refused before the servicer, each refusal counted
    assert health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)  # open


def test_channels_of_the_services_carry_the_key(keyed_decode):
    address, servicer, _ = keyed_decode
    stub = pb_grpc.DecodeStub(insecure_channel(address, api_key="k3y"))
    assert [call() for call in calls(stub)] == [True, 3, [3]]
    pool = auth_channel_pool("k3y")  # the prefill side's channels (hand-off control and transport)
    assert [call() for call in calls(pool.decode_stub(address))] == [True, 3, [3]]
    pool.close()
    assert servicer.seen == ["Bearer k3y"] * 6
    with pytest.raises(grpc.RpcError) as err:  # a stack whose services hold different keys fails loudly
        pb_grpc.DecodeStub(insecure_channel(address, api_key="other")).Abort(pb.AbortRequest(), timeout=5)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
