"""``dtype="auto"``, the engine's default: resolved once where the model loads, to the checkpoint's own half dtype
on a GPU (bfloat16 for a float32 checkpoint or one that names none) and to float32 on the CPU; everything after
the load (weights, pools, hand-off schema, the registry's facts) carries the resolved dtype, never ``auto``.

The resolver is a pure function of the configured dtype, the device's name and the checkpoint's ``config.json``,
so its GPU answers are checked here on a "cuda" device name without a GPU; tests/gpu/test_dtype_auto_gpu.py loads
a bf16 checkpoint on a GPU.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch
from pydantic import ValidationError

from services.cli import main as cli_main
from services.engine_service import engine_facts
from services.settings import DecodeSettings, PrefillSettings, load_settings
from shared.config import EngineConfig, SpecConfig, checkpoint_dtype, resolve_dtype
from shared.engine import Engine
from shared.handoff import SchemaMismatch
from shared.model.default_pair import trained_tiny_pair
from shared.model.factory import make_model
from shared.model.loader import load_target
from shared.sampling import SamplingParams
from tests.unit.handoff.handoff_helpers import hand_off, prefill_until_handoff

GREEDY = SamplingParams(max_new_tokens=12, ignore_eos=True)
SEEDED = SamplingParams(max_new_tokens=12, ignore_eos=True, temperature=0.9, top_p=0.95, seed=7)
PROMPTS = [[5, 17, 33, 2, 9], [(i * 37 + 11) % 500 for i in range(30)], [7, 7, 8]]
SPEC = SpecConfig(topk=1, steps=3, num_draft_tokens=4)


@pytest.fixture(scope="module")
def pair():
    found = trained_tiny_pair()
    assert found is not None, "models/tiny-pair is part of the repository"
    return found


def write_config(tmp_path, **keys):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64, **keys}))
    return tmp_path


# ---- the resolver (pure: a "cuda" device name needs no GPU) ---------------------------------------------------

@pytest.mark.parametrize("keys, on_gpu", [
    (dict(torch_dtype="bfloat16"), "bfloat16"),
    (dict(torch_dtype="float16"), "float16"),
    (dict(torch_dtype="float32"), "bfloat16"),  # a float32 checkpoint runs in a half type on a GPU
    (dict(), "bfloat16"),  # none named
    (dict(torch_dtype=None), "bfloat16"),
    (dict(dtype="float16"), "float16"),  # transformers 5 writes `dtype`
    (dict(dtype="bfloat16"), "bfloat16"),
    (dict(dtype="float32"), "bfloat16"),
    (dict(dtype="float16", torch_dtype="bfloat16"), "float16"),  # `dtype` wins, as transformers 5 reads it
    (dict(torch_dtype="torch.float16"), "float16"),
    (dict(torch_dtype="float8_e4m3fn"), "bfloat16"),  # not a dtype the engine computes in
])
def test_auto_is_the_checkpoint_half_dtype_on_cuda_and_float32_on_the_cpu(tmp_path, keys, on_gpu):
    model_dir = write_config(tmp_path, **keys)
    for device in ("cuda", "cuda:1"):
        resolved = EngineConfig(device=device).resolved(model_dir)
        assert resolved.dtype == on_gpu and resolved.device == device
        assert resolve_dtype("auto", device, checkpoint_dtype(model_dir)) == on_gpu
    assert EngineConfig(device="cpu").resolved(model_dir).dtype == "float32"
    assert resolve_dtype("auto", "cpu", checkpoint_dtype(model_dir)) == "float32"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_an_explicit_dtype_is_kept_on_every_device(tmp_path, dtype):
    model_dir = write_config(tmp_path, torch_dtype="float16")
    for device in ("cpu", "cuda", "cuda:3"):
        config = EngineConfig(device=device, dtype=dtype)
        assert config.resolved(model_dir) is config
        assert resolve_dtype(dtype, device, "float16") == dtype


def test_a_checkpoint_without_a_readable_config_names_no_dtype(tmp_path):
    assert checkpoint_dtype(tmp_path / "missing") is None
    (tmp_path / "config.json").write_text("{not json")
    assert checkpoint_dtype(tmp_path) is None
    assert EngineConfig(device="cuda").resolved(tmp_path).dtype == "bfloat16"


def test_auto_is_the_default_of_the_engine_and_of_the_services():
    assert EngineConfig().dtype == "auto"
    assert DecodeSettings().dtype == PrefillSettings().dtype == "auto"
    assert DecodeSettings().engine_config().dtype == "auto"  # resolved by the engine, where the model is


# ---- bad values ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", ["int8", "half", "AUTO", "fp8", ""])
def test_a_bad_dtype_is_refused_naming_the_field_and_the_choices(bad):
    with pytest.raises(ValidationError) as err:
        EngineConfig(dtype=bad)
    first = err.value.errors()[0]
    assert first["loc"] == ("dtype",) and "auto, float32, bfloat16 or float16" in first["msg"]


def test_a_bad_eyrie_dtype_is_refused_naming_the_field(monkeypatch):
    monkeypatch.setenv("EYRIE_DTYPE", "half")
    with pytest.raises(ValidationError) as err:
        load_settings("decode")
    assert err.value.errors()[0]["loc"] == ("dtype",)


@pytest.mark.parametrize("command", [["generate", "--prompt", "hi"], ["serve", "decode"], ["serve", "prefill"]])
def test_the_cli_refuses_a_bad_dtype_with_one_line(pair, capsys, command):
    with pytest.raises(SystemExit) as exit_:
        cli_main([*command, "--model", str(pair.target), "--dtype", "half"])
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert exit_.value.code == 2 and out == "" and len(lines) == 1, err
    assert "dtype" in lines[0] and "half" in lines[0] and "Traceback" not in err


# ---- on the CPU: auto is float32, whatever the checkpoint ----------------------------------------------------

def test_auto_on_the_cpu_loads_the_bf16_tiny_pair_as_float32_and_matches_an_explicit_float32_engine(pair, caplog):
    assert checkpoint_dtype(pair.target) == "bfloat16"  # on a GPU, auto would keep it
    with caplog.at_level(logging.INFO, logger="eyrie.weights"):
        auto = Engine(pair.target, pair.eagle3, EngineConfig(spec=SPEC, spec_policy="fixed"))
    explicit = Engine(pair.target, pair.eagle3, EngineConfig(dtype="float32", spec=SPEC, spec_policy="fixed"))
    assert auto.config.dtype == "float32" and auto.runner.config.dtype == "float32"
    assert auto.config.model_copy(update={"dtype": "auto"}) == EngineConfig(spec=SPEC, spec_policy="fixed")
    assert {p.dtype for p in auto.model.parameters()} == {torch.float32}
    assert {p.dtype for p in auto.runner.head.parameters() if p.is_floating_point()} == {torch.float32}
    assert all(c.k[0].dtype == torch.float32 for c in auto.runner.caches)
    assert auto.handoff_schema() == explicit.handoff_schema() and auto.handoff_schema().dtype == "float32"
    assert engine_facts(auto)["dtype"] == "float32"  # what GetModelInfo reports
    [event] = [r for r in caplog.records if getattr(r, "event", None) == "dtype_resolved"]
    assert event.fields == {"configured": "auto", "dtype": "float32", "checkpoint": "bfloat16", "device": "cpu"}
    for params in (GREEDY, SEEDED):
        got = auto.generate(PROMPTS, params)
        want = explicit.generate(PROMPTS, params)
        assert [r.token_ids for r in got] == [r.token_ids for r in want]
        assert [r.logprobs for r in got] == [r.logprobs for r in want]
    assert auto.is_idle_and_clean() and explicit.is_idle_and_clean()


def test_a_target_passed_in_built_keeps_its_weights_dtype(pair):
    """Nothing is loaded: the pools and the draft head take the built target's dtype (bf16 here, on the CPU)."""
    target = load_target(pair.target, "bfloat16")
    engine = Engine(target, pair.eagle3, EngineConfig(spec=SPEC, spec_policy="fixed"))
    assert engine.config.dtype == "bfloat16" and engine.cache.k[0].dtype == torch.bfloat16
    assert engine.runner.head.fc.weight.dtype == torch.bfloat16
    want = Engine(load_target(pair.target, "bfloat16"), pair.eagle3,
                  EngineConfig(dtype="bfloat16", spec=SPEC, spec_policy="fixed"))
    got = engine.generate(PROMPTS, GREEDY)
    assert [r.token_ids for r in got] == [r.token_ids for r in want.generate(PROMPTS, GREEDY)]
    assert engine.is_idle_and_clean() and want.is_idle_and_clean()


def test_an_fp8_checkpoint_on_auto_runs_as_an_explicit_float32_engine_on_the_cpu(tmp_path):
    """The FP8 projections stay FP8; the rest (norms, embeddings, LM head) and the compute take the resolved
    dtype, as with an explicit one."""
    root = make_model("tiny", tmp_path, fp8="block")
    auto = Engine(root / "target", config=EngineConfig())
    explicit = Engine(root / "target", config=EngineConfig(dtype="float32"))
    assert auto.config.dtype == "float32"
    dtypes = {name: p.dtype for name, p in auto.model.named_parameters()}
    assert dtypes == {name: p.dtype for name, p in explicit.model.named_parameters()}
    assert torch.float8_e4m3fn in dtypes.values() and dtypes["model.norm.weight"] == torch.float32
    got, want = auto.generate(PROMPTS, GREEDY), explicit.generate(PROMPTS, GREEDY)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert auto.is_idle_and_clean() and explicit.is_idle_and_clean()


# ---- the hand-off compares resolved dtypes ---------------------------------------------------------------------

def test_a_prefill_on_auto_hands_off_to_a_decode_on_float32(pair):
    """Both sides' schemas carry the resolved dtype: a prefill instance on auto (float32 on the CPU) and a decode
    instance on an explicit float32 agree, and the handed-off requests finish as one float32 engine's do."""
    config = EngineConfig(page_size=16, chunk_size=8, spec=SPEC, spec_policy="fixed")
    prefill = Engine(pair.target, pair.eagle3, config, role="prefill")
    decode = Engine(pair.target, pair.eagle3, config.model_copy(update={"dtype": "float32"}), role="decode")
    assert prefill.handoff_schema().dtype == "float32"
    decode.handoff_schema().check(prefill.handoff_schema())  # agreement: no SchemaMismatch
    want = Engine(pair.target, pair.eagle3, config.model_copy(update={"dtype": "float32"})).generate(PROMPTS, GREEDY)
    reqs = prefill_until_handoff(prefill, PROMPTS, GREEDY)
    moved = []
    for req in reqs:
        moved.append(hand_off(prefill, req, decode))
        prefill.release(req)
    decode.run_until_done()
    assert [m.output_ids for m in moved] == [r.token_ids for r in want]
    assert decode.is_idle_and_clean() and prefill.is_idle_and_clean()


def test_a_prefill_on_auto_and_a_decode_on_bfloat16_disagree_naming_the_resolved_dtype(pair):
    prefill = Engine(pair.target, None, EngineConfig(page_size=16), role="prefill")
    decode = Engine(pair.target, None, EngineConfig(page_size=16, dtype="bfloat16"), role="decode")
    with pytest.raises(SchemaMismatch) as err:
        decode.handoff_schema().check(prefill.handoff_schema())
    assert "dtype: decode has bfloat16, prefill has float32" in str(err.value) and "auto" not in str(err.value)
