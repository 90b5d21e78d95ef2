"""Greedy speculative decoding is lossless over the FULL cross product of configurations.

Factors (issue 3, "Lossless matrix"): drafts {random, oracle} x draft kind {eagle, eagle3, mtp} x
topk {1, 2, 4} x steps {1, 3, 5} x num_draft_tokens {steps + 1, 8, 16 where valid} x page size
{1, 4, 16} x chunk size {4, 64, none} x batch {1, 5 of mixed lengths}. A chain (topk = 1) needs
exactly steps + 1 nodes and a tree holds at most 1 + topk + (steps - 1) * topk^2, so 16 of the 27
(topk, steps, num_draft_tokens) triples are valid, and the product has 2 * 3 * 16 * 3 * 3 * 2 = 1728
cases, every one of them run.

To stay fast on a 2-core CI machine (about 3 minutes), each test runs one engine configuration
(drafts, kind, tree shape, page size, chunk size: 864 tests) on both batch sizes in turn: first the
five prompts of mixed lengths (1 .. 30 tokens, 66 in all, so chunks of 4 and of 64 both cut the
batch, and prefill chunks share steps with other requests' decode steps), then, once the engine is
idle again, a single prompt (with chunk 64, a 67-token prompt that the chunk cuts; otherwise one of
the five, in rotation). Models are loaded once per session, and the greedy target-only outputs are
computed once per (model, prompt set, page size, chunk size); those references are also checked to
agree with each other (target-only decoding does not depend on pages or chunks).

Each case must give, token for token, the target-only output, the same logprobs to float32 noise,
the same finish reasons, full pools after each batch, and as many verifies in the statistics as
decode steps committed tokens. Both ends of acceptance are asserted per case, over both batches:
random drafts are (almost) never accepted (accept length < 1.2; 1.00-1.07 measured), while the
oracle drafts are accepted often (accept length > 1.5; 1.78-3.9 measured, the most a steps = 1
chain can reach being 2), and where the tree is deep enough (a chain of steps >= 3, or >= 8 nodes)
some verify commits 3 or more tokens, so long accepted runs are compacted.

The matrix runs the fixed policy (every decode step verifies, so the accounting above holds); a slice of it
(every 25th case) runs again under the default, adaptive policy, asserting the same output and pools.

The oracle pair is ``make_oracle_model`` with alpha = 0.05 (the target's next token is dominated by
its layer 0, which the drafts copy; attention and the other layers still move its logits by a few
percent, far above the 1e-4 logprob tolerance, so a K/V mistake is seen) plus a small random read of
the target features in every draft (``add_feature_path``), so drafts depend on the features too.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from pydantic import ValidationError
from spec_helpers import KINDS, Models, add_feature_path, assert_same_greedy, load_models

from shared.config import SpecConfig
from shared.engine import Engine, GenerationResult
from shared.sampling import SamplingParams

DRAFTS = ("random", "oracle")
TOPK = (1, 2, 4)
STEPS = (1, 3, 5)
NDT = ("steps+1", 8, 16)
PAGE_SIZES = (1, 4, 16)
CHUNKS = (4, 64, None)
BATCHES = (1, 5)

# Mixed lengths (1 .. 30, 66 tokens in all): chunks of 4 cut every prompt longer than 4, a chunk of
# 64 cuts the batch (the last prompt is split across two steps), and the one-token prompt's draft
# extend has only the sampled token as its tail.
PROMPTS = [
    [7],
    [5, 6, 7, 8, 9],
    [60 + (i * 11) % 97 for i in range(11)],
    [100 + (i * 37) % 300 for i in range(19)],
    list(range(3, 33)),
]
LONG = [200 + (i * 29) % 250 for i in range(67)]  # batch 1 with chunk 64: cut into 64 + 3
PARAMS = {  # oracle: several verify steps with long accepted runs; random: every verify rejects
    "oracle": SamplingParams(max_new_tokens=10, ignore_eos=True),
    "random": SamplingParams(max_new_tokens=6, ignore_eos=True),
}
ORACLE_ALPHA, ORACLE_FEATURE_SCALE = 0.05, 0.05
ORACLE_MIN_ACCEPT, RANDOM_MAX_ACCEPT = 1.5, 1.2


def draft_tokens(steps: int, ndt) -> int:
    return steps + 1 if ndt == "steps+1" else ndt


def spec_valid(topk: int, steps: int, ndt) -> bool:
    try:
        SpecConfig(topk=topk, steps=steps, num_draft_tokens=draft_tokens(steps, ndt))
    except ValidationError:
        return False
    return True


SHAPES = [(k, s, n) for k, s, n in itertools.product(TOPK, STEPS, NDT) if spec_valid(k, s, n)]
CASES = [dict(drafts=d, kind=kind, topk=k, steps=s, ndt=n, page_size=p, chunk_size=c)
         for d, kind, (k, s, n), p, c in itertools.product(DRAFTS, KINDS, SHAPES, PAGE_SIZES, CHUNKS)]


def case_id(case: dict) -> str:
    return "-".join(f"{v}" for v in case.values()).replace("steps+1", "s1")


def batch1_prompt(case_index: int, chunk_size: int | None) -> list[int]:
    return LONG if chunk_size == 64 else PROMPTS[case_index % len(PROMPTS)]


def test_the_matrix_is_the_full_product():
    """Every valid combination of every factor is run, batch sizes included; only configurations
    SpecConfig refuses are left out, and exactly those."""
    assert len(SHAPES) == 16, SHAPES
    for k, s, n in itertools.product(TOPK, STEPS, NDT):
        nodes = draft_tokens(s, n)
        want = nodes == s + 1 if k == 1 else 2 <= nodes <= 1 + k + (s - 1) * k * k
        assert spec_valid(k, s, n) == want, (k, s, n)
    assert len(CASES) * len(BATCHES) == 2 * 3 * 16 * 3 * 3 * 2 == 1728
    assert len({case_id(c) for c in CASES}) == len(CASES)
    # both batch sizes run in every case; batch 1 sees every prompt (and the long one) many times
    lens = sorted(len(p) for p in PROMPTS)
    assert len(set(lens)) == 5 and lens[0] == 1 and sum(lens) > 64 and len(LONG) > 64
    singles = {tuple(batch1_prompt(i, c["chunk_size"])) for i, c in enumerate(CASES)}
    assert singles == {tuple(p) for p in PROMPTS + [LONG]}
    print(f"\nlossless matrix: {len(CASES)} engine configurations x batch sizes {BATCHES}")


@pytest.fixture(scope="module")
def matrix_oracle(tmp_path_factory) -> Models:
    from tests.oracle_model import make_oracle_model

    root = make_oracle_model(tmp_path_factory.mktemp("matrix-oracle"), seed=0, alpha=ORACLE_ALPHA)
    return add_feature_path(load_models(Path(root)), scale=ORACLE_FEATURE_SCALE)


@pytest.fixture(scope="module")
def models(random_models, matrix_oracle) -> dict[str, Models]:
    return {"random": random_models, "oracle": matrix_oracle}


_REFS: dict = {}


def reference(models: Models, prompts: list[list[int]], params: SamplingParams, page_size: int,
              chunk_size: int | None) -> list[GenerationResult]:
    """Greedy target-only results for one (model, prompt set, page size, chunk size), computed once."""
    key = (id(models), tuple(map(tuple, prompts)), params, page_size, chunk_size)
    if key not in _REFS:
        engine = models.engine(page_size=page_size, chunk_size=chunk_size)
        _REFS[key] = engine.generate(prompts, params)
        assert engine.is_idle_and_clean()
    return _REFS[key]


@pytest.mark.parametrize("drafts", DRAFTS)
def test_target_only_references_agree(models, drafts):
    """The references the matrix compares with do not depend on page size or chunking (so each case's
    reference is the one target-only output)."""
    m = models[drafts]
    params = PARAMS[drafts]
    for prompts in [PROMPTS, [LONG]] + [[p] for p in PROMPTS]:
        want = reference(m, prompts, params, 1, None)
        for page, chunk in itertools.product(PAGE_SIZES, CHUNKS):
            assert_same_greedy(reference(m, prompts, params, page, chunk), want, f"target only {page}/{chunk}")
    # a batch-1 reference is that prompt's row of the batch-5 one
    for i, p in enumerate(PROMPTS):
        assert_same_greedy(reference(m, [p], params, 1, None), [reference(m, PROMPTS, params, 1, None)[i]])


def run(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> tuple[list[GenerationResult], list[int]]:
    """Generate step by step; returns the results and, for every verify (one request in one decode
    step), the number of tokens it committed (the first token comes from prefill, not a verify)."""
    reqs = [engine.add_request(p, params) for p in prompts]
    per_verify: list[int] = []
    while engine.scheduler.has_work():
        for req, toks in engine.step():
            if len(req.output_ids) > len(toks):  # the request had its first token: a decode step
                per_verify.append(len(toks))
    return [engine.result(r) for r in reqs], per_verify


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_greedy_lossless(case, models):
    m = models[case["drafts"]]
    params = PARAMS[case["drafts"]]
    page, chunk = case["page_size"], case["chunk_size"]
    # Fixed: every decode step verifies (the per-verify accounting below); the default policy's slice follows.
    engine = m.fixed(case["kind"], case["topk"], case["steps"], draft_tokens(case["steps"], case["ndt"]),
                     page_size=page, chunk_size=chunk)
    per_verify: list[int] = []
    verifies = accepted = 0
    single = batch1_prompt(CASES.index(case), chunk)
    for prompts in (PROMPTS, [single]):  # batch 5, then batch 1 on the same (idle again) engine
        what = f"{case_id(case)} batch {len(prompts)}"
        got, committed = run(engine, prompts, params)
        assert engine.is_idle_and_clean(), f"{what}: pages or rows leaked"
        assert_same_greedy(got, reference(m, prompts, params, page, chunk), what)
        assert all(len(r.token_ids) == params.max_new_tokens for r in got), what
        assert sum(r.spec_stats["verify_steps"] for r in got) == len(committed), what
        assert max(committed) <= case["steps"] + 1, what
        per_verify += committed
        verifies += sum(r.spec_stats["verify_steps"] for r in got)
        accepted += sum(r.spec_stats["accepted_drafts"] for r in got)
    # accept length over both batches: accepted drafts + the bonus token per verify (a run cut short by
    # max_new_tokens still counts the drafts verification accepted: it measures the drafts)
    accept = (accepted + verifies) / verifies
    print(f"{case_id(case)}: accept length {accept:.2f}, longest verify {max(per_verify)}")
    if case["drafts"] == "oracle":  # the high end of acceptance is really exercised
        assert accept > ORACLE_MIN_ACCEPT, f"oracle accept length {accept:.2f} for {case_id(case)}"
        if case["steps"] >= 2 and (case["topk"] == 1 or draft_tokens(case["steps"], case["ndt"]) >= 8):
            assert max(per_verify) >= 3, f"{case_id(case)}: no verify accepted two drafts in a row"
    else:  # and the low end
        assert accept < RANDOM_MAX_ACCEPT, f"random drafts accepted too often ({accept:.2f}): not the low end"


@pytest.mark.parametrize("case", CASES[::25], ids=case_id)  # 35 cases; 25 is prime to the 9 page x chunk pairs
def test_greedy_lossless_under_the_default_policy(case, models):
    """A slice of the same cases under the default policy (adaptive: plain steps and the shapes within the
    configured one, by measured cost and acceptance): token for token the target-only output, pools full."""
    m, params = models[case["drafts"]], PARAMS[case["drafts"]]
    page, chunk = case["page_size"], case["chunk_size"]
    engine = m.engine(case["kind"], case["topk"], case["steps"], draft_tokens(case["steps"], case["ndt"]),
                      page_size=page, chunk_size=chunk)
    assert engine.spec_policy.kind == "adaptive"
    for prompts in (PROMPTS, [batch1_prompt(CASES.index(case), chunk)]):
        what = f"{case_id(case)} batch {len(prompts)}"
        got, _ = run(engine, prompts, params)
        assert engine.is_idle_and_clean(), f"{what}: pages or rows leaked"
        assert_same_greedy(got, reference(m, prompts, params, page, chunk), what)
        assert all(len(r.token_ids) == params.max_new_tokens for r in got), what


@pytest.mark.parametrize("page_size", [1, 16])
def test_negative_control_a_compaction_bug_is_caught(models, monkeypatch, page_size):
    """The matrix's comparison sees a K/V mistake with these oracle drafts: with the accepted path's
    target K/V left where verify wrote it (no compaction), outputs differ from the reference."""
    from shared.spec.phases import SpecPhases

    monkeypatch.setattr(SpecPhases, "_compact_target", lambda self, inp, index, valid: None)
    m, params = models["oracle"], PARAMS["oracle"]
    engine = m.engine("eagle", 2, 3, 8, page_size=page_size, chunk_size=None)
    got, _ = run(engine, PROMPTS, params)
    assert engine.is_idle_and_clean()
    with pytest.raises(AssertionError):
        assert_same_greedy(got, reference(m, PROMPTS, params, page_size, None))
