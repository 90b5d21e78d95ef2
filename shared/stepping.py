"""A step as a generator: it yields once its device work is queued and the host would wait for it.

The engine loop (``services/engine_loop.py``) owns the overlap: it runs the next step up to that yield
(``Engine.launch``), publishes the previous step's tokens and serves the calls that may run beside a step
in flight, then resumes the step (``InFlight.finish``), which waits for the device and commits. Nothing
inside a step calls back into a service.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator
from dataclasses import dataclass

from shared.request import Request

Events = list[tuple[Request, list[int]]]  # per request a step touched, the tokens it committed
Stepping = Generator[None, None, Events]  # a step's run, yielding at its host wait


def drive(running: Stepping) -> Events:
    """Run a step's generator to its end (no overlap: nothing runs at its yield); what it returns."""
    try:
        while True:
            next(running)
    except StopIteration as done:
        return done.value


class InFlight:
    """A step whose device work is queued (``Engine.launch``): ``finish`` waits for it and commits."""

    __slots__ = ("on_device", "running", "events")

    def __init__(self, on_device: Callable[[], contextlib.AbstractContextManager], running: Stepping | None,
                 events: Events | None = None):
        self.on_device, self.running, self.events = on_device, running, events  # on_device: the engine's GPU

    def finish(self) -> Events:
        """Wait for the step's device work, commit its tokens and retire the requests it ended."""
        if self.running is not None:
            with self.on_device():
                self.events = drive(self.running)
            self.running = None
        return self.events


@dataclass(frozen=True)
class StepFacts:
    """What a step ran, for the engine loop's accounting of its time (``services/engine_loop.py``): ``kind``
    ``decode`` (decode rows only), ``mixed`` (prefill chunks beside decode rows) or ``prefill`` (chunks only),
    ``idle`` for an empty plan; ``shape`` the speculative shape its decode rows ran, ``plain``, or None without
    decode rows; how many decode rows and prefill tokens."""

    kind: str
    shape: str | None
    rows: int
    prefill_tokens: int

    @classmethod
    def of(cls, plan, shape: str | None) -> StepFacts:  # ``plan``: a ``shared.scheduler.StepPlan``
        rows, tokens = len(plan.decode), sum(ch.end - ch.start for ch in plan.prefill)
        kind = ("mixed" if tokens else "decode") if rows else ("prefill" if tokens else "idle")
        return cls(kind, (shape or "plain") if rows else None, rows, tokens)
