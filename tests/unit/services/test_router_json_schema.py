"""Structured output on the router: ``response_format`` (both OpenAI endpoints) becomes the gRPC
``SamplingParams.json_schema``; a bad schema or format is a 400 naming ``response_format`` (and the gRPC
field is INVALID_ARGUMENT naming ``sampling.json_schema``) with no request record left running; vLLM's
spellings are refused pointing to ``response_format``."""

from __future__ import annotations

import json

import grpc
import httpx
import pytest

from proto.eyrie.v1 import eyrie_pb2 as pb
from services.metadata import EmbeddedRedis
from services.router.openai_http import ChatRequest, CompletionRequest, parse_chat, parse_completion
from shared.grammar import ANY_JSON_OBJECT
from shared.handoff import sampling_from_pb, sampling_to_pb
from shared.sampling import SamplingParams
from tests.unit.services.scripted_stack import start_scripted_stack

SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}, "required": ["a"]}
FORMATS = [
    ({"type": "json_object"}, ANY_JSON_OBJECT),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}, json.dumps(SCHEMA)),
    ({"type": "text"}, None),
    (None, None),
]


class PlainTemplate:
    def render(self, messages: list[dict]) -> str:
        return "".join(m["content"] for m in messages)


@pytest.mark.parametrize("rf,want", FORMATS, ids=["json_object", "json_schema", "text", "none"])
def test_response_format_becomes_the_grpc_json_schema_on_both_endpoints(rf, want):
    completion = parse_completion(CompletionRequest(prompt="hi", response_format=rf)).req.sampling
    chat = parse_chat(ChatRequest(messages=[{"role": "user", "content": "hi"}], response_format=rf),
                      PlainTemplate(), 16).req.sampling
    for s in (completion, chat):
        assert (s.json_schema if s.HasField("json_schema") else None) == want
    if want is not None:
        assert sampling_from_pb(sampling_to_pb(SamplingParams(json_schema=want))).json_schema == want  # hand-off


@pytest.fixture(scope="module")
def stack(tiny_model_dir):
    redis_server = EmbeddedRedis()
    s = start_scripted_stack(redis_server.start(), tiny_model_dir)
    yield s
    s.stop()
    redis_server.stop()


BAD = [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}, "response_format",
     "objekt"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nowhere"}}}, "response_format",
     "nowhere"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "response_format.json_schema.schema", "schema"),
    ({"type": "json_schema"}, "response_format.json_schema", "json_schema"),
    ({"type": "yaml"}, "response_format.type", "yaml"),
]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("rf,param,problem", BAD, ids=range(len(BAD)))
def test_a_bad_response_format_is_400_naming_it(stack, path, rf, param, problem):
    body = {"response_format": rf, "max_tokens": 2, **({"prompt": "hi"} if path == "/v1/completions"
                                                        else {"messages": [{"role": "user", "content": "hi"}]})}
    r = httpx.post(stack.http_url + path, json=body, timeout=10)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and problem in err["message"], err


def test_a_good_response_format_is_served(stack):
    r = httpx.post(stack.http_url + "/v1/completions", timeout=10,
                   json={"prompt": "hi", "max_tokens": 3, "response_format": {"type": "json_object"}})
    assert r.status_code == 200 and r.json()["choices"], r.text


def test_a_bad_grpc_schema_is_invalid_argument_and_leaves_no_record(stack):
    req = pb.GenerateRequest(request_id="bad-schema", token_ids=pb.TokenIds(ids=[5]),
                             sampling=pb.SamplingParams(json_schema='{"type": "objekt"}'))
    with pytest.raises(grpc.RpcError) as e:
        list(stack.stub.Generate(req, timeout=10))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith("sampling.json_schema:") and "objekt" in e.value.details()
    assert not stack.store.client.exists("req:bad-schema")  # refused before any record or placement


@pytest.mark.parametrize("name,value", [("guided_json", {"type": "object"}), ("structured_outputs", {"json": {}})])
def test_vllm_spellings_are_refused_pointing_to_response_format(stack, name, value):
    r = httpx.post(stack.http_url + "/v1/completions", json={"prompt": "hi", name: value}, timeout=10)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == name and "response_format" in err["message"]
