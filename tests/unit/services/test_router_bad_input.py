"""Bad input never reaches a 500: the cases found by hand (lone surrogates, deep nesting, integers of
thousands of digits, a request id with a trailing newline, undecodable protobuf), and a property-based fuzz
of the gRPC and HTTP request schemas against a real router (scripted engines): every request is refused
naming its field (4xx / INVALID_ARGUMENT) or served to its end, never a 5xx, never a hang. Each fuzz is
shown to catch a planted bug."""

from __future__ import annotations

import json
import re
import uuid

import grpc
import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from proto.eyrie.v1 import eyrie_pb2 as pb
from services.metadata import TERMINAL, EmbeddedRedis
from services.router import openai_http
from services.router import server as router_server
from tests.unit.services.scripted_stack import start_scripted_stack

# The request id grammar as documented (letters, digits, '.', '_', ':' or '-'; 1-128), written out here
# independently of the router's own pattern.
ID_GRAMMAR = re.compile(r"[A-Za-z0-9._:-]{1,128}")
FIELD_PREFIXES = ("request_id:", "request:", "prompt", "sampling.", "n:", "best_of:")  # n, best_of: top-level fields
FUZZ = settings(max_examples=60, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
# A planted bug need only be found, not shrunk to its smallest example (shrinking takes minutes); the same
# examples every run, and enough of them that a rare field combination turns up (the search stops at it).
FIND = settings(FUZZ, max_examples=400, phases=[Phase.generate], report_multiple_bugs=False, derandomize=True)


@pytest.fixture(scope="module")
def stack(tiny_model_dir):
    redis_server = EmbeddedRedis()  # its own: the session server's databases are flushed by other tests
    s = start_scripted_stack(redis_server.start(), tiny_model_dir)
    yield s
    s.stop()
    redis_server.stop()


def post(stack, path: str, body: bytes) -> httpx.Response:
    if not hasattr(stack, "http"):  # one client: a new one per request costs ~0.2 s (its TLS context)
        stack.http = httpx.Client(timeout=10)
    return stack.http.post(stack.http_url + path, content=body, headers={"content-type": "application/json"})


# ---- the cases found by hand ---------------------------------------------------------------------
HTTP_CASES = [
    ("/v1/completions", b'{"prompt": "\\ud800"}', "prompt"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages[0].content"),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}", "max_tokens"),
    ("/v1/completions", b'{"prompt": [' + b"1" * 5000 + b"]}", "prompt[0]"),
    ("/v1/completions", b'{"prompt": "hi", "\\udfff": 1}', None),
    ("/v1/completions", b"[" * 100_000 + b"]" * 100_000, None),
    ("/v1/completions", b'{"prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", None),
    ("/v1/completions", b'{"prompt": ' + b"[" * 40 + b"]" * 40 + b"}", "prompt" + "[0]" * 32),
]


@pytest.mark.parametrize("path, body, param", HTTP_CASES, ids=range(len(HTTP_CASES)))
def test_http_bad_bodies_are_400_naming_the_field(stack, path, body, param):
    r = post(stack, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"], err
    if param is None:
        assert err["code"] == "invalid_json"


def test_grpc_request_id_with_a_trailing_newline_is_refused(stack):
    with pytest.raises(grpc.RpcError) as e:
        list(stack.stub.Generate(pb.GenerateRequest(request_id="abc\n", token_ids=pb.TokenIds(ids=[5])), timeout=10))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith("request_id:")
    assert not stack.store.client.exists("req:abc\n") and not stack.store.client.exists("req:abc")


@pytest.mark.parametrize("method", ["Generate", "Abort", "GetModelInfo"])
def test_grpc_undecodable_protobuf_is_invalid_argument(stack, method):
    raw = b"\x0a\xff\xff\xff\xff\x0f"  # field 1, length-delimited, a length far past the end
    call = (stack.channel.unary_stream if method == "Generate" else stack.channel.unary_unary)(
        f"/eyrie.v1.Generation/{method}")
    with pytest.raises(grpc.RpcError) as e:
        result = call(raw, timeout=10)
        list(result) if method == "Generate" else result
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith("request:")


def test_a_503_carries_the_request_id(redis_url, tiny_model_dir):
    s = start_scripted_stack(redis_url, tiny_model_dir, placement_timeout_s=0.2)
    try:
        s.store.client.delete("instances")  # nobody to place on
        r = post(s, "/v1/completions", b'{"prompt": "hi", "max_tokens": 2}')
        assert r.status_code == 503
        rid = r.headers["x-request-id"]
        assert rid in r.json()["error"]["message"] and s.store.get(rid)["state"] == "failed"
        with pytest.raises(grpc.RpcError) as e:
            list(s.stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5])), timeout=10))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and re.search(r"request [0-9a-f]{32}:", e.value.details())
    finally:
        s.stop()


# ---- the fuzz ------------------------------------------------------------------------------------
def _json_scalar() -> st.SearchStrategy[str]:
    """JSON text of one scalar, including what Python's json and pydantic trip on."""
    return st.one_of(
        st.integers(-2**70, 2**70).map(str),
        st.integers(20, 6000).map(lambda n: "9" * n),  # integers of many digits
        st.floats(allow_nan=False).map(json.dumps), st.sampled_from(["1e999", "-1e999", "0.5", "1.0"]),
        st.booleans().map(json.dumps), st.just("null"),
        st.text(st.characters(codec=None, categories=["L", "N", "P", "Zs", "Cs", "Cc"]), max_size=12)
        .map(json.dumps),  # Cs: lone surrogates, written as \\udXXX escapes
        st.integers(1, 2000).map(lambda n: "[" * n + "]" * n),  # deep nesting
    )


def _json_value() -> st.SearchStrategy[str]:
    return st.recursive(_json_scalar(), lambda inner: st.one_of(
        st.lists(inner, max_size=4).map(lambda xs: "[" + ", ".join(xs) + "]"),
        st.dictionaries(st.sampled_from(["role", "content", "type", "text", "x"]), inner, max_size=3)
        .map(lambda d: "{" + ", ".join(f"{json.dumps(k)}: {v}" for k, v in d.items()) + "}")), max_leaves=6)


HTTP_KEYS = ["prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed",
             "stream", "stop_token_ids", "ignore_eos", "logprobs", "model", "n", "stop", "user", "typo_field"]


@st.composite
def http_bodies(draw) -> tuple[str, bytes]:
    chat = draw(st.booleans())
    fields = {}
    if draw(st.booleans()):  # mostly well-formed prompts, so requests also get through to the end
        fields["messages" if chat else "prompt"] = (
            json.dumps([{"role": "user", "content": draw(st.text(max_size=8))}]) if chat
            else json.dumps(draw(st.one_of(st.text(min_size=1, max_size=8), st.lists(st.integers(0, 511), min_size=1,
                                                                                       max_size=8)))))
        fields["max_tokens"] = str(draw(st.integers(1, 4)))
    for key in draw(st.lists(st.sampled_from(HTTP_KEYS), max_size=4, unique=True)):
        fields[key] = draw(_json_value())
    body = "{" + ", ".join(f"{json.dumps(k)}: {v}" for k, v in fields.items()) + "}"
    return ("/v1/chat/completions" if chat else "/v1/completions"), body.encode()


def check_http(stack, path: str, body: bytes) -> None:
    r = post(stack, path, body)
    assert r.status_code < 500, (r.status_code, r.text[:300])
    if r.status_code == 200:
        assert "data: [DONE]" in r.text if r.text.startswith("data:") else r.json()["choices"], r.text[:300]
        assert '"error"' not in r.text, r.text[:300]
    else:
        err = r.json()["error"]
        assert err["message"] and (err["param"] or err["code"] == "invalid_json"), (r.status_code, err)


@st.composite
def grpc_requests(draw) -> bytes | pb.GenerateRequest:
    """A GenerateRequest's bytes: built from fields (each one valid or, one time in four, anything its wire
    type holds; ids with odd suffixes), or raw bytes."""
    if draw(st.integers(0, 4)) == 0:
        return draw(st.binary(max_size=64))

    def either(valid, wild):
        return draw(wild if draw(st.integers(0, 3)) == 0 else valid)

    req = pb.GenerateRequest(return_logprobs=draw(st.booleans()))
    if draw(st.booleans()):
        req.request_id = draw(st.from_regex(ID_GRAMMAR, fullmatch=True)) + draw(st.sampled_from(["", "\n", " ", "é"]))
    if draw(st.booleans()):
        req.text = either(st.text(min_size=1, max_size=20), st.text(max_size=400))
    else:
        req.token_ids.ids.extend(either(st.lists(st.integers(0, 511), min_size=1, max_size=8),
                                        st.lists(st.integers(-2**31, 2**31 - 1), max_size=70)))
    s = req.sampling
    s.temperature = either(st.floats(0, 2), st.floats(width=32))
    s.top_p = either(st.floats(0, 1), st.floats(width=32))
    s.top_k = either(st.integers(0, 600), st.integers(-2**31, 2**31 - 1))
    s.max_new_tokens = either(st.integers(0, 4), st.integers(0, 2**32 - 1))
    if draw(st.booleans()):
        s.seed = draw(st.integers(0, 2**64 - 1))
    s.stop_token_ids.extend(either(st.lists(st.integers(0, 511), max_size=3),
                                   st.lists(st.integers(-2**31, 2**31 - 1), max_size=3)))
    return req


def check_grpc(stack, request: bytes | pb.GenerateRequest) -> None:
    raw = request
    if isinstance(request, pb.GenerateRequest):
        if request.request_id:  # unique per call: a replayed example must not find its id taken
            request.request_id = uuid.uuid4().hex[:6] + request.request_id
        raw = request.SerializeToString()
    call = stack.channel.unary_stream("/eyrie.v1.Generation/Generate",
                                      response_deserializer=pb.GenerateResponse.FromString)
    try:
        msgs = list(call(raw, timeout=10))
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (e.code(), e.details())
        assert e.details().startswith(FIELD_PREFIXES), e.details()
        return
    assert msgs and msgs[-1].HasField("finish"), msgs
    rid = msgs[-1].request_id
    assert ID_GRAMMAR.fullmatch(rid), f"accepted the request id {rid!r}"
    assert stack.store.get(rid)["state"] in TERMINAL


def run_http_fuzz(stack, budget=FUZZ) -> None:
    @budget
    @given(http_bodies())
    def fuzz(case):
        check_http(stack, *case)

    fuzz()


GRPC_FUZZ = settings(FUZZ, max_examples=200)  # ~10 ms an example


def run_grpc_fuzz(stack, budget=GRPC_FUZZ) -> None:
    @budget
    @given(grpc_requests())
    def fuzz(raw):
        check_grpc(stack, raw)

    fuzz()


def test_http_fuzz_is_4xx_naming_the_field_or_served(stack):
    run_http_fuzz(stack)


def test_grpc_fuzz_is_invalid_argument_naming_the_field_or_served(stack):
    run_grpc_fuzz(stack)


def test_the_http_fuzz_catches_a_planted_bug(stack, monkeypatch):
    monkeypatch.setattr(openai_http, "_check_json", lambda body: None)  # lone surrogates, huge ints, depth
    with pytest.raises(AssertionError):
        run_http_fuzz(stack, FIND)


class _DollarPattern:
    """The bug the issue found: ``^...$`` with ``match`` lets ``"abc\\n"`` through."""

    _regex = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")

    def fullmatch(self, text):
        return self._regex.match(text)


def test_the_grpc_fuzz_catches_a_planted_bug(stack, monkeypatch):
    monkeypatch.setattr(router_server, "RID_PATTERN", _DollarPattern())
    with pytest.raises(AssertionError):
        run_grpc_fuzz(stack, FIND)
