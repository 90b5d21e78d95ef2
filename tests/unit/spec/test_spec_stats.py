"""Speculative statistics, per request and per engine (batch after batch), and the CLI report.

Accept length is tokens per verify (accepted drafts + the bonus token) as verification accepted
them; a stop condition inside the last run cuts the committed tokens but not the count. Accept rate
is accepted drafts over the ``steps`` drafts each verify could accept. Draft and verify times are
measured per step and shared out evenly among the requests of the step.
"""

from __future__ import annotations

import json

import pytest
from spec_helpers import PROMPTS

from services.cli import main as eyrie
from shared.sampling import SamplingParams

STEPS = 3


def run_recorded(models, kind, prompts, params, **spec):
    engine = models.engine(kind, steps=STEPS, **spec)
    lens: dict[str, list[int]] = {}
    accept = engine.spec.accept

    def recording_accept(reqs, tree, logits):
        acc = accept(reqs, tree, logits)
        for r, n in zip(reqs, acc.accept_len.tolist()):
            lens.setdefault(r.rid, []).append(n)
        return acc

    engine.spec.accept = recording_accept
    reqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    engine.run_until_done()
    assert engine.is_idle_and_clean()
    return engine, reqs, lens


@pytest.mark.parametrize("drafts, spec", [("oracle", dict(topk=2, ndt=6)), ("oracle", dict(topk=1)),
                                          ("random", dict(topk=2, ndt=6))])
def test_per_request_and_engine_statistics(oracle_models, random_models, drafts, spec):
    models = oracle_models if drafts == "oracle" else random_models
    prompts = [PROMPTS[0], PROMPTS[3], PROMPTS[4]]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (7, 16, 11)]
    engine, reqs, lens = run_recorded(models, "eagle3", prompts, params, **spec)
    for r in reqs:
        st, n = r.stats, lens[r.rid]
        assert st.verify_steps == len(n) >= 1
        assert st.accepted_drafts == sum(x - 1 for x in n)
        assert st.proposed_drafts == STEPS * len(n)
        assert st.accept_length == pytest.approx(sum(n) / len(n))
        assert st.accept_rate == pytest.approx(st.accepted_drafts / (STEPS * len(n)))
        assert st.draft_time_s > 0 and st.verify_time_s > 0
        # every verify's tokens were committed, except those a stop condition cut from the last one
        committed = len(r.output_ids) - 1  # the first token comes from prefill
        assert sum(n[:-1]) < committed <= sum(n)
        d = engine.result(r).spec
        assert d == {"verify_steps": st.verify_steps, "accepted_drafts": st.accepted_drafts,
                     "accept_length": round(st.accept_length, 4), "accept_rate": round(st.accept_rate, 4),
                     "draft_time_s": round(st.draft_time_s, 6), "verify_time_s": round(st.verify_time_s, 6)}
    total = engine.spec.totals
    assert total.verify_steps == sum(r.stats.verify_steps for r in reqs)
    assert total.accepted_drafts == sum(r.stats.accepted_drafts for r in reqs)
    assert total.proposed_drafts == STEPS * total.verify_steps
    assert total.draft_time_s == pytest.approx(sum(r.stats.draft_time_s for r in reqs))
    assert total.verify_time_s == pytest.approx(sum(r.stats.verify_time_s for r in reqs))
    assert total.accept_length == pytest.approx(sum(map(sum, lens.values())) / total.verify_steps)
    if drafts == "oracle":
        assert total.accept_length > 1.3
    else:
        assert total.accept_length < 1.1


def test_target_only_results_have_no_spec_stats(oracle_models):
    res = oracle_models.engine(None).generate([PROMPTS[0]], SamplingParams(max_new_tokens=3))[0]
    assert res.spec is None and "spec" not in res.as_json()


def test_cli_generate_reports_statistics(oracle_model_dir, oracle_models, capsys):
    prompt = PROMPTS[3]
    base = ["generate", "--model", str(oracle_model_dir / "target"), "--prompt-ids", ",".join(map(str, prompt)),
            "--prompt-ids", "7,8,9", "--max-new-tokens", "12", "--ignore-eos", "--page-size", "4"]
    spec = ["--draft", str(oracle_model_dir / "eagle"), "--spec-topk", "2", "--spec-steps", str(STEPS),
            "--spec-draft-tokens", "6"]
    assert eyrie(base + spec + ["--json"]) == 0
    objs = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(objs) == 2
    want = oracle_models.reference([prompt, [7, 8, 9]], SamplingParams(max_new_tokens=12, ignore_eos=True))
    for o, w in zip(objs, want):
        assert o["token_ids"] == w.token_ids and o["finish_reason"] == "length"
        s = o["spec"]
        assert set(s) == {"verify_steps", "accepted_drafts", "accept_length", "accept_rate", "draft_time_s",
                          "verify_time_s"}
        v, a = s["verify_steps"], s["accepted_drafts"]
        assert 1 <= v <= 11 and a >= 1  # oracle drafts: accepted
        assert s["accept_length"] == round((a + v) / v, 4) and s["accept_rate"] == round(a / (STEPS * v), 4)
        assert s["draft_time_s"] > 0 and s["verify_time_s"] > 0
        assert a + v >= 11  # the 11 tokens after the prefill one were committed by the verifies
    # The human-readable form reports them on stderr.
    assert eyrie(base + spec) == 0
    err = capsys.readouterr().err
    assert err.count("[accept length ") == 2 and "accept rate " in err
