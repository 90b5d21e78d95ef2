"""Back-pressure: the router's bounded queue of requests waiting for room on a decode instance.

When every live decode instance says "no room now" (RESOURCE_EXHAUSTED), a new request does not fail: it
waits here, at most ``max_queued`` of them per router, for up to ``queue_timeout_s``, and is placed as soon as
room frees (a request of this router ends: at once; one of another router: at the instances' next heartbeat).
Past the bound, or after the wait, it is refused before any token reached the client: RESOURCE_EXHAUSTED
(HTTP 503) with a Retry-After. A request whose stream has started (a failover) waits without the bound: load
never breaks a started stream before its time is up.
"""

from __future__ import annotations

import asyncio
import time

import grpc

RETRY_AFTER_S = 1.0


class Admission:
    def __init__(self, max_queued: int, timeout_s: float, poll_s: float, router_error, telemetry=None):
        self.max_queued, self.timeout_s, self.poll_s = max_queued, timeout_s, poll_s
        self.router_error = router_error  # RouterError (the module that defines it imports this one)
        self.telemetry = telemetry
        self.queued = 0  # requests waiting now
        self.room = asyncio.Event()  # set whenever a request of this router ends

    def freed(self) -> None:
        self.room.set()

    async def wait_for_room(self, active, full: set[str], last_error, started: bool) -> None:
        """Wait for room on a decode instance (``full``: those that said no, cleared to be tried again);
        RouterError RESOURCE_EXHAUSTED when the queue is full or the wait is over."""
        if active.queued_since is None:
            if not started and self.queued >= self.max_queued:
                self._count()
                raise self.router_error(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                        f"every decode instance is full and {self.queued} requests already wait "
                                        f"for room here (max_queued {self.max_queued}); try again shortly "
                                        f"({_why(last_error)})", retry_after_s=RETRY_AFTER_S)
            active.queued_since = time.monotonic()
            self.queued += 1
        waited = time.monotonic() - active.queued_since
        if waited > self.timeout_s:
            self._count()
            raise self.router_error(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                    f"no decode instance had room within {self.timeout_s:g}s "
                                    f"(queue_timeout_s); try again shortly ({_why(last_error)})",
                                    retry_after_s=RETRY_AFTER_S)
        await wait_any(active.cancelled, self.room, min(self.poll_s, self.timeout_s - waited + 0.01))
        full.clear()

    def leave(self, active) -> None:
        if active.queued_since is not None:
            active.queued_since = None
            self.queued -= 1

    def _count(self) -> None:
        if self.telemetry is not None:
            self.telemetry.errors_total.labels("queue_full").inc()


def _why(last_error) -> str:
    return last_error.message if last_error is not None else "no room now"


async def wait_any(cancelled: asyncio.Event, room: asyncio.Event, timeout_s: float) -> None:
    """Until ``cancelled`` or ``room`` is set (``room`` cleared first: only a new end counts), or ``timeout_s``."""
    room.clear()
    waits = [asyncio.ensure_future(cancelled.wait()), asyncio.ensure_future(room.wait())]
    try:
        await asyncio.wait(waits, timeout=max(0.0, timeout_s), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()
