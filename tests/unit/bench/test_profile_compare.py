"""bench/profile_compare.py: repeated profile_engine runs of each engine summarized by their medians, spreads and
ratio to the first label; each run's clean tok/s and its widest rows' median mixed and plain decode steps."""

from __future__ import annotations

import json

from bench.profile_compare import main, point_summary, summarize


def report(tok_s: float, mixed_ms: float, decode_ms: float, c: int = 128) -> dict:
    timeline = [["m", "plain", c, 512, mixed_ms, mixed_ms, 1, c, None],
                ["m", "plain", c // 2, 512, 99.0, 99.0, 1, c // 2, None],  # narrower rows: not counted
                ["d", "plain", c, 0, decode_ms, decode_ms, 0, c, None],
                ["d", "chain3", c, 0, 3 * decode_ms, 3 * decode_ms, 0, 2 * c, [1.9, 20.0, 10.0]]]
    return {"points": [{"concurrency": c, "clean": {"tok_s": tok_s}, "timeline": timeline}]}


def test_point_summary_takes_the_widest_rows_steps():
    assert point_summary(report(100.0, 20.0, 10.0)["points"][0]) == {"tok_s": 100.0, "mixed_ms": 20.0,
                                                                      "decode_ms": 10.0}


def test_medians_spreads_and_the_ratio_to_the_first_label():
    s = summarize({"plain": [report(100.0, 20, 10), report(120.0, 22, 11), report(110.0, 21, 10)],
                   "adaptive": [report(90.0, 25, 12), report(99.0, 24, 12)]})[128]
    assert s["plain"]["median"] == 110.0 and s["plain"]["spread"] == 0.2
    assert s["adaptive"]["median"] == 94.5 and s["adaptive"]["vs_first"] == round(94.5 / 110.0, 3)
    assert [r["mixed_ms"] for r in s["adaptive"]["runs"]] == [25, 24]


def test_the_command_line(tmp_path, capsys):
    for name, rate in (("plain_r1", 100.0), ("plain_r2", 104.0), ("adaptive_r1", 95.0)):
        (tmp_path / f"profile_{name}.json").write_text(json.dumps(report(rate, 20, 10)))
    out = tmp_path / "summary.json"
    assert main([f"plain={tmp_path}/profile_plain*.json", f"adaptive={tmp_path}/profile_adaptive*.json",
                 "--out", str(out)]) == 0
    assert json.loads(out.read_text())["128"]["adaptive"]["vs_first"] == round(95.0 / 102.0, 3)
    assert "c128:" in capsys.readouterr().out
    assert main(["plain"]) == 2  # not LABEL=GLOB
