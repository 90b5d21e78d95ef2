"""services.common: gRPC server with health (NOT_SERVING until told) and reflection; API-key auth."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from proto.eyrie.v1 import eyrie_pb2 as pb
from proto.eyrie.v1 import eyrie_pb2_grpc as pb_grpc
from services.common import ApiKeyInterceptor, full_name, set_serving, start_grpc_server

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
    channel, _, _ = server
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    (reply,) = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    names = {s.name for s in reply.list_services_response.service}
    assert {GEN, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= names
    (reply,) = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(file_containing_symbol=GEN)]))
    assert reply.file_descriptor_response.file_descriptor_proto, "a client can fetch the service's descriptor"


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
