"""The roofline a serving point is compared to (issue 30, ``bench/ideal.py``): the issue's own figures for the
8B shape on an H100, the model's figures read off a real checkpoint, and the report's fixed points annotated."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from bench.ideal import DeviceRates, ModelShape, annotate, format_ideal, ideal, model_shape

H100 = DeviceRates(copy_bytes_s=2.95e12, matmul_flop_s=650e12)
LLAMA_8B = ModelShape(weight_bytes=16_060_000_000, kv_bytes_per_token=32 * 8 * 128 * 2 * 2, flop_per_token=16e9)


@pytest.mark.parametrize(("streams", "step_ms", "tok_s"), [(32, 6.35, 4000), (64, 7.27, 6140), (128, 9.09, 8300)])
def test_the_issues_table_for_the_8b_shape_on_an_h100(streams, step_ms, tok_s):
    got = ideal(H100, LLAMA_8B, streams, prompt=512, output=256)
    assert got["step_floor_ms"] == pytest.approx(step_ms, rel=0.01)
    assert got["ideal_tok_s"] == pytest.approx(tok_s, rel=0.02)
    assert got["request_gpu_ms"] == pytest.approx(256 * step_ms / streams + 512 * 16e9 / 650e12 * 1e3, rel=0.01)


def test_the_model_figures_come_off_the_checkpoint(tiny_model_dir):
    target = tiny_model_dir / "target"
    cfg = json.loads((target / "config.json").read_text())
    tensors = {k: v for f in target.glob("*.safetensors") for k, v in load_file(f).items()}
    stored = sum(t.numel() * t.element_size() for t in tensors.values())
    assert all(t.dtype == torch.float32 for t in tensors.values())  # a float32 checkpoint
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_fp32 = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * 4
    as_stored = model_shape(target, "float32")  # served as it is stored
    assert as_stored.weight_bytes == stored and as_stored.kv_bytes_per_token == kv_fp32
    assert as_stored.flop_per_token == 2 * sum(t.numel() for t in tensors.values())
    on_gpu = model_shape(target)  # auto on a GPU: bfloat16, so half the bytes read per step and per token
    assert on_gpu.weight_bytes == stored // 2 and on_gpu.kv_bytes_per_token == kv_fp32 // 2
    assert on_gpu.flop_per_token == as_stored.flop_per_token


def test_only_the_fixed_points_gain_an_ideal_and_a_ratio():
    fixed = {"workload": "fixed", "concurrency": 64, "prompt": [512, 512], "output": [256, 256],
             "output_tok_s": 3070.0}
    mixed = {"workload": "mixed", "concurrency": 64, "prompt": [64, 1024], "output": [16, 512], "output_tok_s": 1.0}
    report = {"engine": {"points": [dict(fixed), mixed]},
              "layouts": [{"layout": "colo1", "points": [dict(fixed, output_tok_s=None)]}]}
    annotate(report, None, LLAMA_8B)  # no device rates (the CPU): nothing added
    assert "ideal" not in report and "ideal_tok_s" not in report["engine"]["points"][0]
    annotate(report, H100, LLAMA_8B)
    engine = report["engine"]["points"][0]
    assert engine["ideal_tok_s"] == pytest.approx(6140, rel=0.02) and engine["of_ideal"] == pytest.approx(0.5, rel=0.02)
    assert "ideal_tok_s" not in report["engine"]["points"][1]
    assert "of_ideal" not in report["layouts"][0]["points"][0]  # a point that measured nothing has no ratio
    assert report["ideal"]["device"]["copy_bytes_s"] == 2.95e12
    lines = format_ideal(report)
    assert len(lines) == 2 and "engine" in lines[0] and "layout[colo1]" in lines[1]
