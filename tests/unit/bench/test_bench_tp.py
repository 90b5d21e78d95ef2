"""bench/bench_tp.py end to end on the CPU (``--smoke``: the tiny model, two gloo ranks, shared-memory pools):
every part runs and writes its rows; what each rank's floor divides is its own share of the bytes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_smoke_run_measures_tp1_tp2_their_floors_bytes_and_the_handoff(tmp_path):
    out = tmp_path / "tp.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "bench/bench_tp.py", "--smoke", "--out", str(out)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout + run.stderr
    got = json.loads(out.read_text())
    assert got["errors"] == {} and got["skipped"] == [], got
    rows = {(r["tp"], r["batch"]): r for r in got["decode"]}
    assert sorted(rows) == [(1, 1), (1, 2), (2, 1), (2, 2)]
    assert all(r["graph_ms"] > 0 and r["eager_ms"] > 0 and r["rank"] == 0 for r in rows.values())
    for bs in (1, 2):
        one, two = rows[1, bs], rows[2, bs]
        assert two["kv_bytes"] * 2 == one["kv_bytes"] == bs * 32 * 2 * 4 * 2 * 16 * 4  # K+V, layers, heads, dim
        assert one["weight_bytes"] / 2 < two["weight_bytes"] < one["weight_bytes"]  # the norms stay whole
        assert two["collectives_ms"] > 0 and "collectives_ms" not in one
        assert two["slowest_rank_graph_ms"] >= two["graph_ms"]
    ipc, peer = got["handoff"]
    assert ipc["landed"] and ipc["bytes"] == peer["bytes"] == 64 * 2 * 4 * 2 * 16 * 4
    assert ipc["of_peer_copy"] == ipc["gbps"] / peer["gbps"]
    assert "graph ms" in run.stdout and "hand-off ipc write_in_place" in run.stdout  # the table was printed
