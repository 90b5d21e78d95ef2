"""One request's session between the router core and a client connection (gRPC or HTTP).

The core's walk (``RouterCore.stream``) runs in a task of its own and leaves its messages here (``put``); the
client's side takes whatever has arrived since it last wrote, merged into one message (``merge``): when the
client reads slower than the engines write, tokens are coalesced (one gRPC message or one SSE event carries
several) instead of queueing message by message. While the request streams from a decode instance's relay, the
relay's reader puts its tokens here itself (``RouterCore._relay_now``): a token wakes the client's side only,
not the walk's task as well. The walk's task is not the client's: a client that goes
away ends the request through ``RouterCore.abort`` (recorded "aborted"), and the walk's own clean-up (Redis
records, aborts on the services) is never cut short by the client's cancellation.
"""

from __future__ import annotations

import asyncio

import grpc

from proto.eyrie.v1 import eyrie_pb2 as pb


class Session:
    def __init__(self, core, request: pb.GenerateRequest):
        self.core, self.rid = core, request.request_id
        self._pending: list[pb.GenerateResponse] = []
        self._error: BaseException | None = None
        self._done = False
        self._wake = asyncio.Event()
        self.task = asyncio.get_running_loop().create_task(self._pump(request))

    def put(self, msg: pb.GenerateResponse) -> None:
        """A message of the walk's for the client (from the walk's task, or from a relay's reader)."""
        self._pending.append(msg)
        self._wake.set()

    async def _pump(self, request: pb.GenerateRequest) -> None:
        try:
            async for msg in self.core.stream(request, deliver=self.put):
                self.put(msg)
        except BaseException as e:  # noqa: BLE001 (handed to the client's side, which raises it)
            self._error = e
        finally:
            self._done = True
            self._wake.set()

    async def next(self) -> pb.GenerateResponse | None:
        """Everything that arrived since the last call, as one message (of one choice: the others' stay for the
        next calls); None at the end; the walk's error (RequestError, RouterError) once its messages are taken."""
        while not self._pending and not self._done:
            self._wake.clear()
            await self._wake.wait()
        if len(self._pending) == 1:
            return self._pending.pop()
        if self._pending:
            index = self._pending[0].index  # a request of several choices: one choice's messages at a time
            if all(m.index == index for m in self._pending):
                batch, self._pending = self._pending, []
            else:
                batch = [m for m in self._pending if m.index == index]
                self._pending = [m for m in self._pending if m.index != index]
            return merge(batch)
        if self._error is not None:
            raise self._error
        return None

    @property
    def finished(self) -> bool:
        return self._done and self._error is None and not self._pending

    def cancel(self, reason: str = "client went away") -> bool:
        """The client is gone: end the request now (recorded "aborted" with ``reason``); its walk cleans up in
        its own task. False when it had ended already."""
        if self._done:
            return False
        if not self.core.abort(self.rid, reason, grpc.StatusCode.CANCELLED):
            self.task.cancel()  # not yet accepted (the task has not run): it ends before anything is recorded
        return True

    async def close(self, reason: str = "client went away") -> None:
        """``cancel``, then wait for the walk's clean-up (shielded: the caller is usually being cancelled)."""
        if self.cancel(reason):
            await asyncio.shield(asyncio.wait([self.task]))


def merge(batch: list[pb.GenerateResponse]) -> pb.GenerateResponse:
    """Consecutive messages of one request's choice as one: tokens, logprobs, top logprobs and text concatenated;
    the last one's finish."""
    if len(batch) == 1:
        return batch[0]
    out = pb.GenerateResponse(request_id=batch[0].request_id, index=batch[0].index)
    for m in batch:
        out.token_ids.extend(m.token_ids)
        out.logprobs.extend(m.logprobs)
        out.top_logprobs.extend(m.top_logprobs)
    out.text = "".join(m.text for m in batch)
    if batch[-1].HasField("finish"):
        out.finish.CopyFrom(batch[-1].finish)
    return out
