"""The prompt tokens an instance's prefix cache served reach the client (issue 33): in the gRPC ``Finish.usage``
and in the OpenAI responses' ``usage.prompt_tokens_details.cached_tokens`` (as OpenAI and vLLM report them),
from the prefill instance's hand-off (``HandedOff.cached_tokens``) or from a decode instance's own finish (a
prompt prefilled there)."""

from __future__ import annotations

import json

import httpx
import pytest
from scripted_stack import OkPrefill, SteadyDecode, start_scripted_stack

from proto.eyrie.v1 import eyrie_pb2 as pb
from services.metadata import EmbeddedRedis


class CachingPrefill(OkPrefill):
    """Hands off saying it found all but the prompt's last two tokens cached."""

    def Prefill(self, request, context):  # noqa: N802
        for ev in super().Prefill(request, context):
            if ev.HasField("handed_off"):
                ev.handed_off.cached_tokens = len(request.prompt_ids) - 2
            yield ev


class CachingDecode(SteadyDecode):
    """A decode instance whose finish reports 3 cached tokens (its own prefix cache)."""

    def Stream(self, request, context):  # noqa: N802
        for msg in super().Stream(request, context):
            if msg.HasField("finish"):
                msg.finish.usage.cached_tokens = 3
            yield msg


@pytest.fixture(scope="module")
def redis():
    server = EmbeddedRedis()
    yield server.start()
    server.stop()


@pytest.fixture(scope="module")
def stack(redis, tiny_model_dir):
    s = start_scripted_stack(redis, tiny_model_dir, prefill=CachingPrefill())
    yield s
    s.stop()


PROMPT = [5, 6, 7, 8, 9, 10, 11]


def finish_of(stack, prompt: list[int]) -> pb.Finish:
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParams(max_new_tokens=3))
    return [m for m in stack.stub.Generate(req, timeout=30) if m.HasField("finish")][0].finish


def test_grpc_usage_carries_the_prefill_instances_cached_tokens(stack):
    usage = finish_of(stack, PROMPT).usage
    assert (usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens) == (7, 5, 3)


@pytest.mark.parametrize("stream", [False, True])
def test_openai_usage_reports_prompt_tokens_details(stack, stream):
    body = {"prompt": PROMPT, "max_tokens": 3, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    r = httpx.post(stack.http_url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    if stream:
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        usage = events[-1]["usage"]
    else:
        usage = r.json()["usage"]
    assert usage["prompt_tokens"] == 7 and usage["prompt_tokens_details"] == {"cached_tokens": 5}


def test_a_decode_instances_own_cached_tokens_are_kept(tiny_model_dir):
    server = EmbeddedRedis()  # its own registry: the module's stack registers instances of the same names
    s = start_scripted_stack(server.start(), tiny_model_dir, decode=CachingDecode())
    try:
        assert finish_of(s, PROMPT).usage.cached_tokens == 3  # the prefill found nothing: the decode's figure
    finally:
        s.stop()
        server.stop()
