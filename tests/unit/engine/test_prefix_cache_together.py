"""Requests with one prompt arriving together (a request's n choices) prefill it once (issue 33 item 4): with the
prefix cache on, a waiting request whose next page is being prefilled by a running request waits for it to be
cached (shared/scheduler.py, ``_in_flight``), whatever the chunk size, and is then admitted with the hit. The
outputs are the cache-off engine's (greedy and seeded sampling), a request with another prompt is not held back
by the waiting ones, a waiting one whose page source ends early computes its own, and a tensor-parallel follower
replays the same admissions.
"""

from __future__ import annotations

from collections import deque

import pytest
import torch
from engine_checks import check_accounting, check_pools_full, record_plans

from shared.config import EngineConfig, SpecConfig
from shared.engine import Engine
from shared.replay import Leading, follow
from shared.sampling import SamplingParams

PROMPT = [(i * 7 + 3) % 500 for i in range(40)]  # 10 pages of 4: the last holds the prompt's last token
OTHER = [(i * 11 + 5) % 500 for i in range(20)]
FULL_PAGES = (len(PROMPT) - 1) // 4 * 4  # 36: every page before the one holding the last token
N = 3


def greedy(i: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=6, ignore_eos=True)


def seeded(i: int) -> SamplingParams:  # choice i: the request's seed + i, as the router sends them
    return SamplingParams(max_new_tokens=6, ignore_eos=True, temperature=0.9, seed=1000 + i)


def engine(root, cached: bool, chunk: int | None, kind: str | None = None, num_pages: int | None = None) -> Engine:
    spec = SpecConfig(topk=2, steps=3, num_draft_tokens=6) if kind else None
    return Engine(root / "target", root / kind if kind else None,
                  EngineConfig(page_size=4, chunk_size=chunk, max_running=6, max_context=96, num_pages=num_pages,
                               spec=spec, prefix_cache=cached))


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/unit/engine/conftest.py


def run_together(e: Engine, prompts: list[list[int]], params: list[SamplingParams]):
    reqs = [e.add_request(p, sp, rid=f"c{i}") for i, (p, sp) in enumerate(zip(prompts, params))]
    while e.scheduler.has_work():
        e.step()
        check_accounting(e)
    return [e.result(r) for r in reqs]


@pytest.mark.parametrize("kind", [None, "eagle"])
@pytest.mark.parametrize("chunk", [8, 64, None])
@pytest.mark.parametrize("params", [greedy, seeded], ids=["greedy", "seeded"])
def test_choices_arriving_together_share_the_prompts_pages(tiny_model_dir, chunk, kind, params):
    plist = [params(i) for i in range(N)]
    on = engine(tiny_model_dir, True, chunk, kind)
    plans = record_plans(on)
    got = run_together(on, [PROMPT] * N, plist)
    assert [r.cached_tokens for r in got] == [0] + [FULL_PAGES] * (N - 1)
    # one prefill of the prompt, then each other choice's last page only
    assert sum(sum(chunks) for _, chunks, _ in plans) == len(PROMPT) + (N - 1) * (len(PROMPT) - FULL_PAGES)
    check_pools_full(on)
    off = engine(tiny_model_dir, False, chunk, kind)
    want = run_together(off, [PROMPT] * N, plist)
    assert [r.cached_tokens for r in want] == [0] * N
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert all(torch.allclose(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=1e-4)
               for g, w in zip(got, want))
    if params is seeded:
        assert len({tuple(r.token_ids) for r in want}) > 1, "the choices' seeds drew one output: a weak check"
    check_pools_full(off)


@pytest.mark.parametrize("chunk", [64, None])
def test_another_prompt_is_not_held_back_by_the_waiting_choices(tiny_model_dir, chunk):
    e = engine(tiny_model_dir, True, chunk)
    plans = record_plans(e)
    reqs = [e.add_request(PROMPT, greedy(i)) for i in range(N)] + [e.add_request(OTHER, greedy(0))]
    e.step()
    assert plans == [(0, [len(PROMPT), len(OTHER)], N - 1)]  # the other's prompt beside the first choice's
    assert reqs[-1].kv_len == len(OTHER) and list(e.scheduler.waiting) == reqs[1:N]  # kept in order
    e.run_until_done()
    assert [e.result(r).cached_tokens for r in reqs] == [0] + [FULL_PAGES] * (N - 1) + [0]
    want = engine(tiny_model_dir, False, chunk).generate([PROMPT, OTHER], greedy(0))
    assert [e.result(r).token_ids for r in reqs] == [want[0].token_ids] * N + [want[1].token_ids]
    check_pools_full(e)


def test_the_waiting_room_is_kept_from_those_behind(tiny_model_dir):
    """A waiting choice keeps its slot: a request behind it is admitted only beside it (max_running 2 here)."""
    e = Engine(tiny_model_dir / "target", config=EngineConfig(page_size=4, chunk_size=None, max_running=2,
                                                              max_context=96, prefix_cache=True))
    first, second, other = e.add_request(PROMPT, greedy(0)), e.add_request(PROMPT, greedy(1)), \
        e.add_request(OTHER, greedy(2))
    e.step()
    assert first.kv_len == len(PROMPT) and other.kv_len == 0 and list(e.scheduler.waiting) == [second, other]
    e.step()
    assert second.cached_tokens == FULL_PAGES and other.kv_len == 0
    e.run_until_done()
    check_pools_full(e)


def test_without_a_prefix_cache_nothing_waits(tiny_model_dir):
    e = engine(tiny_model_dir, False, None)
    plans = record_plans(e)
    reqs = [e.add_request(PROMPT, greedy(i)) for i in range(N)]
    e.step()
    assert plans == [(0, [len(PROMPT)] * N, 0)]
    e.run_until_done()
    assert all(e.result(r).cached_tokens == 0 for r in reqs)
    check_pools_full(e)


@pytest.mark.parametrize("kind", [None, "eagle"])
def test_a_choice_whose_source_is_aborted_computes_its_own(tiny_model_dir, kind):
    """Waiting only on a running prefill: when it ends before caching the pages, the waiting choice is admitted
    with what is cached (a bound on the wait, no cycle) and draws the cache-off output."""
    e = engine(tiny_model_dir, True, 8, kind)
    reqs = [e.add_request(PROMPT, greedy(i)) for i in range(N)]
    e.step()
    e.step()  # the first choice's 16 tokens computed: 4 pages cached, the others wait for the 5th
    assert reqs[0].kv_len == 16 and list(e.scheduler.waiting) == reqs[1:]
    e.abort(reqs[0].rid)
    e.run_until_done()
    assert [e.result(r).cached_tokens for r in reqs[1:]] == [16, FULL_PAGES]
    want = engine(tiny_model_dir, False, 8, kind).generate([PROMPT], greedy(0))[0]
    assert all(e.result(r).token_ids == want.token_ids for r in reqs[1:])
    check_pools_full(e)


def test_a_follower_replays_the_waiting_choices_admissions(tiny_model_dir):
    """Rank 0 admits a request behind waiting ones (out of queue order): a follower applies the same plan."""
    config = EngineConfig(page_size=4, chunk_size=64, max_running=6, max_context=96, prefix_cache=True,
                          spec=SpecConfig(topk=2, steps=3, num_draft_tokens=6))
    leader, follower = (Engine(tiny_model_dir / "target", tiny_model_dir / "eagle", config) for _ in range(2))
    sent = deque()
    leader.runner.leads = True
    leader.runner.send = lambda name, *args: sent.append((name, *args))
    leader.scheduler = Leading(leader.scheduler, leader.runner.send)
    follower.runner.receive = lambda: sent.popleft() if sent else None
    reqs = [leader.add_request(PROMPT, seeded(i)) for i in range(N)] + [leader.add_request(OTHER, seeded(N))]
    leader.run_until_done()
    made = follow(follower.runner, follower.scheduler)
    assert [r.rid for r in made] == [r.rid for r in reqs]
    assert [r.output_ids for r in made] == [r.output_ids for r in reqs]
    assert [r.cached_tokens for r in made] == [r.cached_tokens for r in reqs] == [0, FULL_PAGES, FULL_PAGES, 0]
    assert not sent and follower.is_idle_and_clean() and leader.is_idle_and_clean()
