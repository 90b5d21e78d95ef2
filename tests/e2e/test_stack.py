"""router -> prefill -> decode over real gRPC with a real Redis server.

Greedy output equals the single-process engine and the target alone, for every draft kind, chain and
tree, page sizes 1 and 16, prompts shorter and several times longer than the chunk size; concurrent
streams; complete Redis records; bad requests; aborts and disconnects leak nothing.
"""

from __future__ import annotations

import functools
import itertools
import threading
import time
import urllib.request

import grpc
import pytest

from proto.eyrie.v1 import eyrie_pb2 as pb
from services.metadata import Registry, connect
from shared.config import EngineConfig, SpecConfig
from shared.engine import Engine
from shared.sampling import SamplingParams
from tests.e2e.conftest import CPU_TRANSPORTS, start_stack
from tests.polling import poll

SHORT = [5, 17, 33, 2, 9]  # shorter than the chunk (8)
LONG = [(i * 37 + 11) % 500 for i in range(30)]  # several chunks
NEW = 16
CHUNK = 8
MAX_CONTEXT = 64  # LONG + NEW fit; small pools keep each stack cheap to start
# The full matrix: every draft kind x chain / tree x page size 1 and 16 (one stack per configuration).
CASES = list(itertools.product(("eagle", "eagle3", "mtp"), (1, 4), (1, 16)))


def spec_config(topk: int) -> SpecConfig:
    return SpecConfig(topk=topk, steps=3, num_draft_tokens=4 if topk == 1 else 8)


@pytest.fixture(scope="module")
def target_only(oracle_model_dir):
    engine = Engine(oracle_model_dir / "target", config=EngineConfig(page_size=4, chunk_size=None))
    return [r.token_ids for r in engine.generate([SHORT, LONG], SamplingParams(max_new_tokens=NEW, ignore_eos=True))]


def test_the_matrix_is_complete():
    assert len(CASES) == 12 and len(set(CASES)) == 12
    assert len(LONG) > 3 * CHUNK > CHUNK > len(SHORT)


@functools.cache
def single_process(model_dir, draft: str, topk: int, page_size: int) -> list[list[int]]:
    """The single-process engine's greedy output for SHORT and LONG in one configuration (once for both
    transports)."""
    engine = Engine(model_dir / "target", model_dir / draft,
                    EngineConfig(page_size=page_size, chunk_size=CHUNK, spec=spec_config(topk), max_context=MAX_CONTEXT,
                                 max_running=4))
    return [r.token_ids for r in engine.generate([SHORT, LONG], SamplingParams(max_new_tokens=NEW, ignore_eos=True))]


@pytest.mark.parametrize("transport", CPU_TRANSPORTS)
@pytest.mark.parametrize("draft, topk, page_size", CASES, ids=[f"{d}-topk{k}-page{p}" for d, k, p in CASES])
def test_greedy_through_the_stack_equals_engine_and_target(redis_url, oracle_model_dir, target_only, draft, topk,
                                                           page_size, transport):
    spec = spec_config(topk)
    assert single_process(oracle_model_dir, draft, topk, page_size) == target_only
    stack = start_stack(redis_url, oracle_model_dir, draft, page_size=page_size, chunk_size=CHUNK, spec_topk=topk,
                        spec_steps=spec.steps, spec_draft_tokens=spec.num_draft_tokens, max_context=MAX_CONTEXT,
                        max_running=4, transport=transport, spec_policy="fixed")  # it asserts verify steps ran
    try:
        accept = []
        for prompt, want in zip([SHORT, LONG], target_only):
            tokens, finish = stack.generate(prompt, max_new_tokens=NEW, ignore_eos=True)
            assert tokens == want
            assert finish.reason == "length" and finish.usage.completion_tokens == NEW
            assert finish.usage.prompt_tokens == len(prompt)
            assert finish.spec.verify_steps > 0
            accept.append(finish.spec.accept_length)
        assert max(accept) > 1.2, "the oracle drafts should be accepted through the stack too"
        assert stack.wait_clean()
    finally:
        stack.stop()


@pytest.fixture(scope="module", params=CPU_TRANSPORTS)
def stack(redis_url, oracle_model_dir, request):
    s = start_stack(redis_url, oracle_model_dir, "eagle3", page_size=4, chunk_size=8, spec_topk=4, spec_steps=3,
                    spec_draft_tokens=8, max_running=32, transport=request.param)
    yield s
    s.stop()


def test_model_info_reports_the_engines_configuration(stack):
    info = stack.stub.GetModelInfo(pb.ModelInfoRequest(), timeout=10)
    assert (info.model, info.vocab_size, info.dtype, info.page_size) == ("eyrie", 512, "float32", 4)
    assert (info.spec.draft_kind, info.spec.topk, info.spec.steps, info.spec.num_draft_tokens) == ("eagle3", 4, 3, 8)


def test_sixteen_concurrent_streams(stack, oracle_model_dir):
    prompts = [[(i * 7 + j * 3) % 500 for j in range(3 + i * 2)] for i in range(16)]
    engine = Engine(oracle_model_dir / "target", config=EngineConfig(page_size=4, chunk_size=None))
    want = [r.token_ids for r in engine.generate(prompts, SamplingParams(max_new_tokens=12, ignore_eos=True))]
    got = [None] * 16
    errors = []

    def run(i):
        try:
            got[i] = stack.generate(prompts[i], max_new_tokens=12, ignore_eos=True)[0]
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors
    assert got == want
    assert stack.wait_clean()


def test_text_prompt_streams_text(stack, oracle_model_dir):
    from shared.model.tokenizer import Tokenizer

    tok = Tokenizer(oracle_model_dir / "target")
    req = pb.GenerateRequest(text="def add(a, b):", sampling=pb.SamplingParams(max_new_tokens=24, ignore_eos=True),
                             return_logprobs=True)
    msgs = list(stack.stub.Generate(req, timeout=60))
    ids = [t for m in msgs for t in m.token_ids]
    assert len(ids) == 24 and all(len(m.logprobs) == len(m.token_ids) for m in msgs)
    assert all(lp <= 0 for m in msgs for lp in m.logprobs)
    assert msgs[-1].HasField("finish") and not any(m.HasField("finish") for m in msgs[:-1])
    assert "".join(m.text for m in msgs) == tok.decode(ids)  # the deltas add up to the whole text
    assert not any(m.text.endswith("\ufffd") for m in msgs[:-1])  # no half character is sent early
    engine = Engine(oracle_model_dir / "target", config=EngineConfig(page_size=4, chunk_size=None))
    want = engine.generate([tok.encode("def add(a, b):")], SamplingParams(max_new_tokens=24, ignore_eos=True))[0]
    assert ids == want.token_ids


def test_requests_spread_over_two_decode_instances(redis_url, oracle_model_dir, target_only):
    """Concurrent requests land on both decode instances: the router counts what it placed itself before the
    instances' heartbeats report it."""
    s = start_stack(redis_url, oracle_model_dir, "eagle", page_size=4, chunk_size=8, num_decodes=2,
                    decode_extra=dict(heartbeat_s=5))  # heartbeats far apart: only the router's own count helps
    try:
        got, errors = {}, []

        def run(i):
            rid = f"spread-{i}"
            req = pb.GenerateRequest(request_id=rid, token_ids=pb.TokenIds(ids=LONG),
                                     sampling=pb.SamplingParams(max_new_tokens=NEW, ignore_eos=True))
            try:
                got[rid] = [t for m in s.stub.Generate(req, timeout=60) for t in m.token_ids]
            except grpc.RpcError as e:
                errors.append(e)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors and all(tokens == target_only[1] for tokens in got.values()) and len(got) == 6
        placed = [s.store.get(rid)["decode_instance"] for rid in got]
        assert min(placed.count(d.instance_id) for d in s.decodes) >= 2, placed
        assert s.wait_clean()
    finally:
        s.stop()


def test_redis_record_of_a_finished_request(stack):
    req = pb.GenerateRequest(request_id="rec-ok", token_ids=pb.TokenIds(ids=LONG),
                             sampling=pb.SamplingParams(max_new_tokens=6, ignore_eos=True))
    list(stack.stub.Generate(req, timeout=60))
    rec = stack.store.get("rec-ok")
    states = [s for s, _ in rec["transitions"]]
    assert states == ["queued", "prefilling", "transferring", "decoding", "finished"]
    times = [t for _, t in rec["transitions"]]
    assert times == sorted(times) and times[0] < times[-1]
    assert rec["prompt_tokens"] == str(len(LONG)) and rec["output_tokens"] == "6"
    assert rec["prefill_instance"].startswith("prefill-") and rec["decode_instance"].startswith("decode-")
    # 1 + accepted drafts per verify step, or 0 when the adaptive policy ran only plain steps for it (timed choices)
    accept = float(rec["accept_length"])
    assert (accept == 0.0 or accept >= 1.0) and int(rec["handoff_bytes"]) > 0
    assert 0 < stack.store.client.ttl("req:rec-ok") <= 3600


def test_request_ending_at_its_first_token_is_not_handed_off(stack):
    req = pb.GenerateRequest(request_id="rec-one", token_ids=pb.TokenIds(ids=SHORT),
                             sampling=pb.SamplingParams(max_new_tokens=1))
    msgs = list(stack.stub.Generate(req, timeout=60))
    assert len(msgs) == 1 and msgs[0].finish.reason == "length"
    assert [s for s, _ in stack.store.get("rec-one")["transitions"]] == ["queued", "prefilling", "finished"]
    assert stack.wait_clean()


BAD = [
    (dict(), "prompt"),
    (dict(text=""), "prompt.text"),
    (dict(token_ids=pb.TokenIds(ids=[])), "prompt.token_ids"),
    (dict(token_ids=pb.TokenIds(ids=[5, 512])), "prompt.token_ids"),
    (dict(token_ids=pb.TokenIds(ids=[5, -3])), "prompt.token_ids"),
    (dict(token_ids=pb.TokenIds(ids=[5] * 5000)), "prompt.token_ids"),
    (dict(text="hi", sampling=pb.SamplingParams(temperature=-1)), "sampling.temperature"),
    (dict(text="hi", sampling=pb.SamplingParams(temperature=float("nan"))), "sampling.temperature"),
    (dict(text="hi", sampling=pb.SamplingParams(temperature=float("inf"))), "sampling.temperature"),
    (dict(text="hi", sampling=pb.SamplingParams(top_p=1.5)), "sampling.top_p"),
    (dict(text="hi", sampling=pb.SamplingParams(top_p=-0.1)), "sampling.top_p"),
    (dict(text="hi", sampling=pb.SamplingParams(top_k=-1)), "sampling.top_k"),
    (dict(text="hi", sampling=pb.SamplingParams(max_new_tokens=10**6)), "sampling.max_new_tokens"),
    (dict(text="hi", sampling=pb.SamplingParams(stop_token_ids=[9999])), "sampling.stop_token_ids"),
    (dict(text="hi", request_id="bad id with spaces"), "request_id"),
    (dict(text="hi", request_id="x" * 200), "request_id"),
    (dict(text="x" * (5 << 20)), "request"),
]


@pytest.mark.parametrize("fields, name", BAD, ids=[f"{n}-{i}" for i, (_, n) in enumerate(BAD)])
def test_bad_requests_are_invalid_argument_naming_the_field(stack, fields, name):
    with pytest.raises(grpc.RpcError) as err:
        list(stack.stub.Generate(pb.GenerateRequest(**fields), timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert err.value.details().startswith(f"{name}:"), err.value.details()
    if fields.get("request_id"):
        assert stack.store.get(fields["request_id"]) == {}, "a refused request leaves no record"


def test_after_every_bad_request_nothing_leaked_and_all_serve(stack):
    """Runs after the bad-request cases (file order): pools full on both engines, health SERVING everywhere."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    assert stack.wait_clean()
    for handle in (stack.router, *stack.prefills, *stack.decodes):
        health = health_pb2_grpc.HealthStub(grpc.insecure_channel(handle.grpc_address))
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == \
            health_pb2.HealthCheckResponse.SERVING
    assert stack.generate(SHORT, max_new_tokens=3, ignore_eos=True)[1].reason == "length"


def test_a_message_over_the_grpc_limit_is_refused_by_grpc_and_the_router_lives(stack):
    """Over 4x max_message_bytes gRPC refuses the message itself (RESOURCE_EXHAUSTED) before the router reads it;
    between 1x and 4x the router answers INVALID_ARGUMENT naming `request` (a BAD case above)."""
    with pytest.raises(grpc.RpcError) as err:
        list(stack.stub.Generate(pb.GenerateRequest(text="x" * (17 << 20)), timeout=30))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert stack.generate(SHORT, max_new_tokens=2, ignore_eos=True)[1].reason == "length"


def test_duplicate_request_id_and_health_after_bad_requests(stack):
    req = pb.GenerateRequest(request_id="dup-1", token_ids=pb.TokenIds(ids=SHORT),
                             sampling=pb.SamplingParams(max_new_tokens=2))
    list(stack.stub.Generate(req, timeout=60))
    with pytest.raises(grpc.RpcError) as err:
        list(stack.stub.Generate(req, timeout=60))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details().startswith("request_id:")
    assert stack.generate(SHORT, max_new_tokens=3)[1].reason == "length"  # still serving
    assert stack.wait_clean()


def _stream_then(stack, rid, action):
    req = pb.GenerateRequest(request_id=rid, token_ids=pb.TokenIds(ids=LONG),
                             sampling=pb.SamplingParams(max_new_tokens=400, ignore_eos=True))
    call = stack.stub.Generate(req, timeout=60)
    seen = 0
    with pytest.raises(grpc.RpcError) as err:
        for msg in call:
            seen += len(msg.token_ids)
            if seen >= 3:
                action(call)
    return err.value


def assert_complete_record(rec: dict, last: str) -> None:
    """Every transition of a request that reached the decode stream, in order, with increasing times."""
    assert [s for s, _ in rec["transitions"]] == ["queued", "prefilling", "transferring", "decoding", last]
    times = [t for _, t in rec["transitions"]]
    assert all(a < b for a, b in zip(times, times[1:])), times
    assert rec["state"] == last and float(rec["created_at"]) == times[0]
    assert rec["prefill_instance"].startswith("prefill-") and rec["decode_instance"].startswith("decode-")
    assert rec["prompt_tokens"] == str(len(LONG)) and int(rec["handoff_bytes"]) > 0


def test_abort_mid_stream(stack):
    err = _stream_then(stack, "abort-1", lambda call: stack.stub.Abort(pb.AbortRequest(request_id="abort-1")))
    assert err.code() == grpc.StatusCode.ABORTED and "Abort call" in err.details()
    assert stack.wait_clean()
    rec = stack.store.get("abort-1")
    assert_complete_record(rec, "aborted")
    assert rec["error"] == "aborted by an Abort call" and int(rec["output_tokens"]) >= 3
    assert not stack.stub.Abort(pb.AbortRequest(request_id="abort-1")).found
    assert 0 < stack.store.client.ttl("req:abort-1") <= 3600


def test_client_disconnect_mid_stream(stack):
    err = _stream_then(stack, "gone-1", lambda call: call.cancel())
    assert err.code() == grpc.StatusCode.CANCELLED
    deadline = time.monotonic() + 10
    while stack.store.get("gone-1").get("state") != "aborted" and time.monotonic() < deadline:
        time.sleep(0.05)
    rec = stack.store.get("gone-1")
    assert_complete_record(rec, "aborted")
    assert rec["error"] in ("client disconnected", "client went away")
    assert stack.wait_clean()


def test_mismatched_speculative_config_is_refused_at_the_handshake(redis_url, oracle_model_dir):
    s = start_stack(redis_url, oracle_model_dir, "eagle", page_size=4, chunk_size=8, spec_topk=1, spec_steps=3,
                    decode_extra=dict(spec_topk=4, spec_draft_tokens=8))
    try:
        req = pb.GenerateRequest(request_id="mismatch", token_ids=pb.TokenIds(ids=SHORT),
                                 sampling=pb.SamplingParams(max_new_tokens=4))
        with pytest.raises(grpc.RpcError) as err:
            list(s.stub.Generate(req, timeout=30))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        details = err.value.details()
        assert "spec" in details and "topk=4" in details and "topk=1" in details
        rec = s.store.get("mismatch")
        assert rec["state"] == "failed" and "mismatch" in rec["error"]
        # Refused at the handshake, which the prefill makes as the prompt's first chunk computes: before its
        # first token (which waits for the decode side's reservation), so it never reached "transferring".
        assert [st for st, _ in rec["transitions"]] == ["queued", "prefilling", "failed"]
        times = [t for _, t in rec["transitions"]]
        assert all(a < b for a, b in zip(times, times[1:]))
        assert s.wait_clean()
    finally:
        s.stop()


def test_prefill_without_draft_cannot_feed_a_speculative_decode(redis_url, oracle_model_dir):
    """SGLang #17212: this pairing produced wrong answers silently; here it is refused."""
    s = start_stack(redis_url, oracle_model_dir, "eagle", page_size=4, chunk_size=8, prefill_extra=dict(draft=None))
    try:
        with pytest.raises(grpc.RpcError) as err:
            s.generate(SHORT, max_new_tokens=4)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "none" in err.value.details()
        assert s.wait_clean()
    finally:
        s.stop()


def test_full_decode_instance_refuses_and_the_router_places_elsewhere(redis_url, oracle_model_dir, target_only):
    """Two decode instances; the one the router tries first (the lower id at equal load) is full. Every request
    is refused there (RESOURCE_EXHAUSTED, counted as decode_full on both services), placed again on the other,
    and ends whole; the Redis record shows the second placement."""
    from services.decode.server import start_decode
    from services.settings import DecodeSettings

    s = start_stack(redis_url, oracle_model_dir, "eagle", page_size=4, chunk_size=8, max_context=MAX_CONTEXT,
                    decode_extra=dict(instance_id="decode-b-big"))
    full = start_decode(DecodeSettings(model=str(oracle_model_dir / "target"), draft=str(oracle_model_dir / "eagle"),
                                       redis_url=s.redis_url, page_size=4, chunk_size=8, max_context=MAX_CONTEXT,
                                       max_running=1, heartbeat_s=0.2, instance_id="decode-a-full"))
    s.decodes.append(full)

    def occupy(engine):  # its one slot taken by a hand-off that never arrives; nothing left to generate
        return engine.reserve_handoff("blocker", [1, 2, 3], [4], [0.0], SamplingParams(max_new_tokens=1), 3)

    blocker = full.engine_loop.call(occupy).result(5)
    assert blocker is not None
    try:
        # two heartbeats after the blocker: the full instance reports 0 outstanding tokens, like the other
        registry = Registry(connect(s.redis_url))

        def beat() -> int:
            return {i.instance_id: i.beat for i in registry.instances("decode")}["decode-a-full"]

        after = beat() + 2
        poll(lambda: beat() >= after, 60, "the full decode instance stopped beating")
        for i in range(3):
            rid = f"replaced-{i}"
            req = pb.GenerateRequest(request_id=rid, token_ids=pb.TokenIds(ids=LONG),
                                     sampling=pb.SamplingParams(max_new_tokens=NEW, ignore_eos=True))
            tokens = [t for m in s.stub.Generate(req, timeout=60) for t in m.token_ids]
            assert tokens == target_only[1]
            rec = s.store.get(rid)
            # Refused as its prefill began (the hand-off reserves at the first chunk): placed again before any
            # first token, so no "transferring" before the second placement.
            assert [st for st, _ in rec["transitions"]] == ["queued", "prefilling", "prefilling", "transferring",
                                                            "decoding", "finished"], rec
            assert rec["decode_instance"] == "decode-b-big"
        assert metric(http_get(full.http_address, "/metrics"), "eyrie_errors_total", kind="decode_full") == 3
        assert metric(http_get(s.prefills[0].http_address, "/metrics"), "eyrie_errors_total",
                      kind="decode_full") == 3
        assert metric(http_get(s.decodes[0].http_address, "/metrics"), "eyrie_errors_total",
                      kind="decode_full") == 0
    finally:
        full.engine_loop.call(lambda e: e.abort("blocker")).result(5)
    try:
        assert s.wait_clean()
    finally:
        s.stop()


def http_get(address: str, path: str) -> str:
    with urllib.request.urlopen(f"http://{address}{path}", timeout=5) as r:
        return r.read().decode()


def metric(text: str, name: str, **labels) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))
