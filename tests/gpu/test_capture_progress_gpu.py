"""On the GPU: the capture progress bar counts every graph ``Engine.capture_graphs`` captures, and no more."""

import io

import pytest

from shared.config import EngineConfig, SpecConfig
from shared.cuda_graphs import PhaseGraphs, capture_progress
from shared.engine import Engine

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("draft", [None, "eagle3"])
def test_capture_progress_counts_each_graph_captured(tiny_model_dir, draft, monkeypatch):
    spec = SpecConfig(topk=2, steps=2, num_draft_tokens=4) if draft else None
    engine = Engine(tiny_model_dir / "target", tiny_model_dir / draft if draft else None,
                    EngineConfig(device="cuda", dtype="float32", page_size=4, chunk_size=8, spec=spec, cuda_graph=True,
                                 cuda_graph_max_bs=8))
    graphs = engine.phase_graphs()
    monkeypatch.setattr("sys.stderr", io.StringIO())  # not a terminal: the bar is off (tqdm counts nothing then)
    ticks = []
    tick = PhaseGraphs._tick
    monkeypatch.setattr(PhaseGraphs, "_tick", lambda self: (ticks.append(self.name), tick(self)))
    with capture_progress(graphs) as bar:
        count = engine.capture_graphs()
    assert len(ticks) == bar.total == count > 0  # one tick per capture, and the bar's length is their number
    assert all(g.progress is None for g in graphs)
