"""A failover's resume, on real engines: a request whose decode instance was lost after some steps is
prefilled again with the tokens the client has (``add_request(..., output_ids=...)``) and handed to another
decode instance. It resumes at the committed length the lost instance had and draws what that one would
have drawn: sampled output, with or without a draft, equals the uninterrupted run's, token and logprob. A
planted bug (the failover's prefill samples the next token itself, as the failover once did) is caught
with a draft; without one, that draw is the decode step's own (draws are keyed by position)."""

from __future__ import annotations

import pytest
from handoff_helpers import PROMPTS, engine_config, hand_off, load_models, make_engine, prefill_until_handoff

from shared.request import Stage
from shared.sampling import SamplingParams

SAMPLED = SamplingParams(temperature=0.8, seed=1234, max_new_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def models(oracle_model_dir):
    return load_models(oracle_model_dir)


@pytest.fixture(scope="module")
def runs(models):
    """Per draft kind, ``uninterrupted``'s result (computed once for the tests of this module)."""
    cache = {}

    def get(draft):
        if draft not in cache:
            cache[draft] = uninterrupted(models, draft, engine_config(draft, topk=2, max_context=512))
        return cache[draft]

    return get


def uninterrupted(models, draft, config):
    """Prefill on one engine, decode on another; per request its outputs, logprobs and the output lengths
    at which a decode step ended (where a client's stream can break)."""
    prefill, decode = make_engine(models, draft, config, role="prefill"), make_engine(models, draft, config,
                                                                                       role="decode")
    moved = []
    for req in prefill_until_handoff(prefill, PROMPTS, SAMPLED):
        moved.append(hand_off(prefill, req, decode))
        prefill.release(req)
    boundaries = [[len(d.output_ids)] for d in moved]
    while decode.scheduler.has_work():
        decode.step()
        for b, d in zip(boundaries, moved):
            if len(d.output_ids) != b[-1]:
                b.append(len(d.output_ids))
    return [(d.output_ids, d.output_logprobs) for d in moved], boundaries


def resume(models, draft, config, prompt, sent, logprobs, again: bool = False):
    """Fail over after ``sent``: a fresh prefill engine computes the prompt and the client's tokens and hands
    off to a fresh decode engine; returns the client's whole output and the new tokens' logprobs. ``again``:
    the planted bug, the prompt plus ``sent`` prefilled as a new prompt whose first token the prefill samples
    itself."""
    prefill, decode = make_engine(models, draft, config, role="prefill"), make_engine(models, draft, config,
                                                                                       role="decode")
    if again:
        left = SAMPLED.max_new_tokens - len(sent)
        req = prefill.add_request(prompt + sent, SAMPLED.model_copy(update={"max_new_tokens": left}))
    else:
        req = prefill.add_request(prompt, SAMPLED, output_ids=sent, output_logprobs=logprobs)
    while req.stage is not Stage.HANDOFF:
        tokens = [t for _, t in prefill.step()]
        assert again or not any(tokens), "a resumed prefill samples nothing"
    assert req.kv_len == len(prompt) + len(sent) - (0 if again else 1)
    d = hand_off(prefill, req, decode)
    prefill.release(req)
    assert prefill.is_idle_and_clean()
    decode.run_until_done()
    assert decode.is_idle_and_clean()
    new = len(d.output_ids) - (0 if again else len(sent))
    return (sent if again else []) + d.output_ids, d.output_logprobs[len(d.output_logprobs) - new:]


@pytest.mark.parametrize("draft", [None, "eagle3"])
def test_a_resumed_sampled_request_continues_as_if_uninterrupted(models, runs, draft):
    config = engine_config(draft, topk=2, max_context=512)
    outputs, boundaries = runs(draft)
    for n, (prompt, (tokens, logprobs), ends) in enumerate(zip(PROMPTS, outputs, boundaries)):
        assert len(tokens) == SAMPLED.max_new_tokens and len(ends) > 3
        k = ends[1] if n == 0 else ends[len(ends) // 2]  # after the first decode step, or halfway
        got, got_logprobs = resume(models, draft, config, prompt, tokens[:k], logprobs[:k])
        assert got == tokens, f"resumed after {k} tokens"
        assert got_logprobs == pytest.approx(logprobs[k:], abs=1e-4)


@pytest.mark.parametrize("draft", [None, "eagle3"])
def test_a_failover_prefill_that_samples_again_is_caught_with_a_draft(models, runs, draft):
    """As the failover once worked: the prefill samples the token after the client's itself. Target-only
    draws are keyed by position, so without a draft that is the very draw the decode step made; with a
    draft the decode step drew it in a verify step, and the prefill's own draw shows."""
    config = engine_config(draft, topk=2, max_context=512)
    uninterrupted_runs, boundaries = runs(draft)
    outputs = []
    for prompt, (tokens, logprobs), ends in zip(PROMPTS, uninterrupted_runs, boundaries):
        k = ends[len(ends) // 2]
        got, _ = resume(models, draft, config, prompt, tokens[:k], logprobs[:k], again=True)
        assert got[:k] == tokens[:k] and len(got) == len(tokens)
        outputs.append(got)
    if draft is None:
        assert outputs == [t for t, _ in uninterrupted_runs]
    else:
        assert outputs != [t for t, _ in uninterrupted_runs]
