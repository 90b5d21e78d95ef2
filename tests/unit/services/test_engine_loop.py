"""The engine loop serves ``call_soon`` during a step, while the device computes it (between the step's
launch and its finish: ``EngineLoop.step_once``), and ``call`` only between steps; the service's
``while_stepping`` runs at the same point. A hand-off reserved during a real engine's step leaves the request
that step runs exact."""

from __future__ import annotations

import threading
import types

import pytest

from services.engine_loop import EngineLoop
from shared.config import EngineConfig
from shared.engine import Engine, EngineLoad
from shared.sampling import SamplingParams


class HeldStep:
    """Just what the loop asks of an engine. Its one step's launch waits for ``go`` (the host still launching
    the step); its finish says the loop served what runs beside it (``hooked``), then waits for ``finish``
    (the device still computing it)."""

    role, device = "decode", "cpu"

    def __init__(self):
        self.work = True
        self.started, self.go, self.hooked, self.finish = (threading.Event() for _ in range(4))

    def handoff_schema(self):
        return None

    def kv_pools(self):
        return []

    def load(self) -> EngineLoad:
        return EngineLoad(running=0, queued=0, prefill_tokens=0, decode_tokens=0, free_pages=(0,), total_pages=(0,))

    def has_work_to_step(self) -> bool:
        return self.work

    def launch(self):
        self.work = False
        self.started.set()
        assert self.go.wait(10)
        return types.SimpleNamespace(finish=self.finish_step)  # the step in flight

    def finish_step(self):
        self.hooked.set()
        assert self.finish.wait(10)
        return []

    def live_requests(self):
        return []


def test_call_soon_runs_in_the_step_in_flight_and_call_after_it():
    engine = HeldStep()
    during = []
    loop = EngineLoop(engine, while_stepping=lambda e: during.append(e.finish.is_set())).start()
    try:
        assert engine.started.wait(5)  # a step is being launched
        soon = loop.call_soon(lambda e: e.finish.is_set())
        later = loop.call(lambda e: e.finish.is_set())
        engine.go.set()
        assert engine.hooked.wait(5)  # the device computes the step now
        assert soon.done() and soon.result() is False and during == [False]
        assert not later.done()  # waits for the step to end
        engine.finish.set()
        assert later.result(5) is True
    finally:
        engine.go.set()
        engine.finish.set()
        loop.stop()


def test_a_call_never_overtakes_a_call_soon_queued_before_it():
    """A call holds the loop; an admission (call_soon) and then an abort (call) queue behind it: the
    admission runs first, so the abort finds the request (in queue order, whichever queue)."""
    engine = HeldStep()
    engine.work = False
    loop = EngineLoop(engine).start()
    order, gate, entered = [], threading.Event(), threading.Event()
    try:
        loop.call(lambda e: (entered.set(), gate.wait(10)))
        assert entered.wait(5)
        later = [loop.call(lambda e: order.append("second call"))]
        soon = loop.call_soon(lambda e: order.append("admission"))
        abort = loop.call(lambda e: order.append("abort"))
        gate.set()
        assert abort.result(5) is None and soon.done() and later[0].done()
        assert order.index("admission") < order.index("abort")
    finally:
        gate.set()
        loop.stop()


def test_a_hand_off_reserved_mid_step_leaves_the_running_request_exact(tiny_model_dir):
    """An engine steps one request while another's reservation is made beside the step in flight: the running
    request's tokens equal a run without it, and every page comes back."""
    config = EngineConfig(page_size=4, max_context=64, max_running=4)
    greedy = SamplingParams(max_new_tokens=6, ignore_eos=True)
    alone = Engine(tiny_model_dir / "target", config=config).generate([[5, 6, 7, 8]], greedy)[0].token_ids
    engine = Engine(tiny_model_dir / "target", config=config)
    loop = EngineLoop(engine)
    req = engine.add_request([5, 6, 7, 8], greedy, rid="running")
    engine.step()  # its prompt: it decodes from here
    reserved = []

    def reserve(e: Engine):
        reserved.append(e.reserve_handoff("joining", list(range(3, 13)), [4], [0.0], greedy, 10))

    assert not reserved
    loop.call_soon(reserve)  # the loop is not started: only its step below serves this
    loop.step_once()  # the reservation is made beside this step, while it "computes"
    assert reserved[0] is not None and reserved[0].rid == "joining" and reserved[0] in engine.live_requests()
    engine.release(reserved[0], "abort")
    engine.run_until_done()
    assert req.output_ids == alone
    assert engine.is_idle_and_clean()


@pytest.mark.parametrize("hold", [True, False])
def test_a_prefill_loop_publishes_each_steps_tokens_before_the_next_step(tiny_model_dir, hold):
    """Holding (a decode loop): a step's tokens go out during the next step, once it is launched; not
    holding (a prefill loop: first tokens, each a client's time to first token): before the next step."""
    engine = Engine(tiny_model_dir / "target", config=EngineConfig(page_size=4, max_context=64, max_running=2))
    loop = EngineLoop(engine, hold_tokens=hold)
    published, publish_all = [], loop.publish_all  # a step's events go out in one publish_all
    loop.publish_all = lambda evs: (published.extend(t for ev in evs for t in ev.token_ids), publish_all(evs))
    events = loop.subscribe("r")
    out_at_start = []  # tokens published when each step began
    launch = engine.launch

    def counted_launch():
        out_at_start.append(len(published))
        return launch()

    engine.launch = counted_launch
    loop.start()
    try:
        loop.call(lambda e: e.add_request([5, 6, 7], SamplingParams(max_new_tokens=4, ignore_eos=True), rid="r"))
        while events.get(timeout=10).finish_reason is None:
            pass
    finally:
        loop.stop()
    assert out_at_start == ([0, 0, 1, 2] if hold else [0, 1, 2, 3]) and len(published) == 4


class Inbox:
    """A relay's inbox as the loop sees it: one subscriber for many requests."""

    def __init__(self):
        self.calls: list[list] = []

    def put(self, event) -> None:
        self.calls.append([event])

    def put_many(self, events: list) -> None:
        self.calls.append(list(events))


def test_a_step_s_events_reach_a_shared_inbox_in_one_call_and_a_queue_each():
    """``publish_all``: the events of requests redirected to one inbox go to it in one ``put_many`` (in the
    step's order); a request with its own queue gets its event there; an unsubscribed one is dropped."""
    from services.engine_loop import TokenEvent

    loop = EngineLoop(HeldStep())
    inbox, moved = Inbox(), []
    queues = {rid: loop.subscribe(rid) for rid in ("a", "b", "c")}
    queues["a"].put("buffered")
    first = types.SimpleNamespace(put=moved.append)
    assert loop.redirect("a", queues["a"], inbox, first=first)
    assert loop.redirect("b", queues["b"], inbox)
    assert not loop.redirect("c", queues["a"], inbox)  # not c's queue: nothing moves
    events = [TokenEvent(rid, [i]) for i, rid in enumerate(("a", "c", "b", "gone", "a"))]
    loop.publish_all(events)
    assert moved == ["buffered"]
    assert inbox.calls == [[events[0], events[2], events[4]]]
    assert queues["c"].get_nowait() is events[1] and queues["c"].empty()
    assert loop.subscribers() == 3
    loop.unsubscribe("a", inbox)
    loop.unsubscribe("b", queues["b"])  # not b's subscriber any more: kept
    assert loop.subscribers() == 2
