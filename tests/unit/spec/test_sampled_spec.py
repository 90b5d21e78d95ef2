"""Sampled speculative decoding on the device path: one acceptance call serves greedy, sampled and mixed
batches, and a seeded request's output depends on its seed alone: the same with and without CUDA-graph
padding (on the CPU ``cuda_graph`` pads every phase's batch to its bucket), with and without drafting
ahead, alone or beside other requests in any row of the batch."""

from __future__ import annotations

import pytest
import torch
from spec_helpers import PROMPTS

from shared.sampling import SamplingParams
from shared.spec import phases

SAMPLED = [SamplingParams(temperature=0.8, seed=11, max_new_tokens=18, ignore_eos=True),
           SamplingParams(temperature=1.2, top_k=5, seed=2**64 - 3, max_new_tokens=12, ignore_eos=True),
           SamplingParams(temperature=0.9, top_p=0.8, seed=7, max_new_tokens=15, ignore_eos=True),
           SamplingParams(temperature=1.0, top_k=8, top_p=0.9, seed=0, max_new_tokens=9, ignore_eos=True)]
GREEDY = SamplingParams(max_new_tokens=14, ignore_eos=True)


def outputs(engine, prompts, params) -> list[tuple[list[int], str]]:
    results = engine.generate(prompts, params)
    assert engine.is_idle_and_clean()
    return [(r.token_ids, r.finish_reason) for r in results]


@pytest.mark.parametrize("kind,topk,steps,ndt", [("eagle3", 2, 3, 6), ("eagle", 1, 3, 4)])
def test_a_seed_gives_one_output_with_and_without_graphs_and_drafting_ahead(oracle_models, kind, topk, steps, ndt):
    prompts = PROMPTS[:4] + [PROMPTS[4]]
    params = SAMPLED + [GREEDY]
    runs = {}
    for graphs in (False, True):
        for ahead in (False, True):
            engine = oracle_models.engine(kind, topk, steps, ndt, page_size=4, chunk_size=8, cuda_graph=graphs,
                                          spec_draft_ahead=ahead)
            assert engine.speculator.graphs["verify_extend"].bucket(5) == (8 if graphs else None)  # 5 rows pad to 8
            runs[graphs, ahead] = outputs(engine, prompts, params)
            if ahead:
                assert engine.speculator.ahead.used > 0
    first = runs[False, False]
    assert all(run == first for run in runs.values()), {k: v == first for k, v in runs.items()}
    assert first[-1][0] == oracle_models.reference([prompts[-1]], GREEDY)[0].token_ids  # greedy still greedy


def test_a_seed_gives_one_output_alone_and_beside_others(oracle_models):
    """The same request (prompt, parameters, seed) alone, first of a batch, last of a batch, and beside
    a different mix: its tokens never change; another seed changes them."""
    mine, prompt = SAMPLED[2], PROMPTS[3]
    others = [(PROMPTS[0], SAMPLED[0]), (PROMPTS[1], GREEDY), (PROMPTS[2], SAMPLED[3])]
    # Fixed: under the adaptive policy a sampled request's draws follow the shapes and plain steps chosen (by
    # measured step times and the batch), so its seed fixes its output only in distribution.
    engine = oracle_models.fixed("eagle3", 2, 3, 6, page_size=4, chunk_size=8)
    alone = outputs(engine, [prompt], [mine])[0]
    first = outputs(engine, [prompt] + [p for p, _ in others], [mine] + [q for _, q in others])[0]
    last = outputs(engine, [p for p, _ in others[1:]] + [prompt], [q for _, q in others[1:]] + [mine])[-1]
    assert alone == first == last
    reseeded = outputs(engine, [prompt], [mine.model_copy(update={"seed": 8})])[0]
    assert reseeded != alone


def test_a_mixed_batch_is_accepted_in_one_call_per_step(oracle_models, monkeypatch):
    """Greedy and sampled requests verified together: one acceptance call per decode step covers every
    row, and the greedy requests' outputs are the target's greedy ones."""
    calls = []
    accept = phases.sampled_accept

    def counted(tree, logits, rows, committed_len, steps):
        calls.append((int((rows.temperature > 0).sum()), int((rows.temperature == 0).sum())))
        return accept(tree, logits, rows, committed_len, steps)

    monkeypatch.setattr(phases, "sampled_accept", counted)
    engine = oracle_models.engine("mtp", 2, 3, 6, page_size=4, chunk_size=None)
    decode_steps = []
    step = engine.speculator.step
    engine.speculator.step = lambda reqs, *rest: decode_steps.append(len(reqs)) or step(reqs, *rest)
    prompts, params = [PROMPTS[0], PROMPTS[2], PROMPTS[3]], [GREEDY, SAMPLED[0], GREEDY]
    got = outputs(engine, prompts, params)
    assert len(calls) == len(decode_steps) > 0
    assert any(sampled and greedy for sampled, greedy in calls), "no step verified both kinds together"
    want = oracle_models.reference([PROMPTS[0], PROMPTS[3]], GREEDY)
    assert [got[0][0], got[2][0]] == [r.token_ids for r in want]


def test_an_unseeded_request_draws_with_a_seed_of_its_own(oracle_models):
    engine = oracle_models.engine("eagle", 1, 3, 4, page_size=4)
    unseeded = SamplingParams(temperature=1.0, max_new_tokens=4)
    reqs = [engine.add_request(PROMPTS[0], unseeded) for _ in range(3)]
    assert len({r.seed for r in reqs}) == 3 and all(0 <= r.seed < 2**64 for r in reqs)
    assert engine.add_request(PROMPTS[0], SAMPLED[1]).seed == SAMPLED[1].seed
    engine.run_until_done()
    assert engine.is_idle_and_clean()
    torch.manual_seed(0)  # the seeds do not come from torch's global generator
    a = engine.add_request(PROMPTS[0], unseeded).seed
    torch.manual_seed(0)
    assert engine.add_request(PROMPTS[0], unseeded).seed != a
    engine.run_until_done()


@pytest.mark.gpu
@pytest.mark.parametrize("kind,topk,steps,ndt", [("eagle3", 2, 3, 6), ("mtp", 1, 3, 4)])
def test_a_seed_gives_one_output_with_and_without_cuda_graphs_on_the_gpu(oracle_models_cuda, kind, topk, steps,
                                                                          ndt):
    """Real graphs: a mixed greedy + sampled batch runs its verify, acceptance and extend in the captured
    verify_extend graph (sampled rows need no host branch), and every seed draws what it draws eagerly
    (and with drafting ahead, the CUDA default, on or off)."""
    prompts, params = PROMPTS[:4] + [PROMPTS[4]], SAMPLED + [GREEDY]
    runs = {}
    for graphs in (False, True):
        for ahead in (False, True):
            engine = oracle_models_cuda.engine(kind, topk, steps, ndt, page_size=4, chunk_size=8, cuda_graph=graphs,
                                               spec_draft_ahead=ahead)
            runs[graphs, ahead] = outputs(engine, prompts, params)
            if graphs:
                assert engine.speculator.graphs["verify_extend"].captured_sizes, "the sampled batch ran no graph"
    first = runs[False, False]
    assert all(run == first for run in runs.values()), {k: v == first for k, v in runs.items()}
    assert first[-1][0] == oracle_models_cuda.reference([prompts[-1]], GREEDY)[0].token_ids
