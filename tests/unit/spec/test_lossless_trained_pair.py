"""The lossless matrix's tree shapes on a trained pair: real acceptance, so every tree depth commits runs.

The pair is ``models/tiny-pair`` (or ``EYRIE_TINY_PAIR``) when present; otherwise the tiny pair's
pipeline at toy size is trained here on the CPU (``bench.house.tiny_pair --smoke``, ~10 s once per
session), whose head also accepts several tokens per step. For every valid (topk, steps, verified
tokens) of the matrix, at two page and chunk sizes, greedy speculative decoding must equal the
target alone token for token, and a deep enough tree must commit runs of 3 or more tokens (one
page and chunk size per shape, the two settings in turn; marked slow: about two minutes).

The prefix cache (issue 33) on the same pair: cold then warm requests (a full hit, a divergence inside a page and
one at a page boundary), the cache on against off, greedy under the fixed policy: the same tokens, and the same
verify steps and accepted drafts request by request; a negative control (the draft's cached K/V overwritten)
shows that acceptance on this pair does read the cached draft K/V (a few seconds together).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from spec_helpers import assert_same_greedy
from test_lossless_matrix import NDT, STEPS, TOPK, draft_tokens, spec_valid

from shared.config import EngineConfig, SpecConfig
from shared.engine import Engine
from shared.model.default_pair import trained_tiny_pair
from shared.sampling import SamplingParams

PROMPTS = ["def fibonacci(n):\n", "import os\nimport sys\n\n\nclass Config:\n    def __init__(self, ",
           "    for i in range(len(", "# Copyright"]
PARAMS = SamplingParams(max_new_tokens=16, ignore_eos=True)
SHAPES = [(k, s, draft_tokens(s, n)) for k in TOPK for s in STEPS for n in NDT if spec_valid(k, s, n)]


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    found = trained_tiny_pair()
    if found is not None:
        return found.target, found.eagle3
    from bench.house.tiny_pair import SMOKE_HEAD, SMOKE_TARGET
    from bench.house.train_target import HouseConfig, build_house, chat_renderer
    from shared.training.trainer import TrainConfig, train_draft

    work = tmp_path_factory.mktemp("pair")
    build_house(HouseConfig(out=str(work / "target"), **SMOKE_TARGET), log=lambda line: None)
    train_draft(TrainConfig(target=str(work / "target"), corpus=[str(work / "target" / "corpus" / "train.jsonl")],
                            out=str(work / "eagle3"), kind="eagle3", **SMOKE_HEAD),
                chat_renderer(work / "target"))  # the corpus's chat records, rendered as bench.house.tiny_pair does
    return work / "target", work / "eagle3"


@pytest.fixture(scope="module")
def reference(pair) -> list:
    return Engine(pair[0], config=EngineConfig(max_running=4, max_context=256)).generate(PROMPTS, PARAMS)


@pytest.mark.slow
@pytest.mark.parametrize("topk,steps,ndt", SHAPES)
def test_trained_pair_is_lossless_and_accepts_runs(pair, reference, topk, steps, ndt):
    page_size, chunk = (16, None) if SHAPES.index((topk, steps, ndt)) % 2 else (4, 8)  # both, in turn
    config = EngineConfig(max_running=4, max_context=256, page_size=page_size, chunk_size=chunk,
                          spec=SpecConfig(topk=topk, steps=steps, num_draft_tokens=ndt),
                          spec_policy="fixed")  # the acceptance of this shape, every step
    engine = Engine(pair[0], draft=pair[1], config=config)
    engine.spec_stats.keep_batches(None)
    assert_same_greedy(engine.generate(PROMPTS, PARAMS), reference, f"topk {topk} steps {steps} n {ndt}")
    totals = engine.spec_stats.totals
    assert totals.accept_length > 1.3, totals  # a trained head: well above a random one's ~1.0
    if (topk == 1 and steps >= 3) or ndt >= 8:  # deep enough (the matrix's rule)
        assert max(max(b.committed) for b in engine.spec_stats.batches) >= 3


# ---- the prefix cache on the trained pair (issue 33: acceptance after a hit equals acceptance without it) ------
# A shared prefix of Python (its first page or pages cached by a cold request), then, warm: the same prompt again,
# one leaving it inside a page and one leaving it at a page boundary (of 4 and of 16), in one batch.
SHARED_TEXT = ("import os\nimport sys\n\n\nclass Config:\n    def __init__(self, path):\n        self.path = path\n"
               "        self.values = {}\n\n    def load(self):\n        with open(self.path) as f:\n"
               "            for line in f:\n")
CACHE_PARAMS = SamplingParams(max_new_tokens=24, ignore_eos=True)
CACHE_SHAPES = {  # (topk, steps, verified tokens), page size, chunk size: a chain and a tree
    "chain": ((1, 3, 4), 4, 8),
    "tree": ((2, 3, 6), 16, None),
}


def cache_prompts(engine: Engine) -> tuple[list[int], list[list[int]]]:
    base = engine.tokenizer.encode(SHARED_TEXT)
    assert len(base) > 40, len(base)
    inside = base[:37] + engine.tokenizer.encode("    def save(self, name):\n")  # 37: inside a page of 4 and 16
    boundary = base[:32] + engine.tokenizer.encode("# a comment\n")  # 32: a boundary of 4 and of 16
    return base, [base, inside, boundary]


def cold_then_warm(pair, shape: str, cached: bool, corrupt_draft: bool = False) -> tuple[list, Engine]:
    (topk, steps, ndt), page_size, chunk = CACHE_SHAPES[shape]
    config = EngineConfig(max_running=4, max_context=256, page_size=page_size, chunk_size=chunk,
                          spec=SpecConfig(topk=topk, steps=steps, num_draft_tokens=ndt),
                          spec_policy="fixed", prefix_cache=cached)  # fixed: acceptance owes nothing to timing
    engine = Engine(pair[0], draft=pair[1], config=config)
    base, warm = cache_prompts(engine)
    cold = engine.generate([base], CACHE_PARAMS)
    assert engine.is_idle_and_clean()
    if corrupt_draft:  # the negative control: the draft's cached K/V replaced by noise (the target's kept),
        # loud enough (4 x a unit normal) that the draft's attention lands on it
        g = torch.Generator().manual_seed(0)
        for pages in engine.prefix_cache.cached_pages():
            for cache, page in zip(engine.scheduler.caches[1:], pages[1:]):
                slots = slice(page * page_size, (page + 1) * page_size)
                for kv in (*cache.k, *cache.v):
                    kv[slots] = 4 * torch.randn(kv[slots].shape, generator=g).to(kv.dtype)
    out = cold + engine.generate(warm, CACHE_PARAMS)
    assert engine.is_idle_and_clean()
    return out, engine


@pytest.mark.parametrize("shape", list(CACHE_SHAPES))
def test_trained_pair_accepts_as_much_after_a_cache_hit(pair, shape):
    """Greedy, the fixed policy: the cache on gives the cache off's tokens and, request by request, its verify
    steps and accepted drafts exactly (a hit takes the target's and the draft's K/V a prefill computed, and the
    positions after it are computed as without the cache: the same arithmetic, so no noise bound is needed). On
    the oracle pair (test_prefix_cache_lossless.py) a draft's K/V barely matters; this head's proposals read it,
    so a draft K/V that a hit got wrong lowers acceptance here (the negative control below shows it does)."""
    off, _ = cold_then_warm(pair, shape, cached=False)
    on, engine = cold_then_warm(pair, shape, cached=True)
    assert [r.cached_tokens for r in off] == [0] * 4
    page = CACHE_SHAPES[shape][1]
    assert on[0].cached_tokens == 0 and on[1].cached_tokens >= len(on[1].prompt_ids) - page, \
        [r.cached_tokens for r in on]  # the same prompt again: every page before its last token
    assert on[2].cached_tokens == (36 if page == 4 else 32)  # inside a page: the whole pages before it
    assert 0 < on[3].cached_tokens < 32  # at a boundary: the page before it missed (its successor differs)
    assert_same_greedy(on, off, f"{shape} cache on")
    for i, (a, b) in enumerate(zip(on, off, strict=True)):
        for key in ("verify_steps", "accepted_drafts"):
            assert a.spec_stats[key] == b.spec_stats[key], f"{shape} request {i}: {a.spec_stats} != {b.spec_stats}"
    accept = sum(len(r.token_ids) - 1 for r in off) / sum(r.spec_stats["verify_steps"] for r in off)
    assert accept > 1.5, accept  # a trained head: drafts are accepted, so their K/V is read and matters
    print(f"{shape}: accept length {accept:.2f}, cached tokens {[r.cached_tokens for r in on]}")


def test_negative_control_a_wrong_cached_draft_kv_lowers_acceptance():
    """The equality above has teeth: the same run with the draft's cached K/V overwritten by noise after the cold
    request keeps the target's greedy tokens (verification is lossless whatever the draft) but accepts fewer
    drafts on the warm requests that hit. On the committed pair only: the fixture's fallback (a head trained for
    30 steps) hardly reads its own K/V, and accepts as much with it corrupted."""
    found = trained_tiny_pair()
    assert found is not None, "models/tiny-pair is part of the repository"
    pair = (found.target, found.eagle3)
    off, _ = cold_then_warm(pair, "chain", cached=False)
    bad, _ = cold_then_warm(pair, "chain", cached=True, corrupt_draft=True)
    assert_same_greedy(bad, off, "a corrupted draft cache")
    hits = [i for i, r in enumerate(bad) if r.cached_tokens > 0]
    assert hits == [1, 2, 3]
    worse, good = (sum(runs[i].spec_stats["accepted_drafts"] for i in hits) for runs in (bad, off))
    print(f"accepted drafts on the hits: {worse} with a corrupted draft cache, {good} without the cache")
    assert worse < good / 2  # here 1 against 44
