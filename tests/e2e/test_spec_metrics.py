"""A served decode instance's /metrics says what its speculation policy ran: decode steps per kind (each tree
shape, and plain) and vLLM's speculation counters by shape; ``eyrie up`` names the kind it ran most from them.

The stack runs the defaults with a draft: the adaptive policy over the shapes of the default tree (topk 4, 4
steps, 16 tokens). One request at a time, so each speculative step verifies one draft."""

from __future__ import annotations

import re
import types
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.launch import report_policies
from tests.e2e.conftest import start_stack
from tests.polling import poll

SHAPES = {"tree-k4-s4-n16": 4, "tree-k4-s4-n8": 4, "chain3": 3, "chain2": 2, "chain1": 1}  # name -> draft steps


@pytest.fixture(scope="module")
def stack(redis_url, tiny_model_dir):
    s = start_stack(redis_url, tiny_model_dir, "eagle3", page_size=4, chunk_size=8)
    yield s
    s.stop()


def series(address: str) -> dict[tuple[str, tuple], float]:
    """Every ``eyrie_spec_decode_num_*`` sample of the instance, by name and labels (model and role dropped)."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("model_name", "role")))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples
            if s.name.startswith("eyrie_spec_decode_num_")}


def steps(m: dict) -> dict[str, float]:
    return {dict(labels)["shape"]: v for (name, labels), v in m.items() if name == "eyrie_spec_decode_num_steps_total"}


def by_shape(m: dict, name: str) -> dict[str, float]:
    return {dict(labels)["shape"]: v for (n, labels), v in m.items() if n == name}


def test_the_decode_instance_exports_steps_and_acceptance_per_shape(stack, capsys):
    decode = stack.decodes[0]
    engine = decode.engine_loop.engine
    assert engine.spec_policy.kind == "adaptive" and set(engine.speculator.shapes) == set(SHAPES)
    before = series(decode.http_address)
    assert steps(before) == {**{s: 0 for s in SHAPES}, "plain": 0}  # every kind's series, before any request
    assert by_shape(before, "eyrie_spec_decode_num_drafts_total") == {s: 0 for s in SHAPES}
    warm = engine.spec_policy.steps_by_kind()  # the warm-up's steps: not counted in /metrics
    for first in (30, 60):
        stack.generate(list(range(first, first + 20)), max_new_tokens=12, ignore_eos=True)
    want = {k: n - warm[k] for k, n in engine.spec_policy.steps_by_kind().items()}
    poll(lambda: steps(series(decode.http_address)) == want, 30, "/metrics' steps per kind never matched the engine's")
    m = series(decode.http_address)
    assert sum(want.values()) >= 2 * 11 / (1 + max(SHAPES.values()))  # 22 tokens after the first two, decoded
    drafts = by_shape(m, "eyrie_spec_decode_num_drafts_total")
    assert drafts == {s: want[s] for s in SHAPES}  # one request at a time: one draft per speculative step
    draft_tokens = by_shape(m, "eyrie_spec_decode_num_draft_tokens_total")
    accepted = by_shape(m, "eyrie_spec_decode_num_accepted_tokens_total")
    for shape, depth in SHAPES.items():
        assert draft_tokens[shape] == depth * drafts[shape]
        per_pos = {dict(labels)["position"]: v for (n, labels), v in m.items()
                   if n == "eyrie_spec_decode_num_accepted_tokens_per_pos_total" and dict(labels)["shape"] == shape}
        assert set(per_pos) == {str(i) for i in range(depth)}  # the shape's own positions
        assert accepted[shape] == sum(per_pos.values()) <= draft_tokens[shape]
    # eyrie up's report: the kind with the most steps, read from the same series.
    report_policies(types.SimpleNamespace(names=["router", "prefill", "decode"], env={},
                                          http={"decode": decode.http_address}))
    line = capsys.readouterr().err.strip()
    said = re.fullmatch(r"eyrie up: \[decode's speculation policy ran (\S+) most: (\d+) of (\d+) decode steps.*\]",
                        line)
    assert said is not None, line
    assert want[said[1]] == int(said[2]) == max(want.values()) and int(said[3]) == sum(want.values()), line
