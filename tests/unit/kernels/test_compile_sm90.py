"""The extend kernel's Hopper launches compile for sm_90a on this machine (no GPU: Triton's own ptxas and
cuobjdump), run their GEMMs on warpgroup MMAs, spill nothing and fit the SM's shared memory: the
default launches and every candidate ``bench_extend --tune-shapes`` would time on a GPU (a candidate
that cannot compile would cost device time to find out).

``bench/compile_extend.py`` runs in a subprocess without ``TRITON_INTERPRET`` (under the interpreter
``triton.jit`` gives functions that cannot be compiled)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from bench.bench_extend import shape_configs
from bench.compile_extend import SMEM_LIMIT
from kernels.extend_attention import HOPPER_CONFIG, LONG_CONFIG

ROOT = Path(__file__).resolve().parents[3]


def test_hopper_launches_compile_without_spills(tmp_path):
    out = tmp_path / "compile.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")  # compile here, not from another run's cache
    res = subprocess.run([sys.executable, "bench/compile_extend.py", "--out", str(out)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    configs = [r["config"] for r in rows]
    assert HOPPER_CONFIG.__dict__ in configs and LONG_CONFIG.__dict__ in configs
    assert all(c.__dict__ in configs for c in shape_configs())
    for row in rows:
        assert "error" not in row, row
        assert row["local_bytes"] == 0, row  # no spills
        assert row["shared_bytes"] <= SMEM_LIMIT, row
        assert 0 < row["registers"] <= 255, row
        assert row["wgmma"], row  # Hopper's warpgroup MMA, not the older mma.sync


def test_paged_attention_launches_compile_and_decode_and_verify_dot_alike(tmp_path):
    """Every bf16 paged-attention variant (decode, mask, window; serial and split) and the combine kernel compile
    for sm_90a, and the decode and mask variants run their dots in the same layouts (a row's sums in one order):
    ``bench/compile_attention.py --quick`` exits 0 only then."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    res = subprocess.run([sys.executable, "bench/compile_attention.py", "--quick"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    assert res.stdout.count("dots in the same layouts: True") == 2, res.stdout[-2000:]
