"""No leak: with speculation, every page and request row goes back to every pool (target and each
draft cache), at every step, for requests aborted at any point and for requests that end inside an
accepted run (a stop token, EOS or max_new_tokens reached in the middle of the tokens one verify
committed: the rest is dropped and its pages freed). Oracle drafts, so accepted runs are long.
"""

from __future__ import annotations

import pytest
from spec_helpers import KINDS, PROMPTS, assert_same_greedy

from shared.engine import Engine
from shared.model.drafts import load_draft
from shared.model.loader import load_target
from shared.sampling import SamplingParams

PARAMS = SamplingParams(max_new_tokens=24, ignore_eos=True)
SPEC = dict(topk=2, steps=4, ndt=8)


def assert_accounting(engine: Engine) -> None:
    """Pages and rows in use are exactly those the live requests hold, in every cache."""
    live = [r for r in engine.scheduler.running if r.handles]
    for j, cache in enumerate(engine.scheduler.caches):
        held = sum(cache.pages_for(r.handles[j].reserved) for r in live)
        assert cache.layout.num_pages - cache.num_free_pages == held, f"cache {j}: pages leaked or double-freed"
        assert cache.req_to_token.num_rows - cache.num_free_rows == len(live), f"cache {j}: rows leaked"


def step_all(engine: Engine) -> list[tuple[str, list[int]]]:
    events = []
    while engine.scheduler.has_work():
        events += [(r.rid, toks) for r, toks in engine.step()]
        assert_accounting(engine)
    assert engine.is_idle_and_clean()
    return events


def inside_an_accepted_run(engine: Engine, prompt: list[int]) -> tuple[list[int], int]:
    """The full greedy output, and an output index j whose token first occurs at j and was committed
    by a verify that committed more tokens after it."""
    req = engine.add_request(prompt, PARAMS)
    commits = [toks for rid, toks in step_all(engine) if rid == req.rid and toks]
    full, pos = req.output_ids, 0
    for i, toks in enumerate(commits):
        for t, tok in enumerate(toks):
            if i > 0 and t < len(toks) - 1 and full.index(tok) == pos + t:
                return full, pos + t
        pos += len(toks)
    raise AssertionError(f"no token to stop at inside an accepted run: {commits}")


@pytest.mark.parametrize("kind", KINDS)
def test_ending_inside_an_accepted_run(oracle_models, kind):
    prompt, others = PROMPTS[3], [PROMPTS[0], PROMPTS[4]]
    full, j = inside_an_accepted_run(oracle_models.engine(kind, **SPEC), prompt)
    tok = full[j]
    want_others = oracle_models.reference(others, PARAMS)
    # An engine whose target names ``tok`` as its EOS (its own target copy: the config is per model).
    target = load_target(oracle_models.root / "target")
    target.config = target.config.model_copy(update={"eos_token_ids": (tok,)})
    stop_engine = oracle_models.engine(kind, **SPEC)
    endings = {
        "stop": (stop_engine, SamplingParams(max_new_tokens=24, stop_token_ids=(tok,)), "stop"),
        "eos": (Engine(target, load_draft(oracle_models.root / kind, target), stop_engine.config),
                SamplingParams(max_new_tokens=24), "stop"),
        "length": (oracle_models.engine(kind, **SPEC), SamplingParams(max_new_tokens=j + 1, ignore_eos=True),
                   "length"),
    }
    for name, (engine, params, reason) in endings.items():
        req = engine.add_request(prompt, params)
        rest = [engine.add_request(p, PARAMS) for p in others]  # these ignore EOS and run on
        step_all(engine)
        res = engine.result(req)
        assert res.finish_reason == reason, name
        assert res.token_ids == full[:j + 1], f"{kind} {name}: not cut right after the stop token"
        assert len(res.logprobs) == j + 1
        assert_same_greedy([engine.result(r) for r in rest], want_others, f"{kind} {name}")


@pytest.mark.parametrize("when", ["waiting", "mid_prefill", "mid_decode", "all_mid_decode", "sampled_mid_decode"])
@pytest.mark.parametrize("kind", KINDS)
def test_abort(oracle_models, kind, when):
    """Three requests, two at a time (the third waits), prefill in chunks of 8; one is aborted."""
    engine = oracle_models.engine(kind, **SPEC, page_size=4, chunk_size=8, max_running=2)
    prompts = [PROMPTS[1], PROMPTS[4], PROMPTS[2]]
    params = PARAMS
    if when == "sampled_mid_decode":
        params = SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_new_tokens=24, ignore_eos=True)
    reqs = [engine.add_request(p, params) for p in prompts]
    victim = {"waiting": reqs[2], "mid_prefill": reqs[0]}.get(when, reqs[1])
    phase = {"waiting": "WAITING", "mid_prefill": "PREFILLING"}.get(when, "DECODING")
    for _ in range(50):
        if victim.stage.name == phase and (phase != "DECODING" or len(victim.output_ids) >= 5):
            break
        engine.step()
        assert_accounting(engine)
    assert victim.stage.name == phase
    for r in (reqs[:2] if when == "all_mid_decode" else [victim]):
        assert engine.abort(r.rid)
        assert_accounting(engine)
    assert not engine.abort(victim.rid)
    step_all(engine)
    assert engine.result(victim).finish_reason == "abort"
    survivors = [(r, p) for r, p in zip(reqs, prompts) if r.finish_reason != "abort"]
    assert survivors
    if params.greedy:
        want = oracle_models.reference([p for _, p in survivors], PARAMS)
        assert_same_greedy([engine.result(r) for r, _ in survivors], want, f"{kind} {when}")
    else:
        assert all(len(r.output_ids) == 24 for r, _ in survivors)
