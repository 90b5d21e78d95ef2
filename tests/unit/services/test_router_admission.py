"""Overload is back-pressure, not failure: while every decode instance is full, a new request waits in the
router's bounded queue and is placed when room frees; past ``max_queued``, or after ``queue_timeout_s``, it is
refused before any token with RESOURCE_EXHAUSTED and a Retry-After, and its record says why."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from services.engine_service import wait_until
from services.router.server import RouterError
from tests.unit.services.test_router import (  # noqa: F401 (the fixture)
    ScriptedDecode,
    ScriptedPrefill,
    make_core,
    run,
    scripted,
)


@pytest.fixture
def core(redis_url, tiny_model_dir):
    c = make_core(redis_url, tiny_model_dir, max_queued=1, queue_timeout_s=60, placement_timeout_s=60)
    yield c
    c.close()


def test_a_request_waits_for_room_and_one_past_the_bound_is_refused_before_any_token(core, scripted):  # noqa: F811
    decode = ScriptedDecode([20, 21])
    a_decode = scripted("decode", "d1", decode)
    prefill = ScriptedPrefill({a_decode: "full"})
    scripted("prefill", "p1", prefill)
    got: dict = {}
    waiter = threading.Thread(target=lambda: got.update(result=run(core, "waits")))
    waiter.start()
    assert wait_until(lambda: core.admission.queued == 1, time.monotonic() + 30), "the request never queued"
    with pytest.raises(RouterError) as err:  # the queue holds one already: refused at once
        run(core, "refused")
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and err.value.retry_after_s >= 1
    assert "max_queued 1" in err.value.message
    assert "refused" not in decode.streams and core.store.get("refused")["state"] == "failed"
    prefill.behaviour[a_decode] = "ok"  # room frees: the waiting request is placed
    waiter.join(30)
    tokens, finish = got["result"]
    assert tokens == [8, 20, 21] and finish.reason == "length"
    assert core.store.get("waits")["state"] == "finished" and core.admission.queued == 0


def test_a_request_that_finds_no_room_in_time_is_refused_with_retry_after(core, scripted):  # noqa: F811
    core.admission.timeout_s = 0.5
    a_decode = scripted("decode", "d1", ScriptedDecode([20]))
    scripted("prefill", "p1", ScriptedPrefill({a_decode: "full"}))
    with pytest.raises(RouterError) as err:
        run(core, "late")
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value.message
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and err.value.retry_after_s >= 1
    assert "queue_timeout_s" in err.value.message
    rec = core.store.get("late")
    assert rec["state"] == "failed" and "queue_timeout_s" in rec["error"] and core.admission.queued == 0
