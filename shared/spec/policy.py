"""Speculation that never loses: per decode step, one of several speculative shapes, or a plain step.

``fixed`` always speculates with the configured shape. ``adaptive`` compares expected output tokens per
second: a speculative step of shape ``c`` commits ``E_c`` tokens per request (1 + the expected accepted
run, from ``c``'s running per-position acceptance) in ``cost.spec_s(b, c)``, a plain step one token in
``cost.decode_s(b)``; it runs the one with the most tokens per second (plain on a tie, and a shape only past
``margin`` over plain: near parity the estimates' errors and a switch's cost decide, and both favour plain).
At large batches the verify costs more than it saves (the recorded grid: 49.8 ms per EAGLE-3 iteration against a 17.9 ms
decode step at batch 64 x 4096), and between there and batch 1 a shallower chain often beats the wide
tree (recorded at 8B shape, batch 8: chain of 3 1305 tok/s, tree 1158).

Every choice is lossless: every shape resumes from the same draft state (the configured shape's
first-level width, which narrower shapes take the first columns of) and leaves the draft KV complete up
to the committed length; a plain step's token is the target's, and its features still extend the draft
(``ModelRunner._plain_step``; with arriving prefill chunks in the same target forward, ``ModelRunner.run``).

Acceptance is each shape's own (``Candidate.acceptance``): a tree's acceptance says little about a
chain's, but the drafts of a chain of depth d are the first d of a deeper chain's, so a chain's verify
steps also feed every shallower chain (``Candidate.chain``) exactly, and only the deepest chain needs probing.
Acceptance decays (``decay`` per verify step, faster for wide ones: ``Acceptance``) so it follows the traffic;
each shape not chosen is run once every ``probe_every`` steps to keep its acceptance current, and each probe
that leaves it still losing, having measured it no cheaper than expected (a probe faster than the estimate says
the estimate is stale, e.g. a first step slowed by a one-time cost), doubles that shape's interval (up to
``max_probe_every``): a probe of a shape that is far dearer (a head nobody accepts, a large batch) costs
several plain steps. Plain is probed the same way while a shape runs (its cost is learnt only from its own
steps: one learnt while a neighbour held the GPU would keep it out for good), and a probe that finds it cheaper
than expected probes it again soon. Step costs come from a ``StepCost``: ``MeasuredCost`` times the engine's
own steps (the median of the recent ones per shape and batch-size bucket; a bucket not yet timed is tried), or
any object with the two methods (the tests inject one).
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

POLICIES = ("fixed", "adaptive")


class StepCost(Protocol):
    def decode_s(self, batch: int) -> float | None: ...  # seconds of a plain decode step; None: unknown

    def spec_s(self, batch: int, shape: str) -> float | None: ...  # seconds of a step of that shape; None: unknown


def bucket(batch: int) -> int:
    """The power of two at or above ``batch`` (step costs grow slowly between them)."""
    return 1 << max(0, batch - 1).bit_length()


def nearest_bucket(batch: int) -> int:
    """The power of two nearest ``batch`` (the larger on a tie)."""
    hi = bucket(batch)
    return hi // 2 if hi // 2 and batch - hi // 2 < hi - batch else hi


@dataclass
class MeasuredCost:
    """Seconds per step kind (``plain`` or a shape's name) and batch-size bucket, from the steps the engine ran:
    the median of the last ``window`` steps of it there, so a burst of slow steps (a neighbour process on the
    GPU, arrivals' hand-offs landing, a one-time cost) is forgotten once ``window // 2 + 1`` ordinary steps
    follow, where a running average kept it for dozens (an H100 in pd1: a plain step at 128 rows learnt as
    51.5 ms against 7.7 ms timed at capture, and plain never chosen there again). Before a kind's first step at
    a bucket, its ``prior`` there when one was timed at start (``seed``: the captured CUDA graphs' replays on
    this device, ``shared/spec/graph_costs.py``), so the policy starts from every shape's cost at every captured
    batch size instead of trying each one; the steps' own time (the host's work included) replaces it."""

    window: int = 15  # steps of a kind at a bucket whose median is its cost (15: two shapes 1% apart under 4%
    # noise are not switched between more often than under the running average it replaced)
    seconds: dict[tuple[str, int], float] = field(default_factory=dict)  # (kind, bucket) -> seconds
    counts: dict[tuple[str, int], int] = field(default_factory=dict)  # (kind, bucket) -> steps recorded
    prior: dict[tuple[str, int], float] = field(default_factory=dict)  # (kind, bucket) -> seconds timed at start
    recent: dict[tuple[str, int], deque] = field(default_factory=dict)  # (kind, bucket) -> its last steps
    ratios: dict[str, dict[int, float]] = field(default_factory=dict)  # kind -> bucket -> seconds / prior

    def seed(self, kind: str, batch: int, seconds: float) -> None:
        """A step of ``kind`` at ``batch`` timed at start (its bucket's prior, until a step of it is recorded)."""
        self.prior[(kind, bucket(batch))] = seconds
        self._ratio(kind, bucket(batch))

    def record(self, kind: str, batch: int, seconds: float) -> None:
        """A step's own time, into the bucket nearest its batch (33 rows into 32's, not 64's: a few requests
        joining a batch of 32 must not make 64 rows look as cheap as 33)."""
        key = (kind, nearest_bucket(batch))
        self.counts[key] = self.counts.get(key, 0) + 1
        last = self.recent.setdefault(key, deque(maxlen=self.window))
        last.append(seconds)
        self.seconds[key] = statistics.median(last)
        self._ratio(*key)

    def _ratio(self, kind: str, b: int) -> None:
        """Keep ``ratios`` (``_host_factor``'s table) current for a bucket whose seconds or prior just moved."""
        if (kind, b) in self.seconds and (kind, b) in self.prior:
            self.ratios.setdefault(kind, {})[b] = self.seconds[(kind, b)] / self.prior[(kind, b)]

    def decode_s(self, batch: int) -> float | None:
        return self.spec_s(batch, "plain")

    def spec_s(self, batch: int, shape: str = "spec") -> float | None:
        """Its bucket's seconds; between two timed buckets, linear between them (33 rows cost about what 32 do,
        not what 64 do: a speculative step's verify grows faster with the batch than a plain step, so costing
        a batch just past a power of two at twice it turned the policy to plain steps whenever one arrived)."""
        hi = bucket(batch)
        s_hi, lo = self._at(shape, hi), hi // 2
        s_lo = self._at(shape, lo) if lo and batch < hi else None
        if s_hi is None or s_lo is None:
            return s_hi
        return s_lo + (batch - lo) / (hi - lo) * (s_hi - s_lo)

    def _at(self, kind: str, b: int) -> float | None:
        if (kind, b) in self.seconds:
            return self.seconds[(kind, b)]
        prior = self.prior.get((kind, b))
        return None if prior is None else prior * self._host_factor(kind, b)

    def _host_factor(self, kind: str, b: int) -> float:
        """What the steps of ``kind`` cost against their prior (a graph's replay: the device alone), at the
        timed bucket nearest ``b`` where both are known; 1 where none is. A prior is the device's time only,
        a step's own time holds the host's work too (an H100 at c128: plain 12.5 ms against 7.3 at capture,
        a chain of 3 25.2 against 15.1): a bucket never timed is estimated at its prior times that ratio, so a
        shape is not tried at a small batch on a prior that leaves the host out (the tail of a wave: chains
        and trees estimated 1.3x plain there, run at 0.8x)."""
        timed = self.ratios.get(kind)
        if not timed:
            return 1.0
        return timed[min(timed, key=lambda c: (abs(c.bit_length() - b.bit_length()), -c))]

    def table(self) -> dict[str, dict[str, float]]:
        """Per kind, its ms per step at each bucket, as the policy reads them (a log's summary)."""
        out: dict[str, dict[str, float]] = {}
        for kind, b in sorted(set(self.seconds) | set(self.prior)):
            out.setdefault(kind, {})[str(b)] = round(1e3 * self._at(kind, b), 3)
        return out


@dataclass
class Acceptance:
    """Decayed per-position acceptance: P(a draft's accepted run reaches position i).

    What was seen before a verify step weighs ``decay`` after it, or less: half as much per ``half_life``
    drafts the step verified, so a wide step (128 rows: 128 drafts) forgets as much as 128 steps of one row
    would, not as much as one. Per step alone, an estimate made of a few wide steps lagged the traffic for dozens
    of them (an H100 at c128: a chain of 3 expected to commit 1.8-2.0 tokens a row while its ten steps in a row
    committed 1.4-1.7). A few hundred drafts still hold a share's noise to a few per cent."""

    steps: int
    decay: float = 0.98  # per verify step ...
    half_life: float = 512.0  # ... and per drafts verified, whichever forgets more
    drafts: float = 0.0
    reached: list[float] = field(default_factory=list)  # [steps] decayed drafts accepted up to position i
    observations: int = 0  # verify steps observed

    def __post_init__(self):
        self.reached = self.reached or [0.0] * self.steps

    def observe(self, verified: list[int]) -> None:
        """One verify step: per request, the nodes accepted, root included (>= 1)."""
        counts = [0] * self.steps
        for n in verified:
            for pos in range(min(n - 1, self.steps)):
                counts[pos] += 1
        self.observe_counts(len(verified), counts)

    def observe_counts(self, drafts: int, reached: list[int]) -> None:
        """The same from counter increments (``SpecTokenCounts``): ``drafts`` verified, ``reached[i]`` of
        them accepted up to position i."""
        if drafts == 0:
            return
        kept = min(self.decay, 0.5 ** (drafts / self.half_life))
        self.drafts = self.drafts * kept + drafts
        self.reached = [r * kept + n for r, n in zip(self.reached, reached)]
        self.observations += 1

    def expected_tokens(self, cap: int | None = None) -> float | None:
        """Tokens a speculative step commits per request (bonus included); None before any draft. ``cap``: a
        request with that many tokens left commits at most that many: the positions past ``cap - 1`` count
        for nothing (the accepted run is cut at its last token)."""
        if self.drafts <= 0:
            return None
        reached = self.reached if cap is None else self.reached[:max(0, cap - 1)]
        return 1.0 + sum(reached) / self.drafts


@dataclass
class Candidate:
    """One speculative shape the policy may choose: its acceptance and its probes."""

    name: str  # the shape's name (``SpecConfig.name``): the cost key
    acceptance: Acceptance
    chain: bool = False  # a chain: its verify steps predict every shallower chain's acceptance exactly
    probe_interval: int = 0  # steps without it before the next probe (0: the policy's probe_every)
    probe: tuple[int, int, float] | None = None  # (acceptance.observations, batch, spec_s) when its pending
    # probe was chosen; None: no probe pending
    idle: int = 0  # steps since it last ran

    def covers(self, other: Candidate) -> bool:
        """Whether this shape's verify steps measure ``other``'s acceptance too (a shallower chain's)."""
        return self.chain and other.chain and other.acceptance.steps <= self.acceptance.steps

    @property
    def tokens(self) -> float | None:
        return self.acceptance.expected_tokens()

    def tokens_left(self, left: dict[int, int] | None) -> float | None:
        """Expected tokens a row of a step whose requests have ``left`` = {tokens left: rows} commits (None:
        uncapped, ``tokens``). A request near its ``max_new_tokens`` commits what is left of it, however far
        the draft is accepted: at a wave's tail a chain of 3 expected at 1.74 a row committed 1.3-1.4 (an
        H100 at c128, 35-45 rows), where plain's one token a row is whole."""
        if not left:
            return self.tokens
        total, rows = 0.0, 0
        for cap, n in left.items():
            t = self.acceptance.expected_tokens(cap)
            if t is None:
                return None
            total, rows = total + t * n, rows + n
        return total / rows


@dataclass
class SpecPolicy:
    kind: str  # "fixed" or "adaptive"
    candidates: list[Candidate]  # the configured shape first: fixed always runs it
    cost: StepCost
    probe_every: int = 16  # steps between two probes of a shape not chosen ...
    max_probe_every: int = 128  # ... doubled after each probe that found it still losing, up to this
    settled: float = 0.98  # a probe that lowers the shape's estimate below this share of it: unsettled
    stay: float = 0.03  # the kind that ran last keeps running while its rate is within this share of the best
    # A speculative shape is chosen over plain only when its expected rate beats plain's by this share: its
    # acceptance is an estimate that lags the traffic (an H100 at c128: 1.9-2.0 expected against 1.6-1.8
    # committed), and a switch to it costs a step (the first after it ran 10-30 ms over its own cost). Near
    # parity plain runs: what is given up is at most this share of a marginal gain.
    margin: float = 0.05
    # A switch costs its first step more than the kind's own (the draft catching up what plain steps left it
    # behind on, no draft launched ahead: an H100 at c128, a chain of 3's first step 31-44 ms against 21-23).
    # ``switch_s``: that extra per kind, measured at each switch (``ran``); a kind not running is chosen only when
    # its rate beats the incumbent's with the extra spread over ``switch_horizon`` of its steps.
    switch_horizon: int = 8
    switch_seen: dict[str, deque] = field(default_factory=dict)  # kind -> its last switches' extras (each at most
    # 4x the kind's own step: a one-time stall, a compile, is not a switch's price)
    choices: dict[str, int] = field(default_factory=lambda: {"spec": 0, "plain": 0})  # steps of each kind
    shapes: dict[str, int] = field(default_factory=dict)  # speculative steps by shape
    last: str | None = None  # the kind ("plain" or a shape) of the step that ran last
    again: str | None = None  # a kind switched to, to run once more so that its own time is measured
    incumbent: str | None = None  # the kind chosen as the best last time (probes aside)
    after_mixed: bool = False  # the last step ran prefill chunks: the next one is neither timed nor a probe
    # Plain steps are probed too while a shape runs: plain's cost is measured only when it runs, and a cost
    # learnt in a burst (a neighbour process on the GPU, a one-time stall) would otherwise keep it out for good.
    plain_idle: int = 0  # steps since the last plain step
    plain_probe_interval: int = 0  # as a Candidate's
    plain_probe: tuple[int, int, float] | None = None  # (plain steps run, batch, decode_s) when one was chosen
    pin: bool = True  # a pinned step runs the configured shape (False: tests of the law under switching, seeded)
    # Per shape, the largest batch its step runs as CUDA graphs (``SpecWorker.graphed_batches``); None: no graphs
    # (every kind eager, as on the CPU). A shape is not chosen past it: an eager speculative step at a large batch
    # costs several graph steps, and compiles kernels the first time (an H100 at 57-64 rows: 67-252 ms a step).
    graphed: dict[str, int] | None = None

    def __post_init__(self):
        if self.kind not in POLICIES:
            raise ValueError(f"spec policy must be one of {POLICIES}, got {self.kind!r}")
        if not self.candidates:
            raise ValueError("the spec policy needs at least one speculative shape")

    @classmethod
    def of(cls, kind: str, shapes: list, cost: StepCost) -> SpecPolicy:
        """A policy over ``shapes`` (``SpecConfig``s, the configured one first)."""
        return cls(kind, [Candidate(s.name, Acceptance(s.steps), chain=s.topk == 1) for s in shapes], cost)

    def choose(self, batch: int, pinned: bool = False, mixed: bool = False,
               left: list[int] | None = None) -> str | None:
        """The shape this step of ``batch`` requests runs, None for a plain step; counted in ``choices``.
        ``pinned``: the configured shape, whatever the policy (a seeded sampled request is in the batch).
        ``mixed``: the step also runs prefill chunks. The adaptive policy runs it plain: the decode rows then
        ride in the chunks' target forward, which reads the weights anyway (a few ms for 64 rows beside a
        512-token chunk), where a speculative step needs a verify forward of its own after the chunks' (an H100
        at c64: 50-55 ms against 31-36 for the one forward). What speculation adds there is ``b (E - 1)`` tokens
        for a whole speculative step's time, a lower rate than that step gives on its own (``b E``) in the time
        it would have taken: the time is better spent on the next decode step. Nothing is explored or probed
        there either (its time is no kind's: ``ran``). ``left``: each request's tokens left to its
        ``max_new_tokens`` (None: unbounded): a shape's expected tokens are capped by them (``tokens_left``)."""
        if pinned and self.pin:
            name = self.candidates[0].name
        elif self.again is not None and self.kind == "adaptive" and not mixed and self._runs_at(self.again, batch):
            name, self.again = (None if self.again == "plain" else self.again), None
        else:
            name = self._decide(batch, mixed, self._left(left))
        self.choices["plain" if name is None else "spec"] += 1
        if name is not None:
            self.shapes[name] = self.shapes.get(name, 0) + 1
        for c in self.candidates:
            c.idle = 0 if c.name == name else c.idle + 1
        self.plain_idle = 0 if name is None else self.plain_idle + 1
        return name

    def ran(self, kind: str, batch: int, seconds: float, timed: bool = True, mixed: bool = False) -> None:
        """A step of ``kind`` ("plain" or a shape) took ``seconds`` on the host. Its time is the kind's own
        only after a step of the same kind: the first step after a switch also waits for what the step before
        left on the device (a draft launched ahead, a plain step's draft extend) and starts without a draft
        of its own launched ahead, so it is not recorded, and the kind runs once more to be timed.
        ``timed=False``: a step whose engine step ran a prefill first, whose wait for its sampled token took
        over what the last step left on the device (H100, c32: the tree's steps timed 11.5 ms that way
        against 25.6 ms per step in a run of them), so the time is not the kind's either; and a plain step that
        ran the arriving requests' prefill chunks in its own target forward (``ModelRunner.run``: one
        forward, as a plain engine's step, not a prefill forward before it), whose time is theirs too.
        ``mixed``: such a step (its kind is the chunks' choice, not a switch: ``choose``): no kind is run
        again for it, and the next step, which may wait for its tail (the draft's extend over the chunks),
        is not recorded either."""
        self.after_mixed = mixed
        if mixed:
            self.last = None
            return
        if kind == self.last and timed and isinstance(self.cost, MeasuredCost):
            self.cost.record(kind, batch, seconds)
        elif kind != self.last and self.last is not None:
            self.again = kind
            # (measured costs only: they are what the policy learns from; injected ones may count their calls)
            own = self._cost(batch, kind) if timed and isinstance(self.cost, MeasuredCost) else None
            if own is not None:
                seen = self.switch_seen.setdefault(kind, deque(maxlen=5))
                seen.append(min(max(0.0, seconds - own), 4 * own))
        self.last = kind

    @property
    def switch_s(self) -> dict[str, float]:
        """Each kind's switch price: the median of its last switches' extras (``switch_seen``)."""
        return {k: statistics.median(seen) for k, seen in self.switch_seen.items()}

    def observe(self, shape: str, drafts: int, reached: list[int]) -> None:
        """A verify step of ``shape``: ``drafts`` verified, ``reached[i]`` of them accepted up to position i
        (counter increments, ``SpecTokenCounts``); every shape it covers learns from it too."""
        ran = self._candidate(shape)
        for c in self.candidates:
            if c is ran or ran.covers(c):
                c.acceptance.observe_counts(drafts, reached[:c.acceptance.steps])

    def summary(self) -> dict:
        """What the policy has learnt: each kind's step costs (ms per bucket), each shape's expected tokens per
        request and steps run (a log's record of its choices)."""
        costs = self.cost.table() if isinstance(self.cost, MeasuredCost) else {}
        return {"kind": self.kind, "costs_ms": costs, "steps": self.steps_by_kind(),
                "tokens": {c.name: None if c.tokens is None else round(c.tokens, 3) for c in self.candidates}}

    def steps_by_kind(self) -> dict[str, int]:
        """Decode steps run so far per shape (every candidate's, 0 for one never run) and ``plain``."""
        return {**{c.name: self.shapes.get(c.name, 0) for c in self.candidates}, "plain": self.choices["plain"]}

    def _candidate(self, shape: str) -> Candidate:
        return next(c for c in self.candidates if c.name == shape)

    def _cost(self, batch: int, kind: str) -> float | None:
        """Seconds of a step of ``kind`` at ``batch``: its bucket's, or where that was never timed, the nearest
        smaller bucket's scaled up linearly with the batch (an overestimate where steps are memory-bound, so
        a kind is not preferred on a guess: it is measured when a probe or the incumbent runs it); None when
        no bucket of it is known."""
        def at(b: int) -> float | None:
            return self.cost.decode_s(b) if kind == "plain" else self.cost.spec_s(b, kind)

        s, b = at(batch), bucket(batch) // 2
        while s is None and b >= 1:
            known = at(b)
            s = None if known is None else known * batch / b
            b //= 2
        return s

    def _runs_at(self, kind: str, batch: int) -> bool:
        """Whether ``kind`` may run a step of ``batch`` requests: its graphs cover it (plain always may)."""
        return kind == "plain" or self.graphed is None or batch <= self.graphed.get(kind, 0)

    def _left(self, left: list[int] | None) -> dict[int, int] | None:
        """{tokens left: rows} of a step's requests, where any is within the deepest shape's reach (a request
        further from its end commits what any shape accepts: counted at the reach); None where none is."""
        if not left or self.kind == "fixed":
            return None
        reach = 1 + max(c.acceptance.steps for c in self.candidates)
        if min(left) >= reach:
            return None
        counts: dict[int, int] = {}
        for n in left:
            k = max(1, min(n, reach))
            counts[k] = counts.get(k, 0) + 1
        return counts

    def _decide(self, batch: int, mixed: bool = False, left: dict[int, int] | None = None) -> str | None:
        first = self.candidates[0]
        if self.kind == "fixed":
            return first.name
        if mixed:
            return None  # the decode rows ride in the chunks' forward (``choose``)
        cands = [c for c in self.candidates if self._runs_at(c.name, batch)]
        spec_s = {c.name: self._cost(batch, c.name) for c in cands}
        decode_s = self._cost(batch, "plain")
        unknown = [c for c in cands if c.tokens is None or spec_s[c.name] is None]
        if unknown or decode_s is None:  # what is not known yet is measured first, at a step that times it
            return unknown[0].name if unknown else None  # else a plain step, once, to know what it costs
        rates = {None: 1 / decode_s} | {c.name: (1 - self.margin) * c.tokens_left(left) / spec_s[c.name]
                                        for c in cands}
        if self.incumbent is not None and self.switch_seen:  # a kind not running pays its switch, spread over
            own, price = {None: decode_s} | spec_s, self.switch_s  # switch_horizon of its steps
            for k in rates:
                extra = price.get(k or "plain", 0.0)
                if (k or "plain") != self.incumbent and extra:
                    rates[k] /= 1 + extra / (self.switch_horizon * own[k])
        best = max(rates, key=rates.get)  # plain on a tie (first)
        # A switch costs a step (a draft launched ahead is dropped): the kind chosen last time (not a probe)
        # keeps running unless another is clearly faster.
        if self.incumbent is not None:
            current = None if self.incumbent == "plain" else self.incumbent
            if current in rates and rates[current] >= (1 - self.stay) * rates[best]:
                best = current
        self.incumbent = best or "plain"
        for c in cands:
            if c.name == best:
                c.probe_interval, c.probe = 0, None
            else:
                self._back_off_after_probe(c)
        if best is None:
            self.plain_probe_interval, self.plain_probe = 0, None
        else:
            self._back_off_after_plain_probe()
        # No probe right after a mixed step: that step is not timed and its kind not run again (``ran``), so a
        # probe there would buy an acceptance sample for a whole switch (an H100 at c128: 33-44 ms, 2-3 plain
        # steps); the next decode step probes instead.
        probe = None if self.after_mixed else self._probe(cands, batch, best, spec_s)
        if probe is None and best is not None and not self.after_mixed and self._probe_plain(batch, decode_s):
            return None
        return probe or best

    def _probe_plain(self, batch: int, decode_s: float) -> bool:
        """Whether this step is a probe of plain in place of the incumbent shape's (plain is due, and its cost is
        learnt from the steps: ``MeasuredCost``). A probe runs plain twice: its first step after a switch is not
        timed (``ran``)."""
        if (not isinstance(self.cost, MeasuredCost) or self.plain_probe is not None
                or self.plain_idle + 1 < (self.plain_probe_interval or self.probe_every)):
            return False
        self.plain_probe = (self.choices["plain"], batch, decode_s)
        return True

    def _back_off_after_plain_probe(self) -> None:
        """Plain still loses after its probe was timed (two plain steps since): probe it half as often, or, when
        the probe lowered its estimate (the GPU freed up: its cost is moving), as often as at first."""
        if self.plain_probe is None or self.choices["plain"] < self.plain_probe[0] + 2:
            return
        _, batch, expected = self.plain_probe
        self.plain_probe = None
        if self._cost(batch, "plain") >= self.settled * expected:
            self.plain_probe_interval = self._doubled(self.plain_probe_interval)
        else:
            self.plain_probe_interval = 0

    def _probe(self, cands: list[Candidate], batch: int, best: str | None, spec_s: dict[str, float]) -> str | None:
        """A shape not chosen whose acceptance is due for a probe (the longest idle), if any, among ``cands``
        (those that may run at ``batch``); a shape another one's steps keep measuring (a shallower chain) is never
        probed for it."""
        due = [c for c in cands if c.name != best and c.idle + 1 >= (c.probe_interval or self.probe_every)
               and not any(o is not c and o.covers(c) for o in self.candidates)]
        if not due:
            return None
        c = max(due, key=lambda c: c.idle)
        c.probe = (c.acceptance.observations, batch, spec_s[c.name])
        return c.name

    def _back_off_after_probe(self, c: Candidate) -> None:
        """``c`` still loses after its pending probe was observed: probe it half as often, unless the probe
        ran enough faster than the estimate it was chosen with to lower it (the estimate is settling)."""
        if c.probe is None or c.acceptance.observations == c.probe[0]:
            return
        _, batch, expected = c.probe
        c.probe = None
        if self._cost(batch, c.name) >= self.settled * expected:
            c.probe_interval = self._doubled(c.probe_interval)

    def _doubled(self, interval: int) -> int:
        """A probe interval after a probe that found its kind still losing (0: ``probe_every``)."""
        return min(2 * (interval or self.probe_every), self.max_probe_every)
