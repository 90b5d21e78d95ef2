"""``eyrie generate`` with valid sampling, precision and device flags gives what the Python API gives.

Each run goes through the CLI's own argument parsing (``services.cli.main``, the console script's
entry point; one run below also goes through the installed command) and is compared token for token
with ``Engine.generate`` under the same settings: temperature, top-k, top-p and seed (same seed, same
output; another seed, another output at temperature 1), bfloat16 and float16 on the CPU, and
``--device cpu`` spelled out, with and without a draft.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from services.cli import main as eyrie
from shared.config import EngineConfig, SpecConfig
from shared.engine import Engine
from shared.sampling import SamplingParams

PROMPT_TEXT = "def f(x):"
PROMPT_IDS = [7, 8, 9, 10, 11]
N = 10


def eyrie_command(*args: str) -> subprocess.CompletedProcess:
    exe = shutil.which("eyrie")
    cmd = [exe] if exe else [sys.executable, "-m", "services.cli"]
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=300)


def cli(capsys, target, *flags: str) -> list[dict]:
    argv = ["generate", "--model", str(target), "--prompt", PROMPT_TEXT, "--prompt-ids",
            ",".join(map(str, PROMPT_IDS)), "--max-new-tokens", str(N), "--ignore-eos", "--json", *flags]
    assert eyrie(argv) == 0
    out = capsys.readouterr().out
    return [json.loads(line) for line in out.splitlines()]


def api(target, params: SamplingParams, draft=None, **config):
    spec = SpecConfig(topk=1, steps=3, num_draft_tokens=4) if draft is not None else None
    engine = Engine(target, draft, EngineConfig(**config, spec=spec))
    return engine.generate([PROMPT_TEXT, PROMPT_IDS], params)


def same(objs: list[dict], results) -> None:
    assert len(objs) == len(results) == 2
    for o, r in zip(objs, results):
        assert o["token_ids"] == r.token_ids and o["text"] == r.text and o["finish_reason"] == r.finish_reason
        assert len(o["token_ids"]) == N


SAMPLING = {
    "temperature": (["--temperature", "1.0", "--seed", "7"], dict(temperature=1.0, seed=7)),
    "top_k": (["--temperature", "0.8", "--top-k", "20", "--seed", "3"], dict(temperature=0.8, top_k=20, seed=3)),
    "top_p": (["--temperature", "1.2", "--top-p", "0.85", "--seed", "11"], dict(temperature=1.2, top_p=0.85, seed=11)),
    "all": (["--temperature", "0.9", "--top-k", "50", "--top-p", "0.9", "--seed", "5"],
            dict(temperature=0.9, top_k=50, top_p=0.9, seed=5)),
    "greedy_top_k_1": (["--temperature", "1.0", "--top-k", "1", "--seed", "2"], dict(temperature=1.0, top_k=1, seed=2)),
}


@pytest.mark.parametrize("name", list(SAMPLING))
def test_sampling_flags_match_the_python_api(tiny_model_dir, capsys, name):
    flags, kw = SAMPLING[name]
    target = tiny_model_dir / "target"
    params = SamplingParams(**kw, max_new_tokens=N, ignore_eos=True)
    same(cli(capsys, target, *flags), api(target, params))
    if name == "greedy_top_k_1":  # top-k 1 leaves one token: greedy, whatever the temperature
        greedy = api(target, SamplingParams(max_new_tokens=N, ignore_eos=True))
        assert [r.token_ids for r in api(target, params)] == [r.token_ids for r in greedy]


def test_seed_same_output_and_another_seed_another_output(tiny_model_dir, capsys):
    target = tiny_model_dir / "target"
    a = cli(capsys, target, "--temperature", "1", "--seed", "123")
    b = cli(capsys, target, "--temperature", "1", "--seed", "123")
    c = cli(capsys, target, "--temperature", "1", "--seed", "124")
    assert [o["token_ids"] for o in a] == [o["token_ids"] for o in b]
    assert all(x["token_ids"] != y["token_ids"] for x, y in zip(a, c))
    greedy = cli(capsys, target)
    assert all(x["token_ids"] != g["token_ids"] for x, g in zip(a, greedy))  # temperature 1 did sample


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_on_cpu_matches_the_python_api(tiny_model_dir, capsys, engine_pools_checked, dtype):
    target = tiny_model_dir / "target"
    greedy = SamplingParams(max_new_tokens=N, ignore_eos=True)
    same(cli(capsys, target, "--dtype", dtype, "--device", "cpu"), api(target, greedy, dtype=dtype, device="cpu"))
    made = engine_pools_checked[0]  # the CLI's engine (every engine a test builds is recorded)
    assert made.config.dtype == dtype and made.model.lm_head.weight.dtype == getattr(torch, dtype)
    assert made.cache.k[0].dtype == getattr(torch, dtype) and made.cache.layout.device == torch.device("cpu")
    sampled = SamplingParams(temperature=0.8, top_p=0.9, seed=9, max_new_tokens=N, ignore_eos=True)
    same(cli(capsys, target, "--dtype", dtype, "--device", "cpu", "--temperature", "0.8", "--top-p", "0.9",
             "--seed", "9"), api(target, sampled, dtype=dtype, device="cpu"))
    # with a draft: speculative decoding in that precision, still what the Python API gives
    draft = tiny_model_dir / "eagle3"
    objs = cli(capsys, target, "--dtype", dtype, "--device", "cpu", "--draft", str(draft), "--spec-topk", "1",
               "--spec-steps", "3")
    same(objs, api(target, greedy, draft=draft, dtype=dtype, device="cpu"))
    assert all(o["spec"]["verify_steps"] >= 1 for o in objs)


def test_installed_command_with_every_sampling_flag(tiny_model_dir):
    target = tiny_model_dir / "target"
    proc = eyrie_command("generate", "--model", str(target), "--prompt-ids", ",".join(map(str, PROMPT_IDS)),
                         "--max-new-tokens", str(N), "--ignore-eos", "--temperature", "0.7", "--top-k", "30",
                         "--top-p", "0.95", "--seed", "42", "--dtype", "bfloat16", "--device", "cpu", "--json")
    assert proc.returncode == 0, proc.stderr
    params = SamplingParams(temperature=0.7, top_k=30, top_p=0.95, seed=42, max_new_tokens=N, ignore_eos=True)
    want = Engine(target, None, EngineConfig(dtype="bfloat16", device="cpu")).generate([PROMPT_IDS], params)[0]
    assert json.loads(proc.stdout)["token_ids"] == want.token_ids


@pytest.mark.parametrize("ahead", ["on", "off", "auto"])
def test_spec_draft_ahead_flag(tiny_model_dir, capsys, monkeypatch, ahead):
    """``--spec-draft-ahead`` reaches the engine (auto: on only with CUDA) and changes no token."""
    target, draft = tiny_model_dir / "target", tiny_model_dir / "eagle"
    seen = []
    init = Engine.__init__

    def recording_init(self, *a, **kw):
        init(self, *a, **kw)
        seen.append(self.speculator.ahead.enabled)

    monkeypatch.setattr(Engine, "__init__", recording_init)
    objs = cli(capsys, target, "--draft", str(draft), "--spec-topk", "1", "--spec-steps", "3",
               "--spec-draft-ahead", ahead)
    assert seen == [{"on": True, "off": False, "auto": False}[ahead]]
    monkeypatch.setattr(Engine, "__init__", init)
    same(objs, api(target, SamplingParams(max_new_tokens=N, ignore_eos=True), draft=draft))
