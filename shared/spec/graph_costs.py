"""Step costs timed at start: each speculative shape's and the plain step's captured CUDA graphs, replayed on
padding rows at each captured batch size, seed the adaptive policy's ``MeasuredCost`` (its priors).

The policy then knows from its first step what every shape costs on this device at every batch size the graphs
cover, and only its acceptance is left to measure online; a batch past the largest graph runs eagerly and is
timed by its own steps, as every step is afterwards (the steps' time, the host's work included, replaces the
prior). The replays run on padding rows (request row 0, length 0: the sink page), as capture does, so no
request's state changes; their count is fixed, so under tensor parallelism every rank replays the same graphs
(whose collectives must meet) in the same order.
"""

from __future__ import annotations

import functools
import time

import torch

from shared.spec.policy import MeasuredCost, bucket
from shared.spec.worker import SpecWorker

REPLAYS = 3  # timed replays per shape and batch size, after one untimed


def time_step(step, replays: int = REPLAYS) -> float:
    """Mean seconds of ``step()`` over ``replays`` runs after one untimed, the device synchronized around."""
    step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(replays):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / replays


def seed_costs(worker: SpecWorker, cost: MeasuredCost, replays: int = REPLAYS) -> dict[tuple[str, int], float]:
    """Time every shape's step and the plain step at each captured batch size that is its own cost bucket (a
    power of two: the largest batch of that bucket), seed ``cost`` with them and return them ((kind, batch) ->
    seconds). Only kinds whose graphs were captured at that size are timed."""
    captured = set().union(*(p.captured_sizes for p in worker.phase_graphs()))
    timed = {}
    for bs in sorted(b for b in captured if bucket(b) == b):
        for kind, step in _padding_steps(worker, bs).items():
            timed[(kind, bs)] = seconds = time_step(step, replays)
            cost.seed(kind, bs, seconds)
    return timed


def _padding_steps(worker: SpecWorker, bs: int) -> dict:
    """Per kind captured at ``bs`` (each shape, ``plain``), one step of it on ``bs`` padding rows."""
    inp = worker.padding_inputs(bs)
    steps = {name: functools.partial(worker.padding_step, name, inp) for name, sh in worker.shapes.items()
             if bs in sh.graphs["draft"].captured_sizes}
    if "plain" in worker.graphs and bs in worker.graphs["plain"].captured_sizes:
        steps["plain"] = functools.partial(worker.plain_padding_step, inp)
    return steps
