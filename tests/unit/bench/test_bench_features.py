"""bench/bench_features.py end to end on the CPU (``--dry-run``: a tiny model, a few steps): one row per
shape, batch, sampling kind and mode, each mode's ratio to plain, and the penalised rows really ran
the penalty path (the plain ones never did)."""

from __future__ import annotations

import json

import torch

import bench.bench_features as bench
import shared.spec.phases as phases
from shared.logits_process import uses_processing


def test_dry_run_times_every_mode_against_plain(tmp_path, monkeypatch):
    processed = []
    process = phases.process_logits
    monkeypatch.setattr(phases, "process_logits", lambda logits, *rest: processed.append(logits.shape[0])
                        or process(logits, *rest))
    threads = torch.get_num_threads()
    try:
        out = bench.main(["--dry-run", "--out", str(tmp_path / "features.json")])
    finally:
        torch.set_num_threads(threads)
    assert json.loads((tmp_path / "features.json").read_text()) == json.loads(json.dumps(out))
    rows = out["iteration"]
    keys = {(r["shape"], r["batch"], r["sampling"], r["mode"]) for r in rows}
    assert keys == {(s, b, k, m) for s in bench.SHAPES for b in (1, 2) for k in ("greedy", "sampled")
                    for m in bench.MODES}
    assert len(rows) == len(keys) and all(r["ms"] > 0 for r in rows)
    plain = {(r["shape"], r["batch"], r["sampling"]): r["ms"] for r in rows if r["mode"] == "plain"}
    for r in rows:
        assert r["over_plain"] == r["ms"] / plain[r["shape"], r["batch"], r["sampling"]]
    steps = 2 * 2 * (1 * 2 + 1)  # shapes x sampling kinds x (timed + warm-up steps), per batch size
    assert sorted(processed) == sorted([1] * steps + [2] * steps)  # the penalised steps only, each once
    assert all(uses_processing(bench.MODES["penalised"](s, 0)) for s in (False, True))
    assert not any(uses_processing(bench.MODES["plain"](s, 0)) for s in (False, True))
