"""Greedy speculative decoding is lossless over a pairwise covering array of configurations.

The full cross product (drafts {random, oracle} x kind {eagle, eagle3, mtp} x topk {1, 2, 4} x
steps {1, 3, 5} x num_draft_tokens {steps+1, 8, 16} x page size {1, 4, 16} x chunk {4, 64, none} x
batch {1, 5 mixed lengths}) has thousands of cases. Drafts and kind are crossed in full (6 strata:
bugs hide where drafts are accepted, so every configuration pair is also run with oracle drafts, for
every kind); within each stratum ``covering_array`` builds a deterministic PAIRWISE array over the
other six factors (14 cases): every feasible pair of their values occurs at least once (pairs no
valid configuration can hold, such as topk=1 with 8 draft tokens, are left out: SpecConfig refuses
them). In all PAIRWISE_CASES = 84 cases, covering every pair of all eight factors, and every triple
of (drafts or kind) with a pair of the others. Each case must give, token for token, the greedy
target-only output (references computed once per model and prompt set), the same logprobs to
float32 noise, and full pools after. Random drafts cover acceptance near zero (accept length < 1.1),
oracle drafts long accepted runs (accept length >= 1.15 in every case, 1.5-3 typical), asserted.
"""

from __future__ import annotations

import itertools

import pytest
from pydantic import ValidationError
from spec_helpers import GREEDY, PROMPTS, assert_same_greedy

from shared.config import SpecConfig

FACTORS: dict[str, tuple] = {
    "drafts": ("random", "oracle"),
    "kind": ("eagle", "eagle3", "mtp"),
    "topk": (1, 2, 4),
    "steps": (1, 3, 5),
    "ndt": ("steps+1", 8, 16),
    "page_size": (1, 4, 16),
    "chunk_size": (4, 64, None),
    "batch": (1, 5),
}
PAIRWISE_CASES = 84  # stated in the module docstring; test_covering_array checks it


def draft_tokens(case: dict) -> int:
    return case["steps"] + 1 if case["ndt"] == "steps+1" else case["ndt"]


def spec_valid(topk: int, steps: int, ndt) -> bool:
    try:
        SpecConfig(topk=topk, steps=steps, num_draft_tokens=draft_tokens({"steps": steps, "ndt": ndt}))
    except ValidationError:
        return False
    return True


def feasible(partial: dict) -> bool:
    """Whether some valid configuration extends ``partial`` (only topk, steps and ndt constrain)."""
    choices = [(partial[f],) if f in partial else FACTORS[f] for f in ("topk", "steps", "ndt")]
    return any(spec_valid(*c) for c in itertools.product(*choices))


def covering_array(factors: dict[str, tuple]) -> list[dict]:
    """Greedy pairwise construction (AETG-like), deterministic: seed each case with the first
    uncovered pair, then give every other factor the value covering most uncovered pairs with the
    values chosen so far, among those that keep the case feasible (ties: the value used least)."""
    names = list(factors)
    uncovered = {((a, x), (b, y)) for a, b in itertools.combinations(names, 2)
                 for x in factors[a] for y in factors[b] if feasible({a: x, b: y})}
    order = {p: i for i, p in enumerate(sorted(uncovered, key=repr))}
    cases: list[dict] = []
    uses = dict.fromkeys(((f, v) for f in names for v in factors[f]), 0)
    while uncovered:
        (a, x), (b, y) = min(uncovered, key=order.__getitem__)
        case = {a: x, b: y}
        for f in names:
            if f in case:
                continue
            best, best_gain = None, -1
            for v in factors[f]:
                if not feasible({**case, f: v}):
                    continue
                gain = sum(((g, case[g]), (f, v)) in uncovered or ((f, v), (g, case[g])) in uncovered
                           for g in case)
                if gain > best_gain or (gain == best_gain and uses[(f, v)] < uses[(f, best)]):
                    best, best_gain = v, gain
            case[f] = best
        case = {f: case[f] for f in names}
        uncovered -= {((a, case[a]), (b, case[b])) for a, b in itertools.combinations(names, 2)}
        for f in names:
            uses[(f, case[f])] += 1
        cases.append(case)
    return cases


# Drafts and kind are crossed in full; within each of those 6 strata, every pair of the other factors.
STRATA = ("drafts", "kind")
CASES = [{"drafts": d, "kind": k, **c} for d in FACTORS["drafts"] for k in FACTORS["kind"]
         for c in covering_array({f: v for f, v in FACTORS.items() if f not in STRATA})]


def case_id(case: dict) -> str:
    return "-".join(f"{v}" for v in case.values()).replace("steps+1", "s1")


def test_covering_array():
    """Every case is a valid configuration; for every draft set and kind, every feasible pair of the
    other factors is covered (so every pair of all factors is), and no infeasible one."""
    assert len(CASES) == PAIRWISE_CASES, f"{len(CASES)} cases; update PAIRWISE_CASES and the docstring"
    print(f"\nlossless matrix: {len(CASES)} cases ({len(CASES) // 6} pairwise per drafts x kind)")
    for case in CASES:
        assert spec_valid(case["topk"], case["steps"], case["ndt"]), case
    names = [f for f in FACTORS if f not in STRATA]
    for d, k in itertools.product(FACTORS["drafts"], FACTORS["kind"]):
        stratum = [c for c in CASES if c["drafts"] == d and c["kind"] == k]
        for a, b in itertools.combinations(names, 2):
            for x, y in itertools.product(FACTORS[a], FACTORS[b]):
                covered = any(c[a] == x and c[b] == y for c in stratum)
                assert covered == feasible({a: x, b: y}), (d, k, a, x, b, y)
    for a, b in itertools.combinations(FACTORS, 2):
        for x, y in itertools.product(FACTORS[a], FACTORS[b]):
            assert any(c[a] == x and c[b] == y for c in CASES) == feasible({a: x, b: y}), (a, x, b, y)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_greedy_lossless(case, random_models, oracle_models):
    models = random_models if case["drafts"] == "random" else oracle_models
    i = CASES.index(case)
    prompts = PROMPTS if case["batch"] == 5 else [PROMPTS[i % len(PROMPTS)]]
    want = models.reference(PROMPTS, GREEDY)
    want = want if case["batch"] == 5 else [want[i % len(PROMPTS)]]
    engine = models.engine(case["kind"], case["topk"], case["steps"], draft_tokens(case),
                           page_size=case["page_size"], chunk_size=case["chunk_size"])
    got = engine.generate(prompts, GREEDY)
    assert engine.is_idle_and_clean(), f"pages or rows leaked: {case}"
    assert_same_greedy(got, want, case_id(case))
    accept = sum(r.spec["accepted_drafts"] + r.spec["verify_steps"] for r in got) / sum(
        r.spec["verify_steps"] for r in got)
    print(f"{case_id(case)}: accept length {accept:.2f}")
    if case["drafts"] == "oracle":  # long accepted runs were really exercised
        assert accept >= 1.15, f"oracle accept length {accept:.2f} for {case}"
    else:
        assert accept < 1.1, f"random drafts accepted too often ({accept:.2f}): not the low end"
