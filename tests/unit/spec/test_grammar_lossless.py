"""Structured output under speculation: each tree node's logits are masked with that node's own grammar
state, and greedy speculative output equals greedy target-only output with the same JSON schema.

* The matrix: every draft kind (EAGLE, EAGLE-3, multi-layer), chain and tree, page sizes 1 and 16, on
  the oracle pair (drafts accepted often, so verifies commit runs inside the JSON value), each against
  the target alone with the same schema; the schema really changes the output and every completed
  output parses.
* The trained tiny pair (``models/tiny-pair``, EAGLE-3 only): chain and tree, page sizes 1 and 16, equal to
  the target alone under four schemas; 100 generations against those schemas all parse and validate
  (``jsonschema``), with and without speculation, and greedy outputs are identical; a failover's resumed
  request goes on with the value.
* A negative control: every node masked with the committed state's mask (the classic bug) breaks it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from spec_helpers import PROMPTS, SMALL, Models

from shared.config import EngineConfig, SpecConfig
from shared.engine import Engine
from shared.grammar import Grammar
from shared.model.default_pair import DEFAULT_DIR
from shared.model.tokenizer import Tokenizer
from shared.request import RequestError
from shared.sampling import SamplingParams

# A JSON string the oracle target fills freely: its own argmax is usually allowed, so drafts are accepted
# (in a schema of fixed keys the grammar forces most tokens, and the oracle drafts, which ignore it, miss)
TEXT = json.dumps({"type": "string"})
# (draft kind, topk, steps, nodes, page size): every kind, chain and tree, both page sizes.
CASES = [
    ("eagle", 1, 3, 4, 16), ("eagle", 2, 3, 6, 1),
    ("eagle3", 1, 4, 5, 1), ("eagle3", 2, 3, 6, 16),
    ("mtp", 1, 3, 4, 1), ("mtp", 2, 3, 6, 16),
]


def engine_on(models: Models, kind: str | None = None, topk: int = 1, steps: int = 3, ndt: int = 4,
              **cfg) -> Engine:
    """``Models.engine`` with the checkpoint's tokenizer (structured output needs one)."""
    spec = SpecConfig(topk=topk, steps=steps, num_draft_tokens=ndt) if kind else None
    config = EngineConfig(**{**SMALL, "device": models.device, **cfg, "spec": spec})
    return Engine(models.target, models.drafts[kind] if kind else None, config,
                  tokenizer=Tokenizer(models.root / "target"))


def text_params(schema: str | None = TEXT) -> SamplingParams:
    return SamplingParams(max_new_tokens=16, json_schema=schema)


@pytest.fixture(scope="module")
def oracle_reference(oracle_models: Models) -> list:
    engine = engine_on(oracle_models, page_size=1, chunk_size=None)
    return engine.generate(PROMPTS[:3], text_params())


@pytest.mark.parametrize("kind,topk,steps,ndt,page", CASES, ids=lambda v: str(v))
def test_greedy_with_a_schema_equals_target_only(oracle_models: Models, oracle_reference, kind, topk, steps, ndt,
                                                 page):
    engine = engine_on(oracle_models, kind, topk, steps, ndt, page_size=page, chunk_size=8)
    got = engine.generate(PROMPTS[:3], text_params())
    for g, w in zip(got, oracle_reference, strict=True):
        assert (g.token_ids, g.finish_reason) == (w.token_ids, w.finish_reason)
    assert engine.is_idle_and_clean()
    assert max(g.spec_stats["accept_length"] for g in got) > 1.2  # several tokens per verify: trees were walked


def test_the_schema_shapes_the_output(oracle_models: Models, oracle_reference):
    plain = engine_on(oracle_models, page_size=1, chunk_size=None).generate(PROMPTS[:3], text_params(None))
    assert [w.token_ids for w in oracle_reference] != [p.token_ids for p in plain]
    for w in oracle_reference:
        assert w.text.startswith('"') and len(w.token_ids) > 3
        if w.finish_reason == "stop":  # the value completed: nothing after it
            assert isinstance(json.loads(w.text), str)


def test_negative_control_the_committed_mask_at_every_node_is_caught(oracle_models: Models, oracle_reference,
                                                                    monkeypatch):
    """Masking every tree node with the committed state's mask (not the node's own) changes the output."""
    monkeypatch.setattr(Grammar, "node_states", lambda self, tokens, parents: [self.matcher.deep_copy()
                                                                               for _ in tokens])
    # Fixed: every step verifies a tree (the default's plain steps would not exercise the planted mistake).
    got = engine_on(oracle_models, "eagle3", 2, 3, 6, page_size=16, spec_policy="fixed").generate(PROMPTS[:3],
                                                                                                 text_params())
    assert [g.token_ids for g in got] != [w.token_ids for w in oracle_reference]


# ---- the trained tiny pair: 100 generations that all validate ------------------------------------
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                      "n": {"type": "integer", "minimum": 0, "maximum": 99}},
     "required": ["name", "n"], "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "tag": {"enum": ["red", "green", "blue"]}},
     "required": ["ok", "tag"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1, "maxItems": 3},
    {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                      "path": {"type": "string", "maxLength": 6}},
     "required": ["id", "path"], "additionalProperties": False},
]
WORDS = ["def", "import", "class", "return", "# ", "for", "if", "x =", "self.", "print(", "with", "try:",
         "while", "raise", "from", "lambda", "async", "yield", "assert", "del", "pass", "elif", "open(", "data",
         "name"]
PAIR_PROMPTS = [f"{w}\n" for w in WORDS]  # 25 prompts x 4 schemas = 100 generations


@pytest.fixture(scope="module")
def pair() -> tuple[Path, Path]:
    root = DEFAULT_DIR
    assert (root / "target" / "model.safetensors").exists(), "models/tiny-pair is part of the repository"
    return root / "target", root / "eagle3"


def hundred(engine: Engine) -> list:
    prompts = [p for p in PAIR_PROMPTS for _ in SCHEMAS]
    params = [SamplingParams(max_new_tokens=40, json_schema=json.dumps(s)) for _ in PAIR_PROMPTS for s in SCHEMAS]
    results = []
    for start in range(0, len(prompts), 25):
        results += engine.generate(prompts[start:start + 25], params[start:start + 25])
    assert engine.is_idle_and_clean()
    return results


def test_a_hundred_generations_validate_with_and_without_speculation(pair):
    import jsonschema  # a test dependency: imported here so the module's gpu test needs only llguidance

    config = dict(max_running=25, max_context=96, page_size=16)
    plain = hundred(Engine(pair[0], config=EngineConfig(**config)))
    spec = Engine(pair[0], draft=pair[1], config=EngineConfig(**config, spec=SpecConfig(topk=2, steps=3,
                                                                                      num_draft_tokens=6)))
    got = hundred(spec)
    for i, (g, w) in enumerate(zip(got, plain, strict=True)):
        assert (g.token_ids, g.finish_reason) == (w.token_ids, w.finish_reason), i
        assert g.finish_reason == "stop", (i, g.text)
        jsonschema.validate(json.loads(g.text), SCHEMAS[i % len(SCHEMAS)])
    assert spec.spec_stats.totals.accept_length > 1.1


@pytest.mark.parametrize("topk,steps,ndt,page", [(1, 4, 5, 1), (2, 3, 6, 1), (1, 3, 4, 16)])
def test_trained_pair_greedy_with_schemas_equals_target_only(pair, topk, steps, ndt, page):
    """The trained pair's EAGLE-3 head (real acceptance inside JSON values), chain and tree, page sizes 1
    and 16 (the tree at 16 is the hundred generations' test): equal to the target alone under each schema."""
    prompts = PAIR_PROMPTS[:4]
    params = [SamplingParams(max_new_tokens=40, json_schema=json.dumps(s)) for s in SCHEMAS]
    config = dict(max_running=4, max_context=96, page_size=page, chunk_size=4)
    want = Engine(pair[0], config=EngineConfig(**config)).generate(prompts, params)
    engine = Engine(pair[0], draft=pair[1], config=EngineConfig(**config, spec_policy="fixed", spec=SpecConfig(
        topk=topk, steps=steps, num_draft_tokens=ndt)))  # the shape named, each step (the policy's choice aside)
    got = engine.generate(prompts, params)
    for g, w in zip(got, want, strict=True):
        assert (g.token_ids, g.finish_reason) == (w.token_ids, w.finish_reason)
    assert engine.is_idle_and_clean()
    assert max(g.spec_stats["accept_length"] for g in got) > 1.3

def test_refusals_and_aborts_leave_the_pools_full(oracle_models: Models):
    """Without a tokenizer a schema is refused naming it; a request aborted inside its JSON value gives
    every page back."""
    bare = oracle_models.engine("eagle3", 2, 3, 6)  # built on the module: no tokenizer
    with pytest.raises(RequestError, match="json_schema"):
        bare.add_request(PROMPTS[0], text_params())
    assert bare.is_idle_and_clean()
    engine = engine_on(oracle_models, "eagle3", 2, 3, 6, page_size=16)
    req = engine.add_request(PROMPTS[0], text_params())
    while len(req.output_ids) < 3:
        engine.step()
    assert req.finish_reason is None and engine.abort(req.rid)
    assert engine.is_idle_and_clean()


@pytest.mark.gpu
@pytest.mark.parametrize("kind,topk,steps,ndt", [("eagle3", 2, 3, 6), ("mtp", 1, 3, 4)])
def test_greedy_with_a_schema_equals_target_only_on_the_gpu_with_graphs(oracle_models_cuda: Models, kind, topk,
                                                                        steps, ndt):
    """On CUDA with graphs on (a batch with a schema replays the verify and extend graphs, masked between
    them; one without replays the one graph) and
    drafting ahead (the CUDA default), a request without a schema mixed in: greedy output equals the
    target alone's, request by request."""
    params = [text_params(), text_params(None), text_params()]
    want = engine_on(oracle_models_cuda, page_size=16, chunk_size=None).generate(PROMPTS[:3], params)
    engine = engine_on(oracle_models_cuda, kind, topk, steps, ndt, page_size=16, cuda_graph=True)
    got = engine.generate(PROMPTS[:3], params)
    for g, w in zip(got, want, strict=True):
        assert (g.token_ids, g.finish_reason) == (w.token_ids, w.finish_reason)
    assert engine.is_idle_and_clean()
    alone = engine.generate(PROMPTS[1:2], text_params(None))[0]  # no schema in the batch: graphs replayed
    assert alone.token_ids == want[1].token_ids and engine.speculator.graphs["verify_extend"].captured_sizes


def test_a_failover_resumes_the_value_where_the_client_has_it(pair):
    """Prompt + the output streamed so far, re-sent with ``resumed_tokens``: the grammar consumes those
    first, so the value goes on (greedy: exactly the uninterrupted run's tokens)."""
    engine = Engine(pair[0], draft=pair[1], config=EngineConfig(max_running=4, max_context=96, spec=SpecConfig(
        topk=2, steps=3, num_draft_tokens=6)))
    schema = json.dumps(SCHEMAS[0])
    whole = engine.generate(PAIR_PROMPTS[0], SamplingParams(max_new_tokens=40, json_schema=schema))[0]
    k = 5
    assert whole.finish_reason == "stop" and len(whole.token_ids) > k + 2
    resumed = engine.generate(whole.prompt_ids + whole.token_ids[:k], SamplingParams(
        max_new_tokens=40 - k, json_schema=schema, resumed_tokens=k))[0]
    assert (resumed.token_ids, resumed.finish_reason) == (whole.token_ids[k:], "stop")
    restarted = engine.generate(whole.prompt_ids + whole.token_ids[:k], SamplingParams(
        max_new_tokens=40 - k, json_schema=schema))[0]
    assert restarted.text.startswith("{")  # without it the grammar starts a new value (the bug it prevents)
    assert engine.is_idle_and_clean()
