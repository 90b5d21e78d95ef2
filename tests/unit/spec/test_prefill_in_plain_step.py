"""An engine with a draft folds arriving prefill chunks into its plain decode step (``ModelRunner.run``).

When the policy picks a plain step and requests arrive while others decode, their prefill chunks run in the
decode step's one target forward, as a plain engine's step does (not a prefill forward, then a decode one).
That must change nothing but the forward count: greedy and seeded sampled output equal the target-only
engine's token for token with staggered arrivals, and every request's draft state (a decode row's and a
request whose prompt completed in the step) equals what the two separate forwards leave, so the speculative
steps after it draft and accept the same.
"""

from __future__ import annotations

import pytest
import torch
from spec_helpers import KINDS, PROMPTS, CountingModel, assert_same_greedy
from test_plain_step_graphs import DEAR_SPEC, adaptive

from shared.sampling import SamplingParams
from shared.scheduler import StepPlan

GREEDY = SamplingParams(max_new_tokens=10, ignore_eos=True)
ARRIVALS = [0, 2, 3, 3, 6]  # the step before which each of PROMPTS arrives: most arrive while others decode
CHUNK = 8  # prefill tokens per step: the 53- and 37-token prompts take several steps beside the decode rows


class Staggered:
    """Runs an engine over PROMPTS arriving at ARRIVALS, recording each step's plan, target forwards and the
    requests' draft states after it."""

    def __init__(self, engine):
        self.engine, self.plans, self.forwards, self.states = engine, [], [], []
        self.model = engine.runner.model = CountingModel(engine.model)
        schedule = engine.scheduler.schedule
        engine.scheduler.schedule = lambda: self.plans.append(schedule()) or self.plans[-1]

    def run(self, params: list[SamplingParams]):
        reqs, engine = [], self.engine
        while len(reqs) < len(PROMPTS) or engine.scheduler.has_work():
            while len(reqs) < len(PROMPTS) and ARRIVALS[len(reqs)] <= len(self.plans):
                reqs.append(engine.add_request(PROMPTS[len(reqs)], params[len(reqs)]))
            before = self.model.calls
            engine.step()
            self.forwards.append(self.model.calls - before)
            self.states.append([r.draft_state for r in reqs])
        return [engine.result(r) for r in reqs]

    def mixed_steps(self) -> list[int]:
        """The steps that had both prefill chunks and decode rows."""
        return [i for i, p in enumerate(self.plans) if p.prefill and p.decode]


def plain_on_prefill_steps(run: Staggered, shape: str) -> None:
    """The policy's choice forced: a plain step on a step with prefill chunks, else a speculative one."""
    run.engine.spec_policy.choose = lambda batch, pinned=False, mixed=False, left=None: (
        None if run.plans[-1].prefill else shape)


def split_mixed_forwards(engine) -> None:
    """The engine's former step: a mixed plan's prefill chunks in a forward of their own, then the decode rows."""
    one = engine.runner._target_step

    def split(plan: StepPlan):  # a step's run (``shared/stepping.py``), as the one it replaces
        if plan.prefill and plan.decode:
            events = yield from one(StepPlan(prefill=plan.prefill))
            return events + (yield from one(StepPlan(decode=plan.decode)))
        return (yield from one(plan))
    engine.runner._target_step = split


def target_run(models, params: list[SamplingParams]):
    plain = Staggered(models.engine(chunk_size=CHUNK))
    return plain.run(params), plain


@pytest.mark.parametrize("kind", KINDS)
def test_prefill_arriving_while_others_decode_runs_in_the_plain_steps_one_forward(oracle_models, kind):
    params = [GREEDY] * len(PROMPTS)
    want, plain = target_run(oracle_models, params)
    run = Staggered(adaptive(oracle_models, kind, False, DEAR_SPEC, chunk_size=CHUNK))
    kinds = []
    ran = run.engine.spec_policy.ran
    run.engine.spec_policy.ran = lambda kind, b, s, timed=True, mixed=False: \
        kinds.append((len(run.plans) - 1, kind, timed)) or ran(kind, b, s, timed, mixed)
    assert_same_greedy(run.run(params), want, kind)
    mixed = run.mixed_steps()
    assert len(mixed) >= 3 and mixed == plain.mixed_steps()  # the same schedule as the plain engine's
    assert run.forwards == plain.forwards == [1] * len(run.plans)  # one target forward per step, mixed ones too
    assert run.engine.spec_policy.choices["spec"] == 0
    assert {i for i, k, timed in kinds if not timed} >= set(mixed)  # a folded step's time is not plain's
    assert all(k == "plain" for _, k, _ in kinds)
    assert run.engine.is_idle_and_clean()


@pytest.mark.parametrize("kind", KINDS)
def test_speculative_steps_after_a_folded_prefill_resume_from_the_same_draft_states(oracle_models, kind):
    params = [GREEDY] * len(PROMPTS)
    want = oracle_models.reference(PROMPTS, GREEDY)
    runs = []
    for split in (False, True):
        engine = adaptive(oracle_models, kind, False, DEAR_SPEC, chunk_size=CHUNK)
        run = Staggered(engine)
        plain_on_prefill_steps(run, next(iter(engine.speculator.shapes)))
        if split:
            split_mixed_forwards(engine)
        assert_same_greedy(run.run(params), want, f"{kind} split={split}")
        assert engine.is_idle_and_clean()
        runs.append(run)
    folded, split = runs
    assert len(folded.mixed_steps()) >= 3 and folded.mixed_steps() == split.mixed_steps()
    assert all(folded.forwards[i] == 1 and split.forwards[i] == 2 for i in folded.mixed_steps())
    assert sum(1 for p in folded.plans if p.decode and not p.prefill) >= 3  # speculative steps follow
    for step, (a, b) in enumerate(zip(folded.states, split.states, strict=True)):
        for sa, sb in zip(a, b, strict=True):
            assert (sa is None) == (sb is None), step
            if sa is not None:
                assert (sa.bonus_token, sa.committed_len) == (sb.bonus_token, sb.committed_len), step
                assert torch.allclose(sa.hidden, sb.hidden, atol=1e-5), step
                assert torch.allclose(sa.topk_p, sb.topk_p, atol=1e-5) and torch.equal(sa.topk_ids, sb.topk_ids)
    totals = [r.engine.spec_stats.totals for r in runs]
    assert totals[0].accept_length == totals[1].accept_length > 1.3  # the same drafts, accepted alike


def test_sampled_output_with_folded_prefills_equals_the_target_only_engines(oracle_models):
    """Seeded draws are hashed by request seed and position: a plain step's equal the target-only engine's."""
    params = [SamplingParams(max_new_tokens=10, ignore_eos=True, temperature=1.0, top_p=0.95, seed=11 + i)
              for i in range(len(PROMPTS))]
    want, _ = target_run(oracle_models, params)
    run = Staggered(adaptive(oracle_models, "eagle3", False, DEAR_SPEC, chunk_size=CHUNK))
    got = run.run(params)
    assert len(run.mixed_steps()) >= 3 and all(run.forwards[i] == 1 for i in run.mixed_steps())
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert any(g.token_ids != r.token_ids for g, r in zip(got, oracle_models.reference(PROMPTS, GREEDY)))  # sampled
    for g, w in zip(got, want):
        assert torch.allclose(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=1e-4)
    assert run.engine.is_idle_and_clean()


@pytest.mark.parametrize("backlog", [0, 32], ids=["extend-decoded", "backlog"])
def test_the_drafts_extend_is_queued_before_the_host_waits_for_the_steps_tokens(oracle_models, backlog):
    """A step with prefill chunks queues the draft's extend over them (and over its plain-decoded rows, without a
    backlog) behind its target forward before the host waits for the sampled tokens: a completed prompt's last
    draft input is its first sampled token, taken on the device. After the wait the requests resume from the
    extend's outputs: each draft state sits at the request's length with its committed token as the bonus."""
    engine = oracle_models.engine("eagle3", spec_policy="adaptive", spec_draft_backlog=backlog)
    first = engine.add_request(PROMPTS[1], GREEDY)
    step = engine.launch()  # a prefill step: the whole prompt, its first token sampled
    assert first.output_ids == [] and first.handles[1].reserved == len(PROMPTS[1])
    step.finish()
    assert first.draft_state.committed_len == first.kv_len == len(PROMPTS[1])
    assert first.draft_state.bonus_token == first.output_ids[0]
    second = engine.add_request(PROMPTS[3], GREEDY)
    step = engine.launch()  # a mixed step (the first decoding beside the second's prompt): run plain
    assert second.output_ids == [] and second.handles[1].reserved == len(PROMPTS[3])
    assert first.handles[1].reserved == (first.kv_len if backlog == 0 else len(PROMPTS[1]))
    step.finish()
    for req in (first, second):
        assert req.draft_state.committed_len == (req.kv_len if backlog == 0 or req is second else len(PROMPTS[1]))
    assert second.draft_state.bonus_token == second.output_ids[0]
    while engine.scheduler.has_work():
        engine.step()
    assert_same_greedy([engine.result(first), engine.result(second)],
                       oracle_models.reference([PROMPTS[1], PROMPTS[3]], GREEDY))
