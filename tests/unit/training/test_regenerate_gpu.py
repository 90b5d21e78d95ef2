"""``--regenerate`` on CUDA: the windows' continuations come from one captured decode graph of the batch's size,
and they are the tokens the eager engine decodes for the same batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shared.config import EngineConfig
from shared.cuda_graphs import PhaseGraphs
from shared.engine import Engine
from shared.model.loader import load_target
from shared.sampling import SamplingParams
from shared.training.trainer import TrainConfig, regenerate


@pytest.mark.gpu
def test_regenerate_on_cuda_runs_one_decode_graph_and_matches_eager_decoding(oracle_model_dir, monkeypatch):
    captured, capture = [], PhaseGraphs._capture

    def counted(self, example):
        captured.append(self.name)
        return capture(self, example)

    monkeypatch.setattr(PhaseGraphs, "_capture", counted)
    target_dir = Path(oracle_model_dir) / "target"
    target = load_target(target_dir, "float32", "cuda")
    wins = torch.randint(2, 500, (24, 32), generator=torch.Generator().manual_seed(0))
    cfg = TrainConfig(target=str(target_dir), corpus=["unused"], out="unused", device="cuda", dtype="float32")
    out = regenerate(target, wins, 12, cfg)
    assert captured == ["decode"]  # one graph: 24 rows, one bucket
    assert torch.equal(out[:, :20], wins[:, :20])
    eager = Engine(target, config=EngineConfig(device="cuda", dtype="float32", max_running=24, max_context=33,
                                               chunk_size=None))
    results = eager.generate(wins[:, :20].tolist(), SamplingParams(max_new_tokens=12, ignore_eos=True))
    assert out[:, 20:].tolist() == [r.token_ids for r in results]
