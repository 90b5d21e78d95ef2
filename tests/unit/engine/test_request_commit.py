"""``Request.commit``'s path for a request whose only stop conditions are tokens and its length (the one a
decode step takes for most requests) appends the tokens, log-probabilities and finish reason of the general
path, token by token: stop and EOS tokens inside the run, ``ignore_eos``, ``max_new_tokens`` reached inside
it or already reached, and runs that stop at the first token."""

from __future__ import annotations

import random

from shared.request import Request
from shared.sampling import SamplingParams


def test_the_token_only_path_commits_what_the_general_path_commits():
    rng = random.Random(0)
    cases = 0
    for _ in range(400):
        params = SamplingParams(max_new_tokens=rng.randrange(1, 9), ignore_eos=rng.random() < 0.3,
                                stop_token_ids=tuple(rng.sample(range(6), rng.randrange(0, 2))))
        arrived = [7] * rng.randrange(0, 10)  # output it arrived with (a hand-off's): max_new_tokens may be past
        fast, general = (Request(rid="r", prompt_ids=[1, 2], params=params, eos_ids=(5,), output_ids=list(arrived),
                                 output_logprobs=[0.0] * len(arrived)) for _ in range(2))
        for req in (fast, general):
            req.t_first_token = 1.0  # past its first token, as a decode step's request is
        while fast.finish_reason is None:
            tokens = [rng.randrange(8) for _ in range(rng.randrange(0, 5))]
            logprobs = [-rng.random() for _ in tokens]
            got = fast.commit(tokens, logprobs)
            want = general.commit(tokens, logprobs, [[] for _ in tokens])  # tops given: the general path
            assert got == want and fast.output_ids == general.output_ids
            assert fast.output_logprobs == general.output_logprobs
            assert fast.finish_reason == general.finish_reason
            cases += 1
        assert fast.commit([3, 4], [-1.0, -1.0]) == general.commit([3, 4], [-1.0, -1.0], [[], []]) == []
        assert len(general.output_top_logprobs) == len(general.output_ids) - len(arrived)  # the general path it was
    assert cases > 500
