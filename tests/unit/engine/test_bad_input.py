"""Bad input gets a clear error naming the field (CLI: exit 2, one line) and leaks nothing."""

from __future__ import annotations

import subprocess
import sys

import pytest
from pydantic import ValidationError

from shared.config import EngineConfig
from shared.engine import Engine
from shared.request import RequestError
from shared.sampling import SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return Engine(tiny_model_dir / "target", config=EngineConfig(page_size=4, max_context=64))


@pytest.mark.parametrize("prompt, field, words", [
    ([], "prompt", "empty"),
    ("", "prompt", "empty"),
    (list(range(3, 70)), "prompt", "context"),
    ([5, 600, 7], "prompt", "vocabulary"),
    ([5, -1], "prompt", "vocabulary"),
])
def test_bad_prompts(engine, prompt, field, words):
    with pytest.raises(RequestError) as err:
        engine.generate([prompt], SamplingParams())
    assert err.value.field == field and words in str(err.value)
    assert engine.is_idle_and_clean()


def test_prompt_plus_max_new_tokens_over_context(engine):
    with pytest.raises(RequestError) as err:
        engine.add_request(list(range(3, 40)), SamplingParams(max_new_tokens=40))
    assert err.value.field == "max_new_tokens"
    assert engine.is_idle_and_clean()


def test_one_bad_prompt_in_a_batch_leaks_nothing(engine):
    with pytest.raises(RequestError):
        engine.generate([[5, 6, 7], [8, 9], [5, 999]], SamplingParams())
    assert engine.is_idle_and_clean() and not engine.requests


@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(max_new_tokens=0), "max_new_tokens"),
])
def test_bad_sampling_params(kwargs, field):
    with pytest.raises(ValidationError) as err:
        SamplingParams(**kwargs)
    assert err.value.errors()[0]["loc"] == (field,)


@pytest.mark.parametrize("kwargs, field", [
    (dict(device="tpu"), "device"),
    (dict(dtype="int8"), "dtype"),
    (dict(page_size=0), "page_size"),
    (dict(chunk_size=0), "chunk_size"),
])
def test_bad_engine_config(kwargs, field):
    with pytest.raises(ValidationError) as err:
        EngineConfig(**kwargs)
    assert err.value.errors()[0]["loc"] == (field,)


def eyrie(*args):
    return subprocess.run([sys.executable, "-m", "services.cli", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("args, words", [
    (["--prompt", ""], "prompt"),
    (["--prompt-ids", "5,600"], "vocabulary"),
    (["--prompt-ids", ",".join(["5"] * 5000)], "context"),
    (["--prompt", "hi", "--temperature", "-1"], "temperature"),
    (["--prompt", "hi", "--top-p", "0"], "top_p"),
    (["--prompt", "hi", "--top-p", "1.01"], "top_p"),
    (["--prompt", "hi", "--max-new-tokens", "0"], "max_new_tokens"),
    (["--prompt", "hi", "--device", "tpu"], "device"),
    (["--prompt", "hi", "--temperature", "warm"], "temperature"),
])
def test_cli_exits_2_with_one_line(tiny_model_dir, args, words):
    proc = eyrie("generate", "--model", str(tiny_model_dir / "target"), *args)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0], proc.stderr
    assert proc.stdout == ""


def test_cli_missing_model_dir(tmp_path):
    proc = eyrie("generate", "--model", str(tmp_path / "nope"), "--prompt", "hi")
    assert proc.returncode == 2 and "--model" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
