"""``eyrie make-model`` and ``eyrie generate --json``."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch


def eyrie(*args):
    return subprocess.run([sys.executable, "-m", "services.cli", *args], capture_output=True, text=True, timeout=300)


def test_make_model_writes_a_transformers_checkpoint_and_drafts(tmp_path):
    transformers = pytest.importorskip("transformers")
    proc = eyrie("make-model", "--preset", "tiny", str(tmp_path / "m"), "--seed", "3")
    assert proc.returncode == 0, proc.stderr
    for sub in ("target", "eagle", "eagle3", "mtp"):
        assert (tmp_path / "m" / sub / "config.json").exists()
        assert (tmp_path / "m" / sub / "model.safetensors").exists()
    assert (tmp_path / "m" / "target" / "tokenizer.json").exists()
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m" / "target")
    with torch.no_grad():
        assert hf(torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, 512)
    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "m" / "target" / "tokenizer.json"))
    assert tok.decode(tok.encode("def f(x): return x")) == "def f(x): return x"


def test_make_model_unknown_preset(tmp_path):
    proc = eyrie("make-model", "--preset", "huge", str(tmp_path / "m"))
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1


def test_generate_json_one_object_per_prompt(tiny_model_dir):
    proc = eyrie("generate", "--model", str(tiny_model_dir / "target"), "--prompt", "import os",
                 "--prompt", "class A:", "--max-new-tokens", "6", "--ignore-eos", "--json")
    assert proc.returncode == 0, proc.stderr
    objs = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(objs) == 2
    for o in objs:
        assert len(o["token_ids"]) == 6 and o["finish_reason"] == "length" and isinstance(o["text"], str)
        assert o["timing"]["latency_s"] >= o["timing"]["ttft_s"] > 0


def test_generate_with_a_draft_reports_spec_stats(tiny_model_dir):
    proc = eyrie("generate", "--model", str(tiny_model_dir / "target"), "--draft", str(tiny_model_dir / "eagle3"),
                 "--spec-topk", "2", "--spec-steps", "3", "--spec-draft-tokens", "6", "--prompt", "x = 1",
                 "--max-new-tokens", "8", "--ignore-eos", "--json")
    assert proc.returncode == 0, proc.stderr
    spec = json.loads(proc.stdout)["spec"]
    assert spec["verify_steps"] >= 1 and spec["accept_length"] >= 1.0 and spec["draft_time_s"] > 0
    plain = eyrie("generate", "--model", str(tiny_model_dir / "target"), "--prompt", "x = 1",
                  "--max-new-tokens", "8", "--ignore-eos", "--json")
    assert json.loads(plain.stdout)["token_ids"] == json.loads(proc.stdout)["token_ids"]
