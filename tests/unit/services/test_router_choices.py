"""The pieces of a request of several choices (``services/router/choices.py``) and the session that hands them to
the client: seeds per choice, best_of's ranking, merging that never mixes two choices' tokens."""

from __future__ import annotations

import asyncio

from proto.eyrie.v1 import eyrie_pb2 as pb
from services.router.choices import SEED_MODULUS, best_choices, choice_counts, choice_params, choice_rid
from services.router.session import Session
from shared.sampling import SamplingParams


def test_choice_seeds_are_the_request_seed_plus_the_index_wrapping_at_2_64():
    params = SamplingParams(temperature=1.0, seed=SEED_MODULUS - 2)
    assert [choice_params(params, i).seed for i in range(4)] == [SEED_MODULUS - 2, SEED_MODULUS - 1, 0, 1]
    assert choice_params(params, 3).temperature == 1.0
    unseeded = SamplingParams(temperature=1.0)
    assert all(choice_params(unseeded, i).seed is None for i in range(3))  # each walk draws its own
    assert choice_rid("abc", 2) == "abc#2"


def test_counts_default_to_one_choice_and_best_of_to_n():
    assert choice_counts(pb.GenerateRequest()) == (1, 1)
    assert choice_counts(pb.GenerateRequest(n=3)) == (3, 3)
    assert choice_counts(pb.GenerateRequest(n=2, best_of=5)) == (2, 5)


def msg(index: int, ids: list[int], lps: list[float], finish: bool = False) -> pb.GenerateResponse:
    out = pb.GenerateResponse(request_id="r", index=index, token_ids=ids, logprobs=lps, text="".join(map(str, ids)))
    if finish:
        out.finish.reason = "length"
    return out


def test_best_of_ranks_choices_by_cumulative_logprob_ties_to_the_lower_index():
    # cumulative logprobs: choice 0 -0.75, 1 -0.75 (a tie), 2 -0.25 (the best), 3 -1.0
    messages = [msg(0, [1], [-0.5]), msg(1, [2], [-0.25]), msg(2, [3], [-0.125]), msg(0, [4], [-0.25], True),
                msg(1, [5], [-0.5], True), msg(2, [6], [-0.125], True), msg(3, [7, 8], [-0.5, -0.5], True)]
    best = best_choices(messages, 3, return_logprobs=False)
    assert [(m.index, list(m.token_ids)) for m in best] == [(0, [3, 6]), (1, [1, 4]), (2, [2, 5])]
    assert all(m.HasField("finish") and not m.logprobs for m in best)
    kept = best_choices(messages, 1, return_logprobs=True)
    assert list(kept[0].token_ids) == [3, 6] and list(kept[0].logprobs) == [-0.125, -0.125]


def test_best_of_reports_the_cached_prompt_tokens_of_every_choice_run():
    # choice 3 computed the prompt (0 cached), the others took its pages; choice 3 is not among the best two
    messages = [msg(i, [i], [-0.1 * (i + 1)], True) for i in range(4)]
    for m in messages:
        m.finish.usage.cached_tokens = 0 if m.index == 3 else 24
    best = best_choices(messages, 2, return_logprobs=False)
    assert [m.finish.usage.cached_tokens for m in best] == [0, 0]


class _Core:
    """A core whose walk yields the given messages, then ends."""

    def __init__(self, messages):
        self.messages = messages

    async def stream(self, request, deliver=None):
        for m in self.messages:
            yield m

    def abort(self, *args) -> bool:
        return False


def test_the_session_hands_out_one_choice_at_a_time_each_merged_in_order():
    messages = [msg(0, [1], []), msg(1, [2], []), msg(0, [3], []), msg(2, [4], [], True), msg(1, [5], [], True),
                msg(0, [6], [], True)]

    async def drain():
        session = Session(_Core(messages), pb.GenerateRequest(request_id="r"))
        await session.task  # everything is pending at once: the coalescing case
        out = []
        while (m := await session.next()) is not None:
            out.append((m.index, list(m.token_ids), m.HasField("finish")))
        return out

    assert asyncio.run(drain()) == [(0, [1, 3, 6], True), (1, [2, 5], True), (2, [4], True)]
