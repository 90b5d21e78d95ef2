"""The adaptive policy among several tree shapes (``shared/spec/policy.py``, ``SpecWorker.shapes``).

The policy runs, per step, the shape (or plain step) with the most expected tokens per second, from each
shape's own acceptance and step costs (injected here); a chain's verify steps also measure every shallower
chain; shapes not chosen are probed, less and less often while they keep losing. In the engine, a step of
any shape may follow a step of any other (or a plain step): greedy output stays the target's alone, for
EAGLE and EAGLE-3, a chain and a tree configured, with drafts launched ahead or not.
"""

from __future__ import annotations

import pytest
from spec_helpers import PROMPTS, assert_same_greedy

from shared.config import EngineConfig, SpecConfig, default_candidates
from shared.sampling import SamplingParams
from shared.spec.policy import MeasuredCost, SpecPolicy
from tests.policy_costs import Rotating

TREE = SpecConfig(topk=4, steps=3, num_draft_tokens=8)
SHAPES = default_candidates(TREE)  # tree-k4-s3-n8, chain3, chain2, chain1
NODES = {s.name: s.num_draft_tokens for s in SHAPES}


class VerifyCost:
    """A step costs 10 ms plus 0.2 ms per token verified (batch x tree nodes; a plain step: batch)."""

    def decode_s(self, batch):
        return 0.010 + 0.0002 * batch

    def spec_s(self, batch, shape):
        return 0.010 + 0.0002 * batch * NODES[shape]


def observed(policy: SpecPolicy) -> SpecPolicy:
    """Acceptance known: the tree's drafts all accepted (4 tokens a step), the chain's reach positions 0 and 1
    three and two times in four (2.25 tokens a step for the chains of 3 and 2, 1.75 for the chain of 1)."""
    policy.observe("tree-k4-s3-n8", 4, [4, 4, 4])
    policy.observe("chain3", 4, [3, 2, 0])  # the chains of 2 and 1 learn from it
    return policy


def test_shapes_and_names_round_trip_and_must_fit_the_configured_one():
    assert [s.name for s in SHAPES] == ["tree-k4-s3-n8", "chain3", "chain2", "chain1"]
    assert all(SpecConfig.parse(s.name) == s for s in SHAPES)
    config = EngineConfig(spec=TREE, spec_policy="adaptive", spec_candidates="chain1, tree-k2-s2-n4")
    assert [s.name for s in config.spec_shapes()] == ["tree-k4-s3-n8", "chain1", "tree-k2-s2-n4"]
    assert EngineConfig(spec=TREE, spec_policy="fixed", spec_candidates="chain1").spec_shapes() == (TREE,)  # the one
    with pytest.raises(ValueError, match="does not fit"):
        EngineConfig(spec=TREE, spec_policy="adaptive", spec_candidates="chain4")
    with pytest.raises(ValueError, match="neither"):
        EngineConfig(spec=TREE, spec_policy="adaptive", spec_candidates="bush3")


def test_a_chain_measures_the_shallower_chains_and_only_them():
    p = observed(SpecPolicy.of("adaptive", list(SHAPES), VerifyCost()))
    tokens = {c.name: c.tokens for c in p.candidates}
    assert tokens == pytest.approx({"tree-k4-s3-n8": 4.0, "chain3": 2.25, "chain2": 2.25, "chain1": 1.75})
    p.observe("chain1", 4, [0, 0, 0])  # a shallower chain's steps say nothing of the deeper ones
    assert [c.tokens for c in p.candidates] == pytest.approx([4.0, 2.25, 2.25, 1 + 3 * 0.98 / (4 * 0.98 + 4)])


def test_adaptive_picks_the_shape_with_the_most_tokens_per_second_at_each_batch():
    cost = VerifyCost()
    picks = {}
    for batch in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512):
        p = observed(SpecPolicy.of("adaptive", list(SHAPES), cost))
        rates = {None: 1 / cost.decode_s(batch)} | {c.name: (1 - p.margin) * c.tokens / cost.spec_s(batch, c.name)
                                                     for c in p.candidates}  # a shape only past the margin
        picks[batch] = p.choose(batch)
        assert picks[batch] == max(rates, key=rates.get), (batch, rates)
    assert picks[1] == "tree-k4-s3-n8" and picks[512] is None
    assert len(set(picks.values())) >= 4  # the tree, chains, plain: each wins somewhere
    assert SpecPolicy.of("fixed", list(SHAPES), cost).choose(128) == "tree-k4-s3-n8"  # fixed: the configured


def test_unknown_shapes_are_measured_first_then_the_plain_step():
    p = SpecPolicy.of("adaptive", list(SHAPES), MeasuredCost())
    seen = []
    for _ in range(len(SHAPES) + 1):
        seen.append(p.choose(4))
        if seen[-1] is not None:
            p.observe(seen[-1], 4, [2, 1, 0][:3])
        p.cost.record(seen[-1] or "plain", 4, 0.01)
    assert seen == ["tree-k4-s3-n8", "chain3", "chain2", "chain1", None]


def test_losing_shapes_are_probed_ever_less_often_and_covered_chains_never():
    """At batch 32 a short chain wins; the tree and the chain of 3 are probed (the chain of 3's steps measure
    the shallower chains too), every 16 steps at first, then twice as far apart after each probe that lost."""
    p = observed(SpecPolicy.of("adaptive", list(SHAPES), VerifyCost()))
    when: dict[str | None, list[int]] = {}
    for step in range(600):
        name = p.choose(32)
        when.setdefault(name, []).append(step)
        if name == "tree-k4-s3-n8":
            p.observe(name, 8, [8, 8, 8])
        elif name is not None:
            p.observe(name, 8, [6, 4, 0][:int(name[-1])])
    best = max(when, key=lambda n: len(when[n]))
    assert best in ("chain1", "chain2") and len(when[best]) > 0.97 * 600
    assert set(when) == {best, "tree-k4-s3-n8", "chain3"}  # the other short chain and plain: never
    for probed in ("tree-k4-s3-n8", "chain3"):
        gaps = [b - a for a, b in zip(when[probed], when[probed][1:])]
        assert when[probed][0] in (15, 16) and gaps[0] in (32, 33), (probed, when[probed])  # 16 steps, then 32
        assert gaps == sorted(gaps) and gaps[-1] == p.max_probe_every, (probed, gaps)


CONFIGS = {"chain": dict(topk=1, steps=3), "tree": dict(topk=3, steps=3, ndt=8,
                                                       spec_candidates=("tree-k2-s3-n6", "chain2", "chain1"))}
BATCH = [PROMPTS[0], PROMPTS[2], PROMPTS[4]]


@pytest.mark.parametrize("ahead", [False, True], ids=["drafted", "ahead"])
@pytest.mark.parametrize("shape", sorted(CONFIGS))
@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_greedy_equals_target_only_with_the_shape_switching_every_step(oracle_models, kind, shape, ahead):
    params = SamplingParams(max_new_tokens=14, ignore_eos=True)
    engine = oracle_models.engine(kind, spec_policy="adaptive", spec_draft_ahead=ahead, **CONFIGS[shape])
    names = list(engine.speculator.shapes)
    policy = engine.spec_policy
    policy.cost, policy.probe_every = Rotating(names + [None] + names[::-1]), 10 ** 6
    for c in policy.candidates:
        c.acceptance.observe([2])  # known acceptance: the costs decide
    assert_same_greedy(engine.generate(BATCH, params), oracle_models.reference(BATCH, params))
    assert set(policy.shapes) == set(names) and policy.choices["plain"] >= 1
    assert engine.spec_stats.totals.accept_length > 1.2  # the oracle drafts are accepted (fixed chains: 1.2-1.6)
    assert engine.speculator.ahead.mismatched == 0 and (engine.speculator.ahead.dropped > 0) == ahead
    assert engine.is_idle_and_clean()


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_every_shape_replays_its_own_graphs_and_stays_lossless_on_the_gpu(oracle_models_cuda, kind, page_size):
    """Real CUDA graphs, drafts launched ahead (on by default on CUDA): each shape captures its own draft and
    verify + extend graphs (names suffixed with the shape's), and switching every step keeps greedy output."""
    params = SamplingParams(max_new_tokens=14, ignore_eos=True)
    engine = oracle_models_cuda.engine(kind, spec_policy="adaptive", cuda_graph=True, page_size=page_size,
                                       **CONFIGS["tree"])
    names = list(engine.speculator.shapes)
    captured = engine.capture_graphs()
    assert {"draft.chain1", "verify_extend.tree-k2-s3-n6"} <= set(engine.graph_capture_s())
    policy = engine.spec_policy
    policy.cost, policy.probe_every = Rotating(names + [None] + names[::-1]), 10 ** 6
    for c in policy.candidates:
        c.acceptance.observe([2])
    assert_same_greedy(engine.generate(BATCH, params), oracle_models_cuda.reference(BATCH, params))
    assert set(policy.shapes) == set(names) and engine.capture_graphs() == captured  # nothing captured late
    assert all(engine.speculator.shapes[n].graphs["verify_extend"].captured_sizes for n in names)
    assert engine.is_idle_and_clean()
