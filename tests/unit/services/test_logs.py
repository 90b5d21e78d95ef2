"""services.logs: one JSON object per line with ts, level, service, instance, rid, event, fields; the engine
loop's lines about a request carry its id; an in-process decode service's log over a request parses."""

from __future__ import annotations

import calendar
import io
import json
import logging
import time

import pytest

from services.engine_loop import EngineLoop
from services.logs import JsonFormatter, ServiceLog
from shared.config import EngineConfig
from shared.engine import Engine
from shared.sampling import SamplingParams

KEYS = {"ts", "level", "service", "instance", "rid", "event", "fields"}


@pytest.fixture
def captured():
    """Everything logged under ``eyrie`` while the test runs, formatted as the services format it."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter("proc", "proc-1"))
    logger = logging.getLogger("eyrie")
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)

    def lines() -> list[dict]:
        handler.flush()
        out = [json.loads(line) for line in stream.getvalue().splitlines()]  # every line is one object
        assert all(set(obj) == KEYS for obj in out), out
        return out

    yield lines
    logger.removeHandler(handler)
    logger.setLevel(old_level)


def test_event_lines(captured):
    log = ServiceLog("decode", "decode-1")
    log.event("finished", "r1", reason="length", output_tokens=3, text="two\nlines")
    log.debug("step_done", "r1", reason="length")
    log.event("started", grpc="127.0.0.1:1")
    (finished, step, started) = captured()
    assert finished["service"] == "decode" and finished["instance"] == "decode-1" and finished["rid"] == "r1"
    assert finished["event"] == "finished" and finished["level"] == "INFO"
    assert finished["fields"] == {"reason": "length", "output_tokens": 3, "text": "two\nlines"}
    assert step["level"] == "DEBUG" and step["rid"] == "r1"
    assert started["rid"] is None and started["fields"] == {"grpc": "127.0.0.1:1"}
    t = calendar.timegm(time.strptime(finished["ts"][:19], "%Y-%m-%dT%H:%M:%S"))  # UTC
    assert abs(t - time.time()) < 60 and finished["ts"].endswith("Z")


def test_plain_lines_and_exceptions(captured):
    logging.getLogger("eyrie.other").warning("disk %s%% full", 93)
    try:
        raise ValueError("boom")
    except ValueError:
        ServiceLog("router", "router-1").exception("internal_error", "r2", reason="boom")
    plain, error = captured()
    assert (plain["service"], plain["instance"], plain["event"], plain["rid"]) == ("proc", "proc-1", "log", None)
    assert plain["fields"] == {"message": "disk 93% full", "logger": "eyrie.other"} and plain["level"] == "WARNING"
    assert error["level"] == "ERROR" and error["rid"] == "r2" and error["fields"]["reason"] == "boom"
    assert "ValueError: boom" in error["fields"]["exception"]


def test_the_engine_loop_names_each_request_an_engine_error_ends(captured, tiny_model_dir):
    engine = Engine(tiny_model_dir / "target", config=EngineConfig(page_size=4, max_context=64, max_running=4))

    def broken_launch():
        raise RuntimeError("kernel on fire")

    loop = EngineLoop(engine, log=ServiceLog("decode", "decode-9")).start()
    try:
        queues = {}
        for rid in ("a", "b"):
            queues[rid] = loop.subscribe(rid)
        engine.launch = broken_launch
        loop.call(lambda e: [e.add_request([5, 6, 7], SamplingParams(max_new_tokens=4), rid=r) for r in "ab"]).result(5)
        for q in queues.values():
            assert q.get(timeout=10).finish_reason == "error"
    finally:
        loop.stop()
    lines = captured()
    (error,) = [x for x in lines if x["event"] == "engine_error"]
    assert error["fields"]["requests"] == ["a", "b"] and "kernel on fire" in error["fields"]["exception"]
    failed = [x for x in lines if x["event"] == "failed"]
    assert sorted(x["rid"] for x in failed) == ["a", "b"]
    assert all(x["service"] == "decode" and x["instance"] == "decode-9" and "kernel on fire" in x["fields"]["reason"]
               for x in failed)


def test_a_request_through_an_in_process_stack_logs_its_lifecycle(captured, redis_url, tiny_model_dir):
    from proto.eyrie.v1 import eyrie_pb2 as pb
    from tests.e2e.conftest import start_stack

    stack = start_stack(redis_url, tiny_model_dir, "eagle", page_size=4, chunk_size=8, max_context=64)
    try:
        req = pb.GenerateRequest(request_id="logged", token_ids=pb.TokenIds(ids=list(range(5, 25))),
                                 sampling=pb.SamplingParams(max_new_tokens=6, ignore_eos=True))
        assert sum(len(m.token_ids) for m in stack.stub.Generate(req, timeout=60)) == 6
    finally:
        stack.stop()
    mine = [x for x in captured() if x["rid"] == "logged"]
    by_service = {}
    for x in mine:
        by_service.setdefault(x["service"], []).append(x)
    instances = {"router": stack.router.instance_id, "prefill": stack.prefills[0].instance_id,
                 "decode": stack.decodes[0].instance_id}
    for service, lines in by_service.items():
        assert {x["instance"] for x in lines} == {instances[service]}
    # The first token goes to the client once the decode instance holds the request, before its hand-off ends.
    assert [x["event"] for x in by_service["router"]] == ["received", "placed", "prefill_done", "first_token",
                                                          "handoff_done", "finished"]
    assert [x["event"] for x in by_service["prefill"]] == ["received", "prefill_done", "handoff_sent"]
    assert [x["event"] for x in by_service["decode"] if x["level"] != "DEBUG"] == \
        ["reserved", "handoff_received", "stream_attached", "first_token", "finished"]
    assert by_service["router"][-1]["fields"]["output_tokens"] == 6
    assert by_service["decode"][-1]["fields"]["reason"] == "length"
