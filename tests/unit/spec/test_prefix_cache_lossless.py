"""The prefix cache changes no output and no acceptance: the lossless matrix's cached axis (issue 33).

Every case runs the same requests on two engines of one configuration, the prefix cache on and off: first a
prompt alone (cold: nothing cached), then, on the same engine once it is idle, three prompts in one batch
(warm): the same prompt again (a hit of every page before its last token), one that leaves it inside a page
and one that leaves it exactly at a page boundary. The cache on must give the cache off's tokens one for one,
its logprobs to float32 noise, its finish reasons, and the same speculative statistics (verify steps and
accepted drafts: acceptance after a hit equals acceptance without the cache), and report the cached tokens
the keys allow: with a draft, a page is cached under the token after it too (the draft's K/V at a page's last
position depends on it: seed 000), so a prompt leaving the cached one at a page boundary misses that page.

Factors: draft kind {none, eagle, eagle3, mtp} x topk {1, 2} (a chain and a tree) x page size {1, 4, 16} x
chunk size {4, 64, none}, greedy, on the oracle pair (drafts accepted often, their K/V read by every step);
sampled with seeds on every kind at one page and chunk size.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from spec_helpers import KINDS

from shared.engine import GenerationResult
from shared.sampling import SamplingParams

BASE = [100 + (i * 37) % 300 for i in range(45)]  # the cold prompt: 45 tokens (2 pages of 16 and 13 tokens)
INSIDE = BASE[:37] + [11, 12, 13, 14, 15, 16]  # leaves it at 37, inside a page of 4 or 16
BOUNDARY = BASE[:32] + [21, 22, 23, 24, 25, 26, 27, 28, 29]  # leaves it at 32, a page boundary of 1, 4 and 16
WARM = [BASE, INSIDE, BOUNDARY]
GREEDY = SamplingParams(max_new_tokens=10, ignore_eos=True)
SAMPLED = SamplingParams(max_new_tokens=10, ignore_eos=True, temperature=0.8, seed=1234)

SHAPES = [(None, 1)] + [(kind, k) for kind in KINDS for k in (1, 2)]
CASES = [dict(kind=kind, topk=k, page_size=p, chunk_size=c)
         for (kind, k), p, c in itertools.product(SHAPES, (1, 4, 16), (4, 64, None))]


def case_id(case: dict) -> str:
    return "-".join(str(v) for v in case.values())


def expected_cached(prompt: list[int], cached_from: list[int], first_output: int, page_size: int,
                    successor: bool) -> int:
    """The prompt tokens a request finds cached after ``cached_from`` ran alone: whole pages of their common
    prefix, before the prompt's last token; with a draft, a page only when the token after it agrees too."""
    seq = cached_from + [first_output]  # the cold request's pages end where its first output token follows
    pages = 0
    for i in range((len(prompt) - 1) // page_size):
        end = (i + 1) * page_size
        if end > len(cached_from):
            break
        agree = end + 1 if successor else end
        if prompt[:agree] != seq[:agree]:
            break
        pages = i + 1
    return pages * page_size


def run_case(models, case: dict, params: SamplingParams, cached: bool) -> tuple[list[GenerationResult], object]:
    spec = dict(topk=case["topk"], steps=3, ndt=6 if case["topk"] == 2 else 4) if case["kind"] else {}
    engine = models.fixed(case["kind"], **spec, page_size=case["page_size"], chunk_size=case["chunk_size"],
                          prefix_cache=cached)
    cold = engine.generate([BASE], params)
    assert engine.is_idle_and_clean()
    warm = engine.generate(WARM, params)
    assert engine.is_idle_and_clean()
    return cold + warm, engine


def assert_same(got: list[GenerationResult], want: list[GenerationResult], what: str) -> None:
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.token_ids == w.token_ids, f"{what} request {i}: {g.token_ids} != {w.token_ids}"
        assert torch.allclose(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=1e-4), f"{what} request {i}"
        assert g.finish_reason == w.finish_reason, what
        if w.spec_stats is not None:  # acceptance after a hit is acceptance without the cache
            for key in ("verify_steps", "accepted_drafts"):
                assert g.spec_stats[key] == w.spec_stats[key], f"{what} request {i}: {key} {g.spec_stats} " \
                                                               f"!= {w.spec_stats}"


def check_hits(results: list[GenerationResult], case: dict) -> None:
    ps, successor = case["page_size"], case["kind"] is not None
    first = results[0].token_ids[0]
    assert results[0].cached_tokens == 0, "the cold request found something cached"
    for prompt, r in zip(WARM, results[1:]):
        assert r.cached_tokens == expected_cached(prompt, BASE, first, ps, successor), \
            f"{case_id(case)}: {r.cached_tokens} cached tokens for a prompt of {len(prompt)}"
    assert results[1].cached_tokens > 0  # the same prompt again: every page before its last token


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_prefix_cache_greedy_lossless(case, oracle_models):
    off, _ = run_case(oracle_models, case, GREEDY, cached=False)
    on, engine = run_case(oracle_models, case, GREEDY, cached=True)
    assert all(r.cached_tokens == 0 for r in off)
    assert_same(on, off, case_id(case))
    check_hits(on, case)
    assert len(engine.prefix_cache) > 0


@pytest.mark.parametrize("kind", (None, *KINDS))
def test_prefix_cache_sampled_lossless(kind, oracle_models):
    """Sampled with seeds: every draw hashes the seed and its position, so the cache on draws the same."""
    case = dict(kind=kind, topk=2 if kind else 1, page_size=4, chunk_size=16)
    off, _ = run_case(oracle_models, case, SAMPLED, cached=False)
    on, _ = run_case(oracle_models, case, SAMPLED, cached=True)
    assert_same(on, off, f"sampled {kind}")
    check_hits(on, case)


def test_boundary_rule_is_what_the_draft_needs():
    """The expected hits above follow the tail-token rule: without a draft a page matches on its own tokens,
    with one only when the next token matches too."""
    assert expected_cached(BOUNDARY, BASE, 7, 16, successor=False) == 32
    assert expected_cached(BOUNDARY, BASE, 7, 16, successor=True) == 16
    assert expected_cached(INSIDE, BASE, 7, 16, successor=True) == 32
    assert expected_cached(BASE, BASE, 7, 4, successor=True) == 44
    assert expected_cached(BASE, BASE, 7, 1, successor=True) == 44
