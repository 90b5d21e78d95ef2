"""Bad input gets a clear error naming the field and leaks nothing.

Python API: ``RequestError.field`` (engine checks) or the pydantic ``ValidationError`` location
(parameter checks). CLI: ``eyrie generate`` exits with status 2 and prints exactly one line on stderr
naming the problem, nothing on stdout.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from importlib.metadata import entry_points

import pytest
import torch
from engine_checks import GREEDY, PROMPTS, check_accounting, check_pools_full
from pydantic import ValidationError

from services.cli import main as cli_main
from shared.config import EngineConfig
from shared.engine import Engine
from shared.request import RequestError
from shared.sampling import SamplingParams

MAX_CONTEXT = 64


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return Engine(tiny_model_dir / "target", config=EngineConfig(page_size=4, max_context=MAX_CONTEXT))


@pytest.mark.parametrize("prompt, words", [
    ([], "empty"),
    ("", "empty"),
    (list(range(3, 3 + MAX_CONTEXT)), "context"),
    ([5, 512, 7], "vocabulary"),
    ([5, -1], "vocabulary"),
])
def test_bad_prompts(engine, prompt, words):
    with pytest.raises(RequestError) as err:
        engine.generate([prompt], SamplingParams())
    assert err.value.field == "prompt" and words in str(err.value)
    check_pools_full(engine)


def test_context_boundary(engine):
    """prompt + max_new_tokens == context fits; one more token is refused, naming max_new_tokens."""
    prompt = list(range(3, 3 + MAX_CONTEXT - 4))
    with pytest.raises(RequestError) as err:
        engine.add_request(prompt, SamplingParams(max_new_tokens=5))
    assert err.value.field == "max_new_tokens" and "context" in str(err.value)
    res = engine.generate([prompt], SamplingParams(max_new_tokens=4, ignore_eos=True))[0]
    assert len(res.token_ids) == 4
    check_pools_full(engine)


def test_prompt_longer_than_the_models_context(tiny_model_dir):
    engine = Engine(tiny_model_dir / "target", config=EngineConfig(page_size=16))
    limit = engine.model.config.max_position_embeddings
    assert engine.max_context == limit
    with pytest.raises(RequestError) as err:
        engine.add_request([5] * limit, SamplingParams(max_new_tokens=1))
    assert err.value.field == "prompt" and str(limit) in str(err.value)
    check_pools_full(engine)


def test_bad_prompt_in_a_batch_leaks_nothing(engine):
    """Good prompts queued before the bad one are withdrawn: nothing stays behind."""
    with pytest.raises(RequestError):
        engine.generate([[5, 6, 7], [8, 9], [5, 999]], SamplingParams())
    check_pools_full(engine)


def test_bad_request_beside_running_ones(engine):
    """A refused request does not disturb requests mid-flight."""
    alone = engine.generate([PROMPTS[0]], GREEDY)[0]
    req = engine.add_request(PROMPTS[0], GREEDY)
    engine.step()
    engine.step()
    for bad in ([], [9999], list(range(3, 3 + MAX_CONTEXT))):
        with pytest.raises(RequestError):
            engine.add_request(bad, GREEDY)
        check_accounting(engine)
    engine.run_until_done()
    assert engine.result(req).token_ids == alone.token_ids
    check_pools_full(engine)


def test_duplicate_request_id(engine):
    engine.add_request([5, 6], GREEDY, rid="same")
    with pytest.raises(RequestError) as err:
        engine.add_request([7, 8], GREEDY, rid="same")
    assert err.value.field == "request_id"
    engine.run_until_done()
    check_pools_full(engine)


@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=-0.5), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(max_new_tokens=-3), "max_new_tokens"),
])
def test_bad_sampling_params(kwargs, field):
    with pytest.raises(ValidationError) as err:
        SamplingParams(**kwargs)
    errors = err.value.errors()
    assert len(errors) == 1 and errors[0]["loc"] == (field,)


def test_edge_sampling_params_are_fine():
    SamplingParams(temperature=0.0, top_p=1.0, max_new_tokens=1)
    SamplingParams(temperature=2.0, top_p=1e-9, top_k=1)


@pytest.mark.parametrize("kwargs, field", [
    (dict(device="tpu"), "device"),
    (dict(device="gpu:0"), "device"),
    (dict(dtype="int8"), "dtype"),
    (dict(page_size=0), "page_size"),
    (dict(chunk_size=0), "chunk_size"),
    (dict(max_running=0), "max_running"),
])
def test_bad_engine_config(kwargs, field):
    with pytest.raises(ValidationError) as err:
        EngineConfig(**kwargs)
    assert err.value.errors()[0]["loc"] == (field,)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_a_gpu_names_the_device(tiny_model_dir):
    with pytest.raises(RequestError) as err:
        Engine(tiny_model_dir / "target", config=EngineConfig(device="cuda"))
    assert err.value.field == "device"


# ---- the CLI ---------------------------------------------------------------------------------------

def eyrie_command() -> list[str]:
    """The installed console script when it is on PATH, else the module it points at."""
    exe = shutil.which("eyrie")
    return [exe] if exe else [sys.executable, "-m", "services.cli"]


def test_console_script_is_declared():
    (ep,) = entry_points(group="console_scripts", name="eyrie")
    assert ep.value == "services.cli:main"


CLI_CASES = {  # name -> (arguments after --model DIR, words the one stderr line must contain)
    "empty_prompt": (["--prompt", ""], ["prompt", "empty"]),
    "out_of_vocabulary": (["--prompt-ids", "5,600"], ["prompt", "600", "vocabulary"]),
    "longer_than_context": (["--prompt-ids", ",".join(["5"] * 5000)], ["prompt", "context"]),
    "negative_temperature": (["--prompt", "hi", "--temperature", "-1"], ["temperature"]),
    "top_p_zero": (["--prompt", "hi", "--top-p", "0"], ["top_p"]),
    "top_p_above_one": (["--prompt", "hi", "--top-p", "1.01"], ["top_p"]),
    "max_new_tokens_zero": (["--prompt", "hi", "--max-new-tokens", "0"], ["max_new_tokens"]),
    "unknown_device": (["--prompt", "hi", "--device", "tpu"], ["device", "tpu"]),
}


@pytest.fixture(scope="module")
def cli_runs(tiny_model_dir) -> dict[str, subprocess.CompletedProcess]:
    """Every bad-input CLI case, run as real processes, a few at a time (they mostly import torch)."""
    def one(args):
        return subprocess.run([*eyrie_command(), "generate", "--model", str(tiny_model_dir / "target"), *args],
                              capture_output=True, text=True, timeout=180)

    with ThreadPoolExecutor(max_workers=4) as pool:
        done = pool.map(one, [args for args, _ in CLI_CASES.values()])
        return dict(zip(CLI_CASES, done))


@pytest.mark.parametrize("case", sorted(CLI_CASES))
def test_cli_exits_2_with_one_line(cli_runs, case):
    proc = cli_runs[case]
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert all(w in lines[0] for w in CLI_CASES[case][1]), lines[0]
    assert "Traceback" not in proc.stderr and proc.stdout == ""


@pytest.mark.parametrize("args, words", [
    (["--prompt", "hi", "--temperature", "warm"], ["temperature"]),
    (["--prompt", "hi", "--top-k", "-1"], ["top_k"]),
    (["--prompt", "hi", "--page-size", "0"], ["page_size"]),
    (["--prompt", "hi", "--chunk-size", "0"], ["chunk_size"]),
    (["--prompt", "hi", "--dtype", "int8"], ["dtype"]),
    (["--prompt", "hi", "--spec-draft-ahead", "maybe"], ["--spec-draft-ahead", "maybe"]),
    (["--prompt-ids", "5,x"], ["prompt-ids"]),
    (["--max-new-tokens", "3"], ["prompt"]),
    (["--prompt", "hi", "--no-such-flag"], ["--no-such-flag"]),
] + ([] if torch.cuda.is_available() else [(["--prompt", "hi", "--device", "cuda"], ["device", "CUDA"])]))
def test_cli_more_bad_arguments_in_process(tiny_model_dir, capsys, args, words):
    """The same contract for the other arguments, through ``main`` (no process start per case)."""
    with pytest.raises(SystemExit) as exit_:
        cli_main(["generate", "--model", str(tiny_model_dir / "target"), *args])
    assert exit_.value.code == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert out == "" and len(lines) == 1 and all(w in lines[0] for w in words), err


def test_cli_missing_model_dir(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli_main(["generate", "--model", str(tmp_path / "nope"), "--prompt", "hi"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(err) == 1 and "--model" in err[0] and "nope" in err[0]
