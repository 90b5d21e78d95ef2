"""Drives an Engine on its own thread for a service.

All engine state is touched on the loop thread only: gRPC handlers ask for work through
``call(fn)`` (run between steps, returns a Future; ``fn`` calls the engine's service API: admit,
reserve / activate a hand-off, read its pages, release or abort) and read tokens from per-request
queues. ``call_soon(fn)`` is for work that touches nothing a step in flight holds (claiming free pages
for a hand-off, reading a reserved request's page ids): it also runs during a step, while the device
computes it, so it does not wait a whole step for the next boundary.

The overlap is the loop's (``step_once``): it launches step N+1 (``Engine.launch``: its device work queued),
publishes step N's tokens, serves ``call_soon``'s calls and the service's ``while_stepping``, then finishes
step N+1 (the host waits for the device and commits). Nothing inside a step calls back into the service.
What other threads may read without a call is published here: the engine's static facts (``schema``,
``device``), fixed at construction, and its load snapshot (``load``), replaced after every step and
every call. This keeps the engine single-threaded, like the scheduler of nano-vllm, with no
locks inside it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from services.faults import HoldGate
from services.logs import ServiceLog
from shared.engine import Engine, EngineLoad
from shared.request import Request
from shared.stepping import StepFacts


@dataclass
class TokenEvent:
    rid: str
    token_ids: list[int]
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    request: Request | None = None  # set on the final event (stats, lengths)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)  # per token, when asked for


@dataclass
class LoopTimes:
    """Where the loop thread's time went, as running totals (the telemetry turns them into counters,
    ``eyrie_engine_loop_seconds_total{part}``): per step kind (``StepFacts.kind``) the steps' time from launch to
    finish (the device's work, and the host's beside it: the previous step's tokens published, calls served
    while it runs), the steps, their decode rows and prefill tokens; ``calls``: between steps, the service's
    calls (admissions, hand-off activations, releases); ``after_step``: the service's hook after each step;
    ``idle``: waiting for work. Their sum is the loop's wall time, so a busy share reads off it."""

    seconds: dict[str, float] = field(default_factory=dict)  # "step_decode", ..., "calls", "after_step", "idle"
    steps: dict[str, int] = field(default_factory=dict)  # step kind -> steps
    rows: dict[str, int] = field(default_factory=dict)  # step kind -> decode rows
    prefill_tokens: int = 0

    def add(self, part: str, seconds: float) -> None:
        self.seconds[part] = self.seconds.get(part, 0.0) + seconds

    def step(self, facts: StepFacts | None, seconds: float) -> None:
        kind = facts.kind if facts is not None else "idle"
        self.add(f"step_{kind}", seconds)
        self.steps[kind] = self.steps.get(kind, 0) + 1
        if facts is not None:
            self.rows[kind] = self.rows.get(kind, 0) + facts.rows
            self.prefill_tokens += facts.prefill_tokens


class EngineLoop:
    def __init__(self, engine: Engine, after_step: Callable[[Engine], None] | None = None,
                 before_fail: Callable[[str], None] | None = None, log: ServiceLog | None = None,
                 while_stepping: Callable[[Engine], None] | None = None, hold_tokens: bool = True):
        self.engine = engine
        self.log = log or ServiceLog(engine.role)  # the service's log: lines about a request carry its id
        self.after_step = after_step  # e.g. the prefill service feeds hand-offs here
        # Called (on the loop thread) while the device computes a step, with the same rule as ``call_soon``:
        # the prefill service starts hand-offs (the decode side's reservation) here, during the first chunk.
        self.while_stepping = while_stepping
        # Called (on the loop thread) for each request an engine error is about to abort, before its
        # pages are freed: the decode service stops a transfer that may still be writing them.
        self.before_fail = before_fail
        self._calls: queue.Queue = queue.Queue()
        self._soon: queue.Queue = queue.Queue()  # call_soon's: served between steps and during them
        self._streams: dict[str, queue.Queue] = {}
        self._streams_lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self.error: BaseException | None = None
        self.schema = engine.handoff_schema()  # static: what this engine's hand-offs carry
        self.device = engine.device
        self.kv_pools = engine.kv_pools()  # static: exported for same-host hand-offs, never read by the services
        self.load: EngineLoad = engine.load()  # replaced (never mutated) after each step and call
        self._thread = threading.Thread(target=self._run, name="eyrie-engine", daemon=True)
        # A step's tokens go to the streams while the next step's device work runs (``step_once``), or at once
        # when no step follows: waking a decode step's many stream
        # threads would take the GIL from the next step's launch. ``hold_tokens=False`` (a prefill: a few first
        # tokens a step, each a client's time to first token) publishes each step's at once.
        self.hold_tokens = hold_tokens
        self._held: list[tuple[Request, list[int]]] = []
        # Under tensor parallelism every call runs between steps (``services/followers.py``): the followers
        # replay rank 0's calls in order, and one made during a step would change rank 0's requests before the
        # step's commit, the followers' after it.
        self.between_steps_only = getattr(engine, "distributed", False)
        self.hold = HoldGate.from_env()  # a test's fault injection: None unless its environment variable is set
        self.times = LoopTimes()  # the loop thread's time by part, running totals (read on the loop thread)

    def start(self) -> EngineLoop:
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)
        self._refuse_pending()

    def call(self, fn: Callable[[Engine], object]) -> Future:
        """Run ``fn(engine)`` on the loop thread between steps; a stopped loop fails the future at once."""
        return self._put(self._calls, fn)

    def call_soon(self, fn: Callable[[Engine], object]) -> Future:
        """Run ``fn(engine)`` on the loop thread between steps or during one, while the device computes it.
        ``fn`` must leave alone what the step in flight holds: it may claim free pages and add requests
        that join at the next step or later, never release a request or change a running one. Under tensor
        parallelism between steps only, as ``call``."""
        return self._put(self._soon, fn)

    def _put(self, calls: queue.Queue, fn: Callable[[Engine], object]) -> Future:
        fut: Future = Future()
        calls.put((fn, fut))
        self._wake.set()
        if self._stop.is_set() and not self._thread.is_alive():
            self._refuse_pending()
        return fut

    def _refuse_pending(self) -> None:
        for calls in (self._soon, self._calls):
            while True:
                try:
                    _, fut = calls.get_nowait()
                except queue.Empty:
                    break
                if fut.set_running_or_notify_cancel():
                    fut.set_exception(RuntimeError("the engine loop has stopped"))

    def subscribe(self, rid: str) -> queue.Queue:
        """Token events of ``rid`` (subscribe before the request can produce tokens)."""
        q: queue.Queue = queue.Queue()
        with self._streams_lock:
            self._streams[rid] = q
        return q

    def unsubscribe(self, rid: str, q: queue.Queue | None = None) -> None:
        """Stop delivering ``rid``'s events (only to ``q`` when given: a newer subscriber under the same
        id, e.g. a request placed here again, keeps its queue)."""
        with self._streams_lock:
            if q is None or self._streams.get(rid) is q:
                self._streams.pop(rid, None)

    def subscribers(self) -> int:
        """How many requests have a subscriber now (each goes when its stream ends: a leak shows here)."""
        with self._streams_lock:
            return len(self._streams)

    def redirect(self, rid: str, old: queue.Queue, new, first=None) -> bool:
        """From now on deliver ``rid``'s events to ``new`` (anything with ``put``, or ``put_many``: a relay's
        inbox), the events ``old`` holds first, in order (put to ``first`` when given, else to ``new``); False
        when ``old`` is no longer ``rid``'s subscriber."""
        with self._streams_lock:
            if self._streams.get(rid) is not old:
                return False
            moved_to = new if first is None else first
            while True:
                try:
                    moved_to.put(old.get_nowait())
                except queue.Empty:
                    break
            self._streams[rid] = new
        return True

    def publish(self, event: TokenEvent) -> None:
        self.publish_all([event])

    def publish_all(self, events: list[TokenEvent]) -> None:
        """Each event to its request's subscriber, under one lock (``redirect`` moves a request's events in
        order); a subscriber with ``put_many`` (a decode relay's inbox, the target of many requests) gets all
        of its events of the step in one call: one queue hand-off per relay per step, not per request."""
        many: dict[int, tuple[object, list[TokenEvent]]] = {}
        with self._streams_lock:
            streams = self._streams
            for event in events:
                q = streams.get(event.rid)
                if q is None:
                    continue
                if hasattr(q, "put_many"):
                    many.setdefault(id(q), (q, []))[1].append(event)
                else:
                    q.put(event)
            for q, batch in many.values():
                q.put_many(batch)

    def _run(self) -> None:
        engine, times, clock = self.engine, self.times, time.perf_counter
        while not self._stop.is_set():
            t0 = clock()
            if self._drain_calls():
                t1 = clock()
                times.add("calls", t1 - t0)
                self._after_step()  # calls (releases, aborts, admissions) change what the gauges show
                t0 = clock()
                times.add("after_step", t0 - t1)
            if self.hold is not None and self.hold.holds(engine):  # held at a test's state: calls only
                self._idle(0.01, t0)
                continue
            if not engine.has_work_to_step():
                self._idle(0.05, t0)
                continue
            try:
                self.step_once()
            except Exception as e:  # a bug: fail every request rather than hang them
                self._publish_held()  # the tokens before the failure go first
                self.log.exception("engine_error", requests=sorted(r.rid for r in engine.live_requests()))
                self.error = e
                self._fail_all(f"engine error: {e}")
                continue
            t1 = clock()
            times.step(getattr(engine, "last_step", None), t1 - t0)
            self._after_step()
            times.add("after_step", clock() - t1)
        self._publish_held()

    def _idle(self, wait_s: float, since: float) -> None:
        """Nothing to step: the held tokens go out, then wait for a call or ``wait_s`` (counted as idle)."""
        self._publish_held()
        self._wake.wait(wait_s)
        self._wake.clear()
        self.times.add("idle", time.perf_counter() - since)

    def step_once(self) -> list[tuple[Request, list[int]]]:
        """One step, overlapped: launch it, publish the previous step's tokens and serve what may run beside
        it while the device computes it, then finish it; its tokens are held for the next step's launch (or
        published now: ``hold_tokens``)."""
        running = self.engine.launch()
        self._while_device_runs()
        events = running.finish()
        self._held = events
        if not self.hold_tokens:
            self._publish_held()
        return events

    def _while_device_runs(self) -> None:
        """The previous step's tokens go out, then ``call_soon``'s calls and the service's ``while_stepping``
        run, while the device computes the step launched."""
        self._publish_held()
        if self.between_steps_only:
            return
        self._serve(self._soon)
        if self.while_stepping is not None:
            try:
                self.while_stepping(self.engine)
            except Exception:  # a hook's bug must not fail the step (every request would be aborted)
                self.log.exception("while_stepping_failed")

    def _publish_held(self) -> None:
        events, self._held = self._held, []
        out = []
        for req, tokens in events:
            done = req.finish_reason is not None
            if done:
                self.log.debug("step_done", req.rid, reason=req.finish_reason, output_tokens=len(req.output_ids))
            if tokens or done:
                logprobs = req.output_logprobs[len(req.output_logprobs) - len(tokens):]
                tops = req.output_top_logprobs[len(req.output_top_logprobs) - len(tokens):] \
                    if req.params.top_logprobs else []
                out.append(TokenEvent(req.rid, tokens, logprobs, req.finish_reason, req if done else None, tops))
        if out:
            self.publish_all(out)

    def _after_step(self) -> None:
        self.load = self.engine.load()
        if self.after_step is None:
            return
        try:
            self.after_step(self.engine)
        except Exception:  # a hook's bug must not stop the loop (every request would hang)
            self.log.exception("after_step_failed")

    def _drain_calls(self) -> int:
        if self._calls.empty() and self._soon.empty():
            return 0
        self._publish_held()  # a call (an abort, a release) sees the state the streams were told
        return self._serve(self._soon) + self._serve(self._calls)

    def _serve(self, calls: queue.Queue) -> int:
        """Run the calls queued in ``calls``, answering each future; how many ran. Before each of ``call``'s
        calls, every ``call_soon`` call queued by then runs: a call never overtakes one queued before it (an
        abort queued after its request's admission sees the request)."""
        done = 0
        while True:
            if calls is self._calls:
                done += self._serve(self._soon)
            try:
                fn, fut = calls.get_nowait()
            except queue.Empty:
                return done
            done += 1
            if fut.set_running_or_notify_cancel():
                try:
                    result, error = fn(self.engine), None
                except BaseException as e:  # handed to the caller
                    result, error = None, e
                self.load = self.engine.load()  # the caller may read it as soon as its answer is there
                if error is None:
                    fut.set_result(result)
                else:
                    fut.set_exception(error)

    def _fail_all(self, reason: str) -> None:
        for req in self.engine.live_requests():
            if self.before_fail is not None:
                self.before_fail(req.rid)
            self.engine.release(req, "error")
            self.log.event("failed", req.rid, logging.ERROR, reason=reason, output_tokens=len(req.output_ids))
            self.publish(TokenEvent(req.rid, [], [], "error", req))
        self.load = self.engine.load()
