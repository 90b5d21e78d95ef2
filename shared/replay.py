"""Tensor parallelism's replay: rank 0 decides, ranks 1 .. N-1 follow it.

Rank 0's engine alone decides: it checks requests, chooses the seeds of those that gave none, schedules, and
its policy picks each step's kind. Its model runner sends each call that touches the device to the followers
before running it (``ModelRunner.send``): a step's run, with rank 0's plan named by request ids and chunk
bounds (host ints) and its shape; the capture of the CUDA graphs; the hand-off's gathers and scatters of K/V
pages. A follower (``follow``, run by ``shared.follower.Follower``) runs the same runner method on its share
of the weights and KV heads, and the collectives inside (a forward's all-reduces, a gather's) meet.

A follower holds the book of rank 0's requests and pages, a scheduler of its own that never schedules: a
step's pages are reserved inside the step (the speculative worker reserves and shrinks them) and a step's
commit (stop strings, grammars) decides how many tokens each request keeps, so every rank must hold the same
requests to run the same step. Rank 0's scheduler is wrapped (``Leading``): each change to its tables made
between steps (an arrival, a reservation, an activation, a release, a flush of the prefix cache) is sent with
rank 0's arguments, its chosen seed included; a step's admissions and commit are the follower's replay of rank
0's plan (``Scheduler.replay``), checked against rank 0's free page counts.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING

from shared.request import Request
from shared.sampling import SamplingParams, request_seed
from shared.scheduler import Scheduler, StepPlan
from shared.spec.state import DraftState
from shared.stepping import drive

if TYPE_CHECKING:
    from shared.memory.kv_cache import KVCache
    from shared.model_runner import ModelRunner


def seeded(params: SamplingParams) -> SamplingParams:
    """``params`` with a seed (its own, or one chosen here, on rank 0): every rank's draws are then alike."""
    return params if params.seed is not None else params.model_copy(update={"seed": request_seed(params)})


def described(plan: StepPlan, caches: list[KVCache]) -> tuple:
    """What a follower needs of rank 0's ``plan``: its decode rows' and chunks' request ids, the chunks' bounds,
    and each cache's free pages once it was scheduled (the follower's must be the same)."""
    return ([r.rid for r in plan.decode], [(c.req.rid, c.start, c.end) for c in plan.prefill],
            [c.num_free_pages for c in caches])


class Leading:
    """Rank 0's scheduler under tensor parallelism: the scheduler's API, each change to its tables made between
    steps also sent to the followers (``send(name, *args)``), with rank 0's arguments."""

    def __init__(self, scheduler: Scheduler, send: Callable[..., None]):
        self._scheduler, self._send = scheduler, send

    def __getattr__(self, name: str):
        return getattr(self._scheduler, name)

    def submit(self, rid: str, prompt_ids: list[int], params: SamplingParams, output_ids=(),
               output_logprobs=()) -> Request:
        params = seeded(params)
        req = self._scheduler.submit(rid, prompt_ids, params, output_ids, output_logprobs)  # a refusal: here alone
        return self._sent(req, "submit", rid, list(prompt_ids), params, list(output_ids), list(output_logprobs))

    def admit_handoff(self, rid: str, prompt_ids: list[int], output_ids: list[int], output_logprobs: list[float],
                      params: SamplingParams, committed_len: int, cached: bool = False) -> Request | None:
        params = params and seeded(params)
        req = self._scheduler.admit_handoff(rid, prompt_ids, output_ids, output_logprobs, params, committed_len,
                                            cached)
        if req is None:  # no room now: nothing changed
            return None
        return self._sent(req, "admit_handoff", rid, list(prompt_ids), list(output_ids), list(output_logprobs),
                          params, committed_len, cached)

    def _sent(self, req: Request, *call) -> Request:
        """``req``, just created here, once ``call`` reached the followers; ended again (its pages back) when
        the group is broken, whose ``RuntimeError`` the caller gets."""
        try:
            self._send(*call)
        except RuntimeError:
            self._scheduler.retire(req, "error")
            raise
        return req

    def activate(self, req: Request, committed_len: int, state: DraftState | None, output_ids=(),
                 output_logprobs=()) -> None:
        self._send("activate", req.rid, committed_len, None if state is None else state.to_bytes(), list(output_ids),
                   list(output_logprobs))
        self._scheduler.activate(req, committed_len, state, output_ids, output_logprobs)

    def retire(self, req: Request, reason: str | None = None) -> None:
        with contextlib.suppress(RuntimeError):  # the group is broken: rank 0's own pages are freed all the same
            self._send("retire", req.rid, reason)
        self._scheduler.retire(req, reason)

    def flush_prefix_cache(self) -> int:
        self._send("flush_prefix_cache")
        return self._scheduler.flush_prefix_cache()


def follow(runner: ModelRunner, book: Scheduler) -> list[Request]:
    """A follower: run the calls rank 0 sends (``runner.receive``) until rank 0 lets it go (``done``) or its
    channel ends; the requests rank 0's calls created here, in order."""
    made = []
    with runner.on_device():  # the thread's current CUDA device: this rank's GPU (kernels, events, graphs)
        while (message := runner.receive()) is not None and message[0] != "done":
            name, *args = message
            if name in _BOOK:
                made.append(_BOOK[name](runner, book, *args))
            else:
                _CALLS[name](runner, book, *args)
    return made


def _run(runner: ModelRunner, book: Scheduler, plan: tuple, shape: str | None) -> None:
    """Rank 0's step: its plan applied to this rank's book, run, and committed."""
    decode, chunks, free = plan
    replayed = book.replay(decode, chunks)
    mine = [c.num_free_pages for c in runner.caches]
    if mine != free:
        raise RuntimeError(f"tensor-parallel rank {runner.rank}: the step plan differs from rank 0's (free pages "
                           f"{mine} != {free}); the ranks' books diverged")
    book.commit(replayed, drive(runner.run(replayed, shape, book.joins_next)))


def _activate(runner: ModelRunner, book: Scheduler, rid: str, committed_len: int, blob: bytes | None,
              output_ids: list[int], output_logprobs: list[float]) -> None:
    state = None if blob is None else DraftState.from_bytes(blob, runner.device)
    book.activate(book.requests[rid], committed_len, state, output_ids, output_logprobs)


def _admit_handoff(runner: ModelRunner, book: Scheduler, rid: str, *args) -> Request:
    req = book.admit_handoff(rid, *args)
    if req is None:
        raise RuntimeError(f"tensor-parallel rank {runner.rank}: rank 0 reserved pages for {rid!r}, this rank "
                           f"has no room; the ranks' books diverged")
    return req


_BOOK = {  # the calls that create a request
    "submit": lambda runner, book, *args: book.submit(*args),
    "admit_handoff": _admit_handoff,
}
_CALLS = {
    "run": _run,
    "activate": _activate,
    "retire": lambda runner, book, rid, reason: book.retire(book.requests[rid], reason),
    "flush_prefix_cache": lambda runner, book: book.flush_prefix_cache(),
    "capture_graphs": lambda runner, book, timed: runner.capture_graphs(timed=timed),
    "gather_pages": lambda runner, book, pages: runner.gather_pages(runner.caches[0], pages),
    "gather_pages_into": lambda runner, book, first, pages: runner.gather_pages_into(None, first, runner.caches[0],
                                                                                     pages),
    "scatter_pages": lambda runner, book, pages: runner.scatter_pages(None, None, runner.caches[0], pages),
    "share_pages": lambda runner, book, index, pages: runner.share_pages(runner.caches[index], pages),
}
