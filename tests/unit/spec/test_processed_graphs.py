"""A batch with penalties, filters, a grammar or top logprobs keeps the decode step's graphs: the verify
graph's logits are processed and accepted eagerly, then the extend graph runs; the draft launched ahead
serves it too (its rows and masks are built after the commit, at the ahead draft's rows).

* The split path (verify, then ``accept_extend`` with an extend that holds the logits in another dtype,
  as a graph captured on the target's logits does) equals the one-function path field for field.
* On the engine (graphs "on": padded to buckets, run eagerly on the CPU), with drafting ahead and
  requests ending at different steps: the one-graph function is never called, every step goes through
  the verify and extend phases, drafts launched ahead are used (also for only some of their requests),
  and greedy output equals the target alone's, with penalties and with a JSON schema.
* On CUDA (``gpu``): the same batches replay the captured verify and extend graphs (no eager call of any
  verify or extend phase once captured) and equal the target alone's greedy output.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from spec_helpers import PROMPTS, SMALL, Models

from shared.config import EngineConfig, SpecConfig
from shared.engine import Engine
from shared.model.tokenizer import Tokenizer
from shared.sampling import SamplingParams

PENALISED = dict(presence_penalty=1.5, frequency_penalty=2.0, repetition_penalty=1.3, logit_bias=((7, 1.0),),
                 min_tokens=4)
MAX_NEW = [16, 5, 11]  # requests end at different steps: a draft launched ahead then serves only some
SCHEMA = json.dumps({"type": "string"})


def penalised(max_new: int, **extra) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new, ignore_eos=True, stop_token_ids=(25,), **PENALISED, **extra)


def schema_engine(models: Models, kind: str | None = None, **cfg) -> Engine:
    """An engine with the checkpoint's tokenizer (structured output needs one)."""
    spec = SpecConfig(topk=2, steps=3, num_draft_tokens=6) if kind else None
    config = EngineConfig(**{**SMALL, "device": models.device, **cfg, "spec": spec})
    return Engine(models.target, models.drafts[kind] if kind else None, config,
                  tokenizer=Tokenizer(models.root / "target"))


def count_calls(engine: Engine) -> dict[str, int]:
    """Wrap each speculative phase's function (what a graph replay does not call) with a counter."""
    counts = {}
    for name, g in engine.speculator.graphs.items():
        counts[name] = 0

        def counted(*args, _fn=g.fn, _name=name):
            counts[_name] += 1
            return _fn(*args)
        g.fn = counted
    return counts


def assert_same_greedy(got, want, atol: float = 1e-5) -> None:
    """Equal tokens and finish reasons; equal logprobs (those of the processed distribution) and top lists."""
    for g, w in zip(got, want, strict=True):
        assert (g.token_ids, g.finish_reason) == (w.token_ids, w.finish_reason)
        assert torch.allclose(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=atol, rtol=0)
        assert len(g.top_logprobs) == len(w.top_logprobs)
        for a, b in zip(g.top_logprobs, w.top_logprobs):
            assert [t for t, _ in a] == [t for t, _ in b]
            assert torch.allclose(torch.tensor([v for _, v in a]), torch.tensor([v for _, v in b]), atol=atol, rtol=0)


@pytest.mark.parametrize("page", [1, 16])
def test_split_path_with_processing_equals_the_one_function_path(oracle_models: Models, page):
    engine = oracle_models.engine("eagle3", topk=2, steps=3, ndt=6, page_size=page, chunk_size=None,
                                  cuda_graph=True)
    params = [penalised(16, top_logprobs=3), penalised(16, temperature=0.8, min_p=0.1, seed=3),
              SamplingParams(max_new_tokens=16, ignore_eos=True)]
    reqs = [engine.add_request(p, q) for p, q in zip(PROMPTS[:3], params)]
    while len(reqs[0].output_ids) < 4:  # some output: the penalties count something
        engine.step()
    w = engine.speculator
    w._reserve(reqs)  # the pages the step writes
    d = w._draft(reqs)
    assert d.inp.L.shape[0] == 4  # padded to the bucket: a padding row rides along
    rows = w._logits_rows(reqs, d)
    one = w.phases.verify_extend(d.inp, d.tree, rows, 3)
    extended = []

    def extend_in_bf16(inp, tree, acc, logits, feats):  # a graph captured on bf16 logits casts them so
        extended.append(w.phases.extend(inp, tree, acc, logits.to(torch.bfloat16), feats))
        return extended[-1]
    logits, feats = w.graphs["verify"](d.inp, d.tree)
    split = w.phases.accept_extend(d.inp, d.tree, logits, feats, rows, 3, extend=extend_in_bf16)
    for f in dataclasses.fields(one):
        assert torch.equal(getattr(split, f.name), getattr(one, f.name)), f.name
    assert not torch.equal(extended[0].logprobs, one.logprobs)  # the cast matters: the logprobs are read again
    assert int(one.accept_len[:3].max()) > 1
    assert all(engine.abort(r.rid) for r in reqs) and engine.is_idle_and_clean()


@pytest.mark.parametrize("kind,page", [("eagle3", 16), ("mtp", 1)])
def test_penalised_batches_keep_the_phases_and_the_draft_ahead(oracle_models: Models, kind, page):
    params = [penalised(m, top_logprobs=2 if m == 11 else 0) for m in MAX_NEW]
    want = oracle_models.engine(page_size=16, chunk_size=None).generate(PROMPTS[:3], params)
    engine = oracle_models.engine(kind, topk=2, steps=3, ndt=6, page_size=page, chunk_size=None,
                                  cuda_graph=True, spec_draft_ahead=True)
    counts = count_calls(engine)
    assert_same_greedy(engine.generate(PROMPTS[:3], params), want)
    assert engine.is_idle_and_clean()
    ahead = engine.speculator.ahead
    assert ahead.used > 0 and ahead.partial > 0
    assert counts["verify_extend"] == 0 and counts["verify"] == counts["extend"] > 0
    plain = oracle_models.engine(page_size=16, chunk_size=None).generate(
        PROMPTS[:3], [SamplingParams(max_new_tokens=m, ignore_eos=True) for m in MAX_NEW])
    assert [w.token_ids for w in want] != [p.token_ids for p in plain]  # the penalties change the output


def test_a_schema_batch_keeps_the_phases_and_the_draft_ahead(oracle_models: Models):
    params = [SamplingParams(max_new_tokens=m, json_schema=SCHEMA) for m in (16, 6)]
    params.insert(1, SamplingParams(max_new_tokens=9))  # no schema, mixed in
    want = schema_engine(oracle_models, page_size=16, chunk_size=None).generate(PROMPTS[:3], params)
    engine = schema_engine(oracle_models, "eagle3", page_size=16, chunk_size=None, cuda_graph=True,
                           spec_draft_ahead=True)
    counts = count_calls(engine)
    assert_same_greedy(engine.generate(PROMPTS[:3], params), want)
    assert engine.is_idle_and_clean()
    assert engine.speculator.ahead.used > 0
    assert counts["verify_extend"] == 0 and counts["verify"] == counts["extend"] > 0
    assert want[0].text.startswith('"')  # the schema really applied


@pytest.mark.gpu
@pytest.mark.parametrize("feature", ["penalties", "schema", "top_logprobs"])
def test_processed_batches_replay_the_graphs_on_the_gpu(oracle_models_cuda: Models, feature):
    """After capture, a penalised, schema-constrained or top-logprobs batch (a plain request mixed in)
    calls no verify or extend phase eagerly: every step replays the graphs; greedy output equals the
    target alone's, and the draft launched ahead (the CUDA default) is used."""
    models = oracle_models_cuda
    special = {"penalties": penalised(16), "schema": SamplingParams(max_new_tokens=16, json_schema=SCHEMA),
               "top_logprobs": SamplingParams(max_new_tokens=16, ignore_eos=True, top_logprobs=5)}[feature]
    params = [special, SamplingParams(max_new_tokens=9, ignore_eos=True), special]
    want = schema_engine(models, page_size=16, chunk_size=None).generate(PROMPTS[:3], params)
    engine = schema_engine(models, "eagle3", page_size=16, cuda_graph=True)
    assert engine.capture_graphs() > 0
    counts = count_calls(engine)
    got = engine.generate(PROMPTS[:3], params)
    assert_same_greedy(got, want, atol=1e-4)
    assert engine.is_idle_and_clean()
    assert counts == {name: 0 for name in counts}, counts  # no eager phase: all replayed
    assert engine.speculator.ahead.used > 0
    assert max(g.spec_stats["accept_length"] for g in got) > 1.2
