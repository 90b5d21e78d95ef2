"""Token-level speculation counters, shaped as vLLM's spec-decode metrics so its dashboards work.

A draft is one request's proposal verified by one verify step. Its draft tokens are the ``steps``
positions verification could accept (a tree verifies more nodes, but accepts at most one path of
``steps``), its accepted tokens those verification accepted (the bonus token is not a draft token;
tokens cut by a stop inside an accepted run still count: they measure the draft). Position i
(0-based) counts the drafts whose accepted run reached it. Then, in PromQL,
``rate(accepted_tokens) / rate(draft_tokens)`` is the token-weighted acceptance rate and
``1 + rate(accepted_tokens) / rate(drafts)`` the mean accept length.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class SpecTokenCounts:
    steps: int  # draft positions per draft
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [steps] drafts accepted up to position i

    def __post_init__(self):
        self.accepted_per_pos = self.accepted_per_pos or [0] * self.steps

    def copy(self) -> SpecTokenCounts:
        """A snapshot (the engine loop publishes it; the engine keeps counting)."""
        return SpecTokenCounts(self.steps, self.drafts, self.draft_tokens, self.accepted_tokens,
                               list(self.accepted_per_pos))

    def record(self, verified: list[int], steps: int | None = None) -> None:
        """One verify step: per request, the nodes verification accepted, root included (>= 1); ``steps``:
        the step's draft positions (a shallower tree's; default ``self.steps``)."""
        m = len(verified)
        self.drafts += m
        self.draft_tokens += (steps or self.steps) * m
        self.accepted_tokens += sum(verified) - m
        for n, count in Counter(verified).items():  # a few distinct lengths, however large the batch
            for pos in range(n - 1):
                self.accepted_per_pos[pos] += count
