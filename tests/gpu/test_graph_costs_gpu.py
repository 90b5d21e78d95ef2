"""On the GPU: an adaptive engine's captured graphs are timed at capture and seed its policy's step costs
(``shared/spec/graph_costs.py``): every shape and the plain step at every captured batch size that is a cost
bucket, so the policy chooses from its first step without running a shape to time it, and stays lossless.

Float32, so the CPU reference is comparable token for token.
"""

import pytest

from shared.config import EngineConfig, SpecConfig
from shared.engine import Engine
from shared.sampling import SamplingParams

pytestmark = pytest.mark.gpu

PROMPTS = [[5, 17, 33, 2, 9, 100, 200, 7], list(range(40, 77)), [3] * 5]
PARAMS = SamplingParams(max_new_tokens=24, ignore_eos=True)


def test_captured_graphs_seed_every_kinds_cost_and_the_policy_needs_no_timing_step(oracle_model_dir):
    config = EngineConfig(device="cuda", dtype="float32", page_size=16, chunk_size=8, cuda_graph=True,
                          cuda_graph_max_bs=16,
                          spec=SpecConfig(topk=4, steps=4, num_draft_tokens=16))  # the default policy: adaptive
    engine = Engine(oracle_model_dir / "target", oracle_model_dir / "eagle3", config)
    policy = engine.spec_policy
    kinds = {*engine.speculator.shapes, "plain"}
    assert policy.kind == "adaptive" and len(kinds) == 6  # the tree of 16, of 8, chains of 3, 2, 1; plain
    engine.capture_graphs()
    assert set(engine.graph_costs) == {(k, b) for k in kinds for b in (1, 2, 4, 8, 16)}
    assert all(0 < s < 1 for s in engine.graph_costs.values()), engine.graph_costs
    assert all(policy.cost.spec_s(b, k) == s for (k, b), s in engine.graph_costs.items())
    assert policy.cost.seconds == {}  # nothing timed by a step yet
    # The widest tree's 16 nodes per row cost more than the 1-step chain's 2 at the largest bucket.
    assert engine.graph_costs[("tree-k4-s4-n16", 16)] > engine.graph_costs[("chain1", 16)]
    for c in policy.candidates:
        c.acceptance.observe([2])  # acceptance known: with every cost seeded, no kind runs only to be timed
    policy.probe_every = 10 ** 6
    best = policy.choose(3)
    assert all(policy.choose(3) == best for _ in range(3))  # the same choice: the seeded costs decided it
    policy.choices, policy.shapes, policy.incumbent = {"spec": 0, "plain": 0}, {}, None
    reference = Engine(oracle_model_dir / "target", None, EngineConfig(page_size=16, chunk_size=8))
    want = [r.token_ids for r in reference.generate(PROMPTS, PARAMS)]
    assert [r.token_ids for r in engine.generate(PROMPTS, PARAMS)] == want
    assert engine.is_idle_and_clean()


def test_a_fixed_engine_times_nothing(oracle_model_dir):
    config = EngineConfig(device="cuda", dtype="float32", page_size=16, chunk_size=8, cuda_graph=True,
                          cuda_graph_max_bs=4, spec=SpecConfig(topk=2, steps=3, num_draft_tokens=6),
                          spec_policy="fixed")
    engine = Engine(oracle_model_dir / "target", oracle_model_dir / "eagle3", config)
    assert engine.capture_graphs() > 0 and engine.graph_costs == {} and engine.spec_policy.cost.prior == {}
