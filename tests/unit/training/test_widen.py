"""Widening a pair keeps what it computes: greedy output token for token, and accept length.

The small pair is the oracle model (a target and an EAGLE-3 head the target accepts often, so the
accept length is a real number to keep); it is widened to wider shapes (more layers, channels,
heads, intermediate channels; the hidden ratio a power of two or not) and both pairs decode the
same prompts through the engine.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from training_helpers import engine_logits

from bench.house.widen import widen_pair
from shared.config import EngineConfig, SpecConfig
from shared.engine import Engine
from shared.model.drafts import load_draft
from shared.model.loader import load_target
from shared.sampling import SamplingParams
from shared.training.widen import Shape, WidenError, head_map, plan

PROMPTS = [[5, 17, 33, 2, 9, 100, 200, 7, 8], [3, 4], list(range(40, 77)), [250] * 5, [11, 300, 42]]
SHAPES = {
    # (the oracle: 4 layers, hidden 64, 4 query / 2 KV heads of 16, intermediate 160)
    "x4_channels": Shape(num_hidden_layers=8, hidden_size=256, intermediate_size=512, num_attention_heads=16,
                         num_key_value_heads=4),
    "x2_odd_layers": Shape(num_hidden_layers=7, hidden_size=128, intermediate_size=200, num_attention_heads=8,
                           num_key_value_heads=4),
}


def decode(target: Path, draft: Path, spec: SpecConfig) -> tuple[list[list[int]], list[int], float]:
    # Fixed policy: the adaptive default picks shapes by timed step costs, so two runs' verify steps differ.
    engine = Engine(target, draft=draft, config=EngineConfig(page_size=4, chunk_size=8, spec=spec, spec_policy="fixed"))
    out = engine.generate(PROMPTS, SamplingParams(max_new_tokens=24, ignore_eos=True))
    committed = [c for b in engine.spec_stats.batches for c in b.committed]
    return [r.token_ids for r in out], committed, engine.spec_stats.totals.accept_length


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_widened_pair_decodes_the_same_tokens_with_the_same_acceptance(oracle_model_dir, tmp_path, name):
    small = Path(oracle_model_dir)
    shape = SHAPES[name]
    record = widen_pair(small / "target", small / "eagle3", tmp_path, shape)
    wide_cfg = json.loads((tmp_path / "target" / "config.json").read_text())
    assert (wide_cfg["num_hidden_layers"], wide_cfg["hidden_size"], wide_cfg["num_attention_heads"]) == (
        shape.num_hidden_layers, shape.hidden_size, shape.num_attention_heads)
    assert wide_cfg["head_dim"] == 16
    assert (tmp_path / "target" / "tokenizer.json").exists()
    head = load_draft(tmp_path / "eagle3", load_target(tmp_path / "target"))
    # The capture points follow the layers: the input of small layer q is the input of wide layer layer_of[q].
    assert head.aux_layers == tuple(record["layer_of"][q] for q in (2, 2, 1))
    for spec in (SpecConfig(topk=1, steps=3, num_draft_tokens=4), SpecConfig(topk=4, steps=3, num_draft_tokens=8)):
        want_tokens, want_committed, want_len = decode(small / "target", small / "eagle3", spec)
        got_tokens, got_committed, got_len = decode(tmp_path / "target", tmp_path / "eagle3", spec)
        assert got_tokens == want_tokens, spec
        assert got_committed == want_committed and got_len == want_len, spec
        assert want_len > 1.5  # a pair with real acceptance: there is something to keep
    # The logits themselves agree (to float rounding: the sums run over more, zero, terms).
    small_logits = engine_logits(Engine(small / "target", config=EngineConfig(page_size=4)), PROMPTS)
    wide_logits = engine_logits(Engine(tmp_path / "target", config=EngineConfig(page_size=4)), PROMPTS)
    for a, b in zip(small_logits, wide_logits):
        assert (a - b).abs().max().item() < 1e-4


def test_widening_without_the_norm_rescale_would_change_the_output(oracle_model_dir, tmp_path):
    """A control: the RMSNorm rescale is what keeps the function (the oracle's norms see the width)."""
    small = Path(oracle_model_dir)
    widen_pair(small / "target", None, tmp_path, SHAPES["x4_channels"])
    cfg_file = tmp_path / "target" / "config.json"
    cfg = json.loads(cfg_file.read_text())
    assert cfg["rms_norm_eps"] == pytest.approx(1e-6 / 4)
    from safetensors.torch import load_file, save_file
    state = load_file(tmp_path / "target" / "model.safetensors")
    for k in state:
        if k.endswith("norm.weight"):
            state[k] = state[k] * 2  # undo the sqrt(64 / 256) scale
    save_file(state, tmp_path / "target" / "model.safetensors")
    a = engine_logits(Engine(small / "target", config=EngineConfig(page_size=4)), PROMPTS[:1])[0]
    b = engine_logits(Engine(tmp_path / "target", config=EngineConfig(page_size=4)), PROMPTS[:1])[0]
    assert (a - b).abs().max().item() > 0.1


def test_heads_keep_their_key_value_group():
    m = head_map(small_q=6, small_kv=2, wide_q=32, wide_kv=8, head_dim=128)
    assert m.q == (0, 1, 2, 4, 5, 6) and m.kv == (0, 1)
    G, g = 4, 3
    assert all(m.q[i] // G == m.kv[i // g] for i in range(6))


def test_shapes_that_cannot_hold_the_model_are_refused():
    cfg = {"num_hidden_layers": 4, "hidden_size": 64, "intermediate_size": 160, "num_attention_heads": 4,
           "num_key_value_heads": 2}
    with pytest.raises(WidenError, match="head_dim"):
        plan(cfg, Shape(8, 256, 512, 8, 2))  # head_dim 32, not 16
    with pytest.raises(WidenError, match="num_hidden_layers"):
        plan(cfg, Shape(2, 256, 512, 16, 4))
    with pytest.raises(WidenError, match="heads"):
        head_map(small_q=4, small_kv=4, wide_q=8, wide_kv=2, head_dim=16)
    assert torch.equal(torch.tensor(plan(cfg, Shape(32, 64, 160, 4, 2)).layer_of), torch.tensor([0, 8, 16, 24]))
