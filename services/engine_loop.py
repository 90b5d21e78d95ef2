"""Drives an Engine on its own thread for a service.

All engine state is touched on the loop thread only: gRPC handlers ask for work through
``call(fn)`` (run between steps, returns a Future) and read tokens from per-request queues. This
keeps the engine single-threaded, like the scheduler of nano-vllm, with no locks inside it.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from shared.engine import Engine
from shared.request import Request

log = logging.getLogger("eyrie.loop")


@dataclass
class TokenEvent:
    rid: str
    token_ids: list[int]
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    request: Request | None = None  # set on the final event (stats, lengths)


class EngineLoop:
    def __init__(self, engine: Engine, after_step: Callable[[Engine], None] | None = None):
        self.engine = engine
        self.after_step = after_step  # e.g. the prefill service starts hand-offs here
        self._calls: queue.Queue = queue.Queue()
        self._streams: dict[str, queue.Queue] = {}
        self._streams_lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="eyrie-engine", daemon=True)

    def start(self) -> EngineLoop:
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)

    def call(self, fn: Callable[[Engine], object]) -> Future:
        fut: Future = Future()
        self._calls.put((fn, fut))
        self._wake.set()
        return fut

    def subscribe(self, rid: str) -> queue.Queue:
        """Token events of ``rid`` (subscribe before the request can produce tokens)."""
        q: queue.Queue = queue.Queue()
        with self._streams_lock:
            self._streams[rid] = q
        return q

    def unsubscribe(self, rid: str) -> None:
        with self._streams_lock:
            self._streams.pop(rid, None)

    def publish(self, event: TokenEvent) -> None:
        with self._streams_lock:
            q = self._streams.get(event.rid)
        if q is not None:
            q.put(event)

    def _run(self) -> None:
        engine = self.engine
        while not self._stop.is_set():
            if self._drain_calls() and self.after_step is not None:
                self.after_step(engine)  # calls (releases, aborts, admissions) change what the gauges show
            if not engine.scheduler.has_work_to_step():
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            try:
                events = engine.step()
            except Exception as e:  # a bug: fail every request rather than hang them
                log.exception("engine step failed")
                self.error = e
                self._fail_all(f"engine error: {e}")
                continue
            for req, tokens in events:
                done = req.finish_reason is not None
                if tokens or done:
                    self.publish(TokenEvent(req.rid, tokens, req.output_logprobs[len(req.output_logprobs) - len(tokens):],
                                            req.finish_reason, req if done else None))
            if self.after_step is not None:
                self.after_step(engine)

    def _drain_calls(self) -> int:
        done = 0
        while True:
            try:
                fn, fut = self._calls.get_nowait()
            except queue.Empty:
                return done
            done += 1
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(self.engine))
                except BaseException as e:  # handed to the caller
                    fut.set_exception(e)

    def _fail_all(self, reason: str) -> None:
        for rid in list(self.engine.requests):
            req = self.engine.requests[rid]
            self.engine.abort(rid)
            req.finish_reason = "error"
            self.publish(TokenEvent(rid, [], [], "error", req))
