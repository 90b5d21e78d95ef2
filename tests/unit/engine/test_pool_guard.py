"""The end-of-test pool check (tests/conftest.py ``engine_pools_checked``, autouse here and in
tests/unit/spec): every engine a test builds is recorded, and one left holding pages or request
slots is reported."""

from __future__ import annotations

from shared.config import EngineConfig
from shared.engine import Engine
from shared.sampling import SamplingParams
from tests.conftest import pools_complaint


def test_engines_are_recorded_and_a_leftover_request_is_reported(tiny_model_dir, engine_pools_checked):
    cfg = EngineConfig(max_running=2, max_context=64, page_size=4)
    a = Engine(tiny_model_dir / "target", config=cfg)
    b = Engine(a.model, config=cfg)  # built on a loaded model: recorded too
    assert engine_pools_checked == [a, b]
    a.generate([[7, 8, 9]], SamplingParams(max_new_tokens=3, ignore_eos=True))
    req = b.add_request([7, 8, 9, 10, 11, 12], SamplingParams(max_new_tokens=8, ignore_eos=True))
    b.step()  # prefill: the request holds pages and a row in the target cache
    assert req.handles and b.scheduler.running
    complaint = pools_complaint(engine_pools_checked)
    assert complaint is not None and complaint.startswith("engine 2 of 2") and "still scheduled" in complaint
    b.abort(req.rid)  # the pages and the row go back: the end-of-test check passes
    assert pools_complaint(engine_pools_checked) is None


def test_a_held_page_is_reported_even_with_no_request_left(tiny_model_dir, engine_pools_checked):
    engine = Engine(tiny_model_dir / "target", config=EngineConfig(max_running=2, max_context=64, page_size=4))
    cache = engine.cache
    h = cache.open()
    cache.reserve(h, 5)  # a claim no request owns
    complaint = pools_complaint(engine_pools_checked)
    assert complaint is not None and "pages free" in complaint
    cache.close(h)
    assert pools_complaint(engine_pools_checked) is None
