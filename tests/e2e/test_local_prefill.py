"""Conditional disaggregation (``EYRIE_LOCAL_PREFILL_MAX_TOKENS``): a short prompt is prefilled by its decode
instance, inside its decode steps, and never handed off; a longer one still goes through a prefill instance.

Both paths give the same tokens (greedy equals the target; a seeded sampled request draws the same tokens either
way), the Redis record says where the prompt was prefilled, the metrics count it, aborts leak nothing, and a
decode instance that cannot take a prompt (or does not know the call) sends it back to a prefill instance.
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from proto.eyrie.v1 import eyrie_pb2 as pb
from proto.eyrie.v1 import eyrie_pb2_grpc as pb_grpc
from services.decode.server import DecodeServicer
from shared.config import EngineConfig
from shared.engine import Engine
from shared.request import RequestError
from shared.sampling import SamplingParams
from tests.e2e.conftest import start_stack
from tests.e2e.test_operations import metric, scrape

SHORT = [5, 17, 33, 2, 9]  # prefilled on the decode instance (<= LOCAL)
LONG = [(i * 37 + 11) % 500 for i in range(30)]  # through a prefill instance (several chunks)
LOCAL = 10
NEW = 12


def local_stack(redis_url, model_dir, local: int = LOCAL, **kw):
    """Fixed policy: a seeded sampled request must draw the same tokens on two stacks (the adaptive policy's
    choices follow measured step times, and a sampled request's draws follow the choices)."""
    return start_stack(redis_url, model_dir, "eagle3", page_size=4, chunk_size=8, spec_topk=4, spec_steps=3,
                       spec_draft_tokens=8, max_running=16, max_context=64, spec_policy="fixed",
                       router_extra=dict(local_prefill_max_tokens=local), **kw)


@pytest.fixture(scope="module")
def stack(redis_url, oracle_model_dir):
    s = local_stack(redis_url, oracle_model_dir)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def target_only(oracle_model_dir):
    engine = Engine(oracle_model_dir / "target", config=EngineConfig(page_size=4, chunk_size=None))
    return [r.token_ids for r in engine.generate([SHORT, LONG], SamplingParams(max_new_tokens=NEW, ignore_eos=True))]


def states(stack, rid: str) -> list[str]:
    return [s for s, _ in stack.store.get(rid)["transitions"]]


def run(stack, rid: str, prompt: list[int], **sampling) -> tuple[list[int], pb.Finish]:
    req = pb.GenerateRequest(request_id=rid, token_ids=pb.TokenIds(ids=prompt),
                             sampling=pb.SamplingParams(**sampling))
    tokens, finish = [], None
    for msg in stack.stub.Generate(req, timeout=60):
        tokens += msg.token_ids
        if msg.HasField("finish"):
            finish = msg.finish
    return tokens, finish


def test_a_short_prompt_is_prefilled_on_its_decode_instance_and_a_long_one_handed_off(stack, target_only):
    decode = stack.decodes[0]
    before = (metric(scrape(stack.router), "eyrie_local_prefills_total"),
              metric(scrape(decode), "eyrie_local_prefills_total"))
    short, finish = run(stack, "lp-short", SHORT, max_new_tokens=NEW, ignore_eos=True)
    assert short == target_only[0]
    assert finish.reason == "length" and finish.usage.prompt_tokens == len(SHORT)
    assert finish.usage.completion_tokens == NEW and 0 < finish.ttft_s <= finish.latency_s
    assert finish.spec.verify_steps > 0 and finish.spec.accept_length > 1.2  # the oracle draft, accepted
    rec = stack.store.get("lp-short")
    assert states(stack, "lp-short") == ["queued", "prefilling", "decoding", "finished"]
    assert rec["prefill_instance"] == rec["decode_instance"] == decode.instance_id
    assert "handoff_bytes" not in rec
    long, _ = run(stack, "lp-long", LONG, max_new_tokens=NEW, ignore_eos=True)
    assert long == target_only[1]
    assert states(stack, "lp-long") == ["queued", "prefilling", "transferring", "decoding", "finished"]
    assert stack.store.get("lp-long")["prefill_instance"].startswith("prefill-")
    assert (metric(scrape(stack.router), "eyrie_local_prefills_total"),
            metric(scrape(decode), "eyrie_local_prefills_total")) == (before[0] + 1, before[1] + 1)
    assert stack.wait_clean()


def test_concurrent_short_and_long_prompts_equal_the_target(stack, oracle_model_dir):
    prompts = [[(i * 7 + j * 3) % 500 for j in range(2 + i * 3)] for i in range(10)]  # 2 .. 29 tokens
    assert any(len(p) <= LOCAL for p in prompts) and any(len(p) > LOCAL for p in prompts)
    engine = Engine(oracle_model_dir / "target", config=EngineConfig(page_size=4, chunk_size=None))
    want = [r.token_ids for r in engine.generate(prompts, SamplingParams(max_new_tokens=NEW, ignore_eos=True))]
    got, errors = [None] * len(prompts), []

    def one(i):
        try:
            got[i] = run(stack, f"lp-c{i}", prompts[i], max_new_tokens=NEW, ignore_eos=True)[0]
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and got == want
    local = [i for i in range(len(prompts)) if "transferring" not in states(stack, f"lp-c{i}")]
    assert local == [i for i, p in enumerate(prompts) if len(p) <= LOCAL]
    assert stack.wait_clean()


def test_a_seeded_sampled_request_draws_the_same_tokens_prefilled_here_or_there(redis_url, oracle_model_dir, stack):
    sampling = dict(max_new_tokens=NEW, ignore_eos=True, temperature=0.8, top_p=0.9, seed=1234)
    here, _ = run(stack, "lp-sampled-here", SHORT, **sampling)
    assert "transferring" not in states(stack, "lp-sampled-here")
    other = local_stack(redis_url, oracle_model_dir, local=0)  # every prompt through a prefill instance
    try:
        there, _ = run(other, "lp-sampled-there", SHORT, **sampling)
        assert "transferring" in states(other, "lp-sampled-there")
        assert other.wait_clean()
    finally:
        other.stop()
    assert here == there and len(here) == NEW


def test_ending_at_the_first_token_and_an_abort_mid_stream_leak_nothing(stack):
    tokens, finish = run(stack, "lp-one", SHORT, max_new_tokens=1)
    assert len(tokens) == 1 and finish.reason == "length" and finish.ttft_s > 0
    assert states(stack, "lp-one") == ["queued", "prefilling", "decoding", "finished"]
    req = pb.GenerateRequest(request_id="lp-abort", token_ids=pb.TokenIds(ids=SHORT),
                             sampling=pb.SamplingParams(max_new_tokens=50, ignore_eos=True))
    seen = 0
    with pytest.raises(grpc.RpcError) as err:
        for msg in stack.stub.Generate(req, timeout=60):
            seen += len(msg.token_ids)
            if seen >= 3:
                stack.stub.Abort(pb.AbortRequest(request_id="lp-abort"))
    assert err.value.code() == grpc.StatusCode.ABORTED
    assert stack.wait_clean()
    deadline = time.monotonic() + 10
    while stack.store.get("lp-abort").get("state") != "aborted" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert states(stack, "lp-abort") == ["queued", "prefilling", "decoding", "aborted"]


def test_a_decode_instance_without_the_call_sends_short_prompts_to_a_prefill_instance(redis_url, oracle_model_dir,
                                                                                      target_only, monkeypatch):
    def old_decode(self, request, context):  # a decode instance from before conditional disaggregation
        context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not implemented!")

    monkeypatch.setattr(DecodeServicer, "Admit", old_decode)
    s = local_stack(redis_url, oracle_model_dir)
    try:
        tokens, finish = run(s, "lp-old", SHORT, max_new_tokens=NEW, ignore_eos=True)
        assert tokens == target_only[0] and finish.reason == "length"
        assert states(s, "lp-old") == ["queued", "prefilling", "transferring", "decoding", "finished"]
        assert s.store.get("lp-old")["prefill_instance"].startswith("prefill-")
        assert s.wait_clean()
    finally:
        s.stop()


def test_a_prompt_the_decode_engine_refuses_goes_to_a_prefill_instance(redis_url, oracle_model_dir, target_only):
    s = local_stack(redis_url, oracle_model_dir)
    engine = s.decodes[0].engine_loop.engine

    def refuse(*args, **kwargs):
        raise RequestError("prompt", "no room for it here")

    engine.add_request = refuse  # what Admit calls; a hand-off's reservation does not
    try:
        tokens, _ = run(s, "lp-refused", SHORT, max_new_tokens=NEW, ignore_eos=True)
        assert tokens == target_only[0]
        assert states(s, "lp-refused") == ["queued", "prefilling", "transferring", "decoding", "finished"]
        assert s.wait_clean()
    finally:
        s.stop()


def test_admit_directly_refuses_a_duplicate_and_bad_input_and_takes_the_id_again_once_it_ended(stack, target_only):
    decode = pb_grpc.DecodeStub(grpc.insecure_channel(stack.decodes[0].grpc_address))
    admit = pb.AdmitRequest(request_id="lp-direct", prompt_ids=SHORT,
                            sampling=pb.SamplingParams(max_new_tokens=4, ignore_eos=True))
    for round_ in range(2):  # the id is free again once its stream ended
        assert decode.Admit(admit, timeout=10).accepted, round_
        again = decode.Admit(admit, timeout=10)
        assert not again.accepted and "already here" in again.reason
        tokens = [t for msg in decode.Stream(pb.StreamRequest(request_id="lp-direct"), timeout=30)
                  for t in msg.token_ids]
        assert tokens == target_only[0][:4]
    for bad, field in ((pb.AdmitRequest(prompt_ids=SHORT), "request_id"),
                       (pb.AdmitRequest(request_id="lp-bad", prompt_ids=SHORT,
                                        sampling=pb.SamplingParams(temperature=-1)), "sampling.temperature")):
        with pytest.raises(grpc.RpcError) as err:
            decode.Admit(bad, timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details().startswith(field)
    assert stack.wait_clean()
