"""services.metadata against a real Redis server: registry TTLs, heartbeats, request records."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest

from services.metadata import EmbeddedRedis, Heartbeat, InstanceInfo, Registry, RequestStore, connect

# An entry's TTL: long enough that a test thread (or a heartbeat of 0.05 s) held up on a loaded machine does not
# see an entry lapse between two of its own lines (0.3 s once did), short enough that waiting it out is cheap.
TTL_S = 2.0


def wait_for(predicate, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def test_embedded_redis_is_a_real_server_and_stops_cleanly():
    server = EmbeddedRedis()
    url = server.start()
    socket_file = url.removeprefix("unix://").split("?")[0]
    client = connect(url)
    assert client.ping() and client.info("server")["redis_version"]
    client.set("k", "v", px=50)
    assert wait_for(lambda: client.get("k") is None, 2)  # real expiry, not a dict
    server.stop()
    assert not os.path.exists(socket_file)
    assert server.url is None


def test_registry_lists_live_instances_by_role_and_forgets_expired_ones(redis_url):
    registry = Registry(connect(redis_url), ttl_s=TTL_S)
    registry.register(InstanceInfo("p1", "prefill", "h:1"))
    registry.register(InstanceInfo("d1", "decode", "h:2", outstanding_tokens=7))
    registry.register(InstanceInfo("d2", "decode", "h:3"))
    assert [i.instance_id for i in registry.instances("decode")] == ["d1", "d2"]
    assert registry.instances("decode")[0].outstanding_tokens == 7
    assert [i.instance_id for i in registry.instances("prefill")] == ["p1"]
    assert len(registry.instances()) == 3
    registry.deregister("d2")
    assert [i.instance_id for i in registry.instances("decode")] == ["d1"]
    assert wait_for(lambda: registry.instances() == [], TTL_S + 30), "instances must vanish when their TTL runs out"
    assert registry.client.smembers(Registry.INDEX) == set(), "the index forgets them too"


def test_listing_does_not_scan_request_records(redis_url):
    client = connect(redis_url)
    registry, store = Registry(client, ttl_s=30), RequestStore(client)
    for i in range(300):
        store.create(f"r{i}")
    registry.register(InstanceInfo("d1", "decode", "h:1"))
    client.execute_command("CONFIG", "RESETSTAT")
    assert [i.instance_id for i in registry.instances("decode")] == ["d1"]
    stats = client.info("commandstats")
    assert "cmdstat_scan" not in stats and "cmdstat_keys" not in stats


def test_instance_info_tolerates_fields_a_newer_instance_adds(redis_url):
    client = connect(redis_url)
    client.set("instance:x", json.dumps({"instance_id": "x", "role": "decode", "grpc_address": "a:1",
                                         "gpu_memory": 80, "beat": 4}))
    client.sadd(Registry.INDEX, "x")
    (info,) = Registry(client).instances("decode")
    assert info.instance_id == "x" and info.beat == 4


def test_heartbeat_refreshes_load_and_sequence_and_deregisters_on_stop(redis_url):
    registry = Registry(connect(redis_url), ttl_s=TTL_S)
    calls = iter(range(1000))
    hb = Heartbeat(registry, InstanceInfo("d1", "decode", "h:1"), interval_s=0.05,
                   load_fn=lambda: {"outstanding_tokens": next(calls), "running": 2, "free_pages": 9}).start()
    try:
        assert registry.instances("decode")[0].beat == 1  # registered before start() returns
        assert wait_for(lambda: registry.instances("decode")[0].beat >= 4, 30)
        info = registry.instances("decode")[0]
        assert info.outstanding_tokens == info.beat - 1 and info.running == 2 and info.free_pages == 9
        # Beats at least 0.05 s apart: this many span more than the TTL. The heartbeat keeps it alive.
        beats = int(TTL_S / 0.05) + 2
        assert wait_for(lambda: hb.info.beat >= beats, 60)
        assert [i.instance_id for i in registry.instances("decode")] == ["d1"]
    finally:
        hb.stop()
    assert registry.instances("decode") == []


def test_a_silent_instance_vanishes_after_its_ttl(redis_url):
    """A killed process deregisters nothing; its key expires on its own."""
    registry = Registry(connect(redis_url), ttl_s=TTL_S)
    hb = Heartbeat(registry, InstanceInfo("d1", "decode", "h:1"), interval_s=0.05).start()
    hb._stop.set()  # the thread stops beating, as if the process died (no deregister)
    hb._thread.join(30)
    assert registry.instances("decode"), "still there right after the last beat"
    assert wait_for(lambda: registry.instances("decode") == [], TTL_S + 30)


def test_request_record_transitions_in_order_with_increasing_times(redis_url):
    store = RequestStore(connect(redis_url), ttl_s=60)
    assert store.create("r1", prompt_tokens=5, stop=[1, 2])
    assert not store.create("r1", prompt_tokens=99), "a duplicate id must not be created twice"
    for state in ("prefilling", "transferring", "decoding"):
        assert store.transition("r1", state, decode_instance="d1")
    assert store.transition("r1", "finished", output_tokens=16, accept_length=2.5)
    rec = store.get("r1")
    assert [s for s, _ in rec["transitions"]] == ["queued", "prefilling", "transferring", "decoding", "finished"]
    times = [t for _, t in rec["transitions"]]
    assert all(a < b for a, b in zip(times, times[1:]))
    assert rec["state"] == "finished" and rec["prompt_tokens"] == "5" and rec["output_tokens"] == "16"
    assert json.loads(rec["stop"]) == [1, 2] and rec["decode_instance"] == "d1"
    assert 50 < store.client.ttl("req:r1") <= 60
    # terminal is final: a late transition (e.g. the stream ending after an abort) changes nothing
    assert not store.transition("r1", "failed", error="late")
    assert store.get("r1")["state"] == "finished" and "error" not in store.get("r1")
    with pytest.raises(ValueError):
        store.transition("r1", "exploded")
    assert store.get("missing") == {}


def test_live_records_expire_late_and_ended_ones_after_the_ttl(redis_url):
    store = RequestStore(connect(redis_url), ttl_s=TTL_S, live_ttl_s=3600)
    store.create("live")
    store.create("gone")
    store.transition("gone", "aborted", error="client went away")
    assert store.client.ttl("req:live") > 3000
    assert store.get("gone")["error"] == "client went away"
    assert wait_for(lambda: not store.exists("gone"), TTL_S + 30)
    assert store.exists("live")


def test_concurrent_transitions_lose_nothing(redis_url):
    store = RequestStore(connect(redis_url))
    store.create("r")
    stores = [RequestStore(connect(redis_url)) for _ in range(12)]
    threads = [threading.Thread(target=s.transition, args=("r", "decoding"), kwargs={"n": i})
               for i, s in enumerate(stores)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert [s for s, _ in store.get("r")["transitions"]] == ["queued"] + ["decoding"] * 12


def test_transition_times_increase_when_the_clock_steps_back_and_a_lost_script_is_loaded_again(redis_url,
                                                                                              monkeypatch):
    """A record's writes are server-side scripts: a clock stepping back still gives strictly increasing times
    (the last one plus a microsecond), and a Redis that forgot its scripts (a restart) gets them again."""
    import services.metadata as md

    store = RequestStore(connect(redis_url), ttl_s=60)
    store.client.script_flush()
    assert store.create("back")
    t0 = store.get("back")["transitions"][0][1]
    monkeypatch.setattr(md.time, "time", lambda: t0 - 100.0)
    store.client.script_flush()
    assert store.transition("back", "prefilling", placements=[{"prefill": "p"}])
    assert store.transition("back", "decoding")
    rec = store.get("back")
    times = [t for _, t in rec["transitions"]]
    assert times == sorted(set(times)) and len(times) == 3 and times[1] > t0
    assert json.loads(rec["placements"]) == [{"prefill": "p"}] and rec["state"] == "decoding"
