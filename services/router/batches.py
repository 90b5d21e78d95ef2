"""The router's Redis calls from its event loop, a batch per hop to the I/O pool (issue 29).

Many requests' walks ask Redis for something at once: a record written (created, a transition), the registry read
for a placement. Each call was a hop to the I/O pool (Redis blocks) and a round trip of its own. A ``Batches``
sends what its callers ask for together: what is asked while one batch is on its way waits and goes in the next,
so under load a batch carries many calls in one hop and one round trip, and alone a call goes at once. One batch
is in flight at a time, in the order asked: a request's writes, each awaited before the next, land in order, and
every call of a batch was asked for before the batch began (a registry read shared by several placements sees
every change made before any of them asked).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Executor


class Batches:
    """``await batches(item)``: ``run`` (blocking, on ``pool``) given a batch of items, returning a result per item;
    an exception instance as a result is raised to its caller. A caller that goes away (its task cancelled) leaves
    its item in the batch: a write asked for is made."""

    def __init__(self, run: Callable[[list], list], pool: Executor):
        self._run, self._pool = run, pool
        self._asked: list[tuple[object, asyncio.Future]] = []
        self._task: asyncio.Task | None = None  # the one sending batches, while there are any

    async def __call__(self, item):
        return await self.ask(item)

    def ask(self, item) -> asyncio.Future:
        """``item`` in the next batch (on the running loop); its result to come. Whatever is asked later goes in
        the same batch or a later one."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._asked.append((item, fut))
        if self._task is None:
            self._task = loop.create_task(self._send(loop))
        return fut

    async def _send(self, loop: asyncio.AbstractEventLoop) -> None:
        batch: list[tuple[object, asyncio.Future]] = []
        try:
            while self._asked:
                batch, self._asked = self._asked, []
                try:
                    results = await loop.run_in_executor(self._pool, self._run, [item for item, _ in batch])
                except Exception as e:  # the batch as a whole failed: each caller gets the error
                    results = [e] * len(batch)
                for (_, fut), result in zip(batch, results):
                    if fut.done():  # its caller went away
                        continue
                    if isinstance(result, BaseException):
                        fut.set_exception(result)
                    else:
                        fut.set_result(result)
                batch = []
        finally:
            self._task = None
            for _, fut in batch + self._asked:  # the loop is closing (this task cancelled): nobody is left hanging
                fut.cancel()
            self._asked = []
