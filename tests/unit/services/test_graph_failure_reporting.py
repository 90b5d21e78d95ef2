"""A contained CUDA graph capture failure (``shared.cuda_graphs``) is visible to operators: in ``/health``'s
details, as ``eyrie_graph_capture_failures{phase}`` and in the log, while the service serves on.

The capture itself is a GPU-only path (tests/gpu/test_graph_capture_failure_gpu.py forces a real
failure); here the engine carries a failure record as a failed capture leaves it, and the service's
start-up reports it."""

from __future__ import annotations

import json

from services.engine_service import capture_graphs
from services.logs import ServiceLog
from services.telemetry import Telemetry
from shared.config import EngineConfig
from shared.cuda_graphs import CaptureFailure, PhaseGraphs
from shared.engine import Engine
from tests.unit.services.test_telemetry import get, samples


def test_a_failed_capture_shows_in_health_metrics_and_log(tiny_model_dir, caplog):
    engine = Engine(tiny_model_dir / "target", tiny_model_dir / "eagle3", EngineConfig(cuda_graph=True))
    engine.graph_failures.append(CaptureFailure("draft", 4, "RuntimeError: operation not permitted when "
                                                            "stream is capturing"))
    telemetry = Telemetry("decode", "decode-graphs").start()
    try:
        with caplog.at_level("WARNING"):
            capture_graphs(engine, True, telemetry, ServiceLog("decode", "decode-graphs"))
        telemetry.set_state("ready")
        status, body = get(f"http://{telemetry.address}/health")
        assert status == 200  # contained: the service serves, that phase eagerly
        assert json.loads(body)["graphs"]["capture_failures"] == [
            {"phase": "draft", "batch_size": 4, "reason": "RuntimeError: operation not permitted when stream is "
                                                          "capturing"}]
        assert samples(telemetry.address)[("eyrie_graph_capture_failures_total", (("phase", "draft"),))] == 1
        assert any("graph_capture_failed" in r.getMessage() or getattr(r, "event", "") == "graph_capture_failed"
                   for r in caplog.records)
        # Seen failures are counted once, however often the engine is observed.
        telemetry.observe_load(engine.load())
        telemetry.observe_load(engine.load())
        assert samples(telemetry.address)[("eyrie_graph_capture_failures_total", (("phase", "draft"),))] == 1
    finally:
        telemetry.stop()


def test_every_phase_of_an_engine_records_into_its_one_failure_list(tiny_model_dir):
    cfg = EngineConfig(cuda_graph=True)
    engine = Engine(tiny_model_dir / "target", tiny_model_dir / "eagle3", cfg)
    phases: list[PhaseGraphs] = [engine.decode_graphs, *engine.speculator.graphs.values()]
    assert all(g.failures is engine.graph_failures for g in phases)
    other = Engine(tiny_model_dir / "target", None, cfg)
    assert other.decode_graphs.failures is other.graph_failures is not engine.graph_failures
