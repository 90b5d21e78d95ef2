"""The extend kernel's tuned launch table: how ``bench_extend --tune-shapes --write-table`` turns timings
into rows, and how ``choose_cuda_config`` picks a row for a call (host logic; no GPU needed)."""

from __future__ import annotations

import json

import pytest
import torch

from bench.bench_extend import merge_table, table_rows
from kernels.extend_attention import (
    HOPPER_CONFIG,
    LONG_CONFIG,
    POINTER_CONFIG,
    ExtendConfig,
    choose_cuda_config,
    pick_tuned,
    table_key,
    tuned_entries,
)

H100 = "NVIDIA H100 80GB HBM3"
KEY = "bf16_d128_g4"
PACK2 = ExtendConfig(64, 64, 4, 3, True, pack=2)
WIDE = ExtendConfig(128, 128, 8, 3, True, head_major=True)
SMALL = ExtendConfig(64, 64, 4, 2, True)


def tuned(cfg: ExtendConfig, ms: float) -> dict:
    return {"config": cfg.__dict__, "ms": ms, "tflops": 100 / ms, "ratio_vs_sdpa": 1 / ms}


def write(tmp_path, rows, device=H100, key=KEY) -> str:
    path = tmp_path / "table.json"
    path.write_text(json.dumps({"devices": {device: {key: rows}}}))
    return str(path)


def test_table_rows_take_each_shapes_fastest_candidate_that_matched():
    results = [
        {"batch": 1, "seq": 8192, "prefix": 0, "tune": [tuned(SMALL, 3.0), tuned(WIDE, 2.5),
                                                        {"config": PACK2.__dict__, "error": "mismatch"}]},
        {"batch": 4, "seq": 4096, "prefix": 0, "tune": [tuned(PACK2, 1.0), tuned(WIDE, 1.2)]},
        {"batch": 1, "seq": 4096, "prefix": 0, "tune": [tuned(SMALL, 0.5), tuned(PACK2, 0.6)]},
        {"batch": 1, "seq": 4096, "prefix": 4096, "tune": [tuned(WIDE, 0.1)]},  # prefix shapes stay out
        {"batch": 1, "seq": 2048, "prefix": 0, "tune": [{"config": SMALL.__dict__, "error": "compile"}]},
    ]
    rows = table_rows(results)
    got = [(r["min_max_q_len"], r["min_tokens"], ExtendConfig(**r["config"])) for r in rows]
    assert got == [(4096, 4096, SMALL), (4096, 16384, PACK2), (8192, 8192, WIDE)]
    assert rows[2]["measured"]["ms"] == 2.5


def test_merge_replaces_only_this_devices_key():
    old = {"devices": {"H200": {KEY: [1]}, H100: {KEY: [2], "fp16_d128_g4": [3]}}}
    new = merge_table(old, H100, KEY, [4], {"date": "2026-11-23"})
    assert new["devices"]["H200"] == {KEY: [1]}
    assert new["devices"][H100][KEY] == [4] and new["devices"][H100]["fp16_d128_g4"] == [3]
    assert new["devices"][H100]["_provenance"][KEY] == {"date": "2026-11-23"}
    assert old["devices"][H100][KEY] == [2]  # the input is not changed


def test_pick_takes_the_last_row_a_call_meets():
    rows = [(2048, 2048, SMALL), (4096, 4096, HOPPER_CONFIG), (4096, 16384, PACK2), (16384, 16384, WIDE)]
    assert pick_tuned(rows, 1024, 1024, 4, True) is None  # below every row: the rules decide
    assert pick_tuned(rows, 3000, 3000, 4, True) == SMALL
    assert pick_tuned(rows, 4096, 4096, 4, True) == HOPPER_CONFIG
    assert pick_tuned(rows, 4096, 4 * 4096, 4, True) == PACK2  # a batch of four 4k requests
    assert pick_tuned(rows, 20000, 20000, 4, True) == WIDE
    assert pick_tuned(rows, 4096, 4 * 4096, 1, True) == HOPPER_CONFIG  # pack 2 does not divide an MHA group
    assert pick_tuned(rows, 4096, 4 * 4096, 4, False) is None  # descriptor rows on the pointer path


def test_choose_uses_the_table_for_its_device_and_key_only(tmp_path):
    path = write(tmp_path, [{"min_max_q_len": 2048, "min_tokens": 0, "config": PACK2.__dict__, "measured": {}}])
    bf16 = torch.bfloat16
    assert choose_cuda_config(H100, bf16, 128, 4096, 4096, True, 4, path) == PACK2
    assert choose_cuda_config("NVIDIA H200", bf16, 128, 4096, 4096, True, 4, path) == HOPPER_CONFIG
    assert choose_cuda_config(H100, torch.float16, 128, 4096, 4096, True, 4, path) == HOPPER_CONFIG
    assert choose_cuda_config(H100, bf16, 128, 32768, 32768, True, 8, path) == LONG_CONFIG  # another group
    assert choose_cuda_config(H100, bf16, 128, 1024, 1024, True, 4, path) == HOPPER_CONFIG  # below the rows
    assert choose_cuda_config(H100, bf16, 128, 64, 64, True, 4, path).block_m == 64  # short chunks: the rule
    assert choose_cuda_config(H100, bf16, 128, 4096, 4096, False, 4, path) == POINTER_CONFIG


def test_without_a_table_file_the_rules_decide(tmp_path):
    missing = str(tmp_path / "none.json")
    assert tuned_entries(H100, KEY, missing) == []
    assert choose_cuda_config(H100, torch.bfloat16, 128, 16384, 16384, True, 4, missing) == LONG_CONFIG


def test_the_environment_variable_names_the_table(tmp_path, monkeypatch):
    path = write(tmp_path, [{"min_max_q_len": 128, "min_tokens": 0, "config": WIDE.__dict__}])
    monkeypatch.setenv("EYRIE_EXTEND_CONFIGS", path)
    assert tuned_entries(H100, KEY) == [(128, 0, WIDE)]


def test_a_bad_row_names_itself(tmp_path):
    path = write(tmp_path, [{"min_max_q_len": 128, "config": WIDE.__dict__}])
    with pytest.raises(ValueError, match="bad row.*min_tokens"):
        tuned_entries(H100, KEY, path)
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(ValueError, match="unreadable"):
        tuned_entries(H100, KEY, str(broken))


def test_table_key():
    assert table_key(torch.bfloat16, 128, 4) == KEY
    assert table_key(torch.float16, 64, 1) == "fp16_d64_g1"


def test_paired_ratio_alternates_and_takes_the_median(monkeypatch):
    """SDPA and the kernel are timed in alternation, the ratio of each pair kept, their median reported."""
    import bench.bench_extend as be

    calls, times = [], {"sdpa": iter([2.0, 2.2, 1.8, 2.0, 2.0]), "ours": iter([2.5, 2.0, 2.0, 4.0, 2.5])}
    monkeypatch.setattr(be, "time_ms", lambda fn: (calls.append(fn()), next(times[calls[-1]]))[1])
    got = be.paired_ratio(lambda: "ours", lambda: "sdpa", rounds=5)
    assert calls == ["sdpa", "ours"] * 5
    assert got["ratios"] == sorted([0.8, 1.1, 0.9, 0.5, 0.8])
    assert got["median"] == 0.8 and got["min"] == 0.5 and got["max"] == 1.1


def test_race_times_every_launch_right_after_sdpa_in_rotating_order(monkeypatch):
    import bench.bench_extend as be

    calls = []
    clock = {"sdpa": 1.0, "a": 2.0, "b": 0.5}
    drift = iter(range(100))  # every timing 10% slower than the one before: only neighbours compare

    def fake_time(fn):
        calls.append(fn())
        return clock[calls[-1]] * 1.1 ** next(drift)

    monkeypatch.setattr(be, "time_ms", fake_time)
    got = be.race(lambda: "sdpa", {"a": lambda: "a", "b": lambda: "b"}, rounds=3)
    assert calls == ["sdpa", "a", "sdpa", "b", "sdpa", "b", "sdpa", "a", "sdpa", "a", "sdpa", "b"]
    assert got["a"]["median"] == pytest.approx(0.5 / 1.1) and got["b"]["median"] == pytest.approx(2 / 1.1)
    assert got["a"]["min"] == pytest.approx(got["a"]["max"])  # the drift cancels within each pair


def raced(cfg: ExtendConfig, median: float) -> dict:
    return {"config": cfg.__dict__, "ratios": [median], "median": median, "min": median, "max": median}


def test_a_finalist_displaces_the_launch_chosen_now_only_by_more_than_the_margin():
    rows = [
        {"batch": 1, "seq": 4096, "prefix": 0, "config": HOPPER_CONFIG.__dict__,  # 1% better: noise
         "race": [raced(WIDE, 0.808), raced(HOPPER_CONFIG, 0.80)]},
        {"batch": 1, "seq": 8192, "prefix": 0, "config": HOPPER_CONFIG.__dict__,  # 5% better: taken
         "race": [raced(HOPPER_CONFIG, 0.80), raced(PACK2, 0.84), raced(WIDE, 0.83)]},
    ]
    got = table_rows(rows)
    assert [ExtendConfig(**r["config"]) for r in got] == [HOPPER_CONFIG, PACK2]
    assert got[0]["measured"]["paired_ratio_vs_sdpa"] == 0.8 and got[1]["measured"]["paired_ratio_vs_sdpa"] == 0.84
