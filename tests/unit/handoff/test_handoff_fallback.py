"""A transport that fails at its first use for a decode instance: the request is still served (sent again over
the next transport, the same reservation), the transport is marked unusable for that instance with its reason
logged and counted, and later requests go straight to the next one. Issue 28: a peer GPU's in-place write
refused by Triton failed every request, nothing fell back."""

from __future__ import annotations

import logging

import pytest
import torch
from handoff_helpers import GREEDY, LONG, SHORT
from test_handoff_services import Stack, config, make_engine, models, redis_url  # noqa: F401 (fixtures)

import shared.handoff.ipc as ipc
from proto.eyrie.v1 import eyrie_pb2 as pb
from shared.handoff import Increment, PageFeed, PageGuard, Prefilled, negotiate
from shared.handoff.ipc import export_pools, host_id
from shared.memory.kv_cache import allocate_pool

DRAFT = "eagle"


@pytest.fixture(scope="module")
def single(models):  # noqa: F811
    engine = make_engine(models, DRAFT, config())
    return engine.generate([SHORT, LONG], GREEDY)


@pytest.fixture
def auto_stack(models, redis_url):  # noqa: F811
    """The prefill side choosing its transport (on the CPU: ipc, the decode pools in shared memory)."""
    stack = Stack(models, redis_url, transport="auto")
    yield stack
    stack.stop()


def refusing_copies(monkeypatch, error: Exception) -> list[int]:
    """Every in-place copy raises ``error`` (as Triton refused a peer GPU's pointer); returns the count of tries."""
    tries = []

    def refuse(*args, **kw):
        tries.append(1)
        raise error

    monkeypatch.setattr(ipc, "_write_increment", refuse)
    return tries


def errors(stack, kind: str) -> float:
    return stack.prefill.extra["telemetry"].errors_total.labels(kind)._value.get()


def test_a_transport_failing_at_first_use_is_marked_unusable_and_the_request_is_still_served(
        auto_stack, single, monkeypatch, caplog):
    tries = refusing_copies(monkeypatch, RuntimeError("Pointer argument (at 1) cannot be accessed from Triton"))
    servicer, address = auto_stack.prefill.extra["servicer"], auto_stack.decode.grpc_address
    with caplog.at_level(logging.INFO, logger="eyrie.prefill"):
        tokens, finish, events = auto_stack.generate(LONG)
        assert tokens == single[1].token_ids and finish.reason == "length"
        assert events[1].handed_off.bytes > 0
        assert len(tries) == 1 and "cannot be accessed from Triton" in servicer._unusable[address]["ipc"]
        assert errors(auto_stack, "transport_unusable") == 1
        marked = [r for r in caplog.records if getattr(r, "event", None) == "transport_unusable"]
        assert len(marked) == 1 and marked[0].levelno == logging.WARNING
        assert "cannot be accessed from Triton" in marked[0].fields["reason"]
        chosen = [r.fields for r in caplog.records if getattr(r, "event", None) == "transport_chosen"]
        assert chosen[-1]["transport"] == "grpc-stream" and "first use" in chosen[-1]["reason"]
        # The next request goes straight over the stream: ipc is not tried again for this decode instance.
        tokens, _, _ = auto_stack.generate(SHORT)
        assert tokens == single[0].token_ids and len(tries) == 1
    assert errors(auto_stack, "transport_unusable") == 1
    assert auto_stack.clean()


def test_a_transport_that_carried_hand_offs_before_fails_the_request_instead(auto_stack, single, monkeypatch):
    """Past its first use a failure is the request's (the router places it again), not the transport's."""
    tokens, _, _ = auto_stack.generate(SHORT)
    assert tokens == single[0].token_ids
    tries = refusing_copies(monkeypatch, RuntimeError("a CUDA error"))
    with pytest.raises(Exception, match="ipc failed"):
        auto_stack.generate(LONG)
    assert len(tries) == 1 and errors(auto_stack, "transport_unusable") == 0
    assert auto_stack.decode.grpc_address not in auto_stack.prefill.extra["servicer"]._unusable
    assert auto_stack.clean()


def test_negotiation_skips_a_transport_marked_unusable_naming_why():
    pools = export_pools([allocate_pool((2, 1, 4, 1, 2), torch.float32, torch.device("cpu"), True)])
    reply = pb.HandshakeResponse(instance_id="d", host_id=host_id(), transports=["ipc", "grpc-stream"], pools=pools)
    cpu = torch.device("cpu")
    assert negotiate("auto", reply, cpu, {}) == ("ipc", "same host, pools reachable")
    name, why = negotiate("auto", reply, cpu, {"ipc": "the copy was refused"})
    assert name == "grpc-stream" and "first use" in why and "the copy was refused" in why


def test_a_rewound_feed_gives_the_pages_so_far_then_the_rest():
    feed, guard = PageFeed(), PageGuard()
    first, second = Increment([[1, 2, 3]], [1]), Increment([[1, 2, 3, 4]], [4], last=Prefilled(b"s"))
    feed.put(first)
    taking = feed.take(guard)
    assert next(taking) is first  # the failed transport took it
    feed.rewind()
    feed.put(second)
    assert list(feed.take(guard)) == [first, second]  # the next transport: from the first page on
    feed.rewind()
    assert list(feed.take(guard)) == [second]  # the last one stands for all: nothing more to wait for
