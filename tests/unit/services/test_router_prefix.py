"""Prefix-aware placement (issue 33): a real router (gRPC, Redis) in front of two scripted prefill instances (and,
for local prefill, two scripted decode instances) whose registry entries and published prefix cache summaries
each test writes: a prompt goes to the instance holding its leading pages, within ``prefix_balance_tokens`` of
the least loaded one's load; without summaries placement is the least loaded instance's, as before."""

from __future__ import annotations

import itertools
import json
import threading

import grpc
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from scripted_stack import OkPrefill, SteadyDecode

from proto.eyrie.v1 import eyrie_pb2 as pb
from proto.eyrie.v1 import eyrie_pb2_grpc as pb_grpc
from services.common import start_grpc_server
from services.metadata import Heartbeat, InstanceInfo, Registry, RequestStore, connect
from services.router.server import start_router
from services.settings import RouterSettings
from shared.memory.prefix_digest import PrefixSummary, prompt_digests

PS = 4
PROMPT = list(range(3, 44))  # 41 tokens: 10 pages a cache could serve (the last token is always computed)
BOUND = 30


class RecordingPrefill(OkPrefill):
    def __init__(self):
        self.prompts: list[list[int]] = []
        self._lock = threading.Lock()

    def Prefill(self, request, context):  # noqa: N802
        with self._lock:
            self.prompts.append(list(request.prompt_ids))
        yield from super().Prefill(request, context)


class LocalDecode(SteadyDecode):
    """Takes every prompt to prefill itself (``Admit``) and streams its tokens, the first included."""

    def __init__(self):
        super().__init__()
        self.admitted: list[list[int]] = []

    def Admit(self, request, context):  # noqa: N802
        self.admitted.append(list(request.prompt_ids))
        return pb.ReserveResponse(accepted=True)


class Stack:
    def __init__(self, redis_url: str, model_dir, **router_settings):
        self.registry = Registry(connect(redis_url), ttl_s=3600)
        self.store = RequestStore(connect(redis_url))
        self.servers, self.addresses, self.servicers = [], {}, {}
        self._versions = itertools.count(100)
        for name, add_fn, servicer in (("prefill-a", pb_grpc.add_PrefillServicer_to_server, RecordingPrefill()),
                                       ("prefill-b", pb_grpc.add_PrefillServicer_to_server, RecordingPrefill()),
                                       ("decode-a", pb_grpc.add_DecodeServicer_to_server, LocalDecode()),
                                       ("decode-b", pb_grpc.add_DecodeServicer_to_server, LocalDecode())):
            server, port, _ = start_grpc_server("127.0.0.1", 0, [(add_fn, servicer)], [], workers=32)
            self.servers.append(server)
            self.addresses[name], self.servicers[name] = f"127.0.0.1:{port}", servicer
            self.publish(name)
        settings = RouterSettings(model=str(model_dir / "target"), redis_url=redis_url, placement_timeout_s=5.0,
                                  max_context=64, prefix_balance_tokens=BOUND, **router_settings)
        self.router = start_router(settings)
        self.channel = grpc.insecure_channel(self.router.grpc_address)
        self.stub = pb_grpc.GenerationStub(self.channel)

    def publish(self, name: str, load: int = 0, cached: list[int] | None = None, successor: bool = True,
                version: int | None = None, page_size: int = PS, write: bool = True) -> None:
        """Register ``name`` with ``load`` outstanding tokens and, given ``cached`` (a prompt), a summary holding
        that prompt's pages, under ``version`` (default: a new one); ``write`` False: the entry names a summary
        Redis lacks."""
        info = InstanceInfo(name, name.split("-")[0], self.addresses[name], outstanding_tokens=load, beat=1)
        summary = None
        if cached is not None:
            info.prefix_version = version = next(self._versions) if version is None else version
            digests = tuple(prompt_digests(cached, page_size, successor))
            summary = PrefixSummary(version, page_size, successor, digests).to_json() if write else None
        self.registry.client.delete(Registry.summary_key(name))
        self.registry.register(info, summary)

    def send(self, rid: str, prompt: list[int]) -> dict:
        """Run ``prompt`` to its end; its placements as the router recorded them."""
        req = pb.GenerateRequest(request_id=rid, token_ids=pb.TokenIds(ids=prompt),
                                 sampling=pb.SamplingParams(max_new_tokens=3))
        assert [m for m in self.stub.Generate(req, timeout=30) if m.HasField("finish")]
        return json.loads(self.store.get(rid)["placements"])[-1]

    def metric(self, name: str, **labels) -> float:
        text = httpx.get(f"http://{self.router.http_address}/metrics", timeout=10).text
        return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
                   if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))

    def stop(self) -> None:
        self.channel.close()
        self.router.stop(0.5)
        for s in self.servers:
            s.stop(0)


@pytest.fixture
def stack(redis_url, tiny_model_dir):
    s = Stack(redis_url, tiny_model_dir)
    yield s
    s.stop()


def test_a_prompt_goes_to_the_instance_holding_its_prefix(stack):
    prefix = dict(role="prefill", reason="prefix")
    before = stack.metric("eyrie_router_placements_total", **prefix), \
        stack.metric("eyrie_router_prefix_matched_tokens_total", role="prefill")
    stack.publish("prefill-b", cached=PROMPT[:25])  # b holds the first 6 pages (successor PROMPT[24] included)
    placed = stack.send("hit", PROMPT)
    assert placed["prefill"] == "prefill-b" and placed["prefix_tokens"] == 24
    assert stack.servicers["prefill-b"].prompts == [PROMPT]
    assert (stack.metric("eyrie_router_placements_total", **prefix),
            stack.metric("eyrie_router_prefix_matched_tokens_total", role="prefill")) == (before[0] + 1, before[1] + 24)
    load = stack.metric("eyrie_router_placements_total", role="prefill", reason="load")
    placed = stack.send("other", [9] + PROMPT[1:])  # its first page differs: nobody holds it, a's by the ids
    assert placed["prefill"] == "prefill-a" and "prefix_tokens" not in placed
    assert stack.metric("eyrie_router_placements_total", role="prefill", reason="load") == load + 1


def test_the_successor_rule_and_the_page_size_are_the_instances(stack):
    """A summary keyed with successors holds a page only with the token after it: a prompt that diverges right
    after a cached page misses that page; one keyed without successors (page size 8) matches it."""
    stack.publish("prefill-b", cached=PROMPT[:25])
    diverged = PROMPT[:24] + [99] + PROMPT[25:]
    assert stack.send("succ", diverged)["prefix_tokens"] == 20
    stack.publish("prefill-b", cached=PROMPT[:25], successor=False, page_size=8)
    assert stack.send("plain", diverged)["prefix_tokens"] == 24


def test_the_imbalance_bound(stack):
    """A holder more loaded than the least loaded instance by more than the bound is passed over; within it, it
    wins while its load less its matched tokens is the least."""
    stack.publish("prefill-b", load=BOUND + 1, cached=PROMPT)  # holds 40 tokens, 31 more loaded: past the bound
    assert stack.send("over", PROMPT)["prefill"] == "prefill-a"
    stack.publish("prefill-b", load=BOUND, cached=PROMPT)  # at the bound: 30 - 40 < 0
    placed = stack.send("at", PROMPT)
    assert placed["prefill"] == "prefill-b" and placed["prefix_tokens"] == 40
    stack.publish("prefill-b", load=BOUND, cached=PROMPT[:13])  # 12 tokens held: 30 - 12 > 0, a is better
    assert stack.send("short", PROMPT)["prefill"] == "prefill-a"
    stack.publish("prefill-a", load=BOUND + 5)  # now the least loaded is b
    assert stack.send("least", PROMPT)["prefill"] == "prefill-b"


def test_without_summaries_placement_is_the_least_loaded(stack):
    stack.publish("prefill-a", load=10)
    assert stack.send("plain", PROMPT)["prefill"] == "prefill-b"
    stack.publish("prefill-a", load=10, cached=PROMPT, write=False)  # the entry names a summary Redis lacks
    assert stack.send("missing", PROMPT)["prefill"] == "prefill-b"
    stack.publish("prefill-a", load=10, cached=[7] * 41)  # a summary of another prompt
    assert stack.send("unrelated", PROMPT)["prefill"] == "prefill-b"
    stack.publish("prefill-a", load=10, cached=PROMPT)
    stack.router.extra["core"].settings.prefix_routing = False
    assert stack.send("off", PROMPT)["prefill"] == "prefill-b"
    stack.router.extra["core"].settings.prefix_routing = True
    assert stack.send("on", PROMPT)["prefill"] == "prefill-a"


def test_a_stale_summary_stays_until_a_new_version_is_read(stack):
    """The router reads a summary once per version: an entry naming the same version is served from what was
    read (a stale summary costs a miss, never a failed request); a new version is read again."""
    stack.publish("prefill-b", cached=PROMPT, version=5)
    assert stack.send("read", PROMPT)["prefill"] == "prefill-b"
    stack.registry.client.set(Registry.summary_key("prefill-b"), "garbage")  # not read again at version 5
    assert stack.send("kept", PROMPT)["prefix_tokens"] == 40
    info = InstanceInfo("prefill-b", "prefill", stack.addresses["prefill-b"], beat=1, prefix_version=6)
    stack.registry.register(info)  # version 6 names the garbage: unreadable, the last read one stands
    assert stack.send("garbled", PROMPT)["prefix_tokens"] == 40
    stack.publish("prefill-b", cached=[7] * 41, version=7)
    placed = stack.send("moved", PROMPT)
    assert placed["prefill"] == "prefill-a" and "prefix_tokens" not in placed


def test_the_choices_of_a_request_prefer_the_instance_holding_the_prefix(stack):
    stack.publish("prefill-b", cached=PROMPT)
    req = pb.GenerateRequest(request_id="two", token_ids=pb.TokenIds(ids=PROMPT), n=2,
                             sampling=pb.SamplingParams(max_new_tokens=3))
    assert len([m for m in stack.stub.Generate(req, timeout=30) if m.HasField("finish")]) == 2
    assert stack.servicers["prefill-b"].prompts == [PROMPT, PROMPT] and not stack.servicers["prefill-a"].prompts
    for i in range(2):
        assert json.loads(stack.store.get(f"two#{i}")["placements"])[-1]["prefix_tokens"] == 40


def test_the_hand_off_goes_to_the_decode_instance_holding_the_prefix(stack):
    """Disaggregated: the decode instance too is chosen by its summary (its prefix cache takes the pages it holds,
    and the hand-off carries only the rest), within the same imbalance bound; prefill and decode independently."""
    decode_prefix = dict(role="decode", reason="prefix")
    before = stack.metric("eyrie_router_placements_total", **decode_prefix)
    stack.publish("decode-a", load=5)
    stack.publish("decode-b", load=10, cached=PROMPT)  # more loaded, within the bound, holding 40 tokens
    placed = stack.send("to-b", PROMPT)
    assert (placed["decode"], placed["decode_prefix_tokens"]) == ("decode-b", 40) and "prefix_tokens" not in placed
    assert stack.metric("eyrie_router_placements_total", **decode_prefix) == before + 1
    assert stack.metric("eyrie_router_prefix_matched_tokens_total", role="decode") >= 40
    cold = stack.send("cold", [5] * 41)  # nobody holds it: the least loaded decode instance
    assert cold["decode"] == "decode-a" and "decode_prefix_tokens" not in cold
    stack.publish("decode-b", load=5 + BOUND + 1, cached=PROMPT)  # past the bound: passed over
    assert stack.send("over", PROMPT)["decode"] == "decode-a"


def test_local_prefill_goes_to_the_decode_instance_holding_the_prefix(redis_url, tiny_model_dir):
    s = Stack(redis_url, tiny_model_dir, local_prefill_max_tokens=64)
    try:
        s.publish("decode-b", cached=PROMPT)
        placed = s.send("local", PROMPT)
        assert placed == {"prefill": "decode-b", "decode": "decode-b", "reason": "new request",
                          "local_prefill": True, "prefix_tokens": 40}
        assert s.servicers["decode-b"].admitted == [PROMPT] and not s.servicers["decode-a"].admitted
        assert s.metric("eyrie_router_placements_total", role="decode", reason="prefix") == 1
        assert s.send("cold", [5] * 41)["prefill"] == "decode-a"
    finally:
        s.stop()


def test_a_long_prompt_whose_prefix_the_decode_instance_holds_is_prefilled_there(redis_url, tiny_model_dir):
    """Conditional disaggregation counts the tokens left to compute on the decode instance: a 41-token prompt
    whose first 40 decode-b holds (a conversation's next turn) is prefilled there, past an 8-token bound; the
    same length cold goes to a prefill instance and its hand-off."""
    s = Stack(redis_url, tiny_model_dir, local_prefill_max_tokens=8)
    try:
        s.publish("decode-b", cached=PROMPT)
        placed = s.send("follow-up", PROMPT)
        assert placed["local_prefill"] is True and (placed["decode"], placed["prefix_tokens"]) == ("decode-b", 40)
        assert s.servicers["decode-b"].admitted == [PROMPT]
        cold = s.send("cold", [5] * 41)
        assert "local_prefill" not in cold and cold["prefill"].startswith("prefill-")
        assert [5] * 41 in s.servicers[cold["prefill"]].prompts
        assert s.servicers["decode-a"].admitted == [] and s.servicers["decode-b"].admitted == [PROMPT]
    finally:
        s.stop()


def test_a_heartbeat_publishes_its_summary_and_sends_it_again_when_redis_lost_it(redis_url):
    """The summary is written when its version moves, renewed with the entry otherwise, written again when
    Redis lost it, and removed with the entry."""
    registry = Registry(connect(redis_url), ttl_s=3600)
    published: list[tuple[int, str | None] | None] = [None]  # what the summary function says next
    hb = Heartbeat(registry, InstanceInfo("p1", "prefill", "h:1"), interval_s=3600, summary_fn=lambda: published[0])
    key = Registry.summary_key("p1")
    hb.beat()  # no summary yet: none named, none written
    assert registry.instances()[0].prefix_version is None and registry.summary("p1") is None
    one = PrefixSummary(1, PS, True, tuple(prompt_digests(PROMPT, PS, True))).to_json()
    published[0] = (1, one)
    hb.beat()
    assert registry.instances()[0].prefix_version == 1 and registry.summary("p1") == one
    published[0] = (1, None)  # unchanged: renewed, not rewritten
    registry.client.pexpire(key, 50_000)
    hb.beat()
    assert registry.client.pttl(key) > 50_000 and registry.summary("p1") == one
    registry.client.delete(key)  # Redis lost it (a restart): the renewal finds it gone, the next beat resends it
    hb.beat()
    assert registry.summary("p1") is None
    hb.beat()
    assert registry.summary("p1") == one
    registry.deregister("p1")
    assert registry.summary("p1") is None and registry.instances() == []
