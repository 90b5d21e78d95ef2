"""RouterCore without engines: validation naming the field, Redis records, UTF-8-safe text deltas, load
accounting, and placement decisions against scripted prefill/decode gRPC servers on real sockets."""

from __future__ import annotations

import random
import threading
import time

import grpc
import pytest

from proto.eyrie.v1 import eyrie_pb2 as pb
from proto.eyrie.v1 import eyrie_pb2_grpc as pb_grpc
from services.common import start_grpc_server
from services.launch import free_port
from services.metadata import InstanceInfo, Registry, RequestStore, connect
from services.router.server import LoadLedger, RouterCore, RouterError, load_model_files
from services.settings import RouterSettings
from shared.request import RequestError
from shared.text import Detokenizer

VOCAB = 512  # the tiny model's


def make_core(redis_url: str, model_dir, **settings) -> RouterCore:
    s = RouterSettings(model=str(model_dir / "target"), redis_url=redis_url,
                       **{"placement_timeout_s": 0.3, "max_context": 64, **settings})
    config, tokenizer = load_model_files(s.model)
    client = connect(redis_url)
    return RouterCore(s, RequestStore(client, s.request_ttl_s), Registry(client, 30), tokenizer, config)


@pytest.fixture
def core(redis_url, tiny_model_dir):
    c = make_core(redis_url, tiny_model_dir)
    yield c
    c.close()


def req(prompt=None, text=None, rid="", **sampling) -> pb.GenerateRequest:
    r = pb.GenerateRequest(request_id=rid, sampling=pb.SamplingParams(**sampling))
    if text is not None:
        r.text = text
    elif prompt is not None:
        r.token_ids.ids.extend(prompt)
    return r


BAD = [
    (req(), "prompt", "give text or token_ids"),
    (req(text=""), "prompt.text", "empty"),
    (req(prompt=[]), "prompt.token_ids", "empty"),
    (pb.GenerateRequest(token_ids=pb.TokenIds()), "prompt.token_ids", "empty"),
    (req(prompt=[5, VOCAB]), "prompt.token_ids", f"token id {VOCAB} is outside"),
    (req(prompt=[-1, 5]), "prompt.token_ids", "token id -1 is outside"),
    (req(prompt=[5] * 64), "prompt.token_ids", "64 tokens leave no room"),
    (req(text="def f(x): return x " * 20), "prompt.text", "leave no room"),
    (req(text="x" * 10_000), "prompt.text", "cannot fit"),
    (req(prompt=[5], temperature=-0.5), "sampling.temperature", "-0.5"),
    (req(prompt=[5], temperature=float("nan")), "sampling.temperature", "nan"),
    (req(prompt=[5], temperature=float("inf")), "sampling.temperature", "inf"),
    (req(prompt=[5], top_p=1.01), "sampling.top_p", "(0, 1]"),
    (req(prompt=[5], top_p=-0.2), "sampling.top_p", "(0, 1]"),
    (req(prompt=[5], top_p=float("nan")), "sampling.top_p", "nan"),
    (req(prompt=[5], top_k=-3), "sampling.top_k", "-3"),
    (req(prompt=[5] * 10, max_new_tokens=55), "sampling.max_new_tokens", "exceed the context of 64"),
    (req(prompt=[5], stop_token_ids=[3, VOCAB + 7]), "sampling.stop_token_ids", f"{VOCAB + 7}"),
    (req(prompt=[5], stop_token_ids=[-2]), "sampling.stop_token_ids", "-2"),
    (req(prompt=[5], rid="has space"), "request_id", "letters, digits"),
    (req(prompt=[5], rid="é"), "request_id", "letters, digits"),
    (req(prompt=[5], rid="r" * 129), "request_id", "1-128"),
    (req(prompt=[5] * 40, stop_token_ids=[1] * 200_000), "request", "exceed the limit"),
    (req(prompt=[5], stop=["x"] * 65), "sampling.stop", "65 stop strings exceed the limit of 64 (max_stop_strings)"),
    (req(prompt=[5], stop=["ok", "y" * 1025]), "sampling.stop", "1025 characters exceeds the limit of 1024"),
]


@pytest.mark.parametrize("request_, field, words", BAD, ids=[f"{i}-{f}" for i, (_, f, _) in enumerate(BAD)])
def test_each_bad_field_is_named_and_nothing_is_recorded(core, request_, field, words):
    core.settings.max_message_bytes = 100_000
    with pytest.raises(RequestError) as err:
        next(core.generate(request_))
    assert err.value.field == field
    assert str(err.value).startswith(f"{field}:") and words in str(err.value), str(err.value)
    assert not list(core.store.client.scan_iter("req:*")), "a refused request leaves no record"


def test_valid_requests_take_their_defaults(core):
    rid, ids, params = core.validate(req(text="def add(a, b):"))
    assert ids == core.tokenizer.encode("def add(a, b):") and len(rid) == 32
    assert params.top_p == 1.0 and params.temperature == 0 and params.seed is None
    assert params.max_new_tokens == min(core.settings.default_max_new_tokens, 64 - len(ids))
    _, _, params = core.validate(req(prompt=[5] * 10, max_new_tokens=54, top_k=7, top_p=0.5, temperature=0.7,
                                     seed=2**63, stop_token_ids=[VOCAB - 1], rid="a.b:c-D_9"))
    assert (params.max_new_tokens, params.top_k, params.seed, params.stop_token_ids) == (54, 7, 2**63, (VOCAB - 1,))


def test_no_instance_fails_the_request_with_a_complete_record(core):
    t0 = time.monotonic()
    with pytest.raises(RouterError) as err:
        list(core.generate(req(prompt=[5, 6], rid="lonely")))
    assert err.value.code == grpc.StatusCode.UNAVAILABLE and "no live prefill instance" in err.value.message
    assert 0.3 <= time.monotonic() - t0 < 3
    rec = core.store.get("lonely")
    assert rec["state"] == "failed" and "no live prefill" in rec["error"] and rec["prompt_tokens"] == "2"
    assert [s for s, _ in rec["transitions"]] == ["queued", "failed"]
    assert rec["transitions"][0][1] < rec["transitions"][1][1]
    assert 0 < core.store.client.ttl("req:lonely") <= core.settings.request_ttl_s
    # the id stays taken while its record lives
    with pytest.raises(RequestError) as err:
        next(core.generate(req(prompt=[5], rid="lonely")))
    assert err.value.field == "request_id" and "already in use" in str(err.value)


def test_abort_while_waiting_for_placement(redis_url, tiny_model_dir):
    core = make_core(redis_url, tiny_model_dir, placement_timeout_s=30)
    errors = []

    def run():
        try:
            list(core.generate(req(prompt=[5], rid="waiting")))
        except RouterError as e:
            errors.append(e)

    t = threading.Thread(target=run)
    t.start()
    deadline = time.monotonic() + 5
    while not core.abort("waiting") and time.monotonic() < deadline:
        time.sleep(0.01)
    t.join(5)
    assert errors and errors[0].code == grpc.StatusCode.ABORTED and "Abort call" in errors[0].message
    rec = core.store.get("waiting")
    assert rec["state"] == "aborted" and rec["error"] == "aborted by an Abort call"
    assert not core.abort("waiting") and not core.abort("never-seen")
    core.close()


def test_model_info(core):
    info = core.model_info()
    assert (info.vocab_size, info.max_context, list(info.eos_token_ids)) == (VOCAB, 64, [1])
    assert info.model == "eyrie"
    assert (info.dtype, info.page_size, info.HasField("spec")) == ("", 0, False)  # no engine registered yet


def test_model_info_reports_the_engines_dtype_page_size_and_speculative_config(core):
    from services.metadata import InstanceInfo

    facts = {"dtype": "bfloat16", "page_size": 16, "max_context": 4096,
             "spec": {"draft_kind": "eagle3", "topk": 4, "steps": 3, "num_draft_tokens": 8}}
    prefill_facts = {**facts, "dtype": "float16"}
    core.registry.register(InstanceInfo("prefill-1", "prefill", "127.0.0.1:1", model=prefill_facts))
    info = core.model_info()
    assert (info.dtype, info.page_size) == ("float16", 16)  # only a prefill instance: its figures
    core.registry.register(InstanceInfo("decode-1", "decode", "127.0.0.1:2", model=facts))
    info = core.model_info()
    assert (info.dtype, info.page_size) == ("bfloat16", 16)  # the decode instance's win
    assert (info.spec.draft_kind, info.spec.topk, info.spec.steps, info.spec.num_draft_tokens) == ("eagle3", 4, 3, 8)
    for instance_id in ("prefill-1", "decode-1"):
        core.registry.deregister(instance_id)
    assert core.model_info().dtype == "bfloat16"  # every engine gone: the last figures seen


# ---- text deltas ---------------------------------------------------------------------------------
def test_text_deltas_join_to_the_full_text_and_never_split_a_character(tiny_model_dir):
    _, tok = load_model_files(str(tiny_model_dir / "target"))
    text = "héllo 世界 🦅 naïve — ok"
    ids = tok.encode(text)
    assert any("\ufffd" in tok.decode([i]) for i in ids), "the sample must split characters across tokens"
    for chunks in ([1] * len(ids), [3, 1, 4, 1, 5, 9, 2, 6][: len(ids)]):
        detok, deltas, pos = Detokenizer(tok), [], 0
        for n in chunks:
            deltas.append(detok.push(ids[pos:pos + n]))
            pos += n
        deltas.append(detok.push(ids[pos:], final=True))
        assert "".join(deltas) == text
        assert not any("\ufffd" in d for d in deltas)
    rng = random.Random(0)
    for _ in range(20):  # random ids (what a random model emits, invalid bytes included)
        ids = [rng.randrange(2, VOCAB) for _ in range(rng.randrange(1, 30))]
        detok = Detokenizer(tok)
        out = "".join(detok.push([i], final=k == len(ids) - 1) for k, i in enumerate(ids))
        assert out == tok.decode(ids)
    assert Detokenizer(None).push([5, 6], final=True) == ""


# ---- load accounting -----------------------------------------------------------------------------
def test_ledger_counts_placements_until_the_instance_reports_them():
    ledger = LoadLedger()
    d = InstanceInfo("d1", "decode", "x", outstanding_tokens=10, beat=3)
    assert ledger.load(d) == 10
    k1 = ledger.place("d1", 100)  # not arrived yet (prefill still running): counts whatever the heartbeat
    k2 = ledger.place("d1", 5, arrived=True)  # arrived at beat 3
    assert ledger.load(d) == 115
    d.beat = 4  # a newer heartbeat: it includes k2 now, not k1
    assert ledger.load(d) == 110
    ledger.arrived("d1", k1)  # arrives at beat 4
    assert ledger.load(d) == 110
    d.beat = 5
    assert ledger.load(d) == 10
    k3 = ledger.place("d1", 7)
    ledger.done("d1", k3)  # left before any heartbeat
    ledger.done("d1", k2)  # already dropped: harmless
    assert ledger.load(d) == 10 and ledger.pending("d1") == 0


def test_placement_picks_least_loaded_counting_own_placements(core):
    reg = core.registry
    reg.register(InstanceInfo("d-a", "decode", "a:1", outstanding_tokens=30, beat=1))
    reg.register(InstanceInfo("d-b", "decode", "b:1", outstanding_tokens=10, beat=1))
    assert core._pick("decode", set())[0].instance_id == "d-b"
    core.ledger.place("d-b", 25, arrived=True)
    assert core._pick("decode", set())[0].instance_id == "d-a"  # 30 < 10 + 25
    reg.register(InstanceInfo("d-b", "decode", "b:1", outstanding_tokens=12, beat=2))
    assert core._pick("decode", set())[0].instance_id == "d-b"  # its heartbeat now counts the request itself
    assert core._pick("decode", {"d-b"})[0].instance_id == "d-a"
    assert core._pick("decode", {"d-a", "d-b"}) == (None, None) and core._pick("prefill", set()) == (None, None)


def test_a_burst_of_choices_spreads_evenly():
    """Choosing and placing is one step, so concurrent requests see each other."""
    ledger = LoadLedger()
    live = [InstanceInfo(f"d{i}", "decode", "x", beat=1) for i in range(3)]
    picks: list[str] = []
    lock = threading.Lock()

    def choose():
        info, _ = ledger.choose(live, 10)
        with lock:
            picks.append(info.instance_id)

    threads = [threading.Thread(target=choose) for _ in range(30)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(picks.count(i.instance_id) for i in live) == [10, 10, 10]
    assert all(ledger.load(i) == 100 for i in live)


# ---- placement against scripted services ---------------------------------------------------------
class ScriptedPrefill(pb_grpc.PrefillServicer):
    """Behaves per decode address like the real prefill service reports that decode's answer."""

    def __init__(self, behaviour: dict[str, str]):
        self.behaviour, self.calls, self.aborts = behaviour, [], []

    def Prefill(self, request, context):  # noqa: N802
        self.calls.append(request.decode_address)
        kind = self.behaviour.get(request.decode_address, "dead")
        yield pb.PrefillEvent(first_token=pb.FirstToken(token_id=request.prompt_ids[-1] + 1, logprob=-0.5))
        if kind == "full":
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"decode {request.decode_address} cannot hold it")
        if kind == "mismatch":
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          "hand-off schema mismatch: spec: decode has eagle(topk=4), prefill has eagle(topk=1)")
        if kind == "dead":
            context.abort(grpc.StatusCode.UNAVAILABLE, f"decode {request.decode_address}: connection refused")
        yield pb.PrefillEvent(handed_off=pb.HandedOff(bytes=1234, seconds=0.01, chunks=3))

    def Abort(self, request, context):  # noqa: N802
        self.aborts.append(request.request_id)
        return pb.AbortResponse(found=False)


class ScriptedDecode(pb_grpc.DecodeServicer):
    def __init__(self, tokens: list[int], hang: bool = False):
        self.tokens, self.hang, self.aborts, self.streams = tokens, hang, [], []

    def Stream(self, request, context):  # noqa: N802
        self.streams.append(request.request_id)
        yield pb.GenerateResponse(request_id=request.request_id, token_ids=self.tokens[:1], logprobs=[-0.1])
        while self.hang and context.is_active():
            time.sleep(0.01)
        yield pb.GenerateResponse(request_id=request.request_id, token_ids=self.tokens[1:],
                                  logprobs=[-0.1] * (len(self.tokens) - 1),
                                  finish=pb.Finish(reason="length", spec=pb.SpecStats(verify_steps=2,
                                                                                      accept_length=1.5)))

    def Abort(self, request, context):  # noqa: N802
        self.aborts.append(request.request_id)
        return pb.AbortResponse(found=True)


@pytest.fixture
def scripted(core):
    """Starts scripted servers and registers them; returns a function(role, id, servicer, load) -> servicer."""
    servers = []

    def add(role: str, instance_id: str, servicer=None, load: int = 0):
        if servicer is None:  # registered but nobody listens: a dead instance the TTL has not removed yet
            address = f"127.0.0.1:{free_port()}"
        else:
            add_fn = (pb_grpc.add_PrefillServicer_to_server if role == "prefill"
                      else pb_grpc.add_DecodeServicer_to_server)
            server, port, _ = start_grpc_server("127.0.0.1", 0, [(add_fn, servicer)], [])
            servers.append(server)
            address = f"127.0.0.1:{port}"
        core.registry.register(InstanceInfo(instance_id, role, address, outstanding_tokens=load, beat=1))
        return address

    yield add
    for s in servers:
        s.stop(0)


def run(core, rid: str, prompt=(5, 6, 7), **sampling):
    tokens, finish = [], None
    for msg in core.generate(req(prompt=list(prompt), rid=rid, max_new_tokens=8, **sampling)):
        tokens += msg.token_ids
        finish = msg.finish if msg.HasField("finish") else finish
    return tokens, finish


def test_full_decode_is_passed_over_for_another(core, scripted):
    full, ok = ScriptedDecode([0]), ScriptedDecode([20, 21])
    a_full = scripted("decode", "d-full", full, load=0)  # least loaded: tried first
    a_ok = scripted("decode", "d-ok", ok, load=50)
    prefill = ScriptedPrefill({a_full: "full", a_ok: "ok"})
    scripted("prefill", "p1", prefill)
    tokens, finish = run(core, "replaced")
    assert tokens == [8, 20, 21] and finish.reason == "length" and finish.usage.completion_tokens == 3
    assert prefill.calls == [a_full, a_ok] and ok.streams == ["replaced"] and full.streams == []
    rec = core.store.get("replaced")
    assert [s for s, _ in rec["transitions"]] == ["queued", "prefilling", "transferring", "prefilling",
                                                  "transferring", "decoding", "finished"]
    assert rec["decode_instance"] == "d-ok" and rec["handoff_bytes"] == "1234" and rec["accept_length"] == "1.5"
    assert core.ledger.pending("d-ok") == core.ledger.pending("d-full") == core.ledger.pending("p1") == 0


def test_a_decode_listening_where_another_router_saw_a_refusal_is_reached_at_once(core, scripted, redis_url,
                                                                                  tiny_model_dir):
    """A router in this process found an address dead (its channel stays open, in gRPC's reconnect backoff); a
    decode instance now listens there. Another router's channel connects afresh instead of failing with the old
    refusal until the backoff runs out, as it did while gRPC shared one connection per address among a process's
    channels (a stress run saw two router tests fail so: a port freed by one test's dead instance, taken by the
    next test's server while the first router's channel lingered)."""
    port = free_port()
    address = f"127.0.0.1:{port}"
    core.registry.register(InstanceInfo("d-dead", "decode", address, outstanding_tokens=0, beat=1))
    scripted("prefill", "p1", ScriptedPrefill({address: "ok"}))
    with pytest.raises(RouterError, match="onnect"):  # nobody listens there yet: refused
        run(core, "first")
    core.registry.deregister("d-dead")
    ok = ScriptedDecode([40, 41])
    server, _, _ = start_grpc_server("127.0.0.1", port, [(pb_grpc.add_DecodeServicer_to_server, ok)], [])
    other = make_core(redis_url, tiny_model_dir)
    try:
        other.registry.register(InstanceInfo("d-new", "decode", address, outstanding_tokens=0, beat=1))
        tokens, finish = run(other, "fresh")
        assert tokens == [8, 40, 41] and finish.reason == "length" and ok.streams == ["fresh"]
    finally:
        other.close()
        server.stop(0)


def test_unreachable_decode_and_prefill_are_passed_over(core, scripted):
    ok = ScriptedDecode([30])
    a_dead = scripted("decode", "d-dead", None, load=0)
    a_ok = scripted("decode", "d-ok", ok, load=9)
    scripted("prefill", "p-dead", None, load=0)  # least loaded, but nobody answers
    prefill = ScriptedPrefill({a_dead: "dead", a_ok: "ok"})
    scripted("prefill", "p-ok", prefill, load=5)
    tokens, _ = run(core, "survivor")
    assert tokens == [8, 30]
    rec = core.store.get("survivor")
    assert rec["prefill_instance"] == "p-ok" and rec["decode_instance"] == "d-ok" and rec["state"] == "finished"


def test_mismatched_decode_fails_at_once_when_it_is_the_only_one(core, scripted):
    core.settings.placement_timeout_s = 20
    decode = ScriptedDecode([1])
    a = scripted("decode", "d-other-spec", decode)
    prefill = ScriptedPrefill({a: "mismatch"})
    scripted("prefill", "p1", prefill)
    t0 = time.monotonic()
    with pytest.raises(RouterError) as err:
        run(core, "mismatch")
    assert time.monotonic() - t0 < 5, "a configuration error must not wait out the placement timeout"
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "topk=4" in err.value.message and "topk=1" in err.value.message
    rec = core.store.get("mismatch")
    assert rec["state"] == "failed" and "schema mismatch" in rec["error"]
    assert "mismatch" in prefill.aborts and "mismatch" in decode.aborts  # both told to let go


def test_abort_mid_stream_frees_both_services(core, scripted):
    decode = ScriptedDecode([40, 41], hang=True)
    a = scripted("decode", "d1", decode)
    prefill = ScriptedPrefill({a: "ok"})
    scripted("prefill", "p1", prefill)
    gen = core.generate(req(prompt=[5], rid="stopme", max_new_tokens=8))
    assert list(next(gen).token_ids) == [6]  # the first token, from the prefill
    assert list(next(gen).token_ids) == [40]  # streaming from the decode
    assert core.abort("stopme")
    with pytest.raises(RouterError) as err:
        next(gen)
    assert err.value.code == grpc.StatusCode.ABORTED
    rec = core.store.get("stopme")
    assert rec["state"] == "aborted" and rec["output_tokens"] == "2"
    assert [s for s, _ in rec["transitions"]] == ["queued", "prefilling", "transferring", "decoding", "aborted"]
    assert "stopme" in decode.aborts and "stopme" in prefill.aborts


def test_a_reader_that_goes_away_aborts_the_request(core, scripted):
    decode = ScriptedDecode([50, 51], hang=True)
    a = scripted("decode", "d1", decode)
    scripted("prefill", "p1", ScriptedPrefill({a: "ok"}))
    gen = core.generate(req(prompt=[5], rid="walked-off", max_new_tokens=8))
    next(gen), next(gen)
    gen.close()  # what the gRPC server / HTTP layer does when the client disconnects
    rec = core.store.get("walked-off")
    assert rec["state"] == "aborted" and rec["error"] == "client went away"
    assert "walked-off" in decode.aborts
