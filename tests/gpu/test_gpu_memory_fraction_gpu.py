"""On a GPU: two engines of ``gpu_memory_fraction`` 0.4, each in its own process as prefill and decode run under
``eyrie up``, start on one device; each takes at most 0.4 of it (weights, reserve and pools) and both serve.
(The refusal naming the figures is tested on the CPU, tests/unit/engine/test_gpu_memory_fraction.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
# Loads an engine with the fraction and a context long enough that the fraction, not max_running x max_context,
# bounds its pools; prints its figures (or its refusal), generates, then waits for a line on stdin.
ENGINE = """
import json, sys, torch
from shared.config import EngineConfig
from shared.engine import Engine
from shared.request import RequestError
from shared.sampling import SamplingParams
try:
    e = Engine(sys.argv[1], config=EngineConfig(device="cuda", dtype="float32", gpu_memory_fraction=0.4, max_running=64,
                                                max_context=131000, cuda_graph=True))
except RequestError as err:
    print(json.dumps({"refused": str(err)}), flush=True)
    sys.exit(1)
e.capture_graphs()
out = e.generate([list(range(3, 40))] * 4, SamplingParams(max_new_tokens=8, ignore_eos=True))
torch.cuda.synchronize()
_, total = torch.cuda.mem_get_info()
print(json.dumps({"pages": e.cache.layout.num_pages, "reserved": torch.cuda.memory_reserved(), "total": total,
                  "tokens": [len(r.token_ids) for r in out]}), flush=True)
sys.stdin.readline()
"""


def start(model_dir) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.Popen([sys.executable, "-c", ENGINE, str(model_dir / "target")], cwd=ROOT, env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def test_two_engines_of_0_4_start_on_one_gpu_each_within_its_share(tmp_path):
    from shared.model.factory import make_tiny_target

    make_tiny_target(tmp_path, max_position_embeddings=131072)
    procs = []
    try:
        figures = []
        for _ in range(2):  # one after the other: the second sees the first's memory in use
            procs.append(start(tmp_path))
            figures.append(json.loads(procs[-1].stdout.readline()))
        for f in figures:
            assert "refused" not in f, f
            assert f["tokens"] == [8] * 4
            assert f["pages"] > 64 * 1024, f  # the fraction gave them far more than the default device's share
            assert f["reserved"] <= 0.4 * f["total"], f  # the caching allocator's whole footprint in its share
    finally:
        for p in procs:
            if p.poll() is None:
                p.stdin.write("\n")
                p.stdin.flush()
                p.wait(60)
    assert torch.cuda.is_available()
