"""Memory: every page and request row comes back, and running out of pages is a scheduling decision.

After every request ends (finished, stopped, aborted while waiting / mid-prefill / mid-decode,
refused), the allocator's counters equal the pool sizes. With a tiny pool, requests queue and all
finish; the pool is never asked for more pages than it has (``OutOfPages`` would propagate).
"""

from __future__ import annotations

import random

import pytest
from engine_checks import GREEDY, PROMPTS, check_accounting, check_pools_full, record_plans

from shared.config import EngineConfig
from shared.engine import Engine
from shared.request import RequestError
from shared.sampling import SamplingParams


def make_engine(model_dir, **cfg) -> Engine:
    return Engine(model_dir / "target", config=EngineConfig(**cfg))


def test_counters_move_and_return(tiny_model_dir):
    engine = make_engine(tiny_model_dir, page_size=4, chunk_size=8)
    cache = engine.cache
    total_pages, total_rows = cache.layout.num_pages, cache.req_to_token.num_rows
    req = engine.add_request(PROMPTS[0], GREEDY)
    assert (cache.num_free_pages, cache.num_free_rows) == (total_pages, total_rows), "waiting holds nothing"
    engine.step()  # first chunk: 8 positions = 2 pages
    assert (cache.num_free_pages, cache.num_free_rows) == (total_pages - 2, total_rows - 1)
    assert not engine.is_idle_and_clean()
    engine.step()
    assert cache.num_free_pages == total_pages - 4
    check_accounting(engine)
    engine.run_until_done()
    assert req.finish_reason == "length" and len(req.output_ids) == 8
    assert (cache.num_free_pages, cache.num_free_rows) == (total_pages, total_rows)
    check_pools_full(engine)


def test_small_pool_queues_instead_of_failing(tiny_model_dir, solo_reference):
    """Room for about one request at a time: the scheduler queues the rest, all finish, same output."""
    engine = make_engine(tiny_model_dir, chunk_size=16, page_size=4, num_pages=12, max_running=4)
    plans = record_plans(engine)
    most_running = 0
    reqs = [engine.add_request(p, GREEDY) for p in PROMPTS]
    while engine.scheduler.has_work():
        engine.step()
        check_accounting(engine)
        most_running = max(most_running, len(engine.scheduler.running))
    assert most_running < len(PROMPTS), "the pool was big enough for everyone: nothing was tested"
    assert any(waiting and (decode or chunks) for decode, chunks, waiting in plans), "nobody queued"
    assert [engine.result(r).token_ids for r in reqs] == [r.token_ids for r in solo_reference]
    check_pools_full(engine)


def test_max_running_bounds_the_batch(tiny_model_dir, solo_reference):
    engine = make_engine(tiny_model_dir, chunk_size=None, page_size=4, max_running=2)
    reqs = [engine.add_request(p, GREEDY) for p in PROMPTS]
    while engine.scheduler.has_work():
        engine.step()
        assert len(engine.scheduler.running) <= 2
    assert [engine.result(r).token_ids for r in reqs] == [r.token_ids for r in solo_reference]
    check_pools_full(engine)


@pytest.mark.parametrize("prompt_len, max_new, field", [(20, 12, "max_new_tokens"), (3, 40, "max_new_tokens"),
                                                         (31, 1, "prompt"), (40, 1, "prompt")])
def test_request_that_can_never_fit_is_rejected(tiny_model_dir, prompt_len, max_new, field):
    engine = make_engine(tiny_model_dir, page_size=4, num_pages=8)  # 32 positions
    running = engine.add_request(PROMPTS[1], GREEDY)
    engine.step()
    with pytest.raises(RequestError) as err:
        engine.add_request(list(range(3, 3 + prompt_len)), SamplingParams(max_new_tokens=max_new))
    assert err.value.field == field and "pages" in str(err.value)
    check_accounting(engine)
    engine.run_until_done()
    assert running.finish_reason == "length"
    check_pools_full(engine)


@pytest.mark.parametrize("when", ["waiting", "mid_prefill", "mid_decode"])
def test_abort_returns_everything(tiny_model_dir, solo_reference, when):
    engine = make_engine(tiny_model_dir, page_size=4, chunk_size=8)
    req = engine.add_request(PROMPTS[2], GREEDY)  # 29 tokens: four chunks
    other = engine.add_request(PROMPTS[1], GREEDY)
    steps = {"waiting": 0, "mid_prefill": 2, "mid_decode": 6}[when]
    for _ in range(steps):
        engine.step()
    assert req.stage.name == {"waiting": "WAITING", "mid_prefill": "PREFILLING", "mid_decode": "DECODING"}[when]
    if when == "mid_decode":
        assert 0 < len(req.output_ids) < 8
    assert engine.abort(req.rid)
    assert not engine.abort(req.rid), "a second abort of the same request is a no-op"
    check_accounting(engine)
    engine.run_until_done()
    assert engine.result(req).finish_reason == "abort"
    assert engine.result(other).token_ids == solo_reference[1].token_ids
    check_pools_full(engine)


def test_abort_everything_at_once(tiny_model_dir):
    engine = make_engine(tiny_model_dir, page_size=4, chunk_size=20, num_pages=16, max_running=2)
    reqs = [engine.add_request(p, GREEDY) for p in PROMPTS]
    for _ in range(3):
        engine.step()
    assert engine.scheduler.waiting and engine.scheduler.running
    for r in reqs:
        assert engine.abort(r.rid)
    assert not engine.scheduler.has_work()
    check_pools_full(engine)


@pytest.mark.parametrize("page_size, num_pages", [(1, 45), (4, 12), (16, 4)])
def test_random_arrivals_and_aborts_under_a_tiny_pool(tiny_model_dir, page_size, num_pages):
    """Random prompts arrive at random steps, some are aborted at random steps, the pool holds
    about one request: every step's bookkeeping adds up, nothing raises, survivors match a roomy run."""
    rng = random.Random(page_size)
    prompts = [[rng.randrange(512) for _ in range(rng.randint(1, 30))] for _ in range(10)]
    params = [SamplingParams(max_new_tokens=rng.randint(1, 8), ignore_eos=True) for _ in prompts]
    roomy = make_engine(tiny_model_dir, chunk_size=None, page_size=page_size)
    want = [r.token_ids for r in roomy.generate(prompts, params)]

    engine = make_engine(tiny_model_dir, chunk_size=rng.choice([3, 7, 16]), page_size=page_size,
                         num_pages=num_pages, max_running=3)
    arrivals = sorted(rng.randrange(25) for _ in prompts)
    abort_steps = set(rng.sample(range(3, 40), 4))
    reqs: dict[int, object] = {}
    aborted: dict[int, str] = {}  # index -> phase at the abort
    step = 0
    while len(reqs) < len(prompts) or engine.scheduler.has_work():
        for i, t in enumerate(arrivals):
            if t == step:
                reqs[i] = engine.add_request(prompts[i], params[i])
        if step in abort_steps:  # a request holding pages if there is one, else a queued one
            live = [i for i, r in reqs.items() if r.rid in engine.requests and i not in aborted]
            holding = [i for i in live if reqs[i].handles]
            if holding or live:
                i = rng.choice(holding or live)
                aborted[i] = reqs[i].stage.name
                assert engine.abort(reqs[i].rid)
        engine.step()
        check_accounting(engine)
        step += 1
        assert step < 500, "the engine stopped making progress"
    assert {"PREFILLING", "DECODING"} & set(aborted.values()), f"no abort hit a request holding pages: {aborted}"
    for i, req in reqs.items():
        res = engine.result(req)
        if i in aborted:
            assert res.finish_reason == "abort" and res.token_ids == want[i][:len(res.token_ids)]
        else:
            assert res.finish_reason == "length" and res.token_ids == want[i]
    check_pools_full(engine)
    check_pools_full(roomy)


def test_capture_graphs_is_a_no_op_off_cuda(tiny_model_dir):
    """On the CPU there is nothing to capture: no graph, no allocation, the engine serves as before."""
    from shared.config import EngineConfig, SpecConfig
    from shared.engine import Engine

    for draft, spec in ((None, None), ("eagle", SpecConfig(topk=2, steps=2, num_draft_tokens=4))):
        engine = Engine(tiny_model_dir / "target", None if draft is None else tiny_model_dir / draft,
                        EngineConfig(device="cpu", cuda_graph=True, spec=spec))
        assert engine.capture_graphs() == 0
        assert engine.is_idle_and_clean()


@pytest.mark.parametrize("page_size, num_pages, chunk", [(1, 60, None), (4, 20, None), (16, 6, 5)])
def test_admission_keeps_the_rule_while_admitting_many_at_once(tiny_model_dir, page_size, num_pages, chunk):
    """One schedule() admits several requests with the headroom kept incrementally: after every step
    the running requests' peaks fit the pool (the rule, recomputed from scratch), and the first
    request left waiting is one the rule refuses or one the row / batch / chunk limits stop."""
    rng = random.Random(num_pages)
    engine = make_engine(tiny_model_dir, chunk_size=chunk, page_size=page_size, num_pages=num_pages, max_running=8)
    sched = engine.scheduler
    prompts = [[rng.randrange(512) for _ in range(rng.randint(1, 12))] for _ in range(12)]
    params = [SamplingParams(max_new_tokens=rng.randint(1, 6), ignore_eos=True) for _ in prompts]
    for p, sp in zip(prompts, params):
        engine.add_request(p, sp)
    admitted = []
    schedule = sched.schedule

    def checked_schedule():
        before = len(sched.running)
        plan = schedule()
        admitted.append(len(sched.running) - before)
        for i, cache in enumerate(sched.caches):  # the running requests' peaks fit what the pool has
            held = sum(cache.pages_for(r.handles[i].reserved) for r in sched.running)
            peaks = sum(cache.pages_for(sched.peak_positions(r)) for r in sched.running)
            assert peaks <= cache.num_free_pages + held
        if sched.waiting and len(sched.running) < sched.max_running and chunk is None:
            assert not sched._admissible(sched.waiting[0])  # left waiting only because it does not fit
        return plan

    sched.schedule = checked_schedule
    while sched.has_work():
        engine.step()
        check_accounting(engine)
    admitted_at_once = max(admitted)
    assert admitted_at_once >= 2  # several admissions in one schedule(), the incremental path
    check_pools_full(engine)
