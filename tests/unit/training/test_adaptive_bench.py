"""The pieces of the adaptive-policy benchmark (``bench/house/adaptive.py``) that decide what it reports:
real-text prompts, the configuration the adaptive run speculates with, and the table's ratio."""

from __future__ import annotations

import pytest

from bench.house.adaptive import BAR, faster_fixed, table
from bench.serving_load import Point, make_requests


def report(speeds: dict[int, float], accept: float | None = None) -> dict:
    spec = None if accept is None else {"accept_length": accept, "spec_steps": 3, "plain_steps": 1}
    return {"engine": {"points": [{"concurrency": c, "output_tok_s": s, "spec": spec} for c, s in speeds.items()]}}


def test_text_prompts_are_seeded_windows_of_the_text():
    text = list(range(1000, 1500))
    point = Point("fixed", 4, 6, (32, 32), (8, 8))
    specs = make_requests(point, (2, 100), text)
    assert specs == make_requests(point, (2, 100), text)
    for s in specs:
        start = text.index(s.prompt_ids[0])
        assert s.prompt_ids == text[start:start + 32] and s.max_new_tokens == 8
    assert len({s.prompt_ids[0] for s in specs}) > 1
    short = make_requests(Point("fixed", 1, 2, (20, 20), (4, 4)), (2, 100), [7, 8, 9])
    for s in short:  # a text shorter than the prompt repeats
        assert len(s.prompt_ids) == 20 and all(b == 7 + (a - 6) % 3 for a, b in zip(s.prompt_ids, s.prompt_ids[1:]))


def test_table_compares_adaptive_with_the_best_of_plain_and_fixed_at_each_point():
    reports = {"plain": report({1: 100.0, 64: 3000.0}), "chain3": report({1: 220.0, 64: 2000.0}, 2.4),
               "tree": report({1: 240.0, 64: 1800.0}, 2.7), "adaptive": report({1: 235.0, 64: 2800.0}, 2.7)}
    assert faster_fixed(reports, 1) == "tree" and faster_fixed(reports, 64) == "chain3"
    rows = {r["concurrency"]: r for r in table(reports, [1, 64])}
    assert rows[1]["best_fixed_or_plain"] == 240.0 and rows[1]["adaptive_ratio"] == pytest.approx(235 / 240)
    assert rows[1]["meets_bar"] is True and rows[1]["best_fixed"] == "tree"
    assert rows[64]["best_fixed_or_plain"] == 3000.0 and rows[64]["meets_bar"] is (2800 / 3000 >= BAR) is False
    assert rows[64]["spec"]["tree"]["accept_length"] == 2.7


def test_missing_points_give_no_ratio():
    reports = {"plain": report({1: 100.0}), "chain3": report({}), "tree": report({}), "adaptive": report({})}
    assert faster_fixed(reports, 1) == "chain3"
    [row] = table(reports, [1])
    assert row["adaptive_ratio"] is None and row["meets_bar"] is None
