"""bench/find_syncs.py on the CPU: a closed loop of the tiny pair runs through it (no CUDA: no waits), and a
synchronizing call reported while a step runs is counted at the project's frames that made it."""

import json
import warnings
from pathlib import Path

import torch

from bench import find_syncs

PAIR = Path(__file__).resolve().parents[3] / "models" / "tiny-pair"


def test_a_closed_loop_runs_and_reports(tmp_path):
    out = tmp_path / "syncs.json"
    argv = ["--model", str(PAIR / "target"), "--draft", str(PAIR / "eagle3"), "--device", "cpu", "--dtype",
            "float32", "--concurrency", "3", "--prompt", "12", "--output", "5", "--max-running", "8", "--out", str(out)]
    assert find_syncs.main(argv) == 0
    report = json.loads(out.read_text())
    assert report["steps"] >= 5 and report["syncs"] == 0 and report["sites"] == []


def test_a_wait_is_counted_at_its_site_only_while_watching():
    from shared.memory import kv_cache  # a module of ours whose frame names the site

    def wait():  # runs with a frame in shared/ on the stack: exec'd under that module's file name
        warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=2)

    code = compile("def in_shared(f):\n    f()\n", kv_cache.__file__, "exec")
    scope: dict = {}
    exec(code, scope)
    with find_syncs.SyncLog(torch, frames=2) as log:
        scope["in_shared"](wait)  # not watching: not counted
        log.watching = True
        scope["in_shared"](wait)
        scope["in_shared"](wait)
        log.watching = False
    assert sum(log.sites.values()) == 2
    (site,) = log.sites
    assert site.startswith("shared/memory/kv_cache.py:2(in_shared)")
