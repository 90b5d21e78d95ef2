"""Without ``--model``, ``eyrie generate`` and ``eyrie up`` serve the tiny trained pair when it is there
(``models/tiny-pair`` or ``EYRIE_TINY_PAIR``), its EAGLE-3 head included, and a random tiny model otherwise."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

from shared.config import EngineConfig
from shared.engine import Engine
from shared.model import default_pair
from shared.sampling import SamplingParams


def generate(env_pair: str, *args: str) -> subprocess.CompletedProcess:
    exe = shutil.which("eyrie")
    cmd = [exe] if exe else [sys.executable, "-m", "services.cli"]
    env = {**os.environ, default_pair.ENV: env_pair}
    return subprocess.run([*cmd, "generate", *args], capture_output=True, text=True, timeout=300, env=env)


def test_trained_pair_is_found_only_when_both_checkpoints_are_there(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv(default_pair.ENV, str(tiny_model_dir))
    assert default_pair.trained_tiny_pair() == default_pair.Pair(tiny_model_dir / "target", tiny_model_dir / "eagle3")
    assert default_pair.default_pair() == default_pair.trained_tiny_pair()
    shutil.copytree(tiny_model_dir / "target", tmp_path / "target")  # no eagle3/: not a pair
    monkeypatch.setenv(default_pair.ENV, str(tmp_path))
    assert default_pair.trained_tiny_pair() is None
    made = default_pair.default_pair()  # the random tiny model, made now
    assert made.target != tmp_path / "target" and (made.eagle3 / "config.json").exists()


def test_generate_without_model_serves_the_pair_with_its_head(tiny_model_dir):
    proc = generate(str(tiny_model_dir), "--prompt-ids", "5,6,7", "--max-new-tokens", "6", "--ignore-eos", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    want = Engine(tiny_model_dir / "target", config=EngineConfig()).generate(
        [5, 6, 7], SamplingParams(max_new_tokens=6, ignore_eos=True))[0]
    assert out["token_ids"] == want.token_ids
    assert out["spec"]["verify_steps"] > 0  # the pair's EAGLE-3 head drafted
    off = generate(str(tiny_model_dir), "--prompt-ids", "5,6,7", "--max-new-tokens", "6", "--ignore-eos", "--json",
                   "--draft", "none")
    assert off.returncode == 0, off.stderr
    assert json.loads(off.stdout)["token_ids"] == want.token_ids and "spec" not in json.loads(off.stdout)


def test_generate_without_model_or_pair_falls_back_to_a_random_tiny_model(tmp_path):
    proc = generate(str(tmp_path / "absent"), "--prompt-ids", "5,6,7", "--max-new-tokens", "4", "--ignore-eos",
                    "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert len(out["token_ids"]) == 4 and "spec" not in out  # generate adds no head to a random model
