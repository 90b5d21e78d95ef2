"""bench/cross_check.py: guidellm's JSON read into the figures bench_serving's client reports, and the comparison."""

from __future__ import annotations

import json

import pytest

from bench.cross_check import compare, format_row, guidellm_points


def request(start: float, ttft_ms: float, itl_ms: float, last: float, tokens: int = 16) -> dict:
    """The fields of one successful request in guidellm 0.8.1's JSON that the cross-check reads."""
    return {"request_start_time": start, "request_dispatch_delay": 0.01, "time_to_first_token_ms": ttft_ms,
            "inter_token_latency_ms": itl_ms,
            "output_tokens": tokens, "info": {"timings": {"last_token_iteration": last}}}


def test_guidellm_points_use_the_window_from_first_send_to_last_token_and_the_medians(tmp_path):
    # Two streams, 2 requests each: busy 0.4 + 0.5 + 0.4 + 0.4 s of a 1.0 s window -> occupancy 0.85.
    reqs = [request(100.0, 40, 10, 100.4), request(100.0, 60, 12, 100.5), request(100.5, 50, 20, 100.9),
            request(100.6, 70, 11, 101.0)]
    path = tmp_path / "guidellm.json"
    path.write_text(json.dumps({"benchmarks": [{
        "config": {"strategy": {"streams": 2}}, "duration": 1.25, "requests": {"successful": reqs},
        "metrics": {"request_totals": {"errored": 1}}}]}))
    [(c, p)] = guidellm_points(path).items()
    assert c == 2 and p["completed"] == 4 and p["failed"] == 1
    assert p["ttft_p50_s"] == pytest.approx(0.055) and p["itl_request_mean_p50_s"] == pytest.approx(0.0115)
    assert p["output_tok_s"] == pytest.approx(64 / 1.0) and p["output_tok_s_reported"] == pytest.approx(64 / 1.25)
    assert p["occupancy"] == pytest.approx(1.7 / 2.0) and p["dispatch_delay_p50_s"] == pytest.approx(0.01)


def test_compare_gives_guidellm_over_each_run_of_ours_and_whether_it_lies_outside_them():
    first = {"ttft_p50_s": 0.10, "itl_request_mean_p50_s": 0.02, "output_tok_s": 100.0, "occupancy": 0.99}
    second = {"ttft_p50_s": 0.12, "itl_request_mean_p50_s": 0.02, "output_tok_s": 110.0, "occupancy": None}
    outside = {"ttft_p50_s": 0.11, "itl_request_mean_p50_s": 0.03, "output_tok_s": 80.0, "occupancy": 0.9}
    got = compare(first, outside, second)
    assert got["ttft_p50_s"]["outside_ours"] is False and got["ttft_p50_s"]["ratio_first"] == pytest.approx(1.1)
    assert got["itl_request_mean_p50_s"]["outside_ours"] is True
    assert got["output_tok_s"]["ratio_second"] == pytest.approx(80 / 110) and got["output_tok_s"]["outside_ours"]
    assert got["occupancy"] is None  # a figure missing on one side is not compared
    line = format_row({"concurrency": 4, "ours_first": first, "guidellm": outside, "ours_second": second,
                       "compare": got})
    assert line.startswith("c4:") and "x0.80/0.73" in line and "occupancy % ours 99.0|- guidellm 90.0 (x-)" in line
