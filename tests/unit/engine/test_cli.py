"""``eyrie make-model`` and ``eyrie generate``, run as the installed command."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from shared.config import EngineConfig
from shared.engine import Engine
from shared.sampling import SamplingParams


def eyrie(*args: str) -> subprocess.CompletedProcess:
    exe = shutil.which("eyrie")
    cmd = [exe] if exe else [sys.executable, "-m", "services.cli"]
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=300)


def test_make_model_writes_a_transformers_checkpoint_and_drafts(tmp_path):
    """The tiny target loads in ``transformers`` and computes the same logits there as in Eyrie."""
    transformers = pytest.importorskip("transformers")
    proc = eyrie("make-model", "--preset", "tiny", str(tmp_path / "m"), "--seed", "3")
    assert proc.returncode == 0, proc.stderr
    for sub in ("target", "eagle", "eagle3", "mtp"):
        assert (tmp_path / "m" / sub / "config.json").exists()
        assert (tmp_path / "m" / sub / "model.safetensors").exists()
    target = tmp_path / "m" / "target"
    assert (target / "tokenizer.json").exists()
    hf = transformers.AutoModelForCausalLM.from_pretrained(target).eval()
    assert type(hf).__name__ == "LlamaForCausalLM"
    prompt = [5, 17, 33, 2, 9, 100, 200]
    with torch.no_grad():
        hf_logits = hf(torch.tensor([prompt])).logits[0, -1]
    engine = Engine(target, config=EngineConfig(chunk_size=None))
    seen = []
    inner = engine.runner._sample_and_commit
    engine.runner._sample_and_commit = lambda out, reqs, *rest: (seen.append(out.logits[0].clone()),
                                                                  inner(out, reqs, *rest))[1]
    engine.generate([prompt], SamplingParams(max_new_tokens=1))
    assert hf_logits.shape == (engine.model.config.vocab_size,)
    assert (seen[0] - hf_logits).abs().max().item() <= 1e-4
    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(target / "tokenizer.json"))
    assert tok.decode(tok.encode("def f(x): return x")) == "def f(x): return x"
    assert tok.encode("def f(x): return x") == engine.tokenizer.encode("def f(x): return x")


def test_make_model_seed_changes_the_weights(tmp_path):
    from safetensors.torch import load_file

    from shared.model.factory import make_model

    a = load_file(make_model("tiny", tmp_path / "a", seed=1) / "target" / "model.safetensors")
    b = load_file(make_model("tiny", tmp_path / "b", seed=1) / "target" / "model.safetensors")
    c = load_file(make_model("tiny", tmp_path / "c", seed=2) / "target" / "model.safetensors")
    key = "model.embed_tokens.weight"
    assert torch.equal(a[key], b[key]) and not torch.equal(a[key], c[key])


def test_make_model_unknown_preset(tmp_path):
    proc = eyrie("make-model", "--preset", "huge", str(tmp_path / "m"))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "huge" in lines[0]
    assert not (tmp_path / "m" / "target").exists()


def test_generate_json_one_object_per_prompt(tiny_model_dir):
    """Two text prompts and one id prompt: three JSON lines; tokens equal the Python API's."""
    target = tiny_model_dir / "target"
    ids = [7, 8, 9, 10]
    proc = eyrie("generate", "--model", str(target), "--prompt", "import os", "--prompt", "class A:",
                 "--prompt-ids", ",".join(map(str, ids)), "--max-new-tokens", "6", "--ignore-eos",
                 "--chunk-size", "3", "--page-size", "4", "--json")
    assert proc.returncode == 0, proc.stderr
    objs = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(objs) == 3
    engine = Engine(target, config=EngineConfig())
    want = engine.generate(["import os", "class A:", ids], SamplingParams(max_new_tokens=6, ignore_eos=True))
    for o, w in zip(objs, want):
        assert {"token_ids", "text", "finish_reason", "timing"} <= set(o)
        assert o["token_ids"] == w.token_ids and o["text"] == w.text and o["finish_reason"] == "length"
        assert o["prompt_tokens"] == len(w.prompt_ids)
        assert o["timing"]["latency_s"] >= o["timing"]["ttft_s"] > 0


def test_generate_stop_tokens_and_plain_text(tiny_model_dir):
    target = tiny_model_dir / "target"
    engine = Engine(target, config=EngineConfig())
    want = engine.generate([[7, 8, 9]], SamplingParams(max_new_tokens=8, ignore_eos=True))[0]
    stop = want.token_ids[2]
    proc = eyrie("generate", "--model", str(target), "--prompt-ids", "7,8,9", "--stop-token-ids", str(stop),
                 "--max-new-tokens", "8", "--ignore-eos", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["finish_reason"] == "stop" and out["token_ids"] == want.token_ids[:want.token_ids.index(stop) + 1]
    proc = eyrie("generate", "--model", str(target), "--prompt-ids", "7,8,9", "--max-new-tokens", "8",
                 "--ignore-eos")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == want.text + "\n"


def test_generate_with_a_draft_reports_spec_stats(tiny_model_dir):
    target = tiny_model_dir / "target"
    proc = eyrie("generate", "--model", str(target), "--draft", str(tiny_model_dir / "eagle3"),
                 "--spec-topk", "2", "--spec-steps", "3", "--spec-draft-tokens", "6", "--prompt", "x = 1",
                 "--max-new-tokens", "8", "--ignore-eos", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    spec = out["spec"]
    assert spec["verify_steps"] >= 1 and spec["accept_length"] >= 1.0 and spec["draft_time_s"] > 0
    plain = Engine(target, config=EngineConfig()).generate("x = 1", SamplingParams(max_new_tokens=8,
                                                                                   ignore_eos=True))[0]
    assert out["token_ids"] == plain.token_ids  # speculation is lossless


def test_generate_names_the_shape_its_policy_ran_most(tiny_model_dir):
    """On stderr, the kind of decode step (a tree shape, or plain) the speculation policy ran most: under fixed
    the configured tree, every decode step (one prompt: one verify each); under the default, adaptive, one of
    its shapes or plain."""
    import re

    args = ("generate", "--model", str(tiny_model_dir / "target"), "--draft", str(tiny_model_dir / "eagle3"),
            "--spec-topk", "2", "--spec-steps", "3", "--spec-draft-tokens", "6", "--prompt", "x = 1",
            "--max-new-tokens", "8", "--ignore-eos", "--json")
    fixed = eyrie(*args, "--spec-policy", "fixed")
    assert fixed.returncode == 0, fixed.stderr
    verifies = json.loads(fixed.stdout)["spec"]["verify_steps"]
    assert f"[fixed policy ran tree-k2-s3-n6 most: {verifies} of {verifies} decode steps]" in fixed.stderr
    adaptive = eyrie(*args)
    assert adaptive.returncode == 0, adaptive.stderr
    said = re.search(r"\[adaptive policy ran (\S+) most: (\d+) of (\d+) decode steps", adaptive.stderr)
    assert said is not None, adaptive.stderr
    assert said[1] in ("tree-k2-s3-n6", "chain3", "chain2", "chain1", "plain")
    assert 1 <= int(said[2]) <= int(said[3]) <= 7  # 8 tokens, the first from the prefill
