"""Tensor-parallel services: the service process is rank 0, ranks 1 .. N-1 follow it.

Rank 0 serves: its gRPC servers, its engine loop and every decision are the service's. Ranks 1 .. N-1 are
processes it starts (``start_engine``), each a ``Follower`` on its own GPU (``shared/follower.py``, built as
rank 0's engine is) following rank 0's engine (``shared/replay.py``): rank 0's model runner sends each call
that touches the device (a step's run with rank 0's plan and shape, the capture of the CUDA graphs, a
hand-off's gathers and scatters) and each change to its scheduler's tables made between steps (an arrival with
the seed rank 0 chose, a reservation, an activation, a release, a flush of the prefix cache) down a pipe to
each follower before running it; the followers run the same calls, and the collectives inside meet. Rank 0
alone checks requests, schedules and picks each step's kind; what a call reads (load, prefilled, page ids,
schema) is rank 0's alone.

The engine loop runs rank 0's calls between steps only under tensor parallelism (``EngineLoop``): a call made
while the device computes a step would change rank 0's book before the step's commit, the followers' after it.

Followers die with rank 0: the end of the pipe (rank 0 closed it or exited) ends one, and one whose parent is
gone (rank 0 killed while it waited in a collective) exits by itself. A follower whose call fails exits: the
group is then broken, rank 0's later calls fail (the engine loop fails their requests) but its releases, which
free its own pages.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time

from shared.engine import Engine
from shared.follower import Follower
from shared.model.config import ModelConfig
from shared.parallel import TPGroup, check_split, free_address, init_group, leave_group, start_ranks


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
        leader.engine = Engine(settings.model, settings.draft, config, role=role, tp=tp, channel=leader)
    except BaseException:
        leader.close()
        raise
    return leader


class Leader:
    """Rank 0's engine as its service sees it (the engine's API), and the channel its model runner sends its
    calls to the followers through (``send``)."""

    def __init__(self, engine: Engine | None, pipes: list, ranks: list):
        self.engine = engine
        self._pipes = pipes  # one writing end per follower
        self.ranks = ranks  # the followers' processes
        self.broken: str | None = None  # why the followers can no longer be reached

    def __getattr__(self, name: str):
        return getattr(self.engine, name)

    def group_failure(self) -> str | None:
        """Why the group can no longer step together (a follower exited, or could not be reached), or None."""
        dead = [f"rank {r} (pid {p.pid}, exit {p.exitcode})" for r, p in enumerate(self.ranks, 1) if not p.is_alive()]
        if dead and self.broken is None:  # (a pipe's end may outlive its reader: checked, not waited for)
            self.broken = f"follower {', '.join(dead)} exited"
        return self.broken

    def send(self, message: tuple) -> None:
        """Rank 0's call ``message`` to every follower (``ModelRunner.send``); a ``RuntimeError`` when the group
        is broken."""
        if self.group_failure() is not None:
            raise RuntimeError(f"the tensor-parallel group is broken: {self.broken}")
        try:
            for pipe in self._pipes:
                pipe.send(message)
        except OSError as e:  # a follower died: every later collective would fail or hang
            self.broken = f"a follower is gone ({e})"
            raise RuntimeError(f"the tensor-parallel group is broken: {self.broken}") from e

    def close(self, timeout_s: float = 30.0) -> None:
        """End the followers (their pipes close: each returns from ``follow`` and leaves the group) and this
        rank's part of the group, as they leave theirs (NCCL's destroy waits for every rank's)."""
        for pipe in self._pipes:
            pipe.close()
        deadline = time.monotonic() + timeout_s
        if self.engine is not None:
            self.engine.release_graphs()  # NCCL's destroy hangs while its captured collectives live
        leave_group(timeout_s)
        for p in self.ranks:
            p.join(max(0.1, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(5)


class PipeEnd:
    """A follower's end of rank 0's calls (``ModelRunner.receive``): None once rank 0 closed it or exited."""

    def __init__(self, pipe):
        self.pipe = pipe

    def receive(self) -> tuple | None:
        try:
            return self.pipe.recv()
        except EOFError:  # rank 0 is done
            return None


def follow(tp: TPGroup, role: str, settings, pipes: list) -> None:
    """A follower (rank ``tp.rank`` > 0): built as rank 0's engine is, running the calls rank 0 sends, until
    the pipe ends."""
    _exit_with_parent()
    channel = PipeEnd(pipes[tp.rank - 1])
    Follower(settings.model, settings.draft, settings.engine_config(), role=role, tp=tp, channel=channel).follow()


def _exit_with_parent(poll_s: float = 0.5) -> None:
    """Exit this process when its parent (rank 0) is gone, whatever this one is waiting for."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(1)

    threading.Thread(target=watch, name="eyrie-tp-parent", daemon=True).start()
