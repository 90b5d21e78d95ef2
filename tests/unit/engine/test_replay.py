"""Rank 0's calls replayed (shared/replay.py), in one process: a leading engine's calls, sent down a queue instead
of to other ranks, make a second engine following them (``shared.replay.follow``, as a ``Follower`` does) hold
the same requests and draw the same tokens, requests without a seed included (the leader chose their seeds,
once); rank 0's refusals and aborts leave the follower's book as rank 0's; a follower whose pages differ from
rank 0's after applying its plan stops with an error naming the divergence; and a request rank 0 cannot send
is not kept. The same over two gloo ranks: test_tensor_parallel.py."""

from __future__ import annotations

from collections import deque

import pytest

from shared.config import EngineConfig, SpecConfig
from shared.engine import Engine
from shared.errors import RequestError
from shared.follower import Follower
from shared.parallel import TPGroup
from shared.replay import Leading, follow
from shared.sampling import SamplingParams

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], [40, 41], list(range(3, 30))]
PARAMS = [SamplingParams(max_new_tokens=8, ignore_eos=True),  # greedy
          SamplingParams(temperature=1.0, max_new_tokens=8, ignore_eos=True),  # sampled, no seed
          SamplingParams(temperature=0.8, top_k=20, seed=7, max_new_tokens=8, ignore_eos=True)]


def pair(root, draft: str | None, send=None) -> tuple[Engine, Engine, deque]:
    """A leading engine whose calls go down a queue (or to ``send``), and an engine whose runner and scheduler
    follow them from it (``follows``)."""
    config = EngineConfig(page_size=4, chunk_size=8, max_running=4, max_context=96,
                          spec=SpecConfig(topk=2, steps=3, num_draft_tokens=6) if draft else None)
    leader, follower = (Engine(root / "target", root / draft if draft else None, config) for _ in range(2))
    sent = deque()
    leader.runner.leads = True  # as rank 0 of a group: its calls are sent
    leader.runner.send = send or (lambda name, *args: sent.append((name, *args)))
    leader.scheduler = Leading(leader.scheduler, leader.runner.send)
    follower.runner.receive = lambda: sent.popleft() if sent else None
    return leader, follower, sent


def follows(engine: Engine) -> list:
    return follow(engine.runner, engine.scheduler)


@pytest.mark.parametrize("draft", [None, "eagle"])
def test_a_follower_holds_the_leaders_requests_and_draws_its_tokens(tiny_model_dir, draft):
    leader, follower, sent = pair(tiny_model_dir, draft)
    reqs = [leader.add_request(p, sp) for p, sp in zip(PROMPTS, PARAMS)]
    assert reqs[1].params.seed is not None  # chosen by the leader, sent with the request
    leader.run_until_done()
    assert any(name == "run" for name, *_ in sent)
    made = follows(follower)
    assert [r.rid for r in made] == [r.rid for r in reqs] and [r.seed for r in made] == [r.seed for r in reqs]
    assert [r.output_ids for r in made] == [r.output_ids for r in reqs]
    assert all(len(r.output_ids) == 8 for r in made)
    assert [r.output_logprobs for r in made] == [r.output_logprobs for r in reqs]
    assert [r.finish_reason for r in made] == [r.finish_reason for r in reqs]
    assert not sent and follower.is_idle_and_clean() and leader.is_idle_and_clean()


def test_refusals_and_aborts_leave_the_followers_book_as_the_leaders(tiny_model_dir):
    leader, follower, sent = pair(tiny_model_dir, None)
    with pytest.raises(RequestError):
        leader.add_request([5, 6], SamplingParams(max_new_tokens=10 ** 6))  # refused by rank 0 alone
    assert not sent
    kept = leader.add_request([5, 6, 7], PARAMS[0])
    gone = leader.add_request([8, 9, 10], PARAMS[1])
    leader.step()
    assert leader.abort(gone.rid)
    made = follows(follower)
    assert [r.rid for r in made] == [kept.rid, gone.rid]
    assert list(follower.requests) == [kept.rid] and made[1].finish_reason == "abort"
    assert made[0].output_ids == kept.output_ids and len(kept.output_ids) == 1
    leader.run_until_done()
    assert follows(follower) == [] and made[0].output_ids == kept.output_ids and len(kept.output_ids) == 8
    assert follower.is_idle_and_clean() and leader.is_idle_and_clean()


def test_a_follower_whose_pages_differ_from_rank_0s_stops_with_an_error(tiny_model_dir):
    leader, follower, sent = pair(tiny_model_dir, None)
    req = leader.add_request(PROMPTS[0], PARAMS[0])
    leader.step()
    name, (decode, chunks, free), shape = sent[-1]
    assert name == "run" and chunks
    sent[-1] = (name, (decode, chunks, [free[0] + 1]), shape)  # as if rank 0 held one page fewer
    with pytest.raises(RuntimeError, match="differs from rank 0's"):
        follows(follower)
    assert leader.abort(req.rid) and follower.abort(req.rid)  # (the engines' pools back for the leak check)


def test_a_request_that_cannot_reach_the_followers_is_not_kept(tiny_model_dir):
    """A broken group (a follower gone): an arrival or a reservation rank 0 cannot send raises, and rank 0 keeps
    nothing of it (no request, no page)."""
    def broken(*call):
        raise RuntimeError("the tensor-parallel group is broken: a follower is gone")

    leader, _, _ = pair(tiny_model_dir, None, broken)
    with pytest.raises(RuntimeError, match="broken"):
        leader.add_request(PROMPTS[0], PARAMS[0])
    with pytest.raises(RuntimeError, match="broken"):
        leader.reserve_handoff("r", [5, 6, 7], [8], [0.0], PARAMS[0], 3)
    assert not leader.requests and leader.is_idle_and_clean()


def test_rank_0_is_an_engine_and_the_other_ranks_are_followers(tiny_model_dir):
    """Under tensor parallelism only rank 0 has an engine (a scheduler that decides, a policy, request checks);
    the other ranks are ``Follower``s of it. (Building either on the wrong rank needs no collective.)"""
    config = EngineConfig(tensor_parallel=2, max_context=64)
    with pytest.raises(ValueError, match="rank 1 of a tensor-parallel group follows rank 0's engine"):
        Engine(tiny_model_dir / "target", config=config, tp=TPGroup(rank=1, size=2, group=None, control=None))
    with pytest.raises(ValueError, match="a follower is a rank other than 0"):
        Follower(tiny_model_dir / "target", config=config, tp=TPGroup(rank=0, size=2, group=None, control=None))
