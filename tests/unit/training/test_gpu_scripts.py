"""The one-command GPU scripts of ``bench/house`` in their CPU forms (tiny shapes, seconds), so they cannot rot.

``gpu_tiny_pair.sh --smoke`` runs the tiny pair's whole pipeline (target, head, CPU measurement, packing)
and its tar unpacks into a pair the engine loads, losslessly, with the accept length the record says.
"""

from __future__ import annotations

import json
import os
import subprocess
import tarfile
from pathlib import Path

import pytest

from shared.config import EngineConfig, SpecConfig
from shared.engine import Engine
from shared.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[3]


def run_script(script: str, out: Path, *flags: str, timeout_s: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OUT": str(out), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run(["bash", str(ROOT / "bench" / "house" / script), *flags], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout_s)


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("tiny-pair-out")
    done = run_script("gpu_tiny_pair.sh", out, "--smoke", "--device", "cpu", "--cpu-prompts", "2",
                      "--cpu-new-tokens", "8", "--work", str(tmp_path_factory.mktemp("tiny-pair-work")))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return out, json.loads((out / "tiny_pair.json").read_text())


def test_tiny_pair_script_writes_the_pair_as_one_tar_with_its_record(tiny_pair, tmp_path):
    out, record = tiny_pair
    assert sorted(p.name for p in out.iterdir()) == ["tiny-pair.tar", "tiny_pair.json", "tiny_pair.log"]
    assert all(p.stat().st_size <= 16 << 20 for p in out.iterdir())
    with tarfile.open(out / "tiny-pair.tar") as t:
        names = sorted(t.getnames())
        t.extractall(tmp_path, filter="data")
    assert names == sorted(["target/config.json", "target/model.safetensors", "target/tokenizer.json",
                            "target/tokenizer_config.json", "eagle3/config.json", "eagle3/model.safetensors",
                            "tiny_pair.json"])
    assert json.loads((tmp_path / "tiny_pair.json").read_text())["files"] == record["files"]
    packages = record["corpus"]["packages"]
    assert {p["split"] for p in packages} == {"train", "heldout"} and all(p["files"] > 0 for p in packages)
    curve = record["target"]["train"]["loss_curve"]
    assert curve[-1]["loss"] < curve[0]["loss"] - 1.0
    assert record["command"][1:3] == ["-m", "bench.house.tiny_pair"] and "--smoke" in record["command"]
    assert record["head"]["evals"] and record["cpu_acceptance"]["outputs_equal"] is True
    assert record["demo"]["prompt"] == "def fibonacci(n):" and record["demo"]["completion"]


def test_tiny_pair_from_the_tar_is_lossless_and_accepts_as_recorded(tiny_pair, tmp_path):
    out, record = tiny_pair
    with tarfile.open(out / "tiny-pair.tar") as t:
        t.extractall(tmp_path, filter="data")
    spec = SpecConfig(topk=1, steps=3, num_draft_tokens=4)
    params = SamplingParams(max_new_tokens=24)
    plain = Engine(tmp_path / "target", config=EngineConfig(max_running=1, max_context=256))
    spec_engine = Engine(tmp_path / "target", draft=tmp_path / "eagle3",
                         config=EngineConfig(max_running=1, max_context=256, spec=spec))
    prompt = record["demo"]["prompt"]
    assert spec_engine.generate(prompt, params)[0].token_ids == plain.generate(prompt, params)[0].token_ids
    again = Engine(tmp_path / "target", draft=tmp_path / "eagle3",
                   config=EngineConfig(max_running=1, max_context=256, spec=spec))
    demo = again.generate(prompt, SamplingParams(max_new_tokens=8))[0]
    assert demo.text == record["demo"]["completion"]
    assert round(again.spec_stats.totals.accept_length, 4) == record["demo"]["accept_length"]


@pytest.mark.slow
def test_house_scripts_cpu_forms_train_measure_and_retime(tmp_path):
    """gpu_house.sh --smoke: target, head, acceptance grid, widening exactness, batch-1 speed, the served
    stack without and with the head; then gpu_house_speed.sh re-times a random pair and reads the first
    run's accept lengths (~4 min here: the two stacks start six service processes)."""
    out = tmp_path / "house"
    done = run_script("gpu_house.sh", out, "--smoke", timeout_s=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    files = sorted(p.name for p in out.iterdir())
    assert files == ["head.json", "head.log", "house.json", "measure.json", "measure.log", "summary.txt",
                     "target.log"]  # at most 8 files come back from a device call
    assert json.loads((out / "house.json").read_text())["train"]["steps"] > 0
    assert json.loads((out / "head.json").read_text())["evals"]
    m = json.loads((out / "measure.json").read_text())
    assert m["skipped"] == []
    grid = {(r["config"], r["temperature"]) for r in m["acceptance"]}
    assert grid == {(c, t) for c in ("chain3", "chain5", "chain7", "tree_topk4_n8", "tree_topk4_n16")
                    for t in (0.0, 0.8)}
    assert all(r["accept_length"] >= 1 for r in m["acceptance"])
    assert m["exactness"]["outputs_equal"] is True  # float32: the widened pair decodes the same tokens
    assert m["exactness"]["accept_length_small"] == m["exactness"]["accept_length_wide"]
    rows = {r["config"]: r for r in m["speed"]["rows"]}
    assert set(rows) == {"plain", "chain3", "chain5", "chain7", "tree_topk4_n8", "tree_topk4_n16"}
    for s in m["speed"]["speedups"]:
        r = rows[s["config"]]
        assert s["formula"] == pytest.approx(r["accept_length"] * rows["plain"]["decode_step_s"] / r["iteration_s"],
                                             rel=1e-2)
    served = m["stack"]["rows"]
    fastest = max(m["speed"]["rows"][1:], key=lambda r: r["tok_per_s"])["config"]
    assert [r["config"] for r in served] == ["plain", fastest]  # the head served in the speed stage's fastest
    assert all(r["completed"] == 1 and r["failed"] == 0 and r["output_tokens"] == 8 for r in served)
    assert m["stack"]["speedup"] == pytest.approx(served[1]["output_tok_s"] / served[0]["output_tok_s"], rel=1e-3)
    assert set(m["stages"]) == {"load_s", "acceptance_s", "widen_s", "exactness_s", "speed_s", "stack_s"}
    summary = (out / "summary.txt").read_text()
    head_phases = json.loads((out / "head.json").read_text())["phases"]
    assert "head: " + ", ".join(f"{k} {v}" for k, v in head_phases.items()) in summary
    assert "measure: load_s" in summary and "skipped: none" in summary
    speed_out = tmp_path / "speed"
    done = run_script("gpu_house_speed.sh", speed_out, str(out / "measure.json"), "--smoke")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    s = json.loads((speed_out / "speed.json").read_text())
    greedy = {r["config"]: r["accept_length"] for r in m["acceptance"] if r["temperature"] == 0.0}
    assert {x["config"]: x["accept_length"] for x in s["speed"]["speedups"]} == greedy
    assert "acceptance" not in s and "exactness" not in s  # nothing trained, nothing to compare


@pytest.mark.slow
def test_adaptive_script_cpu_form_widens_runs_every_configuration_and_tabulates(tmp_path):
    """gpu_adaptive.sh --smoke: the tiny pair widened (vocabulary too), the engine at two concurrencies for
    plain, chains of 1, 2, 3, the tree and adaptive on held-out text, and the table (~2-5 min here: seven
    processes)."""
    out = tmp_path / "adaptive"
    done = run_script("gpu_adaptive.sh", out, "--smoke", timeout_s=600)  # nine processes start torch
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    files = sorted(p.name for p in out.iterdir())
    assert files == ["adaptive.json", "adaptive.log", "adaptive_table.json", "chain1.json", "chain2.json",
                     "chain3.json", "plain.json", "tree.json"]  # at most 8 files come back from a device call
    table = json.loads((out / "adaptive_table.json").read_text())
    assert [r["concurrency"] for r in table["rows"]] == [1, 2]
    for row in table["rows"]:
        speeds = row["tok_s"]
        fixed = {"plain", "chain1", "chain2", "chain3", "tree"}
        assert set(speeds) == fixed | {"adaptive"} and all(v > 0 for v in speeds.values())
        assert row["adaptive_ratio"] == pytest.approx(speeds["adaptive"] / max(speeds[n] for n in fixed))
        assert row["spec"]["chain3"]["accept_length"] > 1.0  # held-out text: the trained head is accepted
    adaptive = json.loads((out / "adaptive.json").read_text())
    assert adaptive["settings"]["spec_policy"] == "adaptive"
    assert adaptive["settings"]["prompts_file"].endswith("heldout.jsonl")
    steps = [p["spec"]["spec_steps"] + p["spec"]["plain_steps"] for p in adaptive["engine"]["points"]]
    assert all(n > 0 for n in steps)
    assert json.loads((out / "plain.json").read_text())["settings"]["draft"] == "none"
    assert "output tok/s" in (out / "adaptive.log").read_text()
