"""The CUDA graphs cover every batch the engine runs unless told otherwise.

A decode step of a batch larger than the graphs' largest bucket runs eagerly, its kernels launched one by one
(at the 8B shape, dozens of milliseconds of host launches a step). The limit was a fixed 32 that no service
could change, so a service with ``max_running`` 64 ran every step past 32 streams eagerly. Now it defaults to
``max_running`` and is a setting (``EYRIE_CUDA_GRAPH_MAX_BS``)."""

from __future__ import annotations

from services.settings import load_settings
from shared.config import EngineConfig, SpecConfig
from shared.engine import Engine


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
