"""services.telemetry: /health follows the state, /metrics parses and moves, instances don't share metrics."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.telemetry import Telemetry
from shared.config import EngineConfig
from shared.engine import Engine
from shared.sampling import SamplingParams

GRPC = (("transport", "grpc"),)  # the hand-off series' label


def get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def samples(address: str) -> dict:
    status, body = get(f"http://{address}/metrics")
    assert status == 200
    out = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            if not s.name.startswith("eyrie_"):
                continue  # the process collectors'
            labels = dict(s.labels)
            assert labels.pop("model_name") == "eyrie" and labels.pop("role") in ("router", "prefill", "decode")
            out[(s.name, tuple(sorted(labels.items())))] = s.value
    return out


@pytest.fixture
def telemetry():
    t = Telemetry("decode", "decode-test").start()
    yield t
    t.stop()


def test_health_follows_the_state(telemetry):
    base = f"http://{telemetry.address}"
    status, body = get(f"{base}/health")
    assert status == 503 and json.loads(body)["status"] == "loading"
    for state in ("capturing", "draining"):
        telemetry.set_state(state)
        status, body = get(f"{base}/health")
        assert status == 503 and json.loads(body)["status"] == state
    telemetry.set_state("ready")
    status, body = get(f"{base}/health")
    assert status == 200 and json.loads(body) == {"status": "ready", "service": "decode", "instance_id": "decode-test",
                                                 "graphs": {"capture_failures": []}}
    assert get(f"{base}/nothing")[0] == 404
    with pytest.raises(ValueError):
        telemetry.set_state("sleepy")


def test_metrics_parse_and_move_and_instances_are_independent(telemetry):
    other = Telemetry("prefill", "prefill-test").start()
    try:
        before = samples(telemetry.address)
        assert before[("eyrie_num_requests_running", ())] == 0
        assert before[("eyrie_time_to_first_token_seconds_count", ())] == 0
        telemetry.requests_total.labels("length").inc()
        telemetry.errors_total.labels("transfer").inc(2)
        telemetry.ttft_seconds.observe(0.02)
        telemetry.handoff_bytes_total.inc(4096)
        telemetry.stage_seconds.labels("prefill").observe(0.5)
        after = samples(telemetry.address)
        assert after[("eyrie_requests_total", (("outcome", "length"),))] == 1
        assert after[("eyrie_errors_total", (("kind", "transfer"),))] == 2
        assert after[("eyrie_time_to_first_token_seconds_count", ())] == 1
        assert after[("eyrie_time_to_first_token_seconds_bucket", (("le", "0.025"),))] == 1
        assert after[("eyrie_time_to_first_token_seconds_bucket", (("le", "0.01"),))] == 0
        assert after[("eyrie_handoff_bytes_total", GRPC)] == 4096
        assert after[("eyrie_request_stage_seconds_sum", (("stage", "prefill"),))] == 0.5
        untouched = samples(other.address)
        assert ("eyrie_requests_total", (("outcome", "length"),)) not in untouched
        assert untouched[("eyrie_handoff_bytes_total", GRPC)] == 0
        assert (("eyrie_handoff_seconds_count", GRPC)) in untouched
        for name in ("eyrie_inter_token_latency_seconds_count", "eyrie_spec_decode_accept_length_count",
                     "eyrie_spec_decode_accept_rate_count", "eyrie_spec_decode_draft_seconds_count",
                     "eyrie_spec_decode_verify_seconds_count", "eyrie_num_requests_waiting"):
            assert (name, ()) in untouched, name
    finally:
        other.stop()


def test_observe_engine_reports_every_pool(telemetry, tiny_model_dir):
    from shared.config import SpecConfig

    engine = Engine(tiny_model_dir / "target", tiny_model_dir / "mtp",
                    EngineConfig(page_size=4, num_pages=32, spec=SpecConfig(topk=1, steps=2, num_draft_tokens=3)))
    telemetry.observe_load(engine.load())
    m = samples(telemetry.address)
    caches = sorted(dict(k[1])["cache"] for k in m if k[0] == "eyrie_kv_pages_capacity")
    assert caches == ["draft0", "draft1", "target"]  # the multi-layer draft has one pool per step
    assert m[("eyrie_kv_pages_used", (("cache", "target"),))] == 0
    engine.add_request(list(range(10)), SamplingParams(max_new_tokens=4), rid="r")
    engine.step()
    telemetry.observe_load(engine.load())
    m = samples(telemetry.address)
    total = m[("eyrie_kv_pages_capacity", (("cache", "target"),))]
    assert total == engine.cache.layout.num_pages
    assert m[("eyrie_kv_pages_used", (("cache", "target"),))] >= 3  # 10+ tokens in pages of 4
    assert m[("eyrie_num_requests_running", ())] + m[("eyrie_num_requests_waiting", ())] == 1
    engine.abort("r")
    telemetry.observe_load(engine.load())
    assert samples(telemetry.address)[("eyrie_kv_pages_used", (("cache", "target"),))] == 0


def test_observe_engine_reports_the_prefix_cache(telemetry, tiny_model_dir):
    """Prompt tokens looked up and found (counters in tokens, as vLLM's) and the pages it holds."""
    engine = Engine(tiny_model_dir / "target", config=EngineConfig(page_size=4, num_pages=32, prefix_cache=True))
    before = samples(telemetry.address)
    prompt, params = list(range(3, 21)), SamplingParams(max_new_tokens=2)  # 18 tokens: 4 pages before the last
    for _ in range(2):
        engine.generate(prompt, params)
    telemetry.observe_load(engine.load())
    m = samples(telemetry.address)
    grew = lambda name: m[(name, ())] - before.get((name, ()), 0)  # noqa: E731
    assert grew("eyrie_prefix_cache_queries_total") == 36 and grew("eyrie_prefix_cache_hits_total") == 16
    assert m[("eyrie_prefix_cache_pages", ())] == 4
    assert m[("eyrie_kv_pages_used", (("cache", "target"),))] == 0  # cached pages nobody holds are free
    telemetry.observe_load(engine.load())  # the same totals again: no increment
    assert samples(telemetry.address)[("eyrie_prefix_cache_hits_total", ())] == m[("eyrie_prefix_cache_hits_total", ())]


def test_service_telemetry_guards_every_path_but_health_with_the_key():
    from services.common import ServiceTelemetry

    open_ = ServiceTelemetry("router", "router-open").start()
    keyed = ServiceTelemetry("router", "router-keyed", api_key="k3y").start()
    try:
        assert get(f"http://{open_.address}/metrics")[0] == 200  # no key set: open
        base = f"http://{keyed.address}"
        for path in ("/metrics", "/metrics?name=x", "/", "/nothing"):
            for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "k3y"}):
                req = urllib.request.Request(base + path, headers=headers)
                try:
                    urllib.request.urlopen(req, timeout=5)
                    pytest.fail(f"{path} answered without the key")
                except urllib.error.HTTPError as e:
                    assert e.code == 401 and e.headers["WWW-Authenticate"].startswith("Bearer")
                    assert json.loads(e.read())["error"]["code"] == "invalid_api_key"
        keyed.set_state("ready")
        assert get(f"{base}/health")[0] == 200  # open
        with urllib.request.urlopen(urllib.request.Request(f"{base}/metrics", headers={"Authorization": "Bearer k3y"}),
                                    timeout=5) as r:
            text = r.read().decode()
        counted = [s.value for f in text_string_to_metric_families(text) for s in f.samples
                   if s.name == "eyrie_errors_total"
                   and s.labels == {"model_name": "eyrie", "role": "router", "kind": "unauthenticated"}]
        assert counted == [12.0]
    finally:
        open_.stop()
        keyed.stop()


def test_draft_ahead_outcomes_are_exported(telemetry, tiny_model_dir):
    from shared.config import SpecConfig

    engine = Engine(tiny_model_dir / "target", tiny_model_dir / "eagle",
                    EngineConfig(page_size=4, spec=SpecConfig(topk=1, steps=2, num_draft_tokens=3),
                                 spec_draft_ahead=True))
    engine.generate([list(range(10)), list(range(5, 12))], [SamplingParams(max_new_tokens=n, ignore_eos=True)
                                                            for n in (12, 4)])
    telemetry.observe_load(engine.load())
    m = samples(telemetry.address)
    w = engine.speculator
    got = {o: m[("eyrie_spec_decode_draft_ahead_total", (("outcome", o),))]
           for o in ("used", "partial", "dropped", "mismatched")}
    assert got == {"used": w.ahead.used, "partial": w.ahead.partial, "dropped": w.ahead.dropped,
                   "mismatched": w.ahead.mismatched}
    assert got["used"] > 0 and got["partial"] > 0


def test_draft_catch_ups_are_exported(telemetry, tiny_model_dir):
    from shared.config import SpecConfig
    from tests.policy_costs import Rotating

    engine = Engine(tiny_model_dir / "target", tiny_model_dir / "eagle",
                    EngineConfig(page_size=4, spec=SpecConfig(topk=1, steps=2, num_draft_tokens=3),
                                 spec_draft_backlog=3))
    engine.spec_policy.cost = Rotating([None])  # a plain step the fastest at every decision ...
    for c in engine.spec_policy.candidates:  # ... once every shape's acceptance is known
        c.acceptance.observe([1])
    engine.generate([list(range(10)), list(range(5, 12))], SamplingParams(max_new_tokens=8, ignore_eos=True))
    telemetry.observe_load(engine.load())
    m = samples(telemetry.address)
    got = {u: m[("eyrie_spec_decode_draft_catch_up_total", (("count", u),))] for u in ("extends", "positions")}
    assert got == engine.speculator.stats.catch_up and got["extends"] == 2  # full after 3 plain steps, twice in 7
    assert got["positions"] == 2 * 2 * 3


SPEC_COUNTERS = ("eyrie_spec_decode_num_drafts_total", "eyrie_spec_decode_num_draft_tokens_total",
                 "eyrie_spec_decode_num_accepted_tokens_total")


def summed(m: dict, name: str, **labels) -> float:
    """``name``'s samples with ``labels`` (and any others: the ``shape`` the series are split by) summed."""
    return sum(v for (n, ls), v in m.items() if n == name and all(dict(ls).get(k) == w for k, w in labels.items()))


def spec_counters(m: dict, steps: int) -> tuple:
    """vLLM's series: the counters summed over the tree shapes that drafted."""
    per_pos = [summed(m, "eyrie_spec_decode_num_accepted_tokens_per_pos_total", position=str(i)) for i in range(steps)]
    return (*(summed(m, name) for name in SPEC_COUNTERS), per_pos)


def test_token_level_spec_metrics_move_as_requests_run(telemetry, oracle_model_dir):
    """The vLLM-shaped counters follow the engine's verify steps: drafts, their ``steps`` draft tokens,
    accepted tokens (the accepted runs' lengths), and per position the drafts accepted that far; a
    second batch adds to them (counters never go back)."""
    from shared.config import SpecConfig

    steps = 3
    engine = Engine(oracle_model_dir / "target", oracle_model_dir / "eagle",  # fixed: every draft offers 3 tokens
                    EngineConfig(page_size=4, spec=SpecConfig(topk=2, steps=steps, num_draft_tokens=6),
                                 spec_policy="fixed"))
    telemetry.observe_load(engine.load())
    assert spec_counters(samples(telemetry.address), steps) == (0, 0, 0, [0] * steps)
    seen, verifies = [], []
    for batch in range(2):
        mark = engine.spec_stats.num_batches
        engine.generate([list(range(3 + batch, 12)), list(range(20, 26))],
                        [SamplingParams(max_new_tokens=20, ignore_eos=True),
                         SamplingParams(max_new_tokens=14, ignore_eos=True, temperature=0.8, seed=batch)])
        telemetry.observe_load(engine.load())
        verifies += [n for b in engine.spec_stats.batches_since(mark) for n in b.verified]
        drafts, draft_tokens, accepted, per_pos = spec_counters(samples(telemetry.address), steps)
        assert drafts == len(verifies) and draft_tokens == steps * len(verifies)
        assert accepted == sum(n - 1 for n in verifies) == sum(per_pos)
        assert per_pos == [sum(n - 1 > i for n in verifies) for i in range(steps)]
        seen.append(accepted)
    assert 0 < seen[0] < seen[1], "drafts were accepted, and the second batch added to the counters"
    assert engine.spec_stats.totals.accepted_drafts == seen[1]  # the same count as the per-request statistics


def test_the_exposition_passes_promtool(telemetry, oracle_model_dir):
    """``promtool check metrics`` (Debian's ``prometheus`` package) finds nothing to remark in /metrics with
    the speculation counters in it (named as vLLM's under the ``eyrie_`` prefix: promtool refuses colons),
    and does reject a text that does not parse."""
    import os
    import shutil
    import subprocess

    from shared.config import SpecConfig

    promtool = shutil.which("promtool")
    if promtool is None:
        if os.environ.get("CI"):
            pytest.fail("promtool is missing on CI (.ci/run installs Debian's prometheus package)")
        pytest.skip("promtool is not installed (apt-get install prometheus)")
    engine = Engine(oracle_model_dir / "target", oracle_model_dir / "eagle",
                    EngineConfig(page_size=4, spec=SpecConfig(topk=1, steps=3, num_draft_tokens=4)))
    engine.generate(list(range(3, 12)), SamplingParams(max_new_tokens=12, ignore_eos=True))
    telemetry.observe_load(engine.load())
    status, body = get(f"http://{telemetry.address}/metrics")
    assert status == 200 and b"eyrie_spec_decode_num_accepted_tokens_per_pos_total" in body
    done = subprocess.run([promtool, "check", "metrics"], input=body, capture_output=True, timeout=60)
    assert done.returncode == 0, (done.stdout + done.stderr).decode()
    broken = subprocess.run([promtool, "check", "metrics"], input=body.replace(b"{", b"{{", 1), capture_output=True,
                            timeout=60)
    assert broken.returncode == 1
