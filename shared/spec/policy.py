"""Speculation that never loses: per decode step, speculate or run a plain decode step.

``fixed`` always speculates (the configured tree). ``adaptive`` compares expected output tokens per
second: a speculative step commits ``E`` tokens per request (E = 1 + the expected accepted run, from
the running per-position acceptance) in ``cost.spec_s(b)``, a plain step one token in
``cost.decode_s(b)``; it speculates iff ``E * decode_s(b) > spec_s(b)``. At large batches the
verify costs more than it saves (the recorded grid: 49.8 ms per EAGLE-3 iteration against a 17.9 ms
decode step at batch 64 x 4096), and a head that stops being accepted costs every step it drafts.

Both choices are lossless: a plain step's token is the target's, and its features still extend the
draft (``Engine._run_plain_step``, under CUDA graphs as a plain engine's decode step is), so the next
speculative step resumes from a complete draft state.

Acceptance decays (``decay`` per verify step) so it follows the traffic; while not speculating the
policy speculates once every ``probe_every`` steps to keep it current, and each probe that leaves plain
steps faster, having measured speculation no cheaper than expected (a probe faster than the estimate says
the estimate is stale, e.g. a first step slowed by a one-time cost), doubles that interval (up to
``max_probe_every``): a probe
where speculation is far dearer (a head nobody accepts, a large batch) costs several plain steps, and
probing at a fixed rate would cost up to a tenth of the throughput there. Step costs come from a
``StepCost``: ``MeasuredCost`` times the engine's own steps (an average per batch-size bucket; a
bucket not yet timed is tried), or any object with the two methods (the tests inject one).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

POLICIES = ("fixed", "adaptive")


class StepCost(Protocol):
    def decode_s(self, batch: int) -> float | None: ...  # seconds of a plain decode step; None: unknown

    def spec_s(self, batch: int) -> float | None: ...  # seconds of a speculative step; None: unknown


def bucket(batch: int) -> int:
    """The power of two at or above ``batch`` (step costs grow slowly between them)."""
    return 1 << max(0, batch - 1).bit_length()


@dataclass
class MeasuredCost:
    """Average seconds per step kind and batch-size bucket, from the steps the engine ran: the plain mean
    of the first ``1 / weight`` steps (a first step slowed by a one-time cost weighs no more than the
    others), a running average after."""

    weight: float = 0.1  # of the newest step in the running average
    seconds: dict[tuple[str, int], float] = field(default_factory=dict)  # (kind, bucket) -> seconds
    counts: dict[tuple[str, int], int] = field(default_factory=dict)  # (kind, bucket) -> steps recorded

    def record(self, kind: str, batch: int, seconds: float) -> None:
        key = (kind, bucket(batch))
        n = self.counts[key] = self.counts.get(key, 0) + 1
        old = self.seconds.get(key, 0.0)
        self.seconds[key] = old + max(self.weight, 1 / n) * (seconds - old)

    def decode_s(self, batch: int) -> float | None:
        return self.seconds.get(("plain", bucket(batch)))

    def spec_s(self, batch: int) -> float | None:
        return self.seconds.get(("spec", bucket(batch)))


@dataclass
class Acceptance:
    """Decayed per-position acceptance: P(a draft's accepted run reaches position i)."""

    steps: int
    decay: float = 0.98
    drafts: float = 0.0
    reached: list[float] = field(default_factory=list)  # [steps] decayed drafts accepted up to position i
    observations: int = 0  # verify steps observed

    def __post_init__(self):
        self.reached = self.reached or [0.0] * self.steps

    def observe(self, verified: list[int]) -> None:
        """One verify step: per request, the nodes accepted, root included (>= 1)."""
        self.drafts *= self.decay
        self.reached = [r * self.decay for r in self.reached]
        self.observations += 1
        for n in verified:
            self.drafts += 1
            for pos in range(min(n - 1, self.steps)):
                self.reached[pos] += 1

    def observe_counts(self, drafts: int, reached: list[int]) -> None:
        """The same from counter increments (``SpecTokenCounts``): ``drafts`` verified, ``reached[i]`` of
        them accepted up to position i."""
        if drafts == 0:
            return
        self.drafts = self.drafts * self.decay + drafts
        self.reached = [r * self.decay + n for r, n in zip(self.reached, reached)]
        self.observations += 1

    def expected_tokens(self) -> float | None:
        """Tokens a speculative step commits per request (bonus included); None before any draft."""
        if self.drafts <= 0:
            return None
        return 1.0 + sum(self.reached) / self.drafts


@dataclass
class SpecPolicy:
    kind: str  # "fixed" or "adaptive"
    acceptance: Acceptance
    cost: StepCost
    probe_every: int = 16  # plain steps between two speculative probes of the acceptance ...
    max_probe_every: int = 128  # ... doubled after each probe that found plain steps still faster, up to this
    settled: float = 0.98  # a probe that lowers the speculative step's estimate below this share of it: unsettled
    probe_interval: int = 0  # plain steps before the next probe (0: probe_every)
    probe: tuple[int, int, float] | None = None  # (acceptance.observations, batch, spec_s) when the pending
    # probe was chosen; None: no probe pending
    plain_run: int = 0  # plain steps since the last speculative one
    choices: dict[str, int] = field(default_factory=lambda: {"spec": 0, "plain": 0})

    def __post_init__(self):
        if self.kind not in POLICIES:
            raise ValueError(f"spec policy must be one of {POLICIES}, got {self.kind!r}")

    def speculate(self, batch: int) -> bool:
        """Whether this step of ``batch`` requests should speculate; counted in ``choices``."""
        yes = self._decide(batch)
        self.choices["spec" if yes else "plain"] += 1
        self.plain_run = 0 if yes else self.plain_run + 1
        return yes

    def _decide(self, batch: int) -> bool:
        if self.kind == "fixed":
            return True
        tokens, spec_s, decode_s = self.acceptance.expected_tokens(), self.cost.spec_s(batch), \
            self.cost.decode_s(batch)
        if tokens is None or spec_s is None:
            return True  # nothing known yet: measure speculation first
        if decode_s is None:
            return False  # then a plain step, once, to know what it costs
        if tokens * decode_s > spec_s:
            self.probe_interval, self.probe = 0, None
            return True
        self._back_off_after_probe()
        if self.plain_run + 1 < (self.probe_interval or self.probe_every):
            return False
        self.probe = (self.acceptance.observations, batch, spec_s)  # keep the acceptance current
        return True

    def _back_off_after_probe(self) -> None:
        """Plain steps still win after the pending probe was observed: probe half as often, unless the probe
        ran enough faster than the estimate it was chosen with to lower it (the estimate is settling)."""
        if self.probe is None or self.acceptance.observations == self.probe[0]:
            return
        _, batch, expected = self.probe
        self.probe = None
        if self.cost.spec_s(batch) >= self.settled * expected:
            self.probe_interval = min(2 * (self.probe_interval or self.probe_every), self.max_probe_every)
