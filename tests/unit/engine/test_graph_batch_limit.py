"""The CUDA graphs cover every batch the engine runs unless told otherwise.

A decode step of a batch larger than the graphs' largest bucket runs eagerly, its kernels launched one by one
(at the 8B shape, dozens of milliseconds of host launches a step). The limit was a fixed 32 that no service
could change, so a service with ``max_running`` 64 ran every step past 32 streams eagerly. Now it defaults to
``max_running`` and is a setting (``EYRIE_CUDA_GRAPH_MAX_BS``)."""

from __future__ import annotations

from services.settings import load_settings
from shared.config import EngineConfig, SpecConfig
from shared.engine import Engine
from shared.sampling import SamplingParams


def test_the_graphs_cover_max_running_by_default_and_a_limit_when_given():
    assert EngineConfig(max_running=64).graph_max_bs == 64
    assert EngineConfig(max_running=64, cuda_graph_max_bs=16).graph_max_bs == 16
    assert EngineConfig(max_running=8, cuda_graph_max_bs=16).graph_max_bs == 8  # never past max_running


def test_an_engine_pads_every_batch_up_to_max_running_to_a_graph_bucket(oracle_model_dir):
    """On the CPU the graphs' padding path runs eagerly: the buckets are what a GPU would capture."""
    spec = SpecConfig(topk=2, steps=3, num_draft_tokens=6)
    engine = Engine(oracle_model_dir / "target", oracle_model_dir / "eagle3",
                    EngineConfig(page_size=4, max_running=48, cuda_graph=True, spec=spec, num_pages=64))
    phases = engine.phase_graphs()
    assert phases and all(g.enabled and g.buckets[-1] == 48 for g in phases)
    assert all(g.bucket(n) is not None for g in phases for n in (33, 40, 48))  # past 32: still graph-shaped
    plain = Engine(oracle_model_dir / "target", None, EngineConfig(page_size=4, max_running=40, cuda_graph=True,
                                                                   cuda_graph_max_bs=16, num_pages=64))
    assert plain.decode_graphs.buckets[-1] == 16 and plain.decode_graphs.bucket(17) is None  # eager past it


def test_services_take_the_limit_from_the_environment(monkeypatch):
    assert load_settings("decode").engine_config().cuda_graph_max_bs is None
    monkeypatch.setenv("EYRIE_CUDA_GRAPH_MAX_BS", "24")
    config = load_settings("decode", max_running=64).engine_config()
    assert config.cuda_graph_max_bs == 24 and config.graph_max_bs == 24


def test_the_capture_budget_stops_before_the_batch_whose_growth_would_pass_it(monkeypatch):
    """Asked before each batch size: what the allocator holds, plus the last size's growth scaled to the next
    size's rows, plus the memory outside PyTorch, within the budget (``gpu_memory_fraction``'s bytes)."""
    import torch

    from shared.cuda_graphs import CaptureBudget

    held = iter([100, 110, 130, 170])  # the allocator before batch sizes 1, 2, 4 and 8
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: next(held))
    budget = CaptureBudget(torch.device("cuda"), budget=250, outside=5)
    assert budget(1)  # the first always fits
    assert budget(2)  # 110 + 10 x 2 / 1 + 5 = 135
    assert budget(4)  # 130 + 20 x 4 / 2 + 5 = 175
    assert not budget(8)  # 170 + 40 x 8 / 4 + 5 = 255 > 250
    assert budget.stopped_at == 8


def test_a_worker_whose_budget_runs_out_captures_and_pads_only_the_smaller_batches(oracle_model_dir):
    """Every phase of every shape (and the plain step's) stops at the same batch size, so a step padded for one
    phase is padded for all; larger batches run eagerly, unpadded."""
    spec = SpecConfig(topk=2, steps=3, num_draft_tokens=6)
    engine = Engine(oracle_model_dir / "target", oracle_model_dir / "eagle3",
                    EngineConfig(page_size=4, max_running=24, cuda_graph=True, spec=spec, num_pages=64,
                                 spec_policy="adaptive"))
    asked = []
    engine.runner.speculator.capture_graphs(room=lambda bs: asked.append(bs) or bs < 8)
    assert asked == [1, 2, 4, 8]
    phases = engine.phase_graphs()
    assert len(phases) > 4 and all(g.buckets == [1, 2, 4] for g in phases)
    assert all(g.bucket(4) == 4 and g.bucket(5) is None for g in phases)
    out = engine.generate([[5, 6, 7, 8]] * 6, SamplingParams(max_new_tokens=6, ignore_eos=True))
    assert [len(r.token_ids) for r in out] == [6] * 6 and engine.is_idle_and_clean()
