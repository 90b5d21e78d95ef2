"""Two engines, one hand-off: a prefill-role engine hands its requests to a decode-role engine through
the wire format (page extraction, chunks, insertion, DraftState bytes), and the decode engine resumes
them straight into draft(). Output equals the single-process engine's and the target's alone, with the
same acceptance (so the draft state and draft K/V arrived intact), for every draft kind, chain and
tree, page sizes 1 and 16, prompts shorter and longer than the chunk, and without a draft; the same
holds when the pages go chunk by chunk while the prompt is still being prefilled (both transports'
data paths), and a prompt's first pages reach the decode side before its next chunk runs.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from handoff_helpers import (
    GREEDY,
    PROMPTS,
    engine_config,
    hand_off,
    hand_off_during_prefill,
    load_models,
    make_engine,
    positions_kv,
    prefill_until_handoff,
)

from shared.config import EngineConfig
from shared.engine import Engine
from shared.sampling import SamplingParams
from shared.spec.state import DraftState

# Every draft kind x chain / tree x page size 1 / 16, and no draft at all.
CASES = [(None, 1, 1), (None, 1, 16)] + [(d, k, p) for d in ("eagle", "eagle3", "mtp") for k in (1, 4) for p in (1, 16)]


@pytest.fixture(scope="module")
def models(oracle_model_dir):
    return load_models(oracle_model_dir)


@pytest.fixture(scope="module")
def target_only(models):
    engine = Engine(models.target, config=EngineConfig(page_size=4, chunk_size=None, max_context=512))
    return [r.token_ids for r in engine.generate(PROMPTS, GREEDY)]


def spec_counts(result) -> tuple[int, int] | None:
    st = result.spec_stats
    return None if st is None else (st["verify_steps"], st["accepted_drafts"])


def same_state(a: DraftState | None, b: DraftState | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return (a.bonus_token, a.committed_len) == (b.bonus_token, b.committed_len) and all(
        torch.equal(getattr(a, f).cpu(), getattr(b, f).cpu()) for f in ("hidden", "topk_p", "topk_ids"))


def run_disaggregated(models, draft, config, params, chunk_bytes=None, tamper=None):
    """Prefill both prompts on one engine, hand them to another, decode there; returns the results and
    (per request) whether the K/V at every committed position of every cache and layer, and the draft
    state (bonus token, length, draft hidden state, first tree level), arrived intact."""
    prefill = make_engine(models, draft, config, role="prefill")
    decode = make_engine(models, draft, config, role="decode")
    reqs = prefill_until_handoff(prefill, PROMPTS, params)
    moved, intact = [], []
    for req in reqs:
        state = None if tamper is None else tamper(req)
        d = hand_off(prefill, req, decode, chunk_bytes, state_bytes=state)
        before, after = positions_kv(prefill, req, req.kv_len), positions_kv(decode, d, req.kv_len)
        same = all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(before, after))
        intact.append(same and same_state(req.draft_state, d.draft_state))
        prefill.release(req)
        moved.append(d)
    assert prefill.is_idle_and_clean(), "the prefill engine kept pages after releasing its hand-offs"
    decode.run_until_done()
    assert decode.is_idle_and_clean(), "the decode engine kept pages after its requests finished"
    return [decode.result(d) for d in moved], intact


@pytest.mark.parametrize("draft, topk, page_size", CASES)
def test_two_engines_equal_one_engine_and_the_target(models, target_only, draft, topk, page_size):
    config = engine_config(draft, topk, page_size, max_context=512)
    single = make_engine(models, draft, config).generate(PROMPTS, GREEDY)
    assert [r.token_ids for r in single] == target_only
    results, intact = run_disaggregated(models, draft, config, GREEDY)
    assert all(intact), "K/V or draft state differs after the hand-off"
    for got, want in zip(results, single):
        assert got.token_ids == want.token_ids
        assert got.finish_reason == want.finish_reason == "length"
        assert torch.allclose(torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=1e-4)
        assert spec_counts(got) == spec_counts(want), "acceptance differs: the draft state or draft K/V changed"
    if draft is not None:
        assert max(r.spec_stats["accept_length"] for r in results) > 1.2, "drafts should be accepted often here"


@pytest.fixture(scope="module")
def single_results(models):
    """The single-process engine's results per (draft, topk, page size), computed once."""
    cache = {}

    def get(draft, topk, page_size):
        if (draft, topk, page_size) not in cache:
            engine = make_engine(models, draft, engine_config(draft, topk, page_size, max_context=512))
            cache[draft, topk, page_size] = engine.generate(PROMPTS, GREEDY)
        return cache[draft, topk, page_size]

    return get


# Sent during the prefill: each draft kind over both transports, chain and tree, page sizes 1 and 16.
DURING = [(None, 1, 1, "grpc-stream"), (None, 1, 16, "ipc"), ("eagle", 1, 16, "grpc-stream"), ("eagle", 4, 1, "ipc"),
          ("eagle3", 4, 16, "grpc-stream"), ("eagle3", 1, 1, "ipc"), ("mtp", 4, 1, "grpc-stream"),
          ("mtp", 1, 16, "ipc")]


@pytest.mark.parametrize("draft, topk, page_size, transport", DURING)
def test_pages_sent_while_the_prompt_is_prefilled_arrive_before_its_next_chunk_and_equal_one_engine(
        models, single_results, draft, topk, page_size, transport):
    """Reserved at the first chunk, each step's pages sent while the next computes, the draft state and the
    first token last: output and acceptance equal the single-process engine's. Observable order, not
    timing: before each prefill step, the long prompt's pages an earlier step completed must be on the
    decode side (the helper waits for them, up to 20 s, and records whether they came)."""
    config = engine_config(draft, topk, page_size, max_context=512)
    prefill = make_engine(models, draft, config, role="prefill")
    decode = make_engine(models, draft, config, role="decode")
    arrived = []
    moved = hand_off_during_prefill(prefill, decode, PROMPTS, GREEDY, transport, arrived=arrived)
    assert arrived == [True], "the long prompt's first pages should reach the decode side before its next chunk"
    assert prefill.is_idle_and_clean()
    decode.run_until_done()
    assert decode.is_idle_and_clean()
    for got, want in zip([decode.result(d) for d in moved], single_results(draft, topk, page_size)):
        assert got.token_ids == want.token_ids and got.finish_reason == "length"
        assert spec_counts(got) == spec_counts(want), "acceptance differs: the draft state or draft K/V changed"


def test_seeded_sampling_resumes_the_same_draws(models):
    """The request's sampling state travels: a sampled request draws on the decode side exactly what it
    draws in one process. Its speculative draws hash its seed with the committed length, so the seed the
    draft state carries is that state: handing over another one draws something else."""
    config = engine_config("eagle", 1, 16, max_context=512)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True, temperature=0.9, seed=11)
    single = make_engine(models, "eagle", config).generate(PROMPTS, params)
    results, _ = run_disaggregated(models, "eagle", config, params)
    assert [r.token_ids for r in results] == [r.token_ids for r in single]

    def another_seed(req):
        return dataclasses.replace(req.draft_state, seed=req.seed + 1).to_bytes()

    reseeded, _ = run_disaggregated(models, "eagle", config, params, tamper=another_seed)
    assert [r.token_ids for r in reseeded] != [r.token_ids for r in single]


def test_an_unseeded_request_keeps_its_seed_across_the_hand_off(models):
    """A request without a seed gets a random one at admission on the prefill side; the decode side
    draws with that one, not with a random one of its own."""
    config = engine_config("eagle", 1, 16, max_context=512)
    prefill = make_engine(models, "eagle", config, role="prefill")
    decode = make_engine(models, "eagle", config, role="decode")
    # ignore_eos: the first token is drawn with a random seed, and a drawn end-of-sequence would end the request on
    # the prefill side, with no pages to hand off (seen once in the suite: "4 (layer, page) pairs never arrived")
    reqs = prefill_until_handoff(prefill, PROMPTS, SamplingParams(max_new_tokens=6, temperature=1.0, ignore_eos=True))
    assert all(r.finish_reason is None for r in reqs)
    for req in reqs:
        moved = hand_off(prefill, req, decode)
        assert moved.seed == req.seed
        prefill.release(req)
    assert len({r.seed for r in reqs}) == len(reqs)
    decode.run_until_done()
    assert decode.is_idle_and_clean() and prefill.is_idle_and_clean()


@pytest.mark.parametrize("draft, topk", [("eagle", 1), ("eagle3", 4)])
def test_steps_draft_ahead_while_a_hand_off_is_received_and_it_joins_losslessly(models, draft, topk):
    """A decode engine drafting ahead keeps doing so while a second request's hand-off is on its way (its join,
    between steps, is foreseen by nobody: at most the one step before it drafts in vain), and both requests give
    the single engine's greedy output."""
    config = engine_config(draft, topk, 16, max_context=512)
    want = [r.token_ids for r in make_engine(models, draft, config).generate(PROMPTS[:2], GREEDY)]
    prefill = make_engine(models, draft, config, role="prefill")
    decode = make_engine(models, draft, config.model_copy(update={"spec_draft_ahead": True}), role="decode")
    first, second = prefill_until_handoff(prefill, PROMPTS[:2], GREEDY)
    a = hand_off(prefill, first, decode)
    prefill.release(first)
    while decode.speculator.ahead.pending is None:
        decode.step()
    moved = decode.reserve_handoff(second.rid, second.prompt_ids, second.output_ids, second.output_logprobs,
                                   second.params, second.kv_len)
    assert moved is not None
    used = decode.speculator.ahead.used
    for _ in range(3):  # the second's pages still on their way
        decode.step()
        assert decode.speculator.ahead.pending is not None
    assert decode.speculator.ahead.used == used + 3
    b = hand_off(prefill, second, decode, moved=moved)  # its pages arrive, it joins between steps
    prefill.release(second)
    decode.run_until_done()
    assert [decode.result(a).token_ids, decode.result(b).token_ids] == want
    assert decode.speculator.ahead.mismatched <= 1 and decode.is_idle_and_clean() and prefill.is_idle_and_clean()
