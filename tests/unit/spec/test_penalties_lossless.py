"""Penalties and filters under speculation: each tree node's logits are processed with the counts of
that node's own prefix, and greedy speculative output equals greedy target-only output with the same
feature, token for token.

* ``process_logits`` over a whole tree equals, node by node, the same function applied to one node
  whose committed output is the request's plus the node's path (the target-only rule), for every
  feature at once, with repeated tokens on the paths.
* The engine: a representative subset of (feature x draft kind x chain/tree x page size) on the oracle
  pair (drafts accepted often, so a verify commits several tokens), each against the target alone
  with the same parameters; every feature also changes the output (it is really applied).
"""

from __future__ import annotations

import pytest
import torch
from spec_helpers import PROMPTS, Models

from kernels.spec_kernels import ancestor_mask
from shared.logits_process import logits_rows, process_logits
from shared.sampling import SamplingParams

V = 12
REPEATS = [5, 17, 99, 3, 250, 41, 7, 8]  # the oracle target's greedy output after it repeats one token


def test_each_tree_node_is_processed_with_its_own_prefix():
    g = torch.Generator().manual_seed(3)
    parents = torch.tensor([[-1, 0, 0, 1, 1, 3], [-1, 0, 1, 2, 0, 4]])
    tokens = torch.tensor([[4, 7, 4, 7, 2, 7], [1, 1, 3, 1, 5, 1]])  # repeats along paths
    depths = torch.tensor([[0, 1, 1, 2, 2, 3], [0, 1, 2, 3, 1, 2]])
    mask = ancestor_mask(parents, 3)
    logits = torch.randn(2, 6, V, generator=g) * 3
    prompts, outputs = [[1, 2, 3], [9, 9]], [[7, 4], [1, 5, 5]]
    params = [SamplingParams(presence_penalty=0.7, frequency_penalty=0.9, repetition_penalty=1.6, min_tokens=5,
                             stop_token_ids=(2,), logit_bias=((7, 1.5), (3, -2.0)), max_new_tokens=9),
              SamplingParams(temperature=0.8, min_p=0.2, repetition_penalty=0.7, frequency_penalty=-0.5,
                             allowed_token_ids=(1, 3, 5, 6, 9), max_new_tokens=9)]
    rows = logits_rows(prompts, outputs, params, [(0,), (0,)], V, 2, "cpu")
    got = process_logits(logits, rows, tokens, mask, depths)
    for b in range(2):
        for n in range(6):
            path = [m for m in range(1, 6) if mask[b, n, m]]  # ancestors below the root, and n itself
            out = outputs[b] + tokens[b, path].tolist()
            one = logits_rows([prompts[b]], [out], [params[b]], [(0,)], V, 1, "cpu")
            want = process_logits(logits[b, n].view(1, 1, V), one)[0, 0]
            assert torch.equal(got[b, n], want), (b, n)
    assert (got[0, 0, 2] == float("-inf")) and (got[0, 0, 0] == float("-inf"))  # min_tokens masks stop and EOS


FEATURES = {  # strong enough to change the tiny model's greedy output
    "presence_frequency": dict(presence_penalty=1.5, frequency_penalty=2.0),
    "frequency_on_repeats": dict(frequency_penalty=0.3),  # with REPEATS: a run repeats a token
    "repetition": dict(repetition_penalty=3.0),
    "logit_bias_allowed": dict(logit_bias=((7, 1.0), (100, 0.5)), allowed_token_ids=tuple(t for t in range(400)
                                                                                          if t % 9 != 4)),
    "min_tokens": dict(min_tokens=12),
}
# (feature, draft kind, topk, steps, nodes, page size): every feature, kind, shape and page size appears.
CASES = [
    ("presence_frequency", "eagle3", 2, 3, 6, 1),
    ("frequency_on_repeats", "eagle3", 2, 3, 6, 16),
    ("presence_frequency", "eagle", 1, 3, 4, 16),
    ("repetition", "mtp", 2, 3, 6, 16),
    ("repetition", "eagle3", 1, 4, 5, 1),
    ("logit_bias_allowed", "eagle", 2, 3, 6, 1),
    ("logit_bias_allowed", "mtp", 1, 3, 4, 16),
    ("min_tokens", "eagle3", 2, 3, 6, 16),
    ("min_tokens", "eagle", 1, 3, 4, 1),
]


def params_for(feature: str | None) -> SamplingParams:
    """The feature's parameters (None: without it); token 25, early in the outputs, is a stop token id."""
    return SamplingParams(max_new_tokens=16, ignore_eos=True, stop_token_ids=(25,), **FEATURES.get(feature, {}))


@pytest.mark.parametrize("feature,kind,topk,steps,ndt,page", CASES, ids=lambda v: str(v))
def test_greedy_with_the_feature_equals_target_only(oracle_models: Models, feature, kind, topk, steps, ndt, page):
    params = params_for(feature)
    prompts = [REPEATS, *PROMPTS[:2]] if feature == "frequency_on_repeats" else PROMPTS[:3]
    want = oracle_models.engine(page_size=page, chunk_size=None).generate(prompts, params)
    engine = oracle_models.fixed(kind, topk=topk, steps=steps, ndt=ndt, page_size=page, chunk_size=8)
    got = engine.generate(prompts, params)
    for g, w in zip(got, want, strict=True):
        assert (g.token_ids, g.finish_reason) == (w.token_ids, w.finish_reason)
    assert engine.is_idle_and_clean()
    assert max(g.spec_stats["accept_length"] for g in got) > 1.2  # several tokens per verify: trees were walked
    plain = oracle_models.reference(prompts, params_for(None))
    assert [w.token_ids for w in want] != [p.token_ids for p in plain]  # the feature changes the output


def test_min_tokens_holds_back_eos_and_stop_ids(oracle_models: Models):
    plain = oracle_models.reference(PROMPTS[:1], SamplingParams(max_new_tokens=16, ignore_eos=True))[0]
    stop = plain.token_ids[2]
    engine = oracle_models.engine("eagle3", topk=2, steps=3, ndt=6)
    short = engine.generate(PROMPTS[:1], SamplingParams(max_new_tokens=16, ignore_eos=True, stop_token_ids=(stop,)))
    held = engine.generate(PROMPTS[:1], SamplingParams(max_new_tokens=16, ignore_eos=True, stop_token_ids=(stop,),
                                                       min_tokens=10))
    assert len(short[0].token_ids) == 3 and len(held[0].token_ids) >= 10
    assert stop not in held[0].token_ids[:9]


def test_negative_control_counting_only_the_committed_tokens_is_caught(oracle_models: Models, monkeypatch):
    """The classic bug (every node penalised with the counts before the step) breaks losslessness."""
    import shared.logits_process as lp

    prompts = [REPEATS, PROMPTS[0]]  # the first one's output repeats a token, so a run holds it twice
    params = SamplingParams(max_new_tokens=24, ignore_eos=True, frequency_penalty=0.3)
    want = oracle_models.engine(page_size=1, chunk_size=None).generate(prompts, params)
    monkeypatch.setattr(lp, "_tree_prefix", lambda out, *args: out)
    got = oracle_models.engine("eagle3", topk=2, steps=3, ndt=6, page_size=1).generate(prompts, params)
    assert [g.token_ids for g in got] != [w.token_ids for w in want]


@pytest.mark.gpu
@pytest.mark.parametrize("feature", ["frequency_on_repeats", "repetition", "logit_bias_allowed", "min_tokens"])
def test_greedy_with_the_feature_equals_target_only_on_the_gpu_with_graphs(oracle_models_cuda: Models, feature):
    """The device path on CUDA (graphs on: a batch with a penalised request replays the verify and extend
    graphs, processed between them; one without replays the one graph), a request without the feature
    mixed in; greedy output equals the target alone's."""
    prompts = [REPEATS, *PROMPTS[:2]] if feature == "frequency_on_repeats" else PROMPTS[:3]
    params = [params_for(feature), params_for(None), params_for(feature)]
    want = oracle_models_cuda.engine(page_size=16, chunk_size=None).generate(prompts, params)
    engine = oracle_models_cuda.engine("eagle3", topk=2, steps=3, ndt=6, page_size=16, cuda_graph=True)
    got = engine.generate(prompts, params)
    for g, w in zip(got, want, strict=True):
        assert (g.token_ids, g.finish_reason) == (w.token_ids, w.finish_reason)
    assert engine.is_idle_and_clean()
