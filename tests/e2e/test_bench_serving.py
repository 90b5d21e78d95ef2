"""bench/bench_serving.py --smoke: the serving benchmark runs end to end on the CPU (tiny model), and its JSON
has every figure for every point of the engine and of the stack, over gRPC and HTTP, with every request
completed. No figure is judged: a shared CPU says nothing about serving speed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FIGURES = ("output_tok_s", "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s", "duration_s")


def test_smoke_run_measures_every_point_on_both_sides_and_completes_every_request(tmp_path):
    out = tmp_path / "serving.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("TRITON_INTERPRET", None)  # the services run the torch references on the CPU, as `eyrie up` does
    run = subprocess.run([sys.executable, "bench/bench_serving.py", "--smoke", "--sweep", "1,2", "--deadline-s", "400",
                          "--out", str(out), "--workdir", str(tmp_path / "work")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=420)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["skipped"] == []
    model = report["model"]
    assert model["shards"] > 1 and Path(model["target"], "model.safetensors.index.json").exists()
    engine = report["engine"]
    assert engine["exit_code"] == 0 and engine["device"]["d2d_copy_gbps"] > 0
    names = ["fixed/c1", "fixed/c2", "probe/c1", "mixed/c1", "mixed/c2"]
    assert [p["point"] for p in engine["points"]] == names
    [stack] = report["stacks"]
    assert "error" not in stack and set(stack["exit_codes"].values()) == {0}
    assert sorted((p["api"], p["point"]) for p in stack["points"]) == sorted(
        (api, n) for api in ("grpc", "http") for n in names)
    for p in engine["points"] + stack["points"]:
        assert p["issued"] == p["requests"] == p["completed"] and p["failed"] == 0, p
        assert p["output_tokens"] >= p["requests"] * p["output"][0], p
        assert all(p[k] is not None and p[k] >= 0 for k in FIGURES), p
        assert p["ttft_p50_s"] <= p["ttft_p99_s"] and p["itl_p50_s"] <= p["itl_p99_s"], p
    # Every hand-off is counted under the transport that carried it (ipc on one host), bytes and seconds.
    assert set(stack["handoff"]) == {"ipc"} and stack["handoff"]["ipc"]["bytes"] > 0
    assert stack["handoff"]["ipc"]["count"] == sum(p["issued"] for p in stack["points"])
    assert len(stack["ratios"]) == len(stack["points"])
    assert all(r["output_tok_s_ratio"] > 0 for r in stack["ratios"])


@pytest.mark.slow  # ~18 s, a second stack: the smoke above keeps the script's path (local prefill: test_local_prefill)
def test_smoke_run_with_local_prefill_prefills_short_prompts_on_the_decode_service(tmp_path):
    """``--local-prefill 40``: the fixed workload's 32-token prompts are prefilled on the decode service (no
    hand-off), the mixed workload's longer ones (8..48 tokens) partly handed off; every request completes."""
    out = tmp_path / "serving.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("TRITON_INTERPRET", None)
    run = subprocess.run([sys.executable, "bench/bench_serving.py", "--smoke", "--skip-engine", "--sweep", "2",
                          "--workloads", "fixed,mixed", "--apis", "grpc", "--local-prefill", "40", "--deadline-s",
                          "300", "--out", str(out), "--workdir", str(tmp_path / "work")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=320)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    [stack] = json.loads(out.read_text())["stacks"]
    assert "error" not in stack and stack["label"] == "auto+local40" and stack["local_prefill_max_tokens"] == 40
    assert [p["point"] for p in stack["points"]] == ["fixed/c2", "mixed/c2"]
    assert all(p["issued"] == p["completed"] and p["failed"] == 0 for p in stack["points"])
    handed_off = sum(h["count"] for h in stack.get("handoff", {}).values())
    issued = sum(p["issued"] for p in stack["points"])
    # The fixed point's requests and the warm-up's never reach the prefill service; some mixed ones may.
    assert stack["local_prefills"] >= stack["points"][0]["issued"] and handed_off < issued
