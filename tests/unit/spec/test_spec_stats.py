"""Speculative statistics: per request, per engine, per verify step (batch), and the CLI report.

Accept length is committed tokens per verify: the accepted drafts plus the bonus token, and when a
stop condition (EOS, a stop token, max_new_tokens) ends a request inside an accepted run, only the
tokens up to it: the discarded rest does not count. Accept rate is the drafts verification accepted
(discarded ones included: it measures the draft) over the ``steps`` drafts each verify could accept.
Draft and verify times are measured per step (``SpecRecorder.batches``) and shared out evenly among
its requests.

The counts are checked against what the engine handed out, recorded outside the statistics code:
the tokens each ``decode_step`` returned per request, the accept lengths verification produced,
and the output itself (one prefill token, then every committed token).
"""

from __future__ import annotations

import json

import pytest
from spec_helpers import PROMPTS

from services.cli import main as eyrie
from shared.sampling import SamplingParams
from shared.spec.stats import summarize_batches

STEPS = 3


def run_recorded(models, kind, prompts, params, **spec):
    """Run to the end; per request id, the accept lengths verification found and the tokens each
    verify committed, recorded around the worker's ``_commit`` and ``decode_step``."""
    engine = models.fixed(kind, steps=STEPS, **spec)  # every decode step verifies: the counts below
    verified: dict[str, list[int]] = {}
    committed: dict[str, list[int]] = {}
    sizes: list[int] = []
    commit, decode_step = engine.speculator._commit, engine.speculator.step

    def recording_commit(reqs, inp, out):  # what verification accepted, before any stop cuts it
        for r, n in zip(reqs, out.accept_len.tolist()):
            verified.setdefault(r.rid, []).append(n)
        return commit(reqs, inp, out)

    def recording_decode_step(reqs, *rest):
        events = yield from decode_step(reqs, *rest)
        sizes.append(len(reqs))
        for r, toks in events:
            committed.setdefault(r.rid, []).append(len(toks))
        return events

    engine.speculator._commit, engine.speculator.step = recording_commit, recording_decode_step
    reqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    engine.run_until_done()
    assert engine.is_idle_and_clean()
    return engine, reqs, verified, committed, sizes


def check_request_stats(r, verified: list[int], committed: list[int]) -> None:
    st = r.stats
    assert st.verify_steps == len(verified) == len(committed) >= 1
    assert sum(committed) == len(r.output_ids) - 1  # the first token comes from prefill
    assert committed[:-1] == verified[:-1] and 1 <= committed[-1] <= verified[-1]  # only the last can be cut
    assert st.accepted_drafts == sum(v - 1 for v in verified) and st.committed_tokens == sum(committed)
    assert st.proposed_drafts == STEPS * len(committed)
    assert st.accept_length == pytest.approx((len(r.output_ids) - 1) / st.verify_steps)
    assert st.accept_rate == pytest.approx(st.accepted_drafts / (STEPS * st.verify_steps))
    assert st.draft_time_s > 0 and st.verify_time_s > 0


@pytest.mark.parametrize("drafts, spec", [("oracle", dict(topk=2, ndt=6)), ("oracle", dict(topk=1)),
                                          ("random", dict(topk=2, ndt=6))])
def test_per_request_engine_and_batch_statistics(oracle_models, random_models, drafts, spec):
    models = oracle_models if drafts == "oracle" else random_models
    prompts = [PROMPTS[0], PROMPTS[3], PROMPTS[4]]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (7, 16, 11)]
    engine, reqs, verified, committed, sizes = run_recorded(models, "eagle3", prompts, params, **spec)
    for r in reqs:
        check_request_stats(r, verified[r.rid], committed[r.rid])
        st = r.stats
        d = engine.result(r).spec_stats
        assert d == {"verify_steps": st.verify_steps, "accepted_drafts": st.accepted_drafts,
                     "committed_tokens": st.committed_tokens, "accept_length": round(st.accept_length, 4),
                     "accept_rate": round(st.accept_rate, 4), "draft_time_s": round(st.draft_time_s, 6),
                     "verify_time_s": round(st.verify_time_s, 6)}

    # Per verify step: who was verified together, what each committed, and the step's times.
    w = engine.speculator
    batches = w.stats.batches_since(0)
    assert [b.step for b in batches] == list(range(len(sizes))) and w.stats.num_batches == len(sizes)
    assert [b.batch_size for b in batches] == sizes and max(sizes) == 3 and sizes[-1] == 1
    seen = {r.rid: 0 for r in reqs}
    for b in batches:
        for rid, c, v in zip(b.request_ids, b.committed, b.verified):
            assert (c, v) == (committed[rid][seen[rid]], verified[rid][seen[rid]])
            seen[rid] += 1
        assert b.accept_length == pytest.approx(sum(b.committed) / b.batch_size)
        assert b.accept_rate == pytest.approx(sum(v - 1 for v in b.verified) / (STEPS * b.batch_size))
        assert b.draft_time_s > 0 and b.verify_time_s > 0
        assert b.as_dict()["committed"] == b.committed and b.as_dict()["batch_size"] == b.batch_size
    assert seen == {r.rid: r.stats.verify_steps for r in reqs}
    for r in reqs:  # each request's times are its shares of its steps' times
        mine = [b for b in batches if r.rid in b.request_ids]
        assert r.stats.draft_time_s == pytest.approx(sum(b.draft_time_s / b.batch_size for b in mine))
        assert r.stats.verify_time_s == pytest.approx(sum(b.verify_time_s / b.batch_size for b in mine))

    total = w.stats.totals
    assert total.verify_steps == sum(r.stats.verify_steps for r in reqs) == sum(sizes)
    assert total.accepted_drafts == sum(r.stats.accepted_drafts for r in reqs)
    assert total.committed_tokens == sum(r.stats.committed_tokens for r in reqs)
    assert total.proposed_drafts == STEPS * total.verify_steps
    assert total.draft_time_s == pytest.approx(sum(b.draft_time_s for b in batches))
    assert total.verify_time_s == pytest.approx(sum(b.verify_time_s for b in batches))
    out_tokens = sum(len(r.output_ids) - 1 for r in reqs)
    assert total.accept_length == pytest.approx(out_tokens / total.verify_steps)
    s = summarize_batches(batches)
    assert (s["verify_batches"], s["verify_steps"], s["committed_tokens"]) == (len(sizes), sum(sizes), out_tokens)
    assert s["accepted_drafts"] == total.accepted_drafts
    assert s["accept_length"] == round(total.accept_length, 4) and s["accept_rate"] == round(total.accept_rate, 4)
    assert s["mean_batch_size"] == round(sum(sizes) / len(sizes), 4)
    if drafts == "oracle":
        assert total.accept_length > 1.3
    else:
        assert total.accept_length < 1.1


def test_a_stop_inside_an_accepted_run_counts_committed_tokens_only(oracle_models):
    """A stop token met inside an accepted run: the verify counts the tokens up to it, not the run."""
    free = SamplingParams(max_new_tokens=20, ignore_eos=True)
    engine, reqs, verified, committed, _ = run_recorded(oracle_models, "eagle", [PROMPTS[3]], [free], topk=1)
    r = reqs[0]
    # a token first produced inside a verify's run, with more tokens committed after it
    out, pos, stop_at = r.output_ids, 1, None
    for c in committed[r.rid]:
        for t in range(c - 1):
            if out.index(out[pos + t]) == pos + t:
                stop_at = pos + t
                break
        if stop_at is not None:
            break
        pos += c
    assert stop_at is not None, f"no accepted run to stop inside: {committed[r.rid]}"
    params = SamplingParams(max_new_tokens=20, ignore_eos=True, stop_token_ids=(out[stop_at],))
    engine, reqs, verified, committed, _ = run_recorded(oracle_models, "eagle", [PROMPTS[3]], [params], topk=1)
    r = reqs[0]
    assert r.output_ids == out[:stop_at + 1] and r.finish_reason == "stop"
    v, c = verified[r.rid], committed[r.rid]
    assert c[-1] < v[-1]  # the run was cut: the rest was accepted but discarded
    check_request_stats(r, v, c)
    # accept length counts the committed tokens; the accept rate, what verification accepted
    assert r.stats.committed_tokens == sum(c) < sum(v) == r.stats.accepted_drafts + r.stats.verify_steps
    assert r.stats.accept_length < (r.stats.accepted_drafts + r.stats.verify_steps) / r.stats.verify_steps
    (b,) = engine.speculator.stats.batches_since(engine.speculator.stats.num_batches - 1)
    assert (b.committed, b.verified) == ([c[-1]], [v[-1]])


def test_batch_log_is_bounded(oracle_models):
    engine = oracle_models.engine("eagle", steps=STEPS)
    engine.speculator.stats.keep_batches(2)
    engine.generate([PROMPTS[0], PROMPTS[4]], SamplingParams(max_new_tokens=12, ignore_eos=True))
    w = engine.speculator.stats
    assert w.num_batches > 2 and [b.step for b in w.batches] == [w.num_batches - 2, w.num_batches - 1]
    assert [b.step for b in w.batches_since(w.num_batches - 1)] == [w.num_batches - 1]


def test_target_only_results_have_no_spec_stats(oracle_models):
    res = oracle_models.engine(None).generate([PROMPTS[0]], SamplingParams(max_new_tokens=3))[0]
    assert res.spec_stats is None and "spec" not in res.as_json()


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
    steps_seen = set()
    for o, w in zip(objs, want):
        assert o["token_ids"] == w.token_ids and o["finish_reason"] == "length"
        s = o["spec"]
        assert set(s) == {"verify_steps", "accepted_drafts", "committed_tokens", "accept_length", "accept_rate",
                          "draft_time_s", "verify_time_s"}
        v, a = s["verify_steps"], s["accepted_drafts"]
        assert 1 <= v <= 11 and a >= 1  # oracle drafts: accepted
        assert s["committed_tokens"] == 11 <= a + v  # 11 tokens after the prefill one; a cut drops some
        assert s["accept_length"] == round(11 / v, 4) and s["accept_rate"] == round(a / (STEPS * v), 4)
        assert s["draft_time_s"] > 0 and s["verify_time_s"] > 0
        # the verify steps this prompt took part in, each with its batch
        bs = o["spec_batches"]
        assert len(bs) == v and all(o["request_id"] in b["request_ids"] for b in bs)
        assert sum(b["committed"][b["request_ids"].index(o["request_id"])] for b in bs) == 11
        assert all(b["batch_size"] == len(b["request_ids"]) == len(b["committed"]) and b["draft_time_s"] > 0
                   for b in bs)
        steps_seen |= {b["step"] for b in bs}
    assert objs[0]["spec_batches"][0]["batch_size"] == 2  # both prompts were verified together at first
    assert steps_seen == set(range(len(steps_seen)))
    # The human-readable form reports them on stderr: per prompt, then the prompt batch's verify steps.
    assert eyrie(base + spec) == 0
    err = capsys.readouterr().err
    assert err.count("[accept length ") == 2 and "accept rate " in err
    assert f"[{len(steps_seen)} verify batches, mean batch size " in err
