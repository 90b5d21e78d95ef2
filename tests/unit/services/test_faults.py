"""The tests' hold gate (``services/faults.py``): while its file exists, an engine loop stops stepping at the named
state (a request decoding with tokens left, a prompt half prefilled), says so in ``<gate>.held``, still serves
calls, and steps on once the file is gone; without the file it never holds."""

from __future__ import annotations

import json
import queue
from pathlib import Path

import pytest

from services.engine_loop import EngineLoop
from services.faults import HOLD_AT_ENV, HOLD_FILE_ENV, HoldGate
from shared.config import EngineConfig
from shared.engine import Engine
from shared.sampling import SamplingParams
from tests.polling import poll


def held_loop(model_dir, gate: Path, at: str) -> EngineLoop:
    engine = Engine(model_dir / "target", config=EngineConfig(page_size=4, max_context=64, max_running=2,
                                                              chunk_size=4))
    loop = EngineLoop(engine)
    loop.hold = HoldGate(str(gate), at)
    return loop.start()


def tokens_until(events: queue.Queue, done) -> list[int]:
    got: list[int] = []
    while not done(got):
        event = events.get(timeout=60)
        got += event.token_ids
        if event.finish_reason is not None:
            break
    return got


def test_a_decode_held_at_its_state_publishes_its_tokens_serves_calls_and_goes_on_once_released(
        tiny_model_dir, tmp_path):
    gate = tmp_path / "hold"
    gate.touch()
    loop = held_loop(tiny_model_dir, gate, "decoding:3")
    try:
        events = loop.subscribe("r")
        loop.call(lambda e: e.add_request([5, 6, 7], SamplingParams(max_new_tokens=20, ignore_eos=True), rid="r"))
        poll(Path(f"{gate}.held").exists, 60, "the loop never held")
        held = json.loads(Path(f"{gate}.held").read_text())
        assert list(held) == ["r"] and 3 <= held["r"] < 20
        assert len(tokens_until(events, lambda got: len(got) >= held["r"])) == held["r"]  # published, all of them
        for _ in range(3):  # held: calls run, the request does not move
            assert loop.call(lambda e: len(e.requests["r"].output_ids)).result(30) == held["r"]
        gate.unlink()
        rest = tokens_until(events, lambda got: False)
        assert held["r"] + len(rest) == 20
        poll(lambda: loop.call(lambda e: e.is_idle_and_clean()).result(30), 60, "pages not back")
    finally:
        loop.stop()


def test_a_prefill_held_mid_prompt_and_no_hold_without_the_gate_file(tiny_model_dir, tmp_path):
    gate = tmp_path / "hold"
    loop = held_loop(tiny_model_dir, gate, "prefilling:0")
    try:
        params = SamplingParams(max_new_tokens=2, ignore_eos=True)
        events = loop.subscribe("free")
        loop.call(lambda e: e.add_request(list(range(3, 23)), params, rid="free"))
        assert len(tokens_until(events, lambda got: False)) == 2  # no gate file: never held
        assert not Path(f"{gate}.held").exists()
        gate.touch()
        loop.call(lambda e: e.add_request(list(range(3, 23)), params, rid="p"))
        poll(Path(f"{gate}.held").exists, 60, "the loop never held")
        assert json.loads(Path(f"{gate}.held").read_text()) == {"p": 0}
        kv_len = loop.call(lambda e: e.requests["p"].kv_len).result(30)
        assert kv_len < 20  # mid-prompt
        gate.unlink()
        poll(lambda: loop.call(lambda e: e.is_idle_and_clean()).result(30), 60, "the prompt did not end")
    finally:
        loop.stop()


def test_the_gate_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv(HOLD_FILE_ENV, raising=False)
    assert HoldGate.from_env() is None
    monkeypatch.setenv(HOLD_FILE_ENV, "/tmp/g")
    monkeypatch.setenv(HOLD_AT_ENV, "prefilling:0")
    gate = HoldGate.from_env()
    assert (str(gate.gate), gate.stage.value, gate.min_tokens) == ("/tmp/g", "prefilling", 0)
    with pytest.raises(ValueError):
        HoldGate("/tmp/g", "nowhere:1")
