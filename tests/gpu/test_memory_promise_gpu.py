"""On a GPU: the memory the configuration promises (issue 28). Prefill and decode at 0.45 each on one GPU with
an EAGLE-3 draft at Llama-3.1-8B's shape (the tiny trained pair widened, ``bench/house/widen_tiny.py``; set
EYRIE_WIDE_PAIR=DIR to reuse one), started as ``eyrie up`` starts them (``services.launch.device_plan``):
both turn ready after their profile run and warm-up, serve a sweep and a long prompt through the OpenAI API
with no failure, and each process's peak (PyTorch's ``max_memory_reserved`` plus what NVML counts outside it,
from its /metrics) stays within its 0.45 of the GPU. A fraction too small for the weights and the measured
reserve stops the engine at start: exit 2 and one line naming the figures. The services' logs go under
EYRIE_SERVICE_LOGS when it is set (``bench/gpu_session.sh memory`` points it under $OUT), else pytest's
tmp dir; a service that exits while starting fails the test with its log's last lines."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.serving_layouts import gpu_memory, instances
from bench.serving_load import HttpDriver, Point, make_requests, run_closed_loop
from bench.serving_stack import ServingStack

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
FLAGS = {"dtype": "bfloat16", "cuda_graph": True, "max_running": 64, "max_context": 8192, "chunk_size": 512,
         "page_size": 16, "spec_topk": 1, "spec_steps": 3}


def log_dir(name: str, tmp_path: Path) -> Path:
    """Where a test's service logs go: EYRIE_SERVICE_LOGS/``name`` when set (they outlive the run), else tmp."""
    given = os.environ.get("EYRIE_SERVICE_LOGS")
    out = Path(given) / name if given else tmp_path / "logs"
    out.mkdir(parents=True, exist_ok=True)
    return out


def test_prefill_and_decode_at_0_45_with_an_eagle3_draft_serve_within_their_share(wide_pair, tmp_path):
    placed = instances("pd1", "cuda")
    assert [own["gpu_memory_fraction"] for _, own in placed] == [0.45, 0.45]  # eyrie up's default split
    stack = ServingStack(str(wide_pair / "target"), str(wide_pair / "eagle3"), FLAGS, log_dir("pd1", tmp_path),
                         env={"EYRIE_LOCAL_PREFILL_MAX_TOKENS": "0"}, instances=placed)
    try:
        stack.start(480)
        driver = HttpDriver(stack.openai_address, 300)
        vocab = (2, 2048)  # the pair's trained ids
        for point in (Point("fixed", 64, 64, (512, 512), (64, 64)), Point("probe", 1, 2, (3584, 3584), (8, 8))):
            records = run_closed_loop(driver, make_requests(point, vocab), point.concurrency, 120)
            assert [r.error for r in records if not r.ok] == [] and len(records) == point.requests
        for name in ("prefill", "decode"):
            memory = gpu_memory(stack.metrics(name))
            print(name, json.dumps(memory))
            assert memory["budget_gib"] > 0 and "peak_non_torch_gib" in memory, memory  # NVML read
            assert memory["peak_total_gib"] <= memory["budget_gib"] * 1.01, (name, memory)
    finally:
        codes = stack.stop()
    assert set(codes.values()) == {0}, codes


def test_a_fraction_too_small_stops_the_engine_at_start_naming_the_figures(wide_pair, tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-m", "services.cli", "serve", "decode", "--model",
                           str(wide_pair / "target"), "--draft", str(wide_pair / "eagle3"), "--device", "cuda",
                           "--dtype", "bfloat16", "--gpu-memory-fraction", "0.2", "--redis-url",
                           "redis://127.0.0.1:9/0", "--grpc-port", "0", "--http-port", "0"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    (log_dir("too-small", tmp_path) / "decode.log").write_text(proc.stderr)
    assert proc.returncode == 2, proc.stderr[-3000:]
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("eyrie: error:")]
    assert "gpu_memory_fraction" in line and "0.2 x" in line and "weights" in line, line
