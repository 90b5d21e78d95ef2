"""The adaptive policy's plain step in an engine with a draft, graph-shaped (``ModelRunner._plain_step``).

With CUDA graphs on, a plain step runs as a plain engine's does (padded to a batch-size bucket, replayed
from a graph on a GPU): the target's decode forward capturing the draft's features (``plain``). By default
the features wait in the draft's backlog (``shared/spec/backlog.py``) and the draft catches up over them in
one extend before the next speculative step or when a backlog is full; with ``spec_draft_backlog=0`` the
draft runs over the one new position at once (``plain_extend``). On the CPU the same phases run eagerly on
the padded rows. Either must leave the draft state the eager plain step (``ModelRunner._target_step``) leaves
run by run, so the next speculative step is unchanged: greedy output equals the fixed engine's and the
target's alone, for every draft kind, with plain steps only and with the policy switching every step. The
GPU tests (``tests/gpu/test_plain_step_graphs_gpu.py``) check the replayed graphs.
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
    """An adaptive engine whose acceptance is known, so that the injected ``cost`` alone decides; its plain steps
    run the draft over their positions at once unless ``cfg`` gives ``spec_draft_backlog``."""
    cfg = {"spec_draft_backlog": 0, **cfg}
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
    backlog = adaptive(oracle_models, "eagle3", True, DEAR_SPEC, spec_draft_backlog=8).speculator.graphs
    assert backlog["plain"].enabled and "plain_extend" not in backlog  # the draft waits: no extend to capture


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


# ---- the draft's backlog (shared/spec/backlog.py) ------------------------------------------------------------
def run_plain_steps(models, kind: str, graphs: bool, backlog: int, steps: int):
    """An adaptive engine after the batch's prefill and ``steps`` plain decode steps."""
    engine = adaptive(models, kind, graphs, DEAR_SPEC, chunk_size=None, spec_draft_backlog=backlog)
    reqs = [engine.add_request(p, PARAMS) for p in BATCH]
    for _ in range(1 + steps):  # the prefill of all three, then the plain steps
        engine.step()
    assert engine.spec_policy.choices == {"spec": 0, "plain": steps}
    return engine, reqs


@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("kind", KINDS)
def test_plain_steps_leave_the_draft_behind_and_one_catch_up_leaves_what_the_per_step_extends_did(
        oracle_models, kind, graphs):
    at_once, at_once_reqs = run_plain_steps(oracle_models, kind, graphs, backlog=0, steps=5)
    later, later_reqs = run_plain_steps(oracle_models, kind, graphs, backlog=8, steps=5)
    w = later.speculator
    assert w.stats.catch_up == {"extends": 0, "positions": 0}
    for a, b in zip(at_once_reqs, later_reqs):
        assert a.output_ids == b.output_ids and a.kv_len == b.kv_len == len(a.prompt_ids) + 5
        assert a.draft_state.committed_len == a.kv_len  # the draft ran over every position ...
        assert b.draft_state.committed_len == len(b.prompt_ids)  # ... or waits where the prompt ended
    w.catch_up(later_reqs)
    assert w.stats.catch_up == {"extends": 1, "positions": 3 * 5}
    for a, b in zip(at_once_reqs, later_reqs):
        sa, sb = a.draft_state, b.draft_state
        assert (sa.bonus_token, sa.committed_len) == (sb.bonus_token, sb.committed_len)
        assert torch.allclose(sa.hidden, sb.hidden, atol=1e-5)
        assert torch.allclose(sa.topk_p, sb.topk_p, atol=1e-5) and torch.equal(sa.topk_ids, sb.topk_ids)
        kv_a, kv_b = draft_kv(at_once, a), draft_kv(later, b)
        assert len(kv_a) == len(kv_b) > 0
        assert all(torch.allclose(x, y, atol=1e-5) for x, y in zip(kv_a, kv_b))  # every caught-up position's K/V
    for engine, reqs in ((at_once, at_once_reqs), (later, later_reqs)):
        for r in reqs:
            engine.abort(r.rid)
        assert engine.is_idle_and_clean()


@pytest.mark.parametrize("graphs", [False, True])
def test_a_full_backlog_catches_every_request_of_the_step_up_and_none_is_ever_further_behind(oracle_models, graphs):
    limit = 4
    engine = adaptive(oracle_models, "eagle3", graphs, DEAR_SPEC, spec_draft_backlog=limit)
    w = engine.speculator
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (12, 9, 11)]
    reqs = [engine.add_request(p, q) for p, q in zip(BATCH, params)]
    engine.step()  # the prefill: every request's draft up to date
    behind_seen = []
    while engine.has_work_to_step():
        engine.step()
        behind_seen.append([r.kv_len - r.draft_state.committed_len for r in reqs if r.finish_reason is None])
    assert max(max(b, default=0) for b in behind_seen) == limit - 1  # full at ``limit``: caught up in that step
    # The three fill together: each catch-up (after every 4th plain step) takes all of them at once; the second
    # not the request of 9 tokens (8 plain steps), which ended in that step. None is caught up at its end.
    assert w.stats.catch_up == {"extends": 2, "positions": 3 * 4 + 2 * 4}
    assert engine.spec_policy.choices["spec"] == 0
    want = first_tokens(oracle_models.reference(BATCH, PARAMS), [12, 9, 11])
    assert_same_greedy([engine.result(r) for r in reqs], want)
    assert engine.is_idle_and_clean()


@pytest.mark.parametrize("kind", KINDS)
def test_the_policy_switching_every_step_accepts_the_same_with_and_without_the_backlog(oracle_models, kind):
    want = oracle_models.reference(BATCH, PARAMS)
    stats = []
    for backlog in (0, 2):  # 2: plain runs overflow it too
        engine = adaptive(oracle_models, kind, True, Alternating(), spec_draft_backlog=backlog)
        assert_same_greedy(engine.generate(BATCH, PARAMS), want, f"backlog {backlog}")
        assert engine.spec_policy.choices["spec"] >= 2 and engine.spec_policy.choices["plain"] >= 2
        stats.append((engine.speculator.stats.totals.accepted_drafts, engine.speculator.stats.totals.verify_steps))
        assert engine.is_idle_and_clean()
    assert stats[0] == stats[1]  # every speculative step drafted from the same state
