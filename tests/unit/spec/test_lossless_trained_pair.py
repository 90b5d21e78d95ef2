"""The lossless matrix's tree shapes on a trained pair: real acceptance, so every tree depth commits runs.

The pair is ``models/tiny-pair`` (or ``EYRIE_TINY_PAIR``) when present; otherwise the tiny pair's
pipeline at toy size is trained here on the CPU (``bench.house.tiny_pair --smoke``, ~10 s once per
session), whose head also accepts several tokens per step. For every valid (topk, steps, verified
tokens) of the matrix, at two page and chunk sizes, greedy speculative decoding must equal the
target alone token for token, and a deep enough tree must commit runs of 3 or more tokens (one
page and chunk size per shape, the two settings in turn; marked slow: about two minutes).
"""

from __future__ import annotations

from pathlib import Path

import pytest
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
    from bench.house.train_target import HouseConfig, build_house
    from shared.training.trainer import TrainConfig, train_draft

    work = tmp_path_factory.mktemp("pair")
    build_house(HouseConfig(out=str(work / "target"), **SMOKE_TARGET), log=lambda line: None)
    train_draft(TrainConfig(target=str(work / "target"), corpus=[str(work / "target" / "corpus" / "train.jsonl")],
                            out=str(work / "eagle3"), kind="eagle3", **SMOKE_HEAD))
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
