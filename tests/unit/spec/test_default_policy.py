"""The adaptive policy is the default, over shapes that cover the batch range, from costs known at start.

With a draft and no tree setting, a service's engine gets ``ADAPTIVE_TREE`` (topk 4, 4 steps, 16 tokens) and the
adaptive policy over its default shapes: that tree for the smallest batches, a tree of 8 tokens, chains of 3 to 1
for the middle and the plain step beyond. Where CUDA graphs are captured their replays seed the policy's costs
(``shared/spec/graph_costs.py``, its GPU test in tests/gpu/test_graph_costs_gpu.py): seeded, the policy chooses
from its first step by those costs and the acceptance it measured; on the CPU nothing is timed at start and each
kind's own steps are.
"""

from __future__ import annotations

import pytest

from services.settings import ADAPTIVE_TREE, EngineOptions
from shared.config import EngineConfig, SpecConfig, default_candidates
from shared.sampling import SamplingParams
from shared.spec.policy import MeasuredCost, SpecPolicy

DEFAULT_SHAPES = ["tree-k4-s4-n16", "tree-k4-s4-n8", "chain3", "chain2", "chain1"]


def test_adaptive_is_the_default_with_a_draft_and_its_shapes_fit_the_configured_tree():
    assert EngineConfig().spec_policy == "adaptive"
    config = EngineOptions(model="m", draft="d").engine_config()
    assert config.spec == ADAPTIVE_TREE and config.spec_policy == "adaptive"
    assert [s.name for s in config.spec_shapes()] == DEFAULT_SHAPES
    assert all(config.spec.holds(s) for s in config.spec_shapes())
    # Fixed runs the configured tree alone; the tree does not depend on the policy (a prefill instance agrees).
    fixed = EngineOptions(model="m", draft="d", spec_policy="fixed").engine_config()
    assert fixed.spec == ADAPTIVE_TREE and fixed.spec_shapes() == (ADAPTIVE_TREE,)
    # A tree setting given: the others take SpecConfig's defaults, as before.
    assert EngineOptions(model="m", draft="d", spec_topk=1).engine_config().spec == SpecConfig()
    assert EngineOptions(model="m", draft="d", spec_topk=2).engine_config().spec == SpecConfig(
        topk=2, steps=3, num_draft_tokens=8)
    with pytest.raises(ValueError, match="num_draft_tokens"):
        EngineOptions(model="m", draft="d", spec_draft_tokens=9).engine_config()
    # The half-budget tree only where it verifies more than a chain of the same depth.
    assert [s.name for s in default_candidates(SpecConfig(topk=4, steps=3, num_draft_tokens=8))] == [
        "tree-k4-s3-n8", "chain3", "chain2", "chain1"]
    assert [s.name for s in default_candidates(SpecConfig(topk=1, steps=5, num_draft_tokens=6))] == [
        "chain5", "chain3", "chain2", "chain1"]


# Seconds per step by kind and batch bucket, shaped like the 8B-shape figures (docs/benchmarks.md): at batch 1 a
# step costs little more than a plain one whatever its shape, at 16 the wide trees' verify costs several plain
# steps, at 128 every speculative step costs more than its tokens are worth.
SEEDS = {1: {"plain": 6.4, "tree-k4-s4-n16": 9.3, "tree-k4-s4-n8": 9.1, "chain3": 8.1, "chain2": 7.6, "chain1": 7.0},
         16: {"plain": 9.0, "tree-k4-s4-n16": 40.0, "tree-k4-s4-n8": 25.0, "chain3": 14.0, "chain2": 12.0,
              "chain1": 11.0},
         128: {"plain": 20.0, "tree-k4-s4-n16": 300.0, "tree-k4-s4-n8": 160.0, "chain3": 70.0, "chain2": 55.0,
               "chain1": 45.0}}


def seeded_policy() -> SpecPolicy:
    """The default shapes' policy with every kind's cost seeded at buckets 1, 16 and 128 and the acceptance of
    100 drafts per shape known (the tree of 16 commits 3 tokens a step, of 8 2.6, the chain of 3 2.2, of 2 2.05,
    of 1 1.7: the chains' from the chain of 3's verify steps)."""
    cost = MeasuredCost()
    for batch, kinds in SEEDS.items():
        for kind, ms in kinds.items():
            cost.seed(kind, batch, ms / 1000)
    policy = SpecPolicy.of("adaptive", [SpecConfig.parse(n) for n in DEFAULT_SHAPES], cost)
    policy.probe_every = policy.max_probe_every = 10 ** 6  # no probe: the choices alone
    policy.observe("tree-k4-s4-n16", 100, [80, 60, 40, 20])
    policy.observe("tree-k4-s4-n8", 100, [70, 50, 30, 10])
    policy.observe("chain3", 100, [70, 35, 15])
    return policy


def test_seeded_costs_choose_a_deep_tree_at_batch_1_a_chain_at_16_and_plain_at_128():
    policy = seeded_policy()
    assert [round(c.tokens, 2) for c in policy.candidates] == [3.0, 2.6, 2.2, 2.05, 1.7]
    assert policy.choose(1) == "tree-k4-s4-n16"
    assert policy.choose(16) == "chain2"  # 2.05 / 12 ms beats 2.2 / 14, 1.7 / 11, 1 / 9 and the trees
    assert policy.choose(128) is None  # 1 / 20 ms beats every shape (1.7 / 45 at best)
    assert policy.choose(100) is None and policy.choose(9) == "chain2"  # the same buckets
    assert policy.steps_by_kind() == {"tree-k4-s4-n16": 1, "tree-k4-s4-n8": 0, "chain3": 0, "chain2": 2,
                                      "chain1": 0, "plain": 2}


def test_a_kinds_own_steps_replace_its_seeded_cost():
    cost = MeasuredCost()
    cost.seed("chain1", 8, 0.010)
    assert cost.spec_s(5, "chain1") == 0.010 and cost.spec_s(16, "chain1") is None and cost.decode_s(8) is None
    cost.record("chain1", 7, 0.030)  # the step's own time, the host's work included
    assert cost.spec_s(8, "chain1") == 0.030
    cost.record("chain1", 8, 0.020)
    assert cost.spec_s(8, "chain1") == pytest.approx(0.025) and cost.prior[("chain1", 8)] == 0.010


def test_on_the_cpu_nothing_is_timed_at_start_and_each_kind_is_timed_by_its_steps(oracle_models):
    engine = oracle_models.engine("eagle3", topk=2, steps=3, ndt=6)  # the default policy: adaptive
    assert engine.spec_policy.kind == "adaptive" and len(engine.spec_policy.candidates) == 4
    assert engine.capture_graphs() == 0 and engine.graph_costs == {} and engine.spec_policy.cost.prior == {}
    engine.generate([3, 4, 5, 6, 7], SamplingParams(max_new_tokens=24, ignore_eos=True))
    kinds = {k for k, _ in engine.spec_policy.cost.seconds}
    assert kinds and kinds <= {*engine.speculator.shapes, "plain"}
    assert engine.is_idle_and_clean()


def test_a_batch_past_the_timed_buckets_is_decided_on_the_largest_timed_one_scaled_not_explored():
    """Graph costs seeded up to 32 rows only (capture stopped there): at 64 and 128 every kind is estimated from
    its 32-row cost scaled with the batch, so the policy decides (the chain of 2, as at 32) instead of trying the
    first shape, the 16-token tree, whose eager steps cost 67-207 ms at those batches on an H100."""
    cost = MeasuredCost()
    for kind, ms in {"plain": 9.0, "tree-k4-s4-n16": 40.0, "tree-k4-s4-n8": 25.0, "chain3": 14.0, "chain2": 12.0,
                     "chain1": 11.0}.items():
        cost.seed(kind, 32, ms / 1000)
    policy = SpecPolicy.of("adaptive", [SpecConfig.parse(n) for n in DEFAULT_SHAPES], cost)
    policy.probe_every = policy.max_probe_every = 10 ** 6
    policy.observe("tree-k4-s4-n16", 100, [80, 60, 40, 20])
    policy.observe("tree-k4-s4-n8", 100, [70, 50, 30, 10])
    policy.observe("chain3", 100, [70, 35, 15])
    assert policy._cost(128, "chain2") == pytest.approx(0.012 * 4) and policy._cost(128, "plain") == 0.036
    assert policy.choose(64) == "chain2" and policy.choose(128) == "chain2"
    cost.record("chain2", 128, 0.2)  # measured: far dearer than the guess
    cost.record("chain2", 128, 0.2)
    assert policy.choose(128) == "chain3"  # 2.2 / 56 ms (guessed) now beats 2.05 / 200 ms (measured) and 1 / 36


def test_a_step_with_prefill_chunks_runs_plain_and_explores_nothing():
    """Under the adaptive policy a step with prefill chunks is plain: its decode rows ride in the chunks' forward,
    where a speculative step would need a verify forward of its own, for fewer tokens per second than that step
    gives alone (``SpecPolicy.choose``). Nothing is explored or probed there; ``fixed`` and a pinned step still
    speculate."""
    cost = MeasuredCost()
    cost.seed("plain", 8, 0.009)
    cost.seed("chain3", 8, 0.014)
    policy = SpecPolicy.of("adaptive", [SpecConfig.parse(n) for n in ("tree-k4-s4-n16", "chain3")], cost)
    policy.observe("chain3", 100, [70, 35, 15])  # the tree's acceptance and cost are unknown
    assert policy.choose(8) == "tree-k4-s4-n16"  # a decode step, which times it, tries it ...
    policy.observe("tree-k4-s4-n16", 100, [95, 90, 85, 80])
    cost.seed("tree-k4-s4-n16", 8, 0.010)  # ... and finds it best by far (4.5 / 10 ms)
    assert policy.choose(8) == "tree-k4-s4-n16"
    assert [policy.choose(8, mixed=True) for _ in range(3)] == [None] * 3  # plain all the same
    policy.probe_every = 1  # every step would probe the chain ...
    assert policy.choose(8, mixed=True) is None  # ... but not a mixed one
    assert policy.choose(8, pinned=True, mixed=True) == "tree-k4-s4-n16"  # a seeded request: the configured shape
    fixed = SpecPolicy.of("fixed", [SpecConfig.parse("chain3")], MeasuredCost())
    assert fixed.choose(8, mixed=True) == "chain3"


def test_a_mixed_step_neither_asks_a_kind_again_nor_times_the_step_after_it():
    """A mixed step's plain kind is the chunks' choice, not a switch: the speculative shape that ran before it is
    chosen on, not a plain step forced to be timed; the step after it, which may wait for the mixed step's tail,
    is not recorded, the one after that is."""
    cost = MeasuredCost()
    policy = SpecPolicy.of("adaptive", [SpecConfig.parse("chain3")], cost)
    policy.ran("chain3", 8, 0.014)
    policy.ran("chain3", 8, 0.014)  # recorded
    policy.ran("plain", 8, 0.030, timed=False, mixed=True)
    assert policy.again is None and policy.last is None
    policy.ran("chain3", 8, 0.050)  # waited for the mixed step's tail: not the kind's time
    assert cost.counts[("chain3", 8)] == 1 and policy.again is None
    policy.ran("chain3", 8, 0.016)
    assert cost.counts[("chain3", 8)] == 2


def test_a_shape_runs_only_where_its_graphs_cover_the_batch():
    """``graphed``: the largest batch each kind's step runs as CUDA graphs. Past it a shape is neither chosen,
    explored, probed nor run again to be timed; plain always may run."""
    policy = seeded_policy()
    policy.graphed = {"tree-k4-s4-n16": 32, "tree-k4-s4-n8": 64, "chain3": 128, "chain2": 8, "chain1": 128,
                      "plain": 128}
    assert policy.choose(1) == "tree-k4-s4-n16"  # as without graphs: it is covered at 1
    assert policy.choose(16) == "chain3"  # chain2 (the best at 16) is graphed to 8 only: 2.2 / 14 ms next
    policy.again = "chain2"  # a switch to be timed at the next step: not at a batch it is not graphed for
    assert policy.choose(16) == "chain3" and policy.again == "chain2"
    assert policy.choose(8) == "chain2" and policy.again is None
    policy.graphed = {"plain": 128}  # no shape graphed at 128
    policy.probe_every = 1  # and every shape due for a probe
    assert [policy.choose(128) for _ in range(3)] == [None] * 3
    fresh = SpecPolicy.of("adaptive", [SpecConfig.parse("chain3")], MeasuredCost())
    fresh.graphed = {"chain3": 4}
    assert fresh.choose(16) is None and fresh.choose(2) == "chain3"  # unknown: explored only where graphed


def test_an_adaptive_engines_wide_shapes_get_graphs_up_to_a_token_budget_and_a_fixed_one_to_max_running():
    from shared.spec.worker import ADAPTIVE_GRAPH_TOKENS, shape_graph_rows

    tree, chain = SpecConfig.parse("tree-k4-s4-n16"), SpecConfig.parse("chain3")
    assert ADAPTIVE_GRAPH_TOKENS == 512
    assert shape_graph_rows(tree, 128, adaptive=True) == 32 and shape_graph_rows(chain, 128, adaptive=True) == 128
    assert shape_graph_rows(tree, 128, adaptive=False) == 128 and shape_graph_rows(tree, 16, adaptive=True) == 16


def test_each_shapes_graph_buckets_stop_at_its_own_rows(oracle_models):
    engine = oracle_models.engine("eagle3", topk=4, steps=4, ndt=16, max_running=64, cuda_graph=True)
    shapes = engine.speculator.shapes
    tops = {name: max(sh.graphs["draft"].buckets) for name, sh in shapes.items()}
    assert tops["tree-k4-s4-n16"] == 32 and tops["tree-k4-s4-n8"] == 64 and tops["chain3"] == 64
    assert max(engine.speculator.graphs["plain"].buckets) == 64
    assert engine.capture_graphs() == 0 and engine.spec_policy.graphed is None  # the CPU captures nothing


def test_graphed_batches_count_a_contained_capture_failure_as_eager_and_leave_all_eager_shapes_unlimited(oracle_models):
    engine = oracle_models.engine("eagle3", topk=4, steps=4, ndt=16, max_running=64, cuda_graph=True,
                                  spec_draft_backlog=0)  # the plain steps' draft extend graphs too
    w = engine.speculator
    for sh in w.shapes.values():  # as after a capture on a GPU: every bucket captured
        for p in sh.graphs.values():
            p.capture, p._graphs = True, {b: None for b in p.buckets}
    w.graphs["plain"].capture = w.graphs["plain_extend"].capture = True
    w.graphs["plain"]._graphs = w.graphs["plain_extend"]._graphs = {b: None for b in w.graphs["plain"].buckets}
    assert w.graphed_batches() == {"tree-k4-s4-n16": 32, "tree-k4-s4-n8": 64, "chain3": 64, "chain2": 64,
                                   "chain1": 64, "plain": 64}
    w.shapes["chain3"].graphs["verify_extend"].capture = False  # its capture failed: the phase runs eagerly
    assert w.graphed_batches()["chain3"] == 0
    for p in w.shapes["chain2"].graphs.values():
        p.enabled = False  # configured eager: not limited by graphs
    assert w.graphed_batches()["chain2"] == 64
    for sh in w.shapes.values():
        for p in sh.graphs.values():
            p._graphs = {}  # nothing is replayed on the CPU


def test_a_probe_at_a_bucket_known_only_by_scaling_backs_off_on_the_estimate():
    """A probe chosen on a scaled estimate (the bucket untimed) and not timed itself (the first step after a switch)
    is judged against the same estimate: the bucket's own cost is still unknown."""
    cost = MeasuredCost()
    cost.seed("plain", 8, 0.009)
    cost.seed("chain3", 8, 0.014)
    cost.seed("tree-k4-s4-n16", 8, 0.040)
    policy = SpecPolicy.of("adaptive", [SpecConfig.parse(n) for n in ("tree-k4-s4-n16", "chain3")], cost)
    policy.observe("chain3", 100, [70, 35, 15])
    policy.observe("tree-k4-s4-n16", 100, [10, 5, 2, 1])
    policy.probe_every = 1
    assert policy.choose(16) == "tree-k4-s4-n16"  # a probe: its 16-row cost is the 8-row one scaled
    policy.observe("tree-k4-s4-n16", 100, [10, 5, 2, 1])  # the probe's verify, its time not recorded
    assert policy.choose(16) in ("chain3", "tree-k4-s4-n16", None)  # judged on the estimate: no error (None:
    # plain's own probe, due at every step here)
    assert policy._candidate("tree-k4-s4-n16").probe_interval == 2


def test_a_batch_just_past_a_bucket_is_costed_near_it_not_at_the_next():
    """A prompt or two joining 32 streams (33-34 rows): the costs between the timed 32 and 64 are interpolated,
    so the policy keeps the chain it runs at 32 rows instead of costing every kind at 64 rows (where plain wins:
    the verify grows faster with the batch), and a 33-row step's own time goes into the 32-row bucket."""
    cost = MeasuredCost()
    for batch, kinds in {32: {"plain": 9.0, "chain3": 14.0, "chain2": 12.0, "chain1": 11.0},
                         64: {"plain": 11.0, "chain3": 30.0, "chain2": 24.0, "chain1": 20.0}}.items():
        for kind, ms in kinds.items():
            cost.seed(kind, batch, ms / 1000)
    policy = SpecPolicy.of("adaptive", [SpecConfig.parse(n) for n in ("chain3", "chain2", "chain1")], cost)
    policy.probe_every = policy.max_probe_every = 10 ** 6  # no probe: the choices alone
    policy.observe("chain3", 100, [70, 35, 15])
    assert policy.choose(32) == "chain2" and policy.choose(64) is None
    assert policy.choose(33) == "chain2" and policy.choose(34) == "chain2"
    assert cost.spec_s(33, "chain2") == pytest.approx(0.012 + 0.012 / 32)
    assert cost.spec_s(48, "plain") == pytest.approx(0.010)
    cost.record("chain2", 33, 0.0125)
    assert cost.counts == {("chain2", 32): 1} and cost.spec_s(32, "chain2") == pytest.approx(0.0125)
    cost.record("plain", 48, 0.010)  # halfway: the larger bucket
    assert ("plain", 64) in cost.counts


def test_no_probe_right_after_a_mixed_step_whose_successor_cannot_be_timed():
    """The step after a mixed step is not timed (it may wait for the mixed step's tail) and its kind is not run
    again: a probe there would cost a switch and learn no cost. The probe due waits for the next decode step."""
    cost = MeasuredCost()
    cost.seed("plain", 8, 0.009)
    cost.seed("chain3", 8, 0.014)
    cost.seed("chain2", 8, 0.013)
    policy = SpecPolicy.of("adaptive", [SpecConfig.parse(n) for n in ("tree-k4-s4-n8", "chain3")], cost)
    cost.seed("tree-k4-s4-n8", 8, 0.030)
    policy.observe("chain3", 100, [90, 80, 70])
    policy.observe("tree-k4-s4-n8", 100, [90, 80, 70, 60])
    policy.probe_every = 1  # every decode step would probe the tree (3.0 / 30 ms loses to 3.4 / 14 ms)
    assert policy.choose(8) == "tree-k4-s4-n8"  # a probe
    policy.ran("tree-k4-s4-n8", 8, 0.030)
    assert policy.choose(8, mixed=True) is None
    policy.ran("plain", 8, 0.030, timed=False, mixed=True)
    assert policy.choose(8) == "chain3"  # right after the mixed step: the best, no probe of the tree or plain
    policy.ran("chain3", 8, 0.014)
    assert policy.choose(8) in ("tree-k4-s4-n8", None)  # the next decode step probes again


def test_a_bucket_never_timed_is_its_prior_times_what_timed_steps_cost_over_theirs():
    """A prior is a graph's replay (the device alone); a step's own time holds the host's work. Where a kind was
    timed at some bucket, its other buckets' priors are scaled by that bucket's ratio (the nearest timed one), so
    a small batch's estimate holds the host's share as a large one's measured it; a kind never timed keeps its
    priors (H100, c128: plain 12.5 ms against 7.3 at capture, a chain of 3 25.2 against 15.1)."""
    cost = MeasuredCost()
    for kind, small, large in (("plain", 0.0059, 0.0073), ("chain3", 0.0078, 0.0151), ("chain2", 0.0073, 0.0137)):
        cost.seed(kind, 8, small)
        cost.seed(kind, 128, large)
    for _ in range(3):
        cost.record("plain", 128, 0.0125)
        cost.record("chain3", 128, 0.0252)
    assert cost.decode_s(128) == pytest.approx(0.0125) and cost.spec_s(128, "chain3") == pytest.approx(0.0252)
    assert cost.decode_s(8) == pytest.approx(0.0059 * 0.0125 / 0.0073)
    assert cost.spec_s(8, "chain3") == pytest.approx(0.0078 * 0.0252 / 0.0151)
    assert cost.spec_s(8, "chain2") == pytest.approx(0.0073)  # never timed: its prior
    cost.record("chain3", 8, 0.011)  # timed there now: its own time, and 16's prior scales by 8's ratio (nearer)
    cost.seed("chain3", 16, 0.008)
    assert cost.spec_s(8, "chain3") == pytest.approx(0.011)
    assert cost.spec_s(16, "chain3") == pytest.approx(0.008 * 0.011 / 0.0078)


@pytest.mark.parametrize("gain, speculates", [(1.03, False), (1.10, True)])
def test_a_shape_must_beat_plain_by_the_margin_to_be_chosen(gain, speculates):
    """Near parity plain runs: a shape's expected tokens lag the traffic and a switch to it costs a step, so it is
    chosen only past ``margin`` (5%) over plain; well past it, it is."""
    cost = MeasuredCost()
    cost.seed("plain", 128, 0.0125)
    cost.seed("chain3", 128, 0.025)
    policy = SpecPolicy.of("adaptive", [SpecConfig.parse("chain3")], cost)
    policy.probe_every = policy.max_probe_every = 10 ** 6
    drafts = 1000  # every first draft accepted, some second ones: E = 2 * gain, gain x plain's rate
    policy.observe("chain3", drafts, [drafts, round((2 * gain - 2) * drafts), 0])
    assert (policy.choose(128) is not None) == speculates
