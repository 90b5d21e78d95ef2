"""On CUDA: ``cuda_graph_mixed`` replays the target's work between attentions from captured graphs in every step with
prefill chunks (tests/unit/engine/test_mixed_graphs.py runs the same pieces eagerly on the CPU). A late prompt
prefilled in chunks beside decoding requests gives the tokens and, within float32 tolerance, the logits and the
draft's features of the eager engine, with and without an EAGLE-3 head; the pieces are captured at start (every
bucket, no failure) and no forward runs them eagerly after.
"""

import pytest

from shared.config import EngineConfig, SpecConfig
from shared.engine import Engine
from shared.sampling import SamplingParams
from tests.mixed_graphs_checks import run_late_prompt

pytestmark = pytest.mark.gpu

CHUNK = 96
LONG = [50 + (i * 29) % 400 for i in range(300)]
SHORT = [list(range(3, 24)), [100 + (i * 37) % 300 for i in range(29)], [7, 8, 9]]
GREEDY = SamplingParams(max_new_tokens=12, ignore_eos=True)


def _run(model_dir, draft, mixed: bool):
    config = EngineConfig(device="cuda", dtype="float32", page_size=16, chunk_size=CHUNK, max_running=8,
                          cuda_graph=True, cuda_graph_mixed=mixed, spec_policy="fixed",
                          spec=SpecConfig(topk=1, steps=2, num_draft_tokens=3) if draft else None)
    engine = Engine(model_dir / "target", model_dir / draft if draft else None, config)
    count = engine.capture_graphs()
    r = engine.runner
    mg = r.mixed_graphs
    if mixed:
        assert mg.enabled and set(mg.graphs) == set(mg.buckets) and not r.graph_failures
        assert count >= len(mg.buckets) * (len(mg.layers) + 1)
        assert all(len(g) == len(mg.layers) + 1 for g in mg.graphs.values())

        def no_eager(n):
            raise AssertionError(f"the pieces ran eagerly at {n} rows")

        mg._pieces = no_eager
    used = []
    applies = mg.applies
    mg.applies = lambda batch: used.append(batch.input_ids.shape[0]) or applies(batch)  # off: always False
    return (*run_late_prompt(engine, SHORT, LONG, GREEDY), used)


@pytest.mark.parametrize("draft", [None, "eagle3"])
def test_replayed_pieces_give_the_eager_steps_outputs(tiny_model_dir, draft):
    want, want_logits, want_features, _ = _run(tiny_model_dir, draft, mixed=False)
    got, got_logits, got_features, used = _run(tiny_model_dir, draft, mixed=True)
    assert got == want
    assert any(t >= CHUNK for t in used)  # the late prompt's full chunks took the pieces
    for g, w in zip(got_logits, want_logits):
        assert g.shape == w.shape and (g - w).abs().max().item() <= 1e-3
    assert len(got_features) == len(want_features)
    for g, w in zip(got_features, want_features):
        assert g.shape == w.shape and (g - w).abs().max().item() <= 1e-3
