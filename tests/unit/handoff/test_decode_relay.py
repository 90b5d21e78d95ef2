"""The decode service's relay (``Decode.Relay``): one stream carries the tokens of every request attached to
it, each request's equal to what its own ``Stream`` call gives (the single-process engine's); a request that
cannot stream ends with the status ``Stream`` would have given; a relay whose client goes away aborts its
requests and every pool is whole again."""

from __future__ import annotations

import queue
import threading

import grpc
from handoff_helpers import GREEDY, LONG, SHORT

from proto.eyrie.v1 import eyrie_pb2 as pb
from shared.sampling import SamplingParams
from tests.unit.handoff.test_handoff_services import (  # noqa: F401 (fixtures)
    aborted_on_decode,
    models,
    redis_url,
    single,
    stacks,
    stream_stack,
    wait_until,
)


def relay(stack):
    """(the call, a function that attaches a request id): the relay stays open until the call is cancelled."""
    ids: queue.SimpleQueue = queue.SimpleQueue()

    def requests():
        while (rid := ids.get()) is not None:
            yield pb.StreamRequest(request_id=rid)

    call = stack.dstub.Relay(requests(), timeout=60)
    return call, ids.put


def handed_off(stack, prompt, params=GREEDY) -> tuple[str, int]:
    rid = stack.rid()
    events = list(stack.prefill_call(rid, prompt, params))
    assert events[-1].HasField("handed_off")
    return rid, events[0].first_token.token_id


def test_one_relay_carries_several_requests_each_equal_to_the_engine(stream_stack, single):  # noqa: F811
    stack = stream_stack
    call, attach = relay(stack)
    want, tokens, finished = {}, {}, {}
    for prompt, result in [(SHORT, single[0]), (LONG, single[1]), (SHORT, single[0])]:
        rid, first = handed_off(stack, prompt)
        want[rid], tokens[rid] = result.token_ids, [first]
        attach(rid)
    attach("never-here")
    errors, batches = {}, 0
    for batch in call:
        batches += 1
        for msg in batch.messages:
            tokens[msg.request_id] += msg.token_ids
            if msg.HasField("finish"):
                finished[msg.request_id] = msg.finish
        errors.update({e.request_id: (grpc.StatusCode.NOT_FOUND.value[0] == e.code, e.details) for e in batch.errors})
        if len(finished) == len(want) and errors:
            break
    call.cancel()
    assert tokens == want and all(f.reason == "length" for f in finished.values())
    assert errors == {"never-here": (True, "request_id: 'never-here' is not on this decode instance")}
    assert stack.clean()


def test_a_relay_whose_client_goes_away_aborts_its_requests(stream_stack):  # noqa: F811
    stack = stream_stack
    before = aborted_on_decode(stack)
    call, attach = relay(stack)
    for _ in range(2):
        rid, _ = handed_off(stack, LONG, SamplingParams(max_new_tokens=400, ignore_eos=True))
        attach(rid)
    got = set()
    for batch in call:  # both stream, then the router goes away
        got |= {m.request_id for m in batch.messages}
        if len(got) == 2:
            break
    call.cancel()
    assert stack.clean()
    wait_until(lambda: aborted_on_decode(stack) == before + 2)


def test_an_abort_on_the_decode_side_ends_that_request_on_the_relay_only(stream_stack):  # noqa: F811
    stack = stream_stack
    call, attach = relay(stack)
    long_rid, _ = handed_off(stack, LONG, SamplingParams(max_new_tokens=400, ignore_eos=True))
    short_rid, _ = handed_off(stack, SHORT)
    attach(long_rid)
    attach(short_rid)
    aborted = finished = False
    for batch in call:
        if not aborted and any(m.request_id == long_rid for m in batch.messages):
            assert stack.dstub.Abort(pb.AbortRequest(request_id=long_rid), timeout=5).found
            aborted = True
        ended = {e.request_id: e.code for e in batch.errors}
        if long_rid in ended:
            assert ended[long_rid] == grpc.StatusCode.ABORTED.value[0]
            aborted = "ended"
        finished |= any(m.request_id == short_rid and m.HasField("finish") for m in batch.messages)
        if aborted == "ended" and finished:
            break
    call.cancel()
    assert stack.clean()



def test_a_draining_decode_instance_ends_an_open_relay_instead_of_waiting_out_its_drain(models, redis_url):  # noqa: F811
    """A router's relay call never ends by itself; an idle decode instance that stops ends it (the router sees
    the call end, no error), so the stop takes far less than its drain period instead of all of it."""
    from tests.unit.handoff.test_handoff_services import Stack

    stack = Stack(models, redis_url)
    try:
        call, attach = relay(stack)
        rid, _ = handed_off(stack, SHORT)
        attach(rid)
        batches = iter(call)
        while not any(m.HasField("finish") for m in next(batches).messages):
            pass
        stack.prefill.stop(0.2)
        stopped = threading.Thread(target=stack.decode.stop, args=(60.0,))
        stopped.start()
        for _ in batches:  # whatever is left of the call; an error would raise here
            pass
        assert call.code() == grpc.StatusCode.OK, call.details()
        stopped.join(30)
        assert not stopped.is_alive(), "the stop waited for the relay (the drain period is 60 s)"
    finally:
        attach(None)


def test_a_relay_leaves_no_subscriber_in_the_engine_loop(stream_stack):  # noqa: F811
    """The engine loop hands a step's events for all of a relay's requests to its one inbox; once a request
    ends there (finished, or its relay gone), the loop keeps no subscriber for it."""
    stack = stream_stack
    loop = stack.decode.engine_loop
    call, attach = relay(stack)
    short_rid, _ = handed_off(stack, SHORT)
    long_rid, _ = handed_off(stack, LONG, SamplingParams(max_new_tokens=400, ignore_eos=True))
    attach(short_rid)
    attach(long_rid)
    for batch in call:  # the short one finishes while the long one still streams
        if any(m.request_id == short_rid and m.HasField("finish") for m in batch.messages):
            break
    wait_until(lambda: loop.subscribers() == 1)  # the long one's
    call.cancel()  # the router goes away: the long one is aborted
    assert stack.clean()
    wait_until(lambda: loop.subscribers() == 0)
