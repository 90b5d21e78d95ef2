"""The engine loop accounts for its thread's time (``services.engine_loop.LoopTimes``): every step by its kind
(decode, mixed, prefill) with its decode rows and prompt tokens, the calls served between steps, the hooks after
steps and the idle waits; the telemetry turns the running totals into counters on /metrics."""

from __future__ import annotations

import time

from prometheus_client.parser import text_string_to_metric_families

from services.engine_loop import EngineLoop, LoopTimes
from services.telemetry import Telemetry
from shared.config import EngineConfig
from shared.engine import Engine
from shared.sampling import SamplingParams
from shared.scheduler import Chunk, StepPlan
from shared.stepping import StepFacts
from tests.polling import poll


def test_step_facts_name_the_kind_of_step():
    R = object  # a request as a plan holds it: only counted
    chunk = Chunk(R(), 0, 12)
    assert StepFacts.of(StepPlan(decode=[R(), R()]), None) == StepFacts("decode", "plain", 2, 0)
    assert StepFacts.of(StepPlan(decode=[R()]), "chain3") == StepFacts("decode", "chain3", 1, 0)
    assert StepFacts.of(StepPlan(prefill=[chunk], decode=[R()]), None) == StepFacts("mixed", "plain", 1, 12)
    assert StepFacts.of(StepPlan(prefill=[chunk]), None) == StepFacts("prefill", None, 0, 12)
    assert StepFacts.of(StepPlan(), None).kind == "idle"


def test_the_loop_counts_every_step_by_kind_its_rows_and_prompt_tokens(tiny_model_dir):
    """Two requests, the second added (on the loop thread, after a step) once the first has decoded a few tokens:
    every step the engine ran is counted once under its kind, one of them mixed; the decode rows and prompt
    tokens add up to what the requests ran, and the loop's parts hold its wall time (idle included)."""
    engine = Engine(tiny_model_dir / "target", config=EngineConfig(page_size=4, max_context=64, max_running=4))
    facts, launch, added = [], engine.launch, []

    def counted():
        running = launch()
        facts.append(engine.last_step)
        return running

    def add_second(e):
        first = e.requests.get("a")
        if not added and first is not None and len(first.output_ids) >= 3:
            added.append(e.add_request(list(range(20, 27)), SamplingParams(max_new_tokens=12, ignore_eos=True),
                                       rid="b"))

    engine.launch = counted
    t0 = time.perf_counter()
    loop = EngineLoop(engine, after_step=add_second).start()
    try:
        first = loop.call(lambda e: e.add_request(list(range(5, 15)), SamplingParams(max_new_tokens=40,
                                                                                      ignore_eos=True), rid="a"))
        first = first.result(10)
        poll(lambda: first.finish_reason and added and added[0].finish_reason, 60, "the requests did not finish")
        poll(lambda: loop.times.seconds.get("idle", 0) > 0, 10, "the loop never waited")
        stepped = loop.call(lambda e: [dict(loop.times.steps), dict(loop.times.rows), loop.times.prefill_tokens,
                                       dict(loop.times.seconds), list(facts)]).result(10)
    finally:
        loop.stop()
    wall = time.perf_counter() - t0
    steps, rows, tokens, seconds, ran = stepped
    kinds = [f.kind for f in ran]
    assert {k: kinds.count(k) for k in set(kinds)} == steps  # each step once, under its kind
    assert steps["mixed"] == 1 and steps["prefill"] == 1  # b's prompt ran beside a's decode row
    assert tokens == 10 + 7 == sum(f.prefill_tokens for f in ran)
    # Each request's first token comes with its prefill; the rest are decode rows.
    assert sum(rows.values()) == sum(f.rows for f in ran) == 39 + 11
    assert set(seconds) >= {"idle", "calls", "after_step", "step_decode", "step_mixed", "step_prefill"}
    assert 0 < sum(seconds.values()) <= wall


def test_telemetry_counts_what_the_totals_gained():
    telemetry = Telemetry("decode", "d0")
    times = LoopTimes()
    times.step(StepFacts("decode", "plain", 8, 0), 0.010)
    times.step(StepFacts("mixed", "plain", 6, 512), 0.030)
    times.add("idle", 0.5)
    telemetry.observe_loop(times)
    times.step(StepFacts("decode", "chain3", 8, 0), 0.012)
    telemetry.observe_loop(times)
    telemetry.observe_loop(times)  # nothing gained: nothing counted twice
    found = {}
    text = telemetry_text(telemetry)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("eyrie_engine_") and s.name.endswith("_total"):
                found[(s.name, s.labels.get("part") or s.labels.get("kind"))] = s.value
    assert found[("eyrie_engine_loop_seconds_total", "step_decode")] == pytest_approx(0.022)
    assert found[("eyrie_engine_loop_seconds_total", "step_mixed")] == pytest_approx(0.030)
    assert found[("eyrie_engine_loop_seconds_total", "idle")] == pytest_approx(0.5)
    assert found[("eyrie_engine_steps_total", "decode")] == 2 and found[("eyrie_engine_steps_total", "mixed")] == 1
    assert found[("eyrie_engine_step_decode_rows_total", "decode")] == 16
    assert found[("eyrie_engine_step_prefill_tokens_total", None)] == 512


def telemetry_text(telemetry: Telemetry) -> str:
    from prometheus_client import generate_latest

    return generate_latest(telemetry.registry).decode()


def pytest_approx(x: float):
    import pytest

    return pytest.approx(x, rel=1e-9)
