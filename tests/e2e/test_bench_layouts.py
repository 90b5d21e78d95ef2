"""bench/bench_serving.py --smoke --layouts: each layout started as users deploy it (separate ``eyrie serve``
processes, one Redis, the router's OpenAI API), on the CPU with the tiny model: every workload's points (the
sweep, the long prompt, the streams quiet and with arrivals) complete with no failure, the layouts are what
they claim (a colocated layout prefills every prompt on its decode instance, a disaggregated one hands every
prompt off), and one table names them all. No figure is judged: a shared CPU says nothing about speed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
POINTS = ["fixed/c1", "fixed/c2", "probe/c1", "mixed/quiet", "mixed/arrivals", "mixed/arrived"]


@pytest.mark.slow  # ~40 s, two layouts' processes: test_bench_serving's first smoke keeps the script's default path
def test_smoke_layouts_run_every_workload_on_each_layout_and_write_one_table(tmp_path):
    out = tmp_path / "layouts.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("TRITON_INTERPRET", None)
    run = subprocess.run([sys.executable, "bench/bench_serving.py", "--smoke", "--layouts", "colo1,pd1",
                          "--deadline-s", "500", "--out", str(out), "--workdir", str(tmp_path / "work")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=560)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["left_out"] == [] and report["slo"] == {"ttft_s": 1.0, "itl_s": 0.05}
    colo, pd = report["layouts"]
    assert [i["role"] for i in colo["instances"]] == ["decode"]
    assert [i["role"] for i in pd["instances"]] == ["prefill", "decode"]
    for lay in (colo, pd):
        assert "error" not in lay and set(lay["exit_codes"].values()) == {0}, lay
        assert "skipped" not in lay, lay["skipped"]
        assert [p["point"] for p in lay["points"]] == POINTS
        for p in lay["points"]:
            assert p["issued"] == p["completed"] > 0 and p["failed"] == 0, p
            assert p["output_tok_s"] > 0 and p["ttft_p50_s"] <= p["ttft_p99_s"], p
            assert 0 <= p["goodput"]["met"] <= p["goodput"]["of"] == p["issued"], p
        arrivals = {p["point"]: p for p in lay["points"]}["mixed/arrivals"]
        assert arrivals["all_goodput"]["of"] == arrivals["issued"] + {p["point"]: p for p in lay["points"]}[
            "mixed/arrived"]["issued"]
    served = sum(p["issued"] for p in colo["points"])
    assert colo["services"]["decode"]["local_prefills"] >= served  # every prompt on its decode instance
    assert pd["services"]["decode"]["local_prefills"] == 0
    handed = sum(h["count"] for h in pd["services"]["prefill"]["handoff"].values())
    assert handed >= sum(p["issued"] for p in pd["points"])  # every prompt handed off (warm-up requests too)
    # Each point says what each engine's loop did meanwhile: colocated, the decode instance's steps computed the
    # prompts; disaggregated, the prefill instance's did and the decode instance's only decoded.
    for p in colo["points"]:
        assert set(p["loops"]) == {"decode"} and p["loops"]["decode"]["prefill_tokens"] > 0, p["loops"]
        assert 0 < p["loops"]["decode"]["busy"] <= 1.05, p["loops"]
    for p in pd["points"]:
        loops = p["loops"]
        assert loops["prefill"]["prefill_tokens"] > 0 and loops["decode"]["prefill_tokens"] == 0, loops
        assert set(loops["decode"]["steps"]) == {"decode"} and loops["decode"]["rows_mean"]["decode"] >= 1, loops
    table = out.with_suffix(".md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("| colo1 ") or line.startswith("| pd1 ")]
    assert len(rows) == 2 and "prefill cpu, decode cpu" in rows[1], table
