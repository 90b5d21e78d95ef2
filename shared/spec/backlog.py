"""Plain steps that leave the draft behind, and the one extend that catches it up.

Under the adaptive policy a plain decode step used to run the draft over the position it wrote, so that the next
speculative step could draft from it: at 64-128 rows that extend (the draft's layer and LM head read for one token
a row) and its launch made the plain step dearer than a draftless engine's, and the policy, comparing its shapes
against that dearer plain step, kept speculating where plain decoding would have served more (issue 31: 0.74-0.86x
a draftless stack at c64-c128 on an H100).

Now a plain step keeps the target's features of the position it wrote (``DraftBacklog``, one row of ``limit``
positions per request slot) and runs no draft. The draft runs over a request's backlog in one extend when a
speculative step is about to draft from it, or when a backlog is full (then every request of the step that is
behind catches up, so the requests' backlogs fill and empty together and the draft's weights are read once per
``limit`` steps, not once per step): ``SpecWorker.catch_up``. The extend runs the same positions with the same
tokens and features as the per-step extends did, so it leaves the draft KV and state those left, float rounding
aside; the target verifies whatever the draft proposes, so the output is exactly as lossless as before.

A request's backlog is the positions ``[draft_state.committed_len, kv_len)``: the draft state is where the draft
last stopped. Only decode positions wait here; a prompt's chunks always extend the draft (its KV goes to the prefix
cache and over the hand-off with the target's).
"""

from __future__ import annotations

import torch

from shared.request import Request


def behind(req: Request) -> int:
    """Positions ``req``'s target K/V holds that its draft has not run over yet."""
    return req.kv_len - req.draft_state.committed_len


class DraftBacklog:
    def __init__(self, rows: int, limit: int):
        self.rows, self.limit = rows, limit  # request slots (the target cache's rows, 1..rows), positions each
        self.features: torch.Tensor | None = None  # [rows + 1, limit, W], made at the first plain step (its width)

    def full(self, reqs: list[Request]) -> bool:
        """Whether a running request of ``reqs`` has no room left for another position."""
        return any(r.finish_reason is None and behind(r) >= self.limit for r in reqs)

    def put(self, reqs: list[Request], features: torch.Tensor) -> None:
        """Each request of ``reqs`` wrote its last position (``kv_len - 1``), whose target features are
        ``features[i]``: the newest of the positions it is behind on."""
        if self.features is None:
            self.features = torch.zeros(self.rows + 1, self.limit, features.shape[-1], dtype=features.dtype,
                                        device=features.device)
        index = torch.tensor([[r.handles[0].row for r in reqs], [behind(r) - 1 for r in reqs]])
        rows, slots = index.to(features.device, non_blocking=True)
        self.features[rows, slots] = features[:len(reqs)]

    def take(self, reqs: list[Request]) -> torch.Tensor:
        """The features of every position ``reqs`` are behind on, request after request, in position order."""
        counts = [behind(r) for r in reqs]
        rows = [r.handles[0].row for r, n in zip(reqs, counts) for _ in range(n)]
        slots = [i for n in counts for i in range(n)]
        index = torch.tensor([rows, slots]).to(self.features.device, non_blocking=True)
        return self.features[index[0], index[1]]
