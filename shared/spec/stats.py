"""Speculative statistics: per request (``SpecStats`` in ``Request.stats``), per verify step
(``SpecBatchStats``) and per engine (``SpecRecorder``, which a decode step calls once, after commit).

Accept length is committed tokens per verify: the accepted drafts plus the bonus token, cut where EOS,
a stop token or max_new_tokens ended a request inside the accepted run (the discarded rest is not
counted). Accept rate is the drafts verification accepted (discarded ones included: it measures the
draft, not where the request ended) over the ``steps`` drafts each verify could accept. A step's draft
time runs to the end of tree drafting, its verify time from there to the end of the extend that
follows; a request's share of each is the step's time over the step's batch size. A draft launched
ahead is timed where it is launched and counted as the draft time of the step that uses it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from shared.spec.token_counts import SpecTokenCounts

if TYPE_CHECKING:
    from shared.request import Request

BATCH_LOG = 4096  # verify steps ``SpecRecorder.batches`` keeps (a serving engine runs forever)


@dataclass
class SpecStats:
    """Speculative statistics (a request's, or an engine's summed over requests).

    Without a cut at a stop, accept length = (accepted_drafts + verify_steps) / verify_steps.
    """

    verify_steps: int = 0
    accepted_drafts: int = 0  # draft tokens verification accepted (bonus tokens not counted)
    proposed_drafts: int = 0  # draft tokens on the verified path's depth budget (steps per verify)
    committed_tokens: int = 0  # tokens the verifies committed to the output (bonus included)
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0

    @property
    def accept_length(self) -> float:
        """Committed tokens per verify."""
        return self.committed_tokens / self.verify_steps if self.verify_steps else 0.0

    @property
    def accept_rate(self) -> float:
        return self.accepted_drafts / self.proposed_drafts if self.proposed_drafts else 0.0

    def add(self, other: SpecStats) -> None:
        """Sum ``other`` into these statistics (a verify step into a request's, or into the engine's)."""
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def as_dict(self) -> dict:
        return {"verify_steps": self.verify_steps, "accepted_drafts": self.accepted_drafts,
                "committed_tokens": self.committed_tokens,
                "accept_length": round(self.accept_length, 4), "accept_rate": round(self.accept_rate, 4),
                "draft_time_s": round(self.draft_time_s, 6), "verify_time_s": round(self.verify_time_s, 6)}


@dataclass
class SpecBatchStats:
    """One verify step of the engine: the requests it verified together and what each committed."""

    step: int  # the engine's verify-step counter (0, 1, ...), kept across generate calls
    request_ids: list[str]
    committed: list[int]  # per request: tokens this verify committed (bonus included, cut at a stop)
    verified: list[int]  # per request: accepted drafts + bonus as verification found them (before a cut)
    drafts_per_request: int  # spec steps: drafts each request could have accepted
    draft_time_s: float
    verify_time_s: float

    @property
    def batch_size(self) -> int:
        return len(self.request_ids)

    def totals(self) -> SpecStats:
        """This step as ``SpecStats`` summed over its requests (the definitions live there)."""
        n = self.batch_size
        return SpecStats(verify_steps=n, accepted_drafts=sum(self.verified) - n,
                         proposed_drafts=self.drafts_per_request * n, committed_tokens=sum(self.committed),
                         draft_time_s=self.draft_time_s, verify_time_s=self.verify_time_s)

    @property
    def accept_length(self) -> float:
        """Committed tokens per verify, averaged over the batch's requests."""
        return self.totals().accept_length

    @property
    def accept_rate(self) -> float:
        """Drafts verification accepted over the drafts the batch's requests could accept."""
        return self.totals().accept_rate

    def as_dict(self) -> dict:
        return {"step": self.step, "batch_size": self.batch_size, "request_ids": list(self.request_ids),
                "committed": list(self.committed), "verified": list(self.verified),
                "accept_length": round(self.accept_length, 4), "accept_rate": round(self.accept_rate, 4),
                "draft_time_s": round(self.draft_time_s, 6), "verify_time_s": round(self.verify_time_s, 6)}


def summarize_batches(batches: list[SpecBatchStats]) -> dict:
    """Totals over verify steps (for example those of one prompt batch): the same definitions."""
    total = SpecStats()
    for b in batches:
        total.add(b.totals())
    steps = total.verify_steps  # request-verifies
    return {"verify_batches": len(batches), "verify_steps": steps,
            "mean_batch_size": round(steps / len(batches), 4) if batches else 0.0,
            "accepted_drafts": total.accepted_drafts, "committed_tokens": total.committed_tokens,
            "accept_length": round(total.accept_length, 4), "accept_rate": round(total.accept_rate, 4),
            "draft_time_s": round(total.draft_time_s, 6), "verify_time_s": round(total.verify_time_s, 6)}


class SpecRecorder:
    """The engine's speculative statistics: its totals, the latest verify steps, and each request's."""

    def __init__(self, steps: int):
        self.steps = steps  # drafts each verify could accept
        self.totals = SpecStats()  # the whole engine's, batch after batch
        self.batches: deque[SpecBatchStats] = deque(maxlen=BATCH_LOG)  # the latest verify steps
        self.num_batches = 0  # verify steps run so far (``batches_since`` takes a mark of it)
        self.tokens = SpecTokenCounts(steps)  # drafts, draft / accepted tokens (the /metrics counters)
        self.by_shape: dict[str, SpecTokenCounts] = {}  # the same per tree shape (``track_shapes``)
        self.catch_up = {"extends": 0, "positions": 0}  # the draft's catch-ups over plain steps' positions

    def caught_up(self, positions: int) -> None:
        """The draft ran over ``positions`` that plain steps had left it behind on, in one extend."""
        self.catch_up["extends"] += 1
        self.catch_up["positions"] += positions

    def track_shapes(self, steps: dict[str, int]) -> None:
        """Count drafts and acceptance per shape too, for the shapes named (name -> its steps)."""
        self.by_shape = {name: SpecTokenCounts(n) for name, n in steps.items()}

    def keep_batches(self, limit: int | None) -> None:
        """Keep the latest ``limit`` verify steps' statistics (None: all, for a bounded run)."""
        self.batches = deque(self.batches, maxlen=limit)

    def batches_since(self, mark: int) -> list[SpecBatchStats]:
        """The kept verify steps numbered ``mark`` and later (``mark`` = ``num_batches`` read earlier)."""
        return [b for b in self.batches if b.step >= mark]

    def record(self, events: list[tuple[Request, list[int]]], verified: list[int], draft_s: float,
               verify_s: float, steps: int | None = None, shape: str | None = None) -> None:
        """One verify step, after its commit: ``events`` are (request, tokens it committed), ``verified``
        the accepted drafts + bonus of each as verification found them (before a stop cut them); ``steps``:
        the drafts each could accept (the step's tree depth; default the configured ``self.steps``); ``shape``:
        the step's tree shape, counted in ``by_shape`` when tracked."""
        steps = steps or self.steps
        self.tokens.record(verified, steps)
        if shape in self.by_shape:
            self.by_shape[shape].record(verified, steps)
        n = len(events)
        committed = [len(taken) for _, taken in events]  # a stop inside the run: only up to it
        share_d, share_v = (draft_s / n, verify_s / n) if n else (0.0, 0.0)
        for (req, _), accepted, took in zip(events, verified, committed):
            # ``SpecStats.add`` of this verify, field by field (a dataclass and an add per request cost ~8 us
            # each, 1 ms a step at 128 rows)
            st = req.stats
            st.verify_steps += 1
            st.accepted_drafts += accepted - 1
            st.proposed_drafts += steps
            st.committed_tokens += took
            st.draft_time_s += share_d
            st.verify_time_s += share_v
        batch = SpecBatchStats(step=self.num_batches, request_ids=[r.rid for r, _ in events],
                               committed=committed, verified=verified,
                               drafts_per_request=steps, draft_time_s=draft_s, verify_time_s=verify_s)
        self.totals.add(batch.totals())
        if events:  # an empty step verifies nothing: no batch to report
            self.batches.append(batch)
            self.num_batches += 1
