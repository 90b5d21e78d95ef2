"""The adaptive policy's plain step in an engine with a draft, graph-shaped (``ModelRunner._plain_step``).

With CUDA graphs on, a plain step runs as a plain engine's does (padded to a batch-size bucket, replayed
from a graph on a GPU): the target's decode forward capturing the draft's features (``plain``), then the
draft over the one new position (``plain_extend``). On the CPU the same phases run eagerly on the padded
rows. It must leave exactly the draft state the eager plain step (``ModelRunner._target_step``) leaves, so the next
speculative step is unchanged: greedy output equals the fixed engine's and the target's alone, for every
draft kind, with plain steps only and with the policy switching every step. The GPU tests
(``tests/gpu/test_plain_step_graphs_gpu.py``) check the replayed graphs.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from spec_helpers import KINDS, PROMPTS, assert_same_greedy
from test_spec_policy import Alternating, TableCost

from shared.sampling import SamplingParams

PARAMS = SamplingParams(max_new_tokens=12, ignore_eos=True)
BATCH = [PROMPTS[0], PROMPTS[2], PROMPTS[4]]  # three requests: padded to a bucket of 4
DEAR_SPEC = TableCost(decode=lambda b: 0.01, spec=lambda b: 1.0)  # speculation never pays: plain steps only


def adaptive(models, kind: str, graphs: bool, cost, **cfg):
    """An adaptive engine whose acceptance is known, so that the injected ``cost`` alone decides."""
    engine = models.engine(kind, topk=2, steps=3, ndt=6, cuda_graph=graphs, spec_policy="adaptive",
                           spec_candidates=(), **cfg)  # the configured shape or a plain step
    engine.spec_policy.cost = cost
    engine.spec_policy.probe_every = 10 ** 6  # no probe: a forced plain step stays plain
    engine.spec_policy.candidates[0].acceptance.observe([2])
    engine.spec_policy.pin = False  # seeded sampled requests follow the injected cost too (they would pin the shape)
    return engine


class Calls:
    """Counts the calls of a phase's function and the batch rows each got."""

    def __init__(self, fn):
        self.fn, self.rows = fn, []

    def __call__(self, *args):
        self.rows.append(args[1].shape[0])  # every plain phase's second argument: lengths [bs]
        return self.fn(*args)


def test_only_an_adaptive_engine_has_plain_step_graphs(oracle_models):
    on = adaptive(oracle_models, "eagle3", True, DEAR_SPEC).speculator.graphs
    assert on["plain"].enabled and on["plain_extend"].enabled and on["plain"].bucket(3) == 4
    fixed = oracle_models.fixed("eagle3", cuda_graph=True).speculator.graphs
    assert "plain" not in fixed and "plain_extend" not in fixed  # fixed never runs a plain step
    no_decode = adaptive(oracle_models, "eagle3", True, DEAR_SPEC, cuda_graph_phases=("draft", "verify", "extend"))
    assert not no_decode.speculator.graphs["plain"].enabled  # the decode phase switched off: eager plain steps
    eager_extend = adaptive(oracle_models, "eagle3", True, DEAR_SPEC, cuda_graph_phases=("decode", "draft"))
    graphs = eager_extend.speculator.graphs
    assert graphs["plain"].enabled and not graphs["plain_extend"].enabled  # the extend phase off: eager


def first_tokens(results, lengths: list[int]):
    """Each result cut to its first ``lengths[i]`` tokens (greedy output of fewer tokens is a prefix)."""
    return [dataclasses.replace(r, token_ids=r.token_ids[:n], logprobs=r.logprobs[:n])
            for r, n in zip(results, lengths)]


@pytest.mark.parametrize("kind", KINDS)
def test_graph_shaped_plain_steps_equal_the_fixed_engine_and_the_target_alone(oracle_models, kind):
    lengths = [12, 5, 9]  # requests end at different steps: the others' rows of a step go on
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in lengths]
    want = first_tokens(oracle_models.reference(BATCH, PARAMS), lengths)
    fixed = oracle_models.engine(kind, topk=2, steps=3, ndt=6, cuda_graph=True)
    assert_same_greedy(fixed.generate(BATCH, params), want, "fixed")
    for cost in (DEAR_SPEC, Alternating()):
        engine = adaptive(oracle_models, kind, True, cost)
        w = engine.speculator
        plain, extend = Calls(w.graphs["plain"].fn), Calls(w.graphs["plain_extend"].fn)
        w.graphs["plain"].fn, w.graphs["plain_extend"].fn = plain, extend
        assert_same_greedy(engine.generate(BATCH, params), want, type(cost).__name__)
        steps = engine.spec_policy.choices
        assert plain.rows and len(plain.rows) == len(extend.rows) == steps["plain"]
        assert all(bs in w.graphs["plain"].buckets for bs in plain.rows + extend.rows)  # padded, never ragged
        assert 4 in plain.rows  # the three requests decoding together, padded to 4
        if isinstance(cost, Alternating):
            assert steps["spec"] >= 2  # speculative steps resumed from the plain steps' draft states
            assert w.stats.totals.accept_length > 1.3
        else:
            assert steps["spec"] == 0
            assert plain.rows == [4] * 4 + [2] * 4 + [1] * 3  # 3 rows padded to 4, then 2 and 1 as requests end
        assert engine.is_idle_and_clean()


def test_plain_steps_with_the_extend_phase_off_run_its_extend_eagerly_on_the_padded_rows(oracle_models):
    engine = adaptive(oracle_models, "eagle3", True, DEAR_SPEC, cuda_graph_phases=("decode", "draft"))
    extend = Calls(engine.speculator.graphs["plain_extend"].fn)
    engine.speculator.graphs["plain_extend"].fn = extend
    assert_same_greedy(engine.generate(BATCH, PARAMS), oracle_models.reference(BATCH, PARAMS))
    assert 4 in extend.rows and len(extend.rows) == engine.spec_policy.choices["plain"]
    assert engine.is_idle_and_clean()


def run_to_one_plain_step(models, kind: str, graphs: bool):
    """An adaptive engine after the batch's prefill and one plain decode step."""
    engine = adaptive(models, kind, graphs, DEAR_SPEC, chunk_size=None)
    reqs = [engine.add_request(p, PARAMS) for p in BATCH]
    engine.step()  # the prefill of all three
    engine.step()  # one plain step
    assert engine.spec_policy.choices == {"spec": 0, "plain": 1}
    assert all(len(r.output_ids) == 2 for r in reqs)
    return engine, reqs


def draft_kv(engine, req) -> list[torch.Tensor]:
    """Every draft cache's K and V of ``req``'s cached positions, layer by layer."""
    out = []
    for c, cache in enumerate(engine.speculator.caches):
        slots = cache.slots(req.handles[1 + c], 0, req.kv_len)
        out += [k[slots] for k in cache.k] + [v[slots] for v in cache.v]
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_draft_state_after_a_graph_shaped_plain_step_equals_the_eager_one(oracle_models, kind):
    eager, eager_reqs = run_to_one_plain_step(oracle_models, kind, graphs=False)
    padded, padded_reqs = run_to_one_plain_step(oracle_models, kind, graphs=True)
    for a, b in zip(eager_reqs, padded_reqs):
        sa, sb = a.draft_state, b.draft_state
        assert (sa.bonus_token, sa.committed_len) == (sb.bonus_token, sb.committed_len) == (
            a.output_ids[-1], len(a.prompt_ids) + 1)
        assert torch.allclose(sa.hidden, sb.hidden, atol=1e-5)
        assert torch.allclose(sa.topk_p, sb.topk_p, atol=1e-5) and torch.equal(sa.topk_ids, sb.topk_ids)
        kv_a, kv_b = draft_kv(eager, a), draft_kv(padded, b)
        assert len(kv_a) == len(kv_b) > 0
        assert all(torch.allclose(x, y, atol=1e-5) for x, y in zip(kv_a, kv_b))  # the new position's K/V too
    for engine, reqs in ((eager, eager_reqs), (padded, padded_reqs)):
        for r in reqs:
            engine.abort(r.rid)
        assert engine.is_idle_and_clean()
