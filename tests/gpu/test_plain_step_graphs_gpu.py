"""On the GPU: the adaptive policy's plain step in an engine with a draft is replayed from CUDA graphs (the
target's decode forward with the draft's features; with ``spec_draft_backlog=0`` then the draft over the one new
position, by default the features wait in the draft's backlog for one catch-up extend), gives the eager plain
step's tokens and draft state, and its graphs are captured ahead with the others.

Float32, so the CPU reference is comparable token for token. The costs are injected so that the policy
runs plain steps only (or switches every step), whatever the GPU's timings.
"""

import pytest
import torch

from shared.config import EngineConfig, SpecConfig
from shared.engine import Engine
from shared.sampling import SamplingParams

pytestmark = pytest.mark.gpu

PROMPTS = [[5, 17, 33, 2, 9, 100, 200, 7], list(range(40, 77)), [3] * 5]
PARAMS = SamplingParams(max_new_tokens=20, ignore_eos=True)


class Cost:
    """Seconds per plain and per speculative step: ``spec`` gives the speculative step's by call number."""

    def __init__(self, spec):
        self.spec, self.calls = spec, 0

    def decode_s(self, batch):
        return 0.01

    def spec_s(self, batch, shape):
        self.calls += 1
        return self.spec(self.calls)


def plain_only():
    return Cost(lambda n: 1.0)


def switching():
    return Cost(lambda n: 0.001 if n % 2 else 1.0)


def adaptive(model_dir, kind, device, graphs, cost, **cfg):
    config = EngineConfig(**{"device": device, "dtype": "float32", "page_size": 16, "chunk_size": 8,
                             "cuda_graph": graphs,
                             "cuda_graph_max_bs": 8, "spec": SpecConfig(topk=2, steps=3, num_draft_tokens=6),
                             "spec_policy": "adaptive", "spec_candidates": (), **cfg})  # one shape or plain
    engine = Engine(model_dir / "target", model_dir / kind, config)
    engine.spec_policy.cost = cost
    engine.spec_policy.probe_every = 10 ** 6  # no probe: a forced plain step stays plain
    engine.spec_policy.candidates[0].acceptance.observe([2])
    engine.spec_policy.pin = False  # seeded sampled requests follow the injected cost too (they would pin the shape)
    return engine


class Calls:
    """Counts the eager calls of a phase's function (a replayed graph runs no Python)."""

    def __init__(self, fn):
        self.fn, self.count = fn, 0

    def __call__(self, *args):
        if not torch.cuda.is_current_stream_capturing():
            self.count += 1
        return self.fn(*args)


@pytest.fixture(scope="module")
def cpu_reference(oracle_model_dir):
    engine = Engine(oracle_model_dir / "target", None, EngineConfig(page_size=16, chunk_size=8))
    return [r.token_ids for r in engine.generate(PROMPTS, PARAMS)]


@pytest.mark.parametrize("backlog", [0, 4])
@pytest.mark.parametrize("kind", ["eagle", "eagle3", "mtp"])
@pytest.mark.parametrize("costs", [plain_only, switching], ids=["plain", "switching"])
def test_plain_step_graphs_are_replayed_and_equal_the_eager_plain_step(oracle_model_dir, cpu_reference, kind,
                                                                        costs, backlog):
    eager = adaptive(oracle_model_dir, kind, "cuda", False, costs(), spec_draft_backlog=backlog)
    want = [r.token_ids for r in eager.generate(PROMPTS, PARAMS)]
    engine = adaptive(oracle_model_dir, kind, "cuda", True, costs(), spec_draft_backlog=backlog)
    count = engine.capture_graphs()
    graphs = engine.speculator.graphs
    assert count == sum(len(g.captured_sizes) for g in graphs.values())
    phases = ("plain", "plain_extend") if not backlog else ("plain",)
    assert ("plain_extend" in graphs) == (not backlog)  # with a backlog a plain step runs no draft
    assert all(graphs[p].captured_sizes == graphs["plain"].buckets for p in phases)
    assert not engine.graph_failures
    calls = {p: Calls(graphs[p].fn) for p in phases}
    for p in phases:
        graphs[p].fn = calls[p]
    got = [r.token_ids for r in engine.generate(PROMPTS, PARAMS)]
    assert got == want == cpu_reference
    assert engine.spec_policy.choices["plain"] >= 5
    assert all(c.count == 0 for c in calls.values())  # every plain step replayed its graphs: nothing ran eagerly
    if backlog:  # 20 tokens, plain steps of 3 rows: the backlogs fill and the draft catches up over them
        assert engine.speculator.stats.catch_up["extends"] >= 1
    if costs is switching:
        assert engine.spec_policy.choices["spec"] >= 5 and engine.spec_stats.totals.accept_length > 1.3
    assert engine.is_idle_and_clean()


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "mtp"])
def test_draft_state_after_a_replayed_plain_step_equals_the_eager_one(oracle_model_dir, kind):
    states = []
    for graphs in (False, True):
        engine = adaptive(oracle_model_dir, kind, "cuda", graphs, plain_only(), chunk_size=None,
                          spec_draft_backlog=0)
        if graphs:
            engine.capture_graphs()
        reqs = [engine.add_request(p, PARAMS) for p in PROMPTS]
        engine.step()  # the prefill
        engine.step()  # one plain step (replayed with graphs on)
        assert engine.spec_policy.choices == {"spec": 0, "plain": 1}
        states.append([r.draft_state for r in reqs])
        for r in reqs:
            engine.abort(r.rid)
        assert engine.is_idle_and_clean()
    for a, b in zip(*states):
        assert (a.bonus_token, a.committed_len) == (b.bonus_token, b.committed_len)
        assert torch.allclose(a.hidden, b.hidden, atol=1e-4)
        assert torch.allclose(a.topk_p, b.topk_p, atol=1e-4) and torch.equal(a.topk_ids, b.topk_ids)


def test_a_fixed_engine_captures_no_plain_step_graphs_and_capture_times_are_per_phase(oracle_model_dir):
    config = EngineConfig(device="cuda", dtype="float32", page_size=16, cuda_graph=True, cuda_graph_max_bs=8,
                          spec=SpecConfig(topk=2, steps=3, num_draft_tokens=6), spec_policy="fixed")
    fixed = Engine(oracle_model_dir / "target", oracle_model_dir / "eagle3", config)
    fixed_count = fixed.capture_graphs()
    for backlog, phases in ((0, {"plain", "plain_extend"}), (32, {"plain"})):
        adaptive_engine = adaptive(oracle_model_dir, "eagle3", "cuda", True, plain_only(), spec_draft_backlog=backlog)
        plain_buckets = len(adaptive_engine.speculator.graphs["plain"].buckets)
        assert adaptive_engine.capture_graphs() == fixed_count + len(phases) * plain_buckets > plain_buckets
        fixed_s, adaptive_s = fixed.graph_capture_s(), adaptive_engine.graph_capture_s()
        assert set(adaptive_s) - set(fixed_s) == phases  # reported with the other phases
        assert all(s > 0 for s in adaptive_s.values())
        adaptive_engine.release_graphs()


def folding(engine) -> tuple[list, object]:
    """The engine's policy forced to a plain step on each step with prefill chunks (they fold into its target
    forward, ``ModelRunner.run``) and to its shape on the others; the plans it ran and its counted target."""
    from tests.unit.spec.spec_helpers import CountingModel

    plans, schedule, shape = [], engine.scheduler.schedule, next(iter(engine.speculator.shapes))
    engine.scheduler.schedule = lambda: plans.append(schedule()) or plans[-1]
    engine.spec_policy.choose = lambda batch, pinned=False, mixed=False, left=None: None if plans[-1].prefill else shape
    engine.runner.model = CountingModel(engine.model)
    return plans, engine.model


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "mtp"])
def test_prefill_folded_into_plain_steps_then_replayed_speculation_equals_the_target(oracle_model_dir, cpu_reference,
                                                                                      kind):
    """With graphs captured: the chunks of the prompts arriving behind the first run in the plain steps' one
    eager target forward, and the replayed speculative steps after them resume from those steps' draft states."""
    engine = adaptive(oracle_model_dir, kind, "cuda", True, plain_only())
    engine.capture_graphs()
    plans, model = folding(engine)
    reqs = [engine.add_request(PROMPTS[0], PARAMS)]
    forwards = []
    while engine.scheduler.has_work() or len(reqs) < len(PROMPTS):
        if len(plans) in (2, 3) and len(reqs) < len(PROMPTS):
            reqs.append(engine.add_request(PROMPTS[len(reqs)], PARAMS))  # arriving while the first decodes
        before = model.calls
        engine.step()
        forwards.append(model.calls - before)
    assert [engine.result(r).token_ids for r in reqs] == cpu_reference
    mixed = [i for i, p in enumerate(plans) if p.prefill and p.decode]
    assert len(mixed) >= 3 and all(forwards[i] == 1 for i in mixed)
    assert engine.spec_stats.totals.accept_length > 1.3  # the speculative steps after them still accept
    assert engine.is_idle_and_clean()
