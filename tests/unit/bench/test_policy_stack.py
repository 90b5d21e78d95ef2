"""bench/house/policy_stack.py: its CPU form runs two configurations through real stacks (colo1), and its exit
status tells a failed configuration (1) from a greedy output that left plain's (3)."""

from __future__ import annotations

import json

from bench.house.policy_stack import first_diff, main, outcome


def test_first_diff():
    assert first_diff([1, 2, 3], [1, 2, 3]) is None
    assert first_diff([1, 2, 3], [1, 5, 3]) == 1
    assert first_diff([1, 2], [1, 2, 3]) == 2  # one ended first


def result(error=None, failed=0, diff=(None,)) -> dict:
    runs = {"plain": {"points": [{"concurrency": 1, "failed": 0}]},
            "default": {"points": [{"concurrency": 1, "failed": failed}], **({"error": error} if error else {})}}
    return {"runs": runs, "greedy_first_diff": {"default": list(diff)}}


def test_outcome_tells_failures_from_a_greedy_difference():
    assert outcome(result())[0] == 0
    assert outcome(result(diff=(None, 37)))[0] == 3 and "37" in outcome(result(diff=(None, 37)))[1]
    assert outcome(result(failed=2)) == (1, "default c1: 2 requests failed")
    code, why = outcome(result(error="RuntimeError: did not start", diff=(4,)))  # a failure wins over a diff
    assert code == 1 and "did not start" in why


def test_the_cpu_form_runs_plain_and_the_default_through_colo1(tmp_path, capsys):
    assert main(["--smoke", "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"), "--runs",
                 "plain,default", "--layout", "colo1", "--sweep", "1"]) == 0
    report = json.loads((tmp_path / "out" / "policy_stack.json").read_text())
    assert report["greedy_first_diff"] == {"default": [None]}
    assert [p["failed"] for r in report["runs"].values() for p in r["points"]] == [0, 0]
    assert "policy_stack: exit 0" in capsys.readouterr().out
