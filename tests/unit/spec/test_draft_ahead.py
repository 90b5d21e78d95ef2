"""Drafting ahead: the next step's draft launched before this step's tokens reach the host.

On CUDA it is on by default (the host's bookkeeping then overlaps the draft on the device); here on
the CPU it is switched on explicitly, so the same logic runs eagerly: which steps may use a draft
launched ahead, which must drop it (a request ended, joined or was aborted in between), the draft
scratch it keeps reserved, and that none of it changes a token. The page-size-1 host mirror of the
target's request-to-token map, which the device permutes on compaction and the host re-derives from
the accept index, is checked against a separate "device" table after every step.
"""

from __future__ import annotations

import pytest
import torch
from spec_helpers import KINDS, PROMPTS, Models, assert_same_greedy

from shared.engine import Engine
from shared.sampling import SamplingParams

# Requests end at different steps (the batch changes under a draft launched ahead).
MAX_NEW = [16, 5, 11, 24, 2]


def per_request(models: Models, prompts, max_new, **extra):
    """Target-only greedy results, one prompt at a time (each with its own max_new_tokens)."""
    return [models.reference([p], SamplingParams(max_new_tokens=m, ignore_eos=True, **extra))[0]
            for p, m in zip(prompts, max_new)]


def run(engine: Engine, prompts, params, join_after: int | None = None, join=None):
    """Step until idle; ``join`` (prompt, params) is added after ``join_after`` steps."""
    reqs = [engine.add_request(p, q) for p, q in zip(prompts, params)]
    steps = 0
    while engine.scheduler.has_work() or (join is not None and steps <= join_after):
        if join is not None and steps == join_after:
            reqs.append(engine.add_request(*join))
        engine.step()
        steps += 1
    return [engine.result(r) for r in reqs]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("topk,steps,n", [(1, 3, 4), (2, 3, 8)])
@pytest.mark.parametrize("page_size", [1, 4])
def test_drafting_ahead_is_lossless_as_the_batch_changes(oracle_models, kind, topk, steps, n, page_size):
    engine = oracle_models.fixed(kind, topk, steps, n, page_size=page_size, chunk_size=4, spec_draft_ahead=True)
    assert engine.speculator.ahead.enabled
    w = engine.speculator
    next_inputs, decode_step, clamped, current, checked = w.ahead.next_inputs, w.step, [], [], [0]

    def recording_decode_step(reqs, *rest):
        current[:] = reqs
        rows = w.ahead.pending.rows_for(reqs) if w.ahead.pending is not None else None
        if rows is not None:  # what the draft ahead drafted from == what the committed states give
            want, got = w._inputs(reqs), w.ahead.pending.inp
            for name in ("target_rows", "draft_rows", "L", "bonus", "topk_ids"):
                assert torch.equal(getattr(got, name)[rows], getattr(want, name)), name
            for name in ("hidden", "topk_p"):
                assert torch.allclose(getattr(got, name)[rows], getattr(want, name)), name
            checked[0] += 1
        return decode_step(reqs, *rest)
    w.step = recording_decode_step

    def checked_next_inputs(inp, out, caps):
        """The draft ahead writes within every request's reserved pages, even one that ends now."""
        nxt = next_inputs(inp, out, caps)
        for i, r in enumerate(current):
            L = int(nxt.L[i])
            clamped.append(L < int(inp.L[i] + out.accept_len[i]))
            for c in range(len(w.caches)):
                assert L + w._draft_reach(c) <= r.handles[1 + c].reserved, (r.rid, L, c)
        return nxt
    w.ahead.next_inputs = checked_next_inputs
    params = [SamplingParams(max_new_tokens=m, ignore_eos=True) for m in MAX_NEW]
    join = (PROMPTS[2], SamplingParams(max_new_tokens=9, ignore_eos=True))
    got = run(engine, PROMPTS, params, join_after=12, join=join)
    want = per_request(oracle_models, PROMPTS + [join[0]], MAX_NEW + [9])
    assert_same_greedy(got, want, f"{kind} {topk}/{steps}/{n} page {page_size}")
    assert any(clamped), "no request ended inside an accepted run longer than its last tokens"
    assert checked[0] == w.ahead.used > 0
    assert w.ahead.used > 0, "no step used a draft launched ahead"
    assert w.ahead.partial > 0, "requests ended mid-batch, yet no draft ahead was used for the others"
    # The join was foreseen and the others' rows reused when requests ended: a draft launched ahead
    # was wasted only when every request of its batch ended.
    assert w.ahead.mismatched == 0 and w.ahead.dropped > 0
    assert w.ahead.pending is None and engine.is_idle_and_clean()
    # a draft launched ahead is the draft time of the step that used it, not the verify time of the one before
    assert all(b.draft_time_s > 0 and b.verify_time_s > 0 for b in w.stats.batches)


def test_drafting_ahead_off_launches_none(oracle_models):
    engine = oracle_models.fixed("eagle", 2, 3, 8, page_size=4, chunk_size=4, spec_draft_ahead=False)
    params = [SamplingParams(max_new_tokens=m, ignore_eos=True) for m in MAX_NEW]
    got = run(engine, PROMPTS, params)
    assert_same_greedy(got, per_request(oracle_models, PROMPTS, MAX_NEW))
    assert engine.speculator.ahead.used == engine.speculator.ahead.dropped == 0


def test_the_default_follows_the_device(oracle_models):
    assert not oracle_models.fixed("eagle", 1, 3, 4).speculator.ahead.enabled  # CPU: nothing to overlap


@pytest.mark.parametrize("topk,steps,n", [(1, 3, 4), (2, 3, 8)])
def test_seeded_sampling_is_the_same_with_and_without_drafting_ahead(oracle_models, topk, steps, n):
    params = [SamplingParams(max_new_tokens=m, ignore_eos=True, temperature=0.8, top_p=0.9, seed=11 + i)
              for i, m in enumerate(MAX_NEW)]
    outs = []
    for ahead in (False, True):
        engine = oracle_models.fixed("eagle3", topk, steps, n, page_size=4, chunk_size=4, spec_draft_ahead=ahead)
        outs.append([(r.token_ids, r.finish_reason) for r in run(engine, PROMPTS, params)])
        assert engine.is_idle_and_clean()
    assert outs[0] == outs[1]


def test_an_abort_between_steps_reuses_the_draft_ahead_for_the_others_and_returns_every_page(oracle_models):
    engine = oracle_models.fixed("mtp", 2, 3, 8, page_size=4, chunk_size=None, spec_draft_ahead=True)
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    reqs = [engine.add_request(p, params) for p in PROMPTS[:3]]
    while engine.speculator.ahead.pending is None:  # prefill, then decode steps until a draft is launched ahead
        engine.step()
    assert engine.abort(reqs[1].rid)
    used, partial = engine.speculator.ahead.used, engine.speculator.ahead.partial
    engine.step()  # the aborted request's row is padding now; the other two use their drafts
    assert (engine.speculator.ahead.used, engine.speculator.ahead.partial) == (used + 1, partial + 1)
    while engine.scheduler.has_work():
        engine.step()
    kept = [engine.result(r) for r in (reqs[0], reqs[2])]
    assert_same_greedy(kept, per_request(oracle_models, [PROMPTS[0], PROMPTS[2]], [30, 30]))
    assert engine.is_idle_and_clean()


def test_an_abort_outside_the_batch_keeps_the_draft_ahead(oracle_models):
    engine = oracle_models.fixed("eagle", 1, 3, 4, page_size=4, chunk_size=None, spec_draft_ahead=True,
                                  max_running=2)
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    running = [engine.add_request(p, params) for p in PROMPTS[:2]]
    waiting = engine.add_request(PROMPTS[2], params)  # no room: waits
    while engine.speculator.ahead.pending is None:
        engine.step()
    used = engine.speculator.ahead.used
    assert engine.abort(waiting.rid) and engine.speculator.ahead.pending is not None
    engine.step()
    assert engine.speculator.ahead.used == used + 1
    while engine.scheduler.has_work():
        engine.step()
    assert_same_greedy([engine.result(r) for r in running], per_request(oracle_models, PROMPTS[:2], [20, 20]))
    assert engine.is_idle_and_clean()


def test_drafting_ahead_claims_no_page_beyond_the_scheduled_peak(oracle_models):
    """A pool exactly as large as the requests' budgeted peaks: drafting ahead must fit in it (it
    is skipped near a request's end) or a reservation would run out of pages mid-step."""
    spec_args = ("eagle", 1, 3, 4)
    probe = oracle_models.fixed(*spec_args, page_size=4, chunk_size=4, spec_draft_ahead=True)
    params = [SamplingParams(max_new_tokens=m, ignore_eos=True) for m in MAX_NEW]
    prompts = PROMPTS
    peaks = [probe.cache.pages_for(len(p) + q.max_new_tokens + probe.config.headroom) for p, q in zip(prompts, params)]
    engine = oracle_models.fixed(*spec_args, page_size=4, chunk_size=4, spec_draft_ahead=True, num_pages=sum(peaks))
    assert engine.cache.layout.num_pages == sum(peaks)
    caps = [], []

    def capped(cache, i):
        reserve = cache.reserve

        def checked(h, n_positions):
            req = next(r for r in engine.scheduler.running if r.handles[i] is h)
            assert n_positions <= engine.scheduler.peak_positions(req), "reserved beyond the scheduled peak"
            caps[0].append(n_positions)
            reserve(h, n_positions)
        cache.reserve = checked

    for i, cache in enumerate([engine.cache] + engine.speculator.caches):
        capped(cache, i)
    got = run(engine, prompts, params)
    assert_same_greedy(got, per_request(oracle_models, prompts, MAX_NEW))
    assert engine.speculator.ahead.used > 0 and caps[0]
    assert engine.is_idle_and_clean()


@pytest.mark.parametrize("ahead", [False, True])
def test_the_page_size_1_host_mirror_follows_the_device_permutation(oracle_models, ahead):
    """Give the CPU engine a separate "device" table, as on CUDA: compaction permutes that one, the
    host re-derives the same permutation from the accept index; the two agree after every step."""
    engine = oracle_models.fixed("eagle", 2, 3, 8, page_size=1, chunk_size=4, spec_draft_ahead=ahead)
    table = engine.cache.req_to_token
    table._table = table.host.clone()  # a separate mirror, as on a GPU
    params = [SamplingParams(max_new_tokens=m, ignore_eos=True) for m in MAX_NEW]
    reqs = [engine.add_request(p, q) for p, q in zip(PROMPTS, params)]
    moved = 0
    while engine.scheduler.has_work():
        before = table.host.clone()
        engine.step()
        for r in engine.scheduler.running:
            row = r.handles[0].row
            assert torch.equal(table.host[row], table.table[row]), f"{r.rid}: host mirror differs"
            moved += not torch.equal(before[row, :r.kv_len], table.host[row, :r.kv_len])
    assert moved > 0, "no compaction permuted a row: the mirror was not exercised"
    assert_same_greedy([engine.result(r) for r in reqs], per_request(oracle_models, PROMPTS, MAX_NEW))
    assert engine.is_idle_and_clean()


def test_a_draft_launched_ahead_counts_as_the_draft_time_of_the_step_that_uses_it(oracle_models):
    """The same work with and without drafting ahead (on the CPU every draft runs where it is launched):
    the draft time stays the draft time (it does not vanish into the verify time of the step before)."""
    params = [SamplingParams(max_new_tokens=24, ignore_eos=True)] * 3
    totals = {}
    for ahead in (False, True):
        engine = oracle_models.fixed("eagle", 2, 3, 8, page_size=4, chunk_size=None, spec_draft_ahead=ahead)
        run(engine, PROMPTS[:3], params)
        assert engine.speculator.ahead.used > (10 if ahead else -1)
        totals[ahead] = engine.speculator.stats.totals
    draft_share = {a: t.draft_time_s / (t.draft_time_s + t.verify_time_s) for a, t in totals.items()}
    assert draft_share[True] > 0.4 * draft_share[False], draft_share


def test_drafts_ahead_while_a_hand_off_is_being_received(oracle_models):
    """A request in RECEIVING joins the decode batch once its K/V has arrived (between steps, when nobody can
    foresee it), many steps later (its prompt's prefill): steps go on launching a draft ahead meanwhile (the
    join itself: tests/unit/handoff/test_handoff_engines.py), and one aborted on its way changes nothing."""
    engine = oracle_models.fixed("eagle", 1, 3, 4, page_size=4, chunk_size=None, spec_draft_ahead=True)
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    req = engine.add_request(PROMPTS[0], params)
    while engine.speculator.ahead.pending is None:
        engine.step()
    incoming = engine.reserve_handoff("incoming", PROMPTS[2], [9], [0.0], params, len(PROMPTS[2]))
    assert incoming is not None
    for _ in range(3):
        engine.step()
        assert engine.speculator.ahead.pending is not None
    assert engine.abort("incoming")
    engine.step()
    assert engine.speculator.ahead.pending is not None
    while engine.scheduler.has_work():
        engine.step()
    assert_same_greedy([engine.result(req)], per_request(oracle_models, [PROMPTS[0]], [40]))
    assert engine.speculator.ahead.mismatched == 0 and engine.is_idle_and_clean()


@pytest.mark.parametrize("topk,steps,n", [(1, 5, 6), (2, 3, 8)])
def test_stop_tokens_inside_accepted_runs_under_drafting_ahead(oracle_models, topk, steps, n):
    """Requests ending on a stop token (which the host sees only after the draft ahead is launched):
    each one's row in the draft ahead stays within its pages and becomes padding; the others go on."""
    base = per_request(oracle_models, PROMPTS, [24] * len(PROMPTS))
    params = [SamplingParams(max_new_tokens=24, ignore_eos=True, stop_token_ids=(r.token_ids[5 + 3 * i],))
              for i, r in enumerate(base)]
    want = [oracle_models.reference([p], q)[0] for p, q in zip(PROMPTS, params)]
    assert len({len(w.token_ids) for w in want}) > 2  # they end at different steps
    engine = oracle_models.fixed("eagle3", topk, steps, n, page_size=4, chunk_size=None, spec_draft_ahead=True)
    assert_same_greedy(run(engine, PROMPTS, params), want)
    assert engine.speculator.ahead.partial > 0 and engine.speculator.ahead.mismatched == 0
    assert engine.is_idle_and_clean()
