"""Top logprobs under speculation are the target's at each committed position, not the draft's.

* Greedy speculative decoding with ``top_logprobs`` gives, for every draft kind, chain and tree, page
  sizes 1 and 16, the target-only output: tokens, the sampled token's logprob and each position's top
  list (ids and values to float32 noise).
* The lists are the processed distribution's: with a penalty, the values equal those of the target
  alone with the same penalty, and differ from those without it.
* Nobody asking costs nothing: no top list is computed (the graphs' path is kept).
"""

from __future__ import annotations

import math

import pytest
import torch
from spec_helpers import PROMPTS, Models

import shared.spec.phases as phases
from shared.sampling import SamplingParams

TOP = SamplingParams(max_new_tokens=12, ignore_eos=True, top_logprobs=5)
CASES = [  # (draft kind, topk, steps, nodes, page size)
    ("eagle", 1, 3, 4, 16),
    ("eagle", 2, 3, 6, 1),
    ("eagle3", 1, 4, 5, 1),
    ("eagle3", 2, 3, 6, 16),
    ("mtp", 1, 3, 4, 1),
    ("mtp", 2, 3, 6, 16),
]


def assert_same_logprobs(got, want, atol: float = 1e-5, asked: list[bool] | None = None) -> None:
    """Equal tokens, logprobs and top lists; a request that did not ask (``asked``) has no top list."""
    for g, w, a in zip(got, want, asked or [True] * len(want), strict=True):
        assert g.token_ids == w.token_ids
        assert len(g.top_logprobs) == len(w.top_logprobs) == (len(w.token_ids) if a else 0)
        assert torch.allclose(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=atol, rtol=0)
        for gt, wt in zip(g.top_logprobs, w.top_logprobs):
            assert [t for t, _ in gt] == [t for t, _ in wt]
            assert torch.allclose(torch.tensor([v for _, v in gt]), torch.tensor([v for _, v in wt]), atol=atol,
                                  rtol=0)


@pytest.mark.parametrize("kind,topk,steps,ndt,page", CASES, ids=lambda v: str(v))
def test_speculative_top_logprobs_equal_target_only(oracle_models: Models, kind, topk, steps, ndt, page):
    prompts = PROMPTS[:3]
    want = oracle_models.engine(page_size=page, chunk_size=None).generate(prompts, TOP)
    engine = oracle_models.fixed(kind, topk=topk, steps=steps, ndt=ndt, page_size=page, chunk_size=8)
    got = engine.generate(prompts, TOP)
    assert_same_logprobs(got, want)
    assert engine.is_idle_and_clean()
    assert max(g.spec_stats["accept_length"] for g in got) > 1.2  # several tokens per verify: paths were read
    for res in want:  # greedy: the committed token is the top one, with the same logprob; 5 per position
        for tok, lp, top in zip(res.token_ids, res.logprobs, res.top_logprobs):
            assert len(top) == 5 and top[0][0] == tok and math.isclose(top[0][1], lp, abs_tol=1e-6)
            assert all(a[1] >= b[1] for a, b in zip(top, top[1:]))


def test_top_logprobs_are_the_processed_distribution(oracle_models: Models):
    penalised = TOP.model_copy(update={"frequency_penalty": 1.5, "presence_penalty": 0.5})
    prompts = PROMPTS[:2]
    want = oracle_models.engine(page_size=16, chunk_size=None).generate(prompts, penalised)
    got = oracle_models.engine("eagle3", topk=2, steps=3, ndt=6, page_size=16).generate(prompts, penalised)
    assert_same_logprobs(got, want)
    plain = oracle_models.engine(page_size=16, chunk_size=None).generate(prompts, TOP)
    assert [w.top_logprobs for w in want] != [p.top_logprobs for p in plain]


def test_mixed_batch_only_the_asking_request_gets_lists(oracle_models: Models):
    params = [TOP.model_copy(update={"top_logprobs": 2}), TOP.model_copy(update={"top_logprobs": 0}), TOP]
    engine = oracle_models.engine("eagle3", topk=2, steps=3, ndt=6)
    got = engine.generate(PROMPTS[:3], params)
    assert [len(t) for t in got[0].top_logprobs] == [2] * len(got[0].token_ids)
    assert got[1].top_logprobs == []
    assert [len(t) for t in got[2].top_logprobs] == [5] * len(got[2].token_ids)


def test_no_top_logprobs_without_a_request_for_them(oracle_models: Models, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("top logprobs computed though nobody asked")

    monkeypatch.setattr(phases.SpecPhases, "with_top_logprobs", staticmethod(refuse))
    monkeypatch.setattr(phases, "top_logprobs", refuse)
    engine = oracle_models.engine("eagle3", topk=2, steps=3, ndt=6)
    got = engine.generate(PROMPTS[:2], SamplingParams(max_new_tokens=8, ignore_eos=True))
    assert all(g.top_logprobs == [] and len(g.logprobs) == 8 for g in got)


@pytest.mark.gpu
def test_speculative_top_logprobs_equal_target_only_on_the_gpu_with_graphs(oracle_models_cuda: Models):
    """On CUDA with graphs: a batch asking for top logprobs replays the verify and extend graphs (the lists read
    between them), one request not asking mixed in; the lists equal the target alone's."""
    prompts = PROMPTS[:3]
    params = [TOP, TOP.model_copy(update={"top_logprobs": 0}), TOP]
    want = oracle_models_cuda.engine(page_size=16, chunk_size=None).generate(prompts, params)
    engine = oracle_models_cuda.engine("eagle3", topk=2, steps=3, ndt=6, page_size=16, cuda_graph=True)
    assert_same_logprobs(engine.generate(prompts, params), want, atol=1e-4, asked=[True, False, True])
    assert engine.is_idle_and_clean()
