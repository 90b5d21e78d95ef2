"""Which architectures a target may have, read from ``config.json``, and the one-line refusal of the rest."""

from __future__ import annotations

import json
import shutil

import pytest
from test_cli import eyrie

from shared.model.config import TARGET_ARCHITECTURES, CheckpointError, ModelConfig
from shared.model.loader import load_target

BASE = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=4096)


def with_architecture(src, dst, arch: str):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["architectures"] = [arch]
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_unknown_architecture_is_refused_naming_the_supported_list(tiny_model_dir, tmp_path):
    path = with_architecture(tiny_model_dir / "target", tmp_path / "neox", "GPTNeoXForCausalLM")
    with pytest.raises(CheckpointError) as err:
        load_target(path)
    msg = str(err.value)
    assert "\n" not in msg and "GPTNeoXForCausalLM" in msg
    assert all(arch in msg for arch in TARGET_ARCHITECTURES)


def test_unknown_architecture_exits_2_with_one_line(tiny_model_dir, tmp_path):
    path = with_architecture(tiny_model_dir / "target", tmp_path / "gemma2", "Gemma2ForCausalLM")
    proc = eyrie("generate", "--model", str(path), "--prompt-ids", "1,2,3", "--max-new-tokens", "2")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and "Gemma2ForCausalLM" in lines[0] and "LlamaForCausalLM" in lines[0]


def test_each_supported_architecture_loads(tiny_model_dir, tmp_path):
    """A Llama-shaped checkpoint under each family's name but Qwen3 / Gemma (whose weights differ) loads."""
    for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"):
        path = with_architecture(tiny_model_dir / "target", tmp_path / arch, arch)
        if arch == "Qwen2ForCausalLM":  # Qwen2's q/k/v biases are not in a Llama checkpoint
            with pytest.raises(CheckpointError, match="bias"):
                load_target(path)
        else:
            assert load_target(path).config.architecture == arch


def test_mistral_window_on_every_layer_and_qwen_only_where_layer_types_say():
    mistral = ModelConfig.from_hf_dict({**BASE, "architectures": ["MistralForCausalLM"], "sliding_window": 16})
    assert [mistral.window_of(i) for i in range(4)] == [16] * 4
    types = ["full_attention", "full_attention", "sliding_attention", "sliding_attention"]
    qwen = ModelConfig.from_hf_dict({**BASE, "architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True,
                                     "sliding_window": 16, "layer_types": types})
    assert [qwen.window_of(i) for i in range(4)] == [0, 0, 16, 16]
    # Qwen's released configs carry a sliding_window with use_sliding_window false: full attention.
    stale = ModelConfig.from_hf_dict({**BASE, "architectures": ["Qwen2ForCausalLM"], "use_sliding_window": False,
                                      "sliding_window": 16})
    assert stale.sliding_window is None and stale.window_of(3) == 0
    # A window the context can never exceed is full attention, with no masking cost.
    wide = ModelConfig.from_hf_dict({**BASE, "architectures": ["MistralForCausalLM"], "sliding_window": 4096})
    assert wide.window_of(0) == 0


@pytest.mark.parametrize("bad", [{"sliding_window": 0}, {"hidden_act": "relu"}, {"sliding_window": "x"}])
def test_bad_family_fields_are_checkpoint_errors(bad):
    with pytest.raises(CheckpointError):
        ModelConfig.from_hf_dict({**BASE, "architectures": ["MistralForCausalLM"], **bad})
