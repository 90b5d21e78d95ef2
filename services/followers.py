"""Tensor-parallel services: the service process is rank 0, ranks 1 .. N-1 follow it.

Rank 0 serves: its gRPC servers, its engine loop and every decision are the service's. Ranks 1 .. N-1 are
processes it starts (``start_engine``), each building the same engine on its own GPU, that replay rank 0's engine
calls in the same order. The narrowest point to replay is the engine loop's calls: every call that changes an
engine (a step, an arrival, a reservation, an activation, a hand-off's source and increments, a release, the
capture of the CUDA graphs, a flush of the prefix cache) goes through ``Leader``, which sends its name down a
pipe to each follower before running it; the collectives inside (a step's all-reduces, an arrival's broadcast of
rank 0's arguments, a hand-off's gather or scatter) then meet. What a call reads (load, prefilled, page ids,
schema) is rank 0's alone. Followers get no arguments they would ignore: the engine broadcasts rank 0's where it
needs them. A request is named by its serial number (requests are created by the same calls in the same order on
every rank). A call that names a request the engine no longer holds is a no-op on every rank (``release`` and
``activate_handoff`` return False), so rank 0 runs it alone.

The engine loop runs these calls between steps only under tensor parallelism (``EngineLoop``): a call made
while the device computes a step would reach the followers after theirs.

Followers die with rank 0: the end of the pipe (rank 0 closed it or exited) ends one, and one whose parent is
gone (rank 0 killed while it waited in a collective) exits by itself. A follower whose call fails (other than
rank 0's refusal of a request, which rank 0 raises too) exits: the group is then broken, rank 0's later calls
fail (the engine loop fails their requests) but its releases, which free its own pages.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import threading
import time
from dataclasses import dataclass

import torch.distributed as dist

from shared.engine import Engine
from shared.errors import RequestError
from shared.model.config import ModelConfig
from shared.parallel import TPGroup, check_split, free_address, init_group, start_ranks
from shared.request import Request

# The engine calls that change an engine, replayed on every rank in rank 0's order.
REPLAYED = frozenset({"step", "add_request", "reserve_handoff", "activate_handoff", "page_source",
                      "handoff_increment", "release", "abort", "capture_graphs", "flush_prefix_cache"})


@dataclass(frozen=True)
class RequestRef:
    serial: int  # the request's number in creation order, the same on every rank


def start_engine(role: str, settings) -> Engine | Leader:
    """The service's engine: with ``tensor_parallel`` N > 1, rank 0's behind a ``Leader``, ranks 1 .. N-1
    started as followers (a ``ValueError`` naming a split the target cannot take, before anything starts)."""
    config = settings.engine_config()
    n = config.tensor_parallel
    if n == 1:
        return Engine(settings.model, settings.draft, config, role=role)
    check_split(ModelConfig.from_dir(settings.model), n)
    address, ctx = free_address(), multiprocessing.get_context("spawn")
    pipes = [ctx.Pipe(duplex=False) for _ in range(1, n)]  # (follower's end, rank 0's end)
    ranks = start_ranks(range(1, n), n, address, config.device, follow, (role, settings, [r for r, _ in pipes]))
    for reader, _ in pipes:
        reader.close()  # the followers hold their ends: theirs alone, so that rank 0's exit ends the pipes
    leader = Leader(None, [w for _, w in pipes], ranks)
    try:
        tp = init_group(n, 0, address, config.device)
        leader.engine = Engine(settings.model, settings.draft, config, role=role, tp=tp)
    except BaseException:
        leader.close()
        raise
    return leader


class Serials:
    """The requests an engine holds, by serial number: their creation order, the same on every rank."""

    def __init__(self):
        self.held: dict[int, Request] = {}
        self._next = 0

    def add(self, result) -> None:
        """Number ``result`` when a call created a request."""
        if isinstance(result, Request):
            self.held[self._next] = result
            self._next += 1

    def serial_of(self, req: Request) -> int | None:
        return next((s for s, r in self.held.items() if r is req), None)

    def prune(self, engine: Engine) -> None:
        """Forget the requests ``engine`` no longer holds (ended, or replaced under their id)."""
        self.held = {s: r for s, r in self.held.items() if engine.holds(r)}


class Leader:
    """Rank 0's engine as its service sees it: the engine's API, each call of ``REPLAYED`` sent to the
    followers before it runs here."""

    def __init__(self, engine: Engine | None, pipes: list, ranks: list):
        self.engine = engine
        self._pipes = pipes  # one writing end per follower
        self.ranks = ranks  # the followers' processes
        self._serials = Serials()
        self.broken: str | None = None  # why the followers can no longer be reached

    def __getattr__(self, name: str):
        if name in REPLAYED:
            return functools.partial(self._replay, name)
        return getattr(self.engine, name)

    def _replay(self, name: str, *args, **kwargs):
        refs = [self._ref(a) for a in args]
        krefs = {k: self._ref(v) for k, v in kwargs.items()}
        if any(r is _GONE for r in (*refs, *krefs.values())):  # a no-op everywhere: rank 0's alone
            return getattr(self.engine, name)(*args, **kwargs)
        try:
            self._send((name, refs, krefs))
        except RuntimeError:  # the group is broken: nothing but rank 0's own clean-up can run now
            if name not in ("release", "abort"):
                raise
        result = getattr(self.engine, name)(*args, **kwargs)
        self._serials.add(result)
        self._serials.prune(self.engine)
        return result

    def launch(self):
        """A step in flight (``Engine.launch``): the followers run the whole step, rank 0 launches it here
        (its loop finishes it)."""
        self._send(("step", [], {}))
        return self.engine.launch()

    def _ref(self, value):
        """What a follower needs of an argument: a request's serial, a plain scalar; None for the rest (the
        engine broadcasts rank 0's where it uses them)."""
        if isinstance(value, Request):
            serial = self._serials.serial_of(value)
            return _GONE if serial is None or not self.engine.holds(value) else RequestRef(serial)
        return value if value is None or isinstance(value, (str, int, float, bool)) else None

    def group_failure(self) -> str | None:
        """Why the group can no longer step together (a follower exited, or could not be reached), or None."""
        dead = [f"rank {r} (pid {p.pid}, exit {p.exitcode})" for r, p in enumerate(self.ranks, 1) if not p.is_alive()]
        if dead and self.broken is None:  # (a pipe's end may outlive its reader: checked, not waited for)
            self.broken = f"follower {', '.join(dead)} exited"
        return self.broken

    def _send(self, message: tuple) -> None:
        if self.group_failure() is not None:
            raise RuntimeError(f"the tensor-parallel group is broken: {self.broken}")
        try:
            for pipe in self._pipes:
                pipe.send(message)
        except OSError as e:  # a follower died: every later collective would fail or hang
            self.broken = f"a follower is gone ({e})"
            raise RuntimeError(f"the tensor-parallel group is broken: {self.broken}") from e

    def close(self, timeout_s: float = 30.0) -> None:
        """End the followers (their pipes close: each returns from ``follow``) and this rank's group."""
        for pipe in self._pipes:
            pipe.close()
        deadline = time.monotonic() + timeout_s
        for p in self.ranks:
            p.join(max(0.1, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(5)
        if dist.is_initialized():
            dist.destroy_process_group()


_GONE = object()  # an argument naming a request the engine no longer holds


def follow(tp: TPGroup, role: str, settings, pipes: list) -> None:
    """A follower (rank ``tp.rank`` > 0): the same engine as rank 0's, running the calls rank 0 sends, until
    the pipe ends."""
    _exit_with_parent()
    pipe = pipes[tp.rank - 1]
    engine = Engine(settings.model, settings.draft, settings.engine_config(), role=role, tp=tp)
    serials = Serials()
    while True:
        try:
            name, args, kwargs = pipe.recv()
        except EOFError:  # rank 0 is done
            return
        args = [serials.held[a.serial] if isinstance(a, RequestRef) else a for a in args]
        kwargs = {k: serials.held[v.serial] if isinstance(v, RequestRef) else v for k, v in kwargs.items()}
        try:
            serials.add(getattr(engine, name)(*args, **kwargs))
        except RequestError:  # rank 0's refusal, broadcast: rank 0 raised it too
            continue
        serials.prune(engine)


def _exit_with_parent(poll_s: float = 0.5) -> None:
    """Exit this process when its parent (rank 0) is gone, whatever this one is waiting for."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(1)

    threading.Thread(target=watch, name="eyrie-tp-parent", daemon=True).start()
