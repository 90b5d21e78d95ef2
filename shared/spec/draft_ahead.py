"""Drafting ahead: the next decode step's draft, launched before this step's tokens reach the host.

The next step's draft needs only device tensors of this step's output, so a step launches it right
after its verify and extend (``DraftAhead.launch``), and the host does the step's bookkeeping while the
device drafts. The next step takes it (``DraftAhead.take``) when it runs these requests, or some of
them, from the states this step left them (``LaunchedDraft.rows_for``); otherwise it drafts anew (the
draft ahead wrote only scratch positions past the committed lengths, which nothing reads).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from shared.cuda_graphs import PhaseGraphs, pad_rows, tree_map
from shared.request import Request
from shared.sampling import to_device
from shared.spec.phases import DecodeInputs, StepOutput
from shared.spec.state import DraftState
from shared.spec.tree import DraftTree


@dataclass
class Drafted:
    """A decode step's draft, ready to verify: drafted by the step itself, or launched ahead by the one before."""

    inp: DecodeInputs  # [bs, ...] padded to the bucket, on the device
    tree: DraftTree  # [bs, ...]
    n: int  # the step's requests
    index: torch.Tensor | None = None  # [n] int64 the requests' rows of the batch, when not its first n
    earlier_s: float = 0.0  # host time the step before spent launching it (this step's draft time)

    def take(self, t: torch.Tensor) -> torch.Tensor:
        """The requests' rows of a [bs, ...] tensor of this batch, in the requests' order."""
        return t[:self.n] if self.index is None else t.index_select(0, self.index)


@dataclass
class LaunchedDraft:
    """The next step's draft, launched before this step's tokens reached the host. The next step uses
    it when it runs these requests (or some of them: the rows of those that ended become padding), in
    this order, from the states this step left them."""

    reqs: list[Request | None]  # None: a request retired since (``DraftAhead.forget``)
    states: list[DraftState | None]  # each request's draft state it was drafted from (set after commit)
    inp: DecodeInputs  # padded to the bucket, on the device
    tree: DraftTree
    seconds: float  # host time of launching it: the draft time of the step that uses it
    shape: str  # the tree shape it was drafted with (``SpecConfig.name``)

    def rows_for(self, reqs: list[Request]) -> list[int] | None:
        """Each request's row here when ``reqs`` are some of this draft's requests, in its order, each
        from the state it was drafted from (the others ended since); otherwise None."""
        where = {id(r): i for i, r in enumerate(self.reqs) if r is not None}
        rows = [where.get(id(r)) for r in reqs]
        if not reqs or None in rows or rows != sorted(rows):
            return None
        return rows if all(r.draft_state is self.states[i] for r, i in zip(reqs, rows)) else None


def as_padding(inp: DecodeInputs, rows: list[int]) -> DecodeInputs:
    """``inp`` with ``rows`` turned into padding rows (request row 0, length 0, zeros): whatever
    tree they carry, they then read and write only the sink slots."""
    index = to_device(torch.tensor(rows, dtype=torch.int64), inp.L.device)
    return tree_map(lambda t: t.index_fill(0, index, 0), inp)


class DraftAhead:
    """The one draft launched ahead (at most), and how launched drafts fared: ``used`` (``partial``: for
    only some of their requests) or ``dropped`` (``mismatched``: the next batch was not some of their
    requests, a join nobody foresaw)."""

    def __init__(self, enabled: bool, steps: int, room: int, dtype: torch.dtype):
        self.enabled = enabled
        self.steps = steps
        # Largest committed length a draft launched ahead may start from: past it, it would write
        # beyond some draft cache's max_context (drafting ahead is then skipped).
        self.room = room
        self.dtype = dtype  # the draft's recurrent hidden state, as the draft loop reads it
        self.pending: LaunchedDraft | None = None
        self.used = self.partial = self.dropped = self.mismatched = 0

    def counts(self) -> dict[str, int]:
        return {"used": self.used, "partial": self.partial, "dropped": self.dropped, "mismatched": self.mismatched}

    def caps(self, reqs: list[Request], next_grows: bool) -> list[int] | None:
        """Per request, the largest committed length after this step with which it still runs the
        next one: the longest accepted run, or one token short of max_new_tokens (reaching it ends
        the request). The next step's draft, launched ahead, writes at most the draft reach past it,
        which stays within the peak the scheduler budgeted for the request (prompt + max_new_tokens
        + headroom), so drafting ahead claims no page another request may need. None when drafting
        ahead is off, the batch is empty, the next one grows (a draft ahead would be wasted) or a
        draft cache's max_context would cut it."""
        if not self.enabled or not reqs or next_grows:
            return None
        caps = [min(r.draft_state.committed_len + self.steps + 1, r.prompt_len + r.params.max_new_tokens - 2)
                for r in reqs]
        return caps if max(caps) <= self.room else None

    def take(self, reqs: list[Request], shape: str) -> Drafted | None:
        """The draft launched ahead for ``reqs`` with tree shape ``shape`` (the rows of requests that ended
        since become padding), or None: then the step drafts anew (a step of another shape drops it)."""
        pending, self.pending = self.pending, None
        if pending is None:
            return None
        if pending.shape != shape:
            self.dropped += 1
            return None
        rows = pending.rows_for(reqs)
        if rows is None:
            self.dropped += 1
            self.mismatched += 1
            return None
        self.used += 1
        inp, index = pending.inp, None
        if len(rows) < len(pending.reqs):
            inp = as_padding(inp, sorted(set(range(len(pending.reqs))) - set(rows)))
            index = to_device(torch.tensor(rows, dtype=torch.int64), inp.L.device)  # no wait for the device
            self.partial += 1
        return Drafted(inp, pending.tree, len(reqs), index, pending.seconds)

    def launch(self, reqs: list[Request], inp: DecodeInputs, out: StepOutput, caps: list[int],
               draft: PhaseGraphs, shape: str) -> float:
        """Launch the next step's draft of tree shape ``shape`` (``draft``: its draft phase) from this
        step's device output (the requests' rows); returns the host time it took."""
        t0 = time.perf_counter()
        n = len(reqs)
        bs = draft.bucket(n) or n
        nxt = tree_map(lambda t: pad_rows(t, bs), self.next_inputs(inp, out, caps))
        tree = draft(nxt)
        seconds = time.perf_counter() - t0
        self.pending = LaunchedDraft(list(reqs), [None] * n, nxt, tree, seconds, shape)
        return seconds

    def next_inputs(self, inp: DecodeInputs, out: StepOutput, caps: list[int]) -> DecodeInputs:
        """On the device, the inputs the worker will build from the states its commit leaves (a
        request that does not finish commits its whole accepted run). Committed lengths are clamped
        to ``caps``, which only a request that finishes in this step can exceed: its row, never used,
        then stays within the pages reserved for it."""
        last = (out.accept_len - 1).unsqueeze(1)
        cap = to_device(torch.tensor(caps, dtype=torch.int64), inp.L.device)
        L = torch.minimum(inp.L + out.accept_len, cap)
        return DecodeInputs(target_rows=inp.target_rows, draft_rows=inp.draft_rows, L=L,
                            bonus=out.tokens.gather(1, last).squeeze(1), hidden=out.hidden.to(self.dtype),
                            topk_p=out.topk_p.float(), topk_ids=out.topk_ids, sampling=inp.sampling)

    def committed(self, reqs: list[Request]) -> None:
        """After the step's commit: the states the pending draft was drafted from (those of requests
        that ended are not used); dropped when every request ended (nothing will use it)."""
        if self.pending is None:
            return
        self.pending.states = [r.draft_state for r in reqs]
        if all(r.finish_reason is not None for r in reqs):
            self.drop()

    def forget(self, req: Request) -> None:
        """``req`` ended (``Scheduler.retire``): the draft launched ahead keeps no reference to it; its row,
        which no later step runs, is padding if the draft is used."""
        if self.pending is not None:
            self.pending.reqs = [None if r is req else r for r in self.pending.reqs]

    def drop(self) -> None:
        """Forget the draft launched ahead (no decode step is going to use it): it keeps no request
        alive; its device work is ordered before anything launched later."""
        if self.pending is not None:
            self.pending = None
            self.dropped += 1
