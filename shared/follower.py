"""A rank other than 0 of a split engine: its model runner, and the book of rank 0's requests that it follows.

Under tensor parallelism rank 0 is an ``Engine`` (``shared/engine.py``): it alone checks requests, chooses
their seeds, schedules and picks each step's kind. Ranks 1 .. N-1 are ``Follower``s. Each loads its share of
the target and its KV pools (``ModelRunner``) and keeps a book of rank 0's requests and pages (a ``Scheduler``
that never schedules), and ``follow`` runs the calls rank 0 sends until rank 0 lets it go
(``shared/replay.py``). It has no policy, no request checks and no hand-off port: those are rank 0's.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from shared.config import EngineConfig
from shared.cuda_graphs import PhaseGraphs
from shared.model.drafts import DraftHead
from shared.model.llama import LlamaForCausalLM
from shared.model.tokenizer import Tokenizer
from shared.model_runner import ModelRunner
from shared.outputs import GenerationResult
from shared.parallel import TPGroup
from shared.replay import follow
from shared.request import Request
from shared.scheduler import Scheduler


class Follower:
    def __init__(self, model: str | Path | LlamaForCausalLM, draft: str | Path | DraftHead | None = None,
                 config: EngineConfig | None = None, tokenizer: Tokenizer | None = None, role: str = "both",
                 tp: TPGroup | None = None, channel=None):
        """As rank 0's ``Engine`` is built (the same model, draft, config and role), with ``tp`` this rank's group
        (not rank 0) and ``channel`` the end rank 0's calls arrive at (``ModelRunner``'s)."""
        self.runner = runner = ModelRunner(model, draft, config or EngineConfig(), role, tp, channel)
        if runner.rank == 0:
            raise ValueError("a follower is a rank other than 0 of a tensor-parallel group (rank 0 is an Engine)")
        self.scheduler = Scheduler.over(runner, tokenizer or Tokenizer.beside(model), role)

    def follow(self) -> list[Request]:
        """Run rank 0's calls until it lets this rank go (``Engine.release_followers``) or its channel ends;
        the requests they created here, in order. Its CUDA graphs are dropped then: the group ends after this,
        and NCCL's destroy hangs while a graph holding its collectives lives."""
        try:
            return follow(self.runner, self.scheduler)
        finally:
            self.runner.release_graphs()

    def result(self, req: Request) -> GenerationResult:  # ``req``'s result here (as rank 0's ``Engine.result``)
        return GenerationResult.of(req, self.scheduler.tokenizer, self.runner.speculator is not None)

    def is_idle_and_clean(self) -> bool:
        """True when no request is held and every cache is full again (the no-leak invariant)."""
        return not self.scheduler.has_work() and all(c.is_full() for c in self.scheduler.caches)

    def phase_graphs(self) -> list[PhaseGraphs]:
        return self.runner.phase_graphs()

    def on_device(self) -> contextlib.AbstractContextManager:
        return self.runner.on_device()

    # Read-only facts of the runner's and the book's (tests and benchmarks compare them with rank 0's).
    model = property(lambda self: self.runner.model)  # this rank's share of the target
    cache = property(lambda self: self.runner.cache)  # the target's KV cache (this rank's KV heads)
    speculator = property(lambda self: self.runner.speculator)
    device = property(lambda self: self.runner.device)
    graph_failures = property(lambda self: self.runner.graph_failures)
    decode_graphs = property(lambda self: self.runner.decode_graphs)
    prefix_cache = property(lambda self: self.scheduler.prefix_cache)
    requests = property(lambda self: self.scheduler.requests)
