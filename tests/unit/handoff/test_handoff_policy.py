"""Under disaggregation the decode instance's speculation policy decides alone. What the prefill instance hands
off (the prompt's K/V in every cache and the draft state its first draft extend leaves) is the same whatever
policy either side is given, and a decode engine resumes from it into whichever shape its policy picks: greedy
output is the target's alone under ``fixed`` and under ``adaptive`` switching shapes every step."""

from __future__ import annotations

import pytest
import torch
from handoff_helpers import GREEDY, PROMPTS, hand_off, load_models, make_engine, positions_kv, prefill_until_handoff

from shared.config import EngineConfig, SpecConfig
from shared.engine import Engine
from shared.sampling import SamplingParams
from tests.policy_costs import Rotating

TREE = SpecConfig(topk=4, steps=3, num_draft_tokens=8)
SEEDED = GREEDY.model_copy(update={"seed": 7})  # the seed travels in the draft state: the same one both times




@pytest.fixture(scope="module")
def models(oracle_model_dir):
    return load_models(oracle_model_dir)


def config(policy: str) -> EngineConfig:
    return EngineConfig(page_size=4, chunk_size=8, max_context=512, spec=TREE, spec_policy=policy)


def prefilled(models, policy: str) -> tuple[Engine, list, list, list]:
    """A prefill engine under ``policy`` with the prompts parked for their hand-off: the engine, the requests,
    each one's seed and draft state (what the wire carries) and its K/V at every committed position."""
    engine = make_engine(models, "eagle3", config(policy), role="prefill")
    reqs = prefill_until_handoff(engine, PROMPTS, SEEDED)
    return engine, reqs, [(r.seed, r.draft_state) for r in reqs], [positions_kv(engine, r, r.kv_len) for r in reqs]


def same_states(a: list, b: list) -> bool:
    """Whether two lists of (seed, draft state) hold the same ones, field by field."""
    return len(a) == len(b) and all(
        (m, s.bonus_token, s.committed_len) == (n, t.bonus_token, t.committed_len)
        and all(torch.equal(getattr(s, f), getattr(t, f)) for f in ("hidden", "topk_p", "topk_ids"))
        for (m, s), (n, t) in zip(a, b))


def decoded(models, prefill: Engine, reqs: list, policy: str) -> tuple[list[list[int]], Engine]:
    """Hand ``reqs`` to a decode engine under ``policy`` (adaptive: a different shape or a plain step every step)
    and decode them: their tokens, and the engine."""
    decode = make_engine(models, "eagle3", config(policy), role="decode")
    if policy == "adaptive":
        names = list(decode.speculator.shapes)
        decode.spec_policy.cost = Rotating([*names, None])
        decode.spec_policy.probe_every = 10 ** 6
        for c in decode.spec_policy.candidates:
            c.acceptance.observe([2])  # known acceptance: the costs decide
    moved = []
    for req in reqs:
        moved.append(hand_off(prefill, req, decode))
        prefill.release(req)
    decode.run_until_done()
    assert decode.is_idle_and_clean() and prefill.is_idle_and_clean()
    return [decode.result(d).token_ids for d in moved], decode


def test_the_hand_off_is_the_same_whatever_the_policies_and_the_decode_side_decides_alone(models):
    target = Engine(models.target, config=EngineConfig(page_size=4, chunk_size=None, max_context=512))
    want = [r.token_ids for r in target.generate(PROMPTS, SEEDED)]
    handed, outputs = {}, {}
    for prefill_policy in ("fixed", "adaptive"):
        prefill, reqs, states, kv = prefilled(models, prefill_policy)
        handed[prefill_policy] = states, kv
        decode_policy = "adaptive" if prefill_policy == "fixed" else "fixed"  # each side under the other policy
        outputs[decode_policy], decode = decoded(models, prefill, reqs, decode_policy)
        if decode_policy == "adaptive":
            assert set(decode.spec_policy.shapes) == set(decode.speculator.shapes)  # every shape ran ...
            assert decode.spec_policy.choices["plain"] >= 1  # ... and plain steps
        else:
            assert set(decode.spec_policy.shapes) == {TREE.name} and decode.spec_policy.choices["plain"] == 0
    (fixed_states, fixed_kv), (adaptive_states, adaptive_kv) = handed["fixed"], handed["adaptive"]
    assert same_states(fixed_states, adaptive_states), "the draft state handed off depends on the prefill's policy"
    for a, b in zip(fixed_kv, adaptive_kv):
        assert all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(a, b))
    assert outputs["fixed"] == outputs["adaptive"] == want



def test_a_seeded_sampled_request_pins_the_configured_shape_and_keeps_its_output(models):
    """A sampled request's draws follow the shape each step runs, so a seed promises one output only on one shape:
    while a sampled request with its own seed runs, the adaptive policy runs the configured shape, and the output
    is the fixed policy's, alone or beside unseeded requests, whatever the costs say. The control: with the pin
    taken away, the rotating shapes change the same seed's output."""
    sampled = SamplingParams(temperature=1.0, max_new_tokens=24, ignore_eos=True)
    seeded = sampled.model_copy(update={"seed": 11})

    def run(policy: str, params: list[SamplingParams], pin: bool = True) -> list[int]:
        engine = Engine(models.target, models.drafts["eagle3"], config(policy))
        engine.spec_policy.cost = Rotating(["chain1", None, "chain2"])  # fixed never asks it
        engine.spec_policy.pin = pin
        return engine.generate([PROMPTS[0]] * len(params), params)[0].token_ids

    want = run("fixed", [seeded])
    assert run("adaptive", [seeded]) == want
    assert run("adaptive", [seeded, sampled, sampled]) == want
    assert run("adaptive", [seeded], pin=False) != want
