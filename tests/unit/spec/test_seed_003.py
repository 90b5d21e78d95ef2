"""Seed 003: empty batches, batches whose requests all finish at verify, and padded rows take the
same path, with widths from one function of the draft.

SGLang built the placeholder draft input of an idle batch with a locally computed hidden size, wrong
for EAGLE-3 (whose draft extend takes 3x the hidden size). Here ``feature_width`` / ``hidden_width``
of the draft head are the widths; an empty decode step runs the very same phases (one padding row)
for every draft kind, eagerly and on the graph padding path; a batch whose requests all finish at
one verify finishes cleanly with the exact target-only tokens and full pools.
"""

from __future__ import annotations

import pytest
import torch
from draft_reference import DraftCalls
from spec_helpers import KINDS, PROMPTS

from shared.sampling import SamplingParams

GRAPHS = pytest.mark.parametrize("graphs", [False, True], ids=["eager", "padded"])


@pytest.mark.parametrize("kind", KINDS)
def test_one_function_gives_the_draft_widths(oracle_models, kind):
    engine = oracle_models.engine(kind, topk=2, steps=3, ndt=6)
    draft, w = engine.speculator.draft, engine.speculator
    h = engine.model.config.hidden_size
    assert draft.feature_width(from_target=True) == (3 * h if kind == "eagle3" else h)
    assert draft.feature_width(from_target=False) == draft.hidden_width == draft.config.hidden_size
    req = engine.add_request(PROMPTS[2], SamplingParams(max_new_tokens=4, ignore_eos=True))
    with DraftCalls(engine) as calls:
        engine.run_until_done()
    assert req.draft_state.hidden.shape == (draft.hidden_width,)  # the draft's width, not the target's
    for call in calls.calls:
        assert call.features.shape[-1] == draft.feature_width(call.from_target)
        assert call.hidden.shape[-1] == draft.hidden_width
    # An empty draft extend takes features of exactly that width; any other width is refused.
    w.draft_extend([], torch.zeros(0, draft.feature_width(from_target=True)), [])
    if kind == "eagle3":
        with pytest.raises(RuntimeError):
            w.draft_extend([], torch.zeros(0, h), [])
    assert engine.is_idle_and_clean()


@GRAPHS
@pytest.mark.parametrize("kind", KINDS)
def test_empty_batch_runs_the_same_path(oracle_models, kind, graphs):
    engine = oracle_models.engine(kind, topk=2, steps=3, ndt=6, cuda_graph=graphs)
    w = engine.speculator
    assert engine.step() == []  # no request at all: nothing scheduled
    with DraftCalls(engine) as calls:
        assert w.decode_step([]) == []
    # The same phases ran on one padding row: the tree growth, then the extend on every draft cache.
    loop = calls.loop()
    assert len(loop) == w.spec.steps - 1 and all(c.input_ids.shape[0] == w.spec.topk for c in loop)
    assert len(calls.calls) - len(loop) == len(w.caches)
    for call in calls.calls:
        assert call.features.shape[-1] == w.draft.feature_width(call.from_target)
    assert w.stats.totals.verify_steps == 0 and engine.is_idle_and_clean()
    # and the engine still decodes exactly afterwards
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    got = engine.generate([PROMPTS[2]], params)
    assert got[0].token_ids == oracle_models.reference([PROMPTS[2]], params)[0].token_ids
    assert engine.is_idle_and_clean()


@GRAPHS
@pytest.mark.parametrize("kind", KINDS)
def test_every_request_finishes_at_one_verify(oracle_models, kind, graphs):
    """Three requests (a batch padded to 4 on the graph path) prefill together and all finish at
    their first verify: by length (two tokens) or by a stop token inside the accepted run."""
    prompts = [PROMPTS[0], PROMPTS[2], PROMPTS[4]]
    want = oracle_models.reference(prompts, SamplingParams(max_new_tokens=8, ignore_eos=True))
    for stop in (False, True):
        engine = oracle_models.engine(kind, topk=2, steps=3, ndt=6, cuda_graph=graphs, chunk_size=None)
        if stop:  # stop at each request's second token (its first verify commits it)
            params = [SamplingParams(max_new_tokens=8, stop_token_ids=(w.token_ids[1],)) for w in want]
            assert all(w.token_ids[1] != w.token_ids[0] for w in want)
        else:
            params = [SamplingParams(max_new_tokens=2, ignore_eos=True)] * 3
        reqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
        engine.step()  # one prefill step for all three
        assert all(r.draft_state is not None and len(r.output_ids) == 1 for r in reqs)
        events = engine.step()  # one verify: every request finishes
        assert {r.rid for r, _ in events} == {r.rid for r in reqs}
        assert all(r.finish_reason == ("stop" if stop else "length") for r in reqs)
        assert not engine.scheduler.has_work() and engine.is_idle_and_clean()
        assert engine.step() == []
        for r, w in zip(reqs, want):
            res = engine.result(r)
            assert res.token_ids == w.token_ids[:2]
            assert torch.allclose(torch.tensor(res.logprobs), torch.tensor(w.logprobs[:2]), atol=1e-4)
            assert res.spec_stats["verify_steps"] == 1
