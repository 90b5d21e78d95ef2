"""services.settings: flags over EYRIE_* environment over a --config file over defaults."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from services.settings import DecodeSettings, PrefillSettings, RouterSettings, load_settings


def test_defaults_and_types():
    r = load_settings("router")
    assert isinstance(r, RouterSettings) and r.request_ttl_s == 3600 and r.api_key is None and r.grpc_port == 0
    assert isinstance(load_settings("prefill"), PrefillSettings)
    assert isinstance(load_settings("decode"), DecodeSettings)


def test_precedence_flags_over_env_over_file(tmp_path, monkeypatch):
    cfg = tmp_path / "eyrie.json"
    cfg.write_text(json.dumps({"page_size": 1, "chunk_size": 64, "spec_topk": 4, "max_running": 3,
                               "api_key": "every-role-reads-this"}))
    monkeypatch.setenv("EYRIE_CHUNK_SIZE", "128")
    monkeypatch.setenv("EYRIE_PAGE_SIZE", "16")  # equal to the default, still over the file's 1
    s = load_settings("decode", str(cfg), spec_topk="2", max_running=None)
    assert (s.page_size, s.chunk_size, s.spec_topk, s.max_running) == (16, 128, 2, 3)
    assert s.api_key == load_settings("router", str(cfg)).api_key == "every-role-reads-this"


def test_env_file_format(tmp_path, monkeypatch):
    monkeypatch.delenv("EYRIE_CHUNK_SIZE", raising=False)
    cfg = tmp_path / "eyrie.env"
    cfg.write_text("# comment\nEYRIE_REDIS_URL='redis://r:6379/2'\neyrie_chunk_size = 32\nMODEL=\"/m/target\"\n\n")
    s = load_settings("prefill", str(cfg))
    assert (s.redis_url, s.chunk_size, s.model) == ("redis://r:6379/2", 32, "/m/target")


def test_unknown_file_keys_and_bad_values_are_refused(tmp_path):
    cfg = tmp_path / "eyrie.json"
    cfg.write_text(json.dumps({"page_sise": 4}))
    with pytest.raises(ValueError, match="page_sise"):
        load_settings("decode", str(cfg))
    cfg.write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        load_settings("decode", str(cfg))
    with pytest.raises(ValidationError) as err:
        load_settings("decode", page_size="four")
    assert err.value.errors()[0]["loc"] == ("page_size",)


def test_engine_config_from_settings():
    s = DecodeSettings(model="m", draft="d", spec_topk=4, spec_steps=3, page_size=1, chunk_size=8)
    cfg = s.engine_config()
    assert (cfg.page_size, cfg.chunk_size, cfg.spec.topk, cfg.spec.steps, cfg.spec.num_draft_tokens) == (1, 8, 4, 3, 8)
    # chain: steps + 1 (with no tree setting at all, the adaptive default tree: tests/unit/spec/test_default_policy.py)
    assert DecodeSettings(draft="d", spec_topk=1).engine_config().spec.num_draft_tokens == 4
    assert DecodeSettings(draft="none").engine_config().spec is None
    assert PrefillSettings().engine_config().spec is None


@pytest.mark.parametrize("env, want", [(None, None), ("true", True), ("0", False)])
def test_spec_draft_ahead_from_the_environment(monkeypatch, env, want):
    if env is not None:
        monkeypatch.setenv("EYRIE_SPEC_DRAFT_AHEAD", env)
    assert load_settings("decode", draft="d").engine_config().spec_draft_ahead is want


def test_spec_draft_ahead_bad_value(monkeypatch):
    monkeypatch.setenv("EYRIE_SPEC_DRAFT_AHEAD", "sometimes")
    with pytest.raises(ValidationError, match="spec_draft_ahead"):
        load_settings("decode")


def test_every_engine_setting_reaches_the_engine_config_under_its_own_name():
    """A setting ``EngineOptions`` shares with ``EngineConfig`` is passed as it is (``ENGINE_SETTINGS``); the others
    are the service's own (paths, the tree shape's parts, the transport), so no engine setting is dropped."""
    from services.settings import ENGINE_SETTINGS, EngineOptions, EngineSettings
    from shared.config import EngineConfig

    own = {"model", "draft", "spec_topk", "spec_steps", "spec_draft_tokens", "handoff_transport"}
    assert set(EngineOptions.model_fields) - set(ENGINE_SETTINGS) == own
    assert set(ENGINE_SETTINGS) <= set(EngineConfig.model_fields)
    changed = dict(dtype="bfloat16", page_size=4, num_pages=99, max_running=3, max_context=77, chunk_size=8,
                   cuda_graph=True, spec_draft_ahead=False, spec_policy="adaptive", tensor_parallel=2,
                   gpu_memory_fraction=0.5)
    config = EngineSettings(model="m", **changed).engine_config()
    assert {k: getattr(config, k) for k in changed} == changed
