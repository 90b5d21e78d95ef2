"""bench/bench_prefix.py: the shared-prefix benchmark (issue 33).

The smoke run goes through the stack as users run it (pd1: a prefill and a decode instance, each its own
``eyrie serve`` process, the router's OpenAI API) on the CPU with the tiny model, the prefix cache on and then
off: every request of every workload completes; the cold/warm split has the workload's counts; the cached
tokens the responses report are a warm request's whole shared prefix with the cache on (as the prefill
instance's counter says), a chat turn's earlier prompt at least, and none with the cache off or on a cold
request; the hand-off carries less with the cache on; the JSON and the table have every field. No speed is
judged: a shared CPU says nothing about it. Also: the workload's order, and bad flags exit 2 with one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.bench_prefix import HEAD_KEY, parse_args, shared_prefix_specs

ROOT = Path(__file__).resolve().parents[3]
WORKLOAD_FIELDS = ("issued", "completed", "failed", "output_tokens", "output_tok_s", "requests_s", "duration_s",
                   "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "cold", "warm", "cached_tokens", "requests_detail",
                   "handoff", "handoff_bytes", "prefix_cache")
KIND_FIELDS = ("requests", "completed", "ttft_p50_s", "ttft_p99_s", "prompt_tokens", "cached_tokens",
               "cached_share", "hits")
COMPARISON_FIELDS = ("probe_ttft_uncached_over_cached", "probe_ttft_off_over_on", "warm_ttft_off_over_on",
                     "warm_cached_share", "throughput_on_over_off", "requests_s_on_over_off",
                     "chat_throughput_on_over_off", "chat_warm_ttft_off_over_on", "handoff_bytes_on",
                     "handoff_bytes_off", "handoff_bytes_on_over_off", "targets")


def test_the_shared_workload_interleaves_prefixes_each_first_question_first():
    specs = shared_prefix_specs(3, 32, 4, 8, 5, (2, 500), None, "s")
    assert [(s.group, s.turn) for s in specs] == [(p, q) for q in range(4) for p in range(3)]
    heads = {s.group: s.prompt_ids[:32] for s in specs if s.turn == 0}
    assert len({tuple(h) for h in heads.values()}) == 3  # distinct prefixes
    for s in specs:
        assert len(s.prompt_ids) == 40 and s.max_new_tokens == 5 and s.prompt_ids[:32] == heads[s.group]
    assert len({tuple(s.prompt_ids[32:]) for s in specs}) == 12  # every question its own
    assert [s.prompt_ids for s in specs] == [s.prompt_ids for s in shared_prefix_specs(3, 32, 4, 8, 5, (2, 500),
                                                                                        None, "s")]
    text = list(range(100, 400))
    for s in shared_prefix_specs(2, 32, 2, 8, 5, (2, 500), text, "t"):  # windows of the text
        assert all(b == a + 1 for a, b in zip(s.prompt_ids[:32], s.prompt_ids[1:32]))


def test_prefixes_of_a_repeating_text_still_start_apart_across_workloads():
    """A text that repeats itself every 50 tokens: 20 windows drawn at random would share a start (and a cold
    request its first page) almost surely; the prefixes drawn (and those of a second call given the same
    ``taken``) all start differently."""
    text, taken = list(range(1000, 1050)) * 20, set()
    first = shared_prefix_specs(20, 32, 2, 8, 5, (2, 500), text, "a", taken)
    second = shared_prefix_specs(5, 32, 2, 8, 5, (2, 500), text, "b", taken)
    starts = [tuple(s.prompt_ids[:HEAD_KEY]) for s in first + second if s.turn == 0]
    assert len(starts) == 25 == len(set(starts)) == len(taken)


@pytest.mark.parametrize("flags, says", [(["--questions", "1"], "--questions must be at least 2"),
                                         (["--cache", "maybe"], "--cache 'maybe'"),
                                         (["--chat", "4"], "--chat '4'"),
                                         (["--workloads", "shared,nope"], "--workloads 'shared,nope'"),
                                         (["--layouts", "colo1,pd9"], "unknown layout 'pd9'"),
                                         (["--draft", "/nonexistent/head"], "--draft /nonexistent/head: not a "
                                                                            "checkpoint directory")])
def test_bad_flags_exit_2_naming_the_flag(flags, says, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(["--smoke", *flags])
    assert e.value.code == 2 and says in capsys.readouterr().err


def smoke(tmp_path: Path) -> dict:
    out = tmp_path / "prefix.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("TRITON_INTERPRET", None)  # the services run the torch references on the CPU, as `eyrie up` does
    run = subprocess.run([sys.executable, "bench/bench_prefix.py", "--smoke", "--layouts", "pd1", "--deadline-s", "500",
                          "--out", str(out), "--workdir", str(tmp_path / "work")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(out.read_text())
    report["markdown"] = out.with_suffix(".md").read_text()
    return report


@pytest.mark.slow
def test_smoke_pd1_cache_on_and_off_reports_cached_tokens_and_smaller_hand_offs(tmp_path):
    report = smoke(tmp_path)
    s = report["settings"]
    prefixes, questions, prefix, question = s["prefixes"], s["questions"], s["prefix_tokens"], s["question_tokens"]
    assert prefix % s["page_size"] == 0  # the shared prefix is whole pages: a warm hit is all of it
    conversations, turns = (int(x) for x in s["chat"].split("x"))
    counts = {"shared": (prefixes, prefixes * (questions - 1)), "chat": (conversations, conversations * (turns - 1)),
              "probe": (s["probe"], s["probe"])}
    assert report["skipped"] == [] and report["left_out"] == []
    on, off = report["runs"]
    assert (on["label"], off["label"]) == ("pd1-cache-on-draft-none", "pd1-cache-off-draft-none")
    for run in (on, off):
        assert "error" not in run and "skipped" not in run and set(run["exit_codes"].values()) == {0}, run
        assert [i["role"] for i in run["instances"]] == ["prefill", "decode"] and run["warmup_failed"] == 0
        for name, (cold, warm) in counts.items():
            w = run[name]
            assert all(k in w for k in WORKLOAD_FIELDS) and all(k in w[kind] for kind in ("cold", "warm")
                                                                for k in KIND_FIELDS), w.keys()
            assert w["issued"] == w["completed"] == cold + warm and w["failed"] == 0, (name, w)
            assert (w["cold"]["requests"], w["warm"]["requests"]) == (cold, warm), name
            assert w["cold"]["completed"] == cold and w["warm"]["completed"] == warm, name
            assert w["output_tok_s"] > 0 and w["requests_s"] > 0 and w["ttft_p50_s"] <= w["ttft_p99_s"], (name, w)
            assert w["handoff_bytes"] > 0 and len(w["requests_detail"]) == cold + warm, name
            for group, turn, _, ttft, tokens, prompt, cached in w["requests_detail"]:
                assert ttft is not None and tokens > 0 and prompt > 0, (name, group, turn)
                if run is off or turn == 0:
                    assert cached == 0, (run["label"], name, group, turn, cached)
                elif name != "chat":
                    assert prompt == prefix + question and cached == prefix, (run["label"], name, group, turn)
        assert report["markdown"].count(f"| pd1 | {run['cache']} | none |") == 1
    # A chat turn finds at least its previous prompt's whole pages (its own prompt's at most).
    prompts = {(g, t): (p, c) for g, t, _, _, _, p, c in on["chat"]["requests_detail"]}
    for (g, t), (prompt, cached) in prompts.items():
        if t:
            earlier = prompts[(g, t - 1)][0]
            assert earlier // s["page_size"] * s["page_size"] <= cached < prompt, (g, t, earlier, cached, prompt)
    # The prefill instance's counter matches the responses; the cache off looks nothing up.
    assert on["shared"]["prefix_cache"]["prefill"]["hits"] == on["shared"]["cached_tokens"] > 0
    assert off["shared"]["prefix_cache"]["prefill"] == {"queries": 0.0, "hits": 0.0}
    assert on["shared"]["warm"]["cached_share"] == prefix / (prefix + question)
    # The decode instance holds a warm request's prefix: its hand-off carries only the rest.
    assert on["shared"]["handoff_bytes"] < off["shared"]["handoff_bytes"]
    [c] = report["comparisons"]
    assert (c["layout"], c["draft"]) == ("pd1", "none") and all(k in c for k in COMPARISON_FIELDS)
    assert c["handoff_bytes_on_over_off"] == on["shared"]["handoff_bytes"] / off["shared"]["handoff_bytes"]
    assert c["throughput_on_over_off"] == on["shared"]["output_tok_s"] / off["shared"]["output_tok_s"]
    assert "| pd1 | none |" in report["markdown"]
