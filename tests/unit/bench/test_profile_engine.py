"""bench/profile_engine.py on the CPU (the tiny trained pair): every step is logged with its kind, the kinds add up
to the steps, every request's tokens are counted, and the profiler windows (torch's, cProfile's) report."""

import json
from pathlib import Path

import pytest

from bench import profile_engine

PAIR = Path(__file__).resolve().parents[3] / "models" / "tiny-pair"


@pytest.mark.parametrize("host", [False, True])  # the target alone under torch.profiler; with its draft, cProfile
def test_a_closed_loop_is_logged_step_by_step_with_a_profiled_window(tmp_path, host):
    out = tmp_path / "prof.json"
    draft = ["--draft", str(PAIR / "eagle3"), "--cprofile"] if host else []  # the adaptive policy's steps too
    argv = ["--model", str(PAIR / "target"), "--device", "cpu", "--dtype", "float32",
            "--concurrency", "2,3", "--waves", "2", "--prompt", "12", "--output", "6", "--profile-steps", "3",
            "--profile-after", "0", "--max-running", "8", "--out", str(out)] + draft
    assert profile_engine.main(argv) == 0
    report = json.loads(out.read_text())
    assert [p["concurrency"] for p in report["points"]] == [2, 3]
    for p in report["points"]:
        assert p["requests"] == 2 * p["concurrency"]
        assert sum(g["steps"] for g in p["by_kind"].values()) == p["steps"] == len(p["timeline"])
        kinds = {k.split("/")[0] for k in p["by_kind"]}
        assert "decode" in kinds and kinds & {"mixed", "prefill"}  # prompts arrive while others decode
        assert p["output_tok_s"] > 0 and p["steps_tok_s"] >= p["output_tok_s"]
        assert all(row[2] <= p["concurrency"] for row in p["timeline"])  # rows never past the closed loop's
        # every output token is in some step's count (a request's first token with its prompt's last chunk)
        assert sum(row[7] for row in p["timeline"]) == p["requests"] * 6
        spec = [row for row in p["timeline"] if row[1] not in ("plain", "-")]
        assert bool(spec) == host and (p["policy"] is not None) == host
        assert all(len(row[8]) == 3 for row in spec)  # what the policy believed (None: not known yet)
        assert all(row[7] >= row[2] for row in spec)  # a speculative step commits at least a token per row
        # ``clean``: the steps outside the window (3 of them from step concurrency + 0) and any compile step
        clean = p["clean"]
        assert clean["steps"] == p["steps"] - 3 - len({e[0] for e in p["compiles"]} - set(
            range(p["concurrency"], p["concurrency"] + 3)))
        assert sum(g["steps"] for g in clean["by_kind"].values()) == clean["steps"] and clean["tok_s"] > 0
        window = p["profile_window"]
        assert window["steps"] == 3
        assert (window["by_own"] and window["by_cumulative"]) if host else window["top_kernels"] is not None


def test_annotated_window_reports_the_engines_phases(tmp_path):
    """``--annotate``: the torch.profiler window reports the engine's own ranges (the target's step, a generator,
    spans its whole run; the policy's choice; the draft's work), each with its calls and host time."""
    out = tmp_path / "prof.json"
    argv = ["--model", str(PAIR / "target"), "--draft", str(PAIR / "eagle3"), "--device", "cpu", "--dtype", "float32",
            "--concurrency", "3", "--waves", "2", "--prompt", "12", "--output", "6", "--profile-steps", "6",
            "--profile-after=-3", "--max-running", "8", "--annotate", "--out", str(out)]
    try:
        assert profile_engine.main(argv) == 0
    finally:
        profile_engine.unannotate()
    ranges = json.loads(out.read_text())["points"][0]["profile_window"]["ranges"]
    assert {"eyrie.SpecPolicy.choose", "eyrie.Scheduler.schedule"} <= set(ranges)
    assert any(k.startswith("eyrie.ModelRunner.") for k in ranges)
    assert all(r["calls"] >= 1 and r["host_ms"] >= 0 for r in ranges.values())
    target = [r for k, r in ranges.items() if k in ("eyrie.ModelRunner._target_step", "eyrie.ModelRunner._plain_step")]
    assert target and all(r["host_ms"] > 0.01 for r in target)  # a generator's range spans its forward
