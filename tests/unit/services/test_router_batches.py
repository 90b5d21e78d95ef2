"""The router's Redis calls in batches (``services/router/batches.py``, ``RecordWriter.write_batch``,
``RequestStore.write_many``): what is asked while a batch is out goes in the next one, in order; a batch's
writes equal the single writes; Redis away buffers transitions and refuses creates as the single writes do."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis as redis_lib

from services.metadata import RequestStore, connect
from services.router.batches import Batches
from services.router.records import CREATE, RecordsUnavailable, RecordWrite, RecordWriter


def test_what_is_asked_while_a_batch_is_out_goes_in_the_next_one_in_order():
    gate, batches = threading.Event(), []

    def run(items: list) -> list:
        batches.append(list(items))
        if len(batches) == 1:
            assert gate.wait(30), "the first batch was never let go"
        return [ValueError(f"bad {i}") if i == "bad" else i * 2 for i in items]

    async def main():
        with ThreadPoolExecutor(2) as pool:
            send = Batches(run, pool)
            first = asyncio.ensure_future(send(1))
            while not batches:  # the first batch is out, held at the gate
                await asyncio.sleep(0.001)
            rest = [asyncio.ensure_future(send(x)) for x in (2, "bad", 3)]
            gone = asyncio.ensure_future(send(4))
            await asyncio.sleep(0)
            gone.cancel()  # its caller went away: the item is still sent
            gate.set()
            out = [await first, await rest[0], await rest[2]]
            with pytest.raises(ValueError, match="bad bad"):
                await rest[1]
            assert gone.cancelled()
            assert await send(5) == 10  # alone: a batch of its own, at once
            return out

    assert asyncio.run(main()) == [2, 4, 6]
    assert batches == [[1], [2, "bad", 3, 4], [5]]


def test_a_batch_of_writes_equals_the_single_writes_and_loads_a_lost_script_again(redis_url):
    client = connect(redis_url)
    store = RequestStore(client, ttl_s=60)
    store.create("taken")
    client.script_flush()  # a restarted Redis: no script loaded
    done = store.write_many([("create", "a", 100.0, {"prompt_tokens": 3}), ("create", "taken", 101.0, {}),
                             ("transition", "a", "prefilling", {"placements": [{"decode": "d"}]}, None),
                             ("create", "b", 102.0, {}), ("transition", "a", "decoding", {}, 2e9),
                             ("transition", "a", "finished", {"output_tokens": 8}, None),
                             ("transition", "a", "failed", {}, None),  # after a terminal state: refused
                             ("discard", "b", repr(102.0))])
    assert done == [True, False, True, True, True, True, False, True]
    rec = store.get("a")
    assert [s for s, _ in rec["transitions"]] == ["queued", "prefilling", "decoding", "finished"]
    times = [t for _, t in rec["transitions"]]  # a transition's own time where it has one, increasing
    assert times[0] == 100.0 < times[1] < times[2] == 2e9 < times[3] < 2e9 + 1e-3
    assert (rec["state"], rec["prompt_tokens"], rec["output_tokens"]) == ("finished", "3", "8")
    assert rec["placements"] == '[{"decode": "d"}]' and 0 < client.ttl("req:a") <= 60
    assert store.get("b") == {} and store.get("taken")["state"] == "queued"
    with pytest.raises(ValueError, match="unknown request state"):
        store.write_many([("transition", "a", "nowhere", {}, None)])


class _BlinkingStore:
    """A RequestStore stand-in whose Redis is away while ``down``; records each write that lands."""

    def __init__(self):
        self.down, self.written = True, []

    def _write(self, rid, state):
        if self.down:
            raise redis_lib.ConnectionError("Error 111 connecting: connection refused")
        self.written.append((rid, state))
        return True

    def write_many(self, writes):
        if self.down:
            raise redis_lib.ConnectionError("Error 111 connecting: connection refused")
        return [self._write(w[1], "queued" if w[0] == "create" else w[2] if w[0] == "transition" else "discard")
                for w in writes]

    def transition(self, rid, state, **fields):
        return self._write(rid, state)

    def discard(self, rid, created_at):
        return self._write(rid, "discard")


def test_a_batch_redis_does_not_take_buffers_its_transitions_and_refuses_its_creates():
    store = _BlinkingStore()
    writer = RecordWriter(store, backoff_s=(0.001,), flush_interval_s=0.01)
    out = writer.write_batch([RecordWrite("new", CREATE), RecordWrite("a", "decoding"), RecordWrite("a", "finished")])
    assert isinstance(out[0], RecordsUnavailable) and out[1:] == [None, None]
    assert writer.buffered == 3  # the create's discard (it may have landed), then the transitions in order
    store.down = False  # Redis is back, the buffer not yet flushed: a create is refused, a transition queues
    out = writer.write_batch([RecordWrite("later", CREATE), RecordWrite("b", "finished")])
    assert isinstance(out[0], RecordsUnavailable) and out[1] is None and writer.buffered == 4
    assert writer.flush() and writer.buffered == 0
    assert store.written == [("new", "discard"), ("a", "decoding"), ("a", "finished"), ("b", "finished")]
    assert writer.write_batch([RecordWrite("c", CREATE), RecordWrite("a", "aborted")]) == [True, None]
    assert store.written[-2:] == [("c", "queued"), ("a", "aborted")]
