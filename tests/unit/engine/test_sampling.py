"""Per-request sampling in the engine: seeds, top-k = 1, stop tokens, EOS, max_new_tokens, text."""

from __future__ import annotations

import json
import shutil

import pytest
from engine_checks import GREEDY, PROMPTS, check_pools_full

from shared.config import EngineConfig
from shared.engine import Engine
from shared.sampling import SamplingParams

SAMPLED = SamplingParams(temperature=1.0, top_p=0.9, seed=123, max_new_tokens=8, ignore_eos=True)


def run(model_dir, prompts, params, **cfg):
    engine = Engine(model_dir, config=EngineConfig(**cfg))
    results = engine.generate(prompts, params)
    check_pools_full(engine)
    return results


def tokens(results) -> list[list[int]]:
    return [r.token_ids for r in results]


def test_seeded_sampling_is_reproducible_across_batches_and_layouts(tiny_model_dir):
    target = tiny_model_dir / "target"
    a = run(target, PROMPTS[:2], SAMPLED, page_size=4)
    assert tokens(a) == tokens(run(target, PROMPTS[:2], SAMPLED, page_size=16, chunk_size=5))
    # the same seeded request alone, or after other requests in the batch, draws the same tokens
    alone = run(target, [PROMPTS[1]], SAMPLED, page_size=1)[0]
    crowd = run(target, [PROMPTS[3], PROMPTS[2], PROMPTS[1]], [GREEDY, SAMPLED.model_copy(update={"seed": 9}),
                                                                 SAMPLED], page_size=4, chunk_size=7)
    assert alone.token_ids == a[1].token_ids == crowd[2].token_ids
    assert tokens(run(target, PROMPTS[:2], SAMPLED.model_copy(update={"seed": 7}), page_size=4)) != tokens(a)


def test_sampling_is_not_greedy_and_top_k_1_is(tiny_model_dir, solo_reference):
    target = tiny_model_dir / "target"
    hot = SamplingParams(temperature=1.5, seed=5, max_new_tokens=8, ignore_eos=True)
    assert tokens(run(target, PROMPTS[:2], hot, page_size=4)) != tokens(solo_reference[:2])
    top1 = hot.model_copy(update={"top_k": 1})
    assert tokens(run(target, PROMPTS[:2], top1, page_size=4)) == tokens(solo_reference[:2])
    tiny_p = hot.model_copy(update={"top_p": 1e-6})  # the nucleus is the argmax alone
    assert tokens(run(target, PROMPTS[:2], tiny_p, page_size=4)) == tokens(solo_reference[:2])


def test_greedy_and_sampled_requests_share_a_batch(tiny_model_dir, solo_reference):
    params = [GREEDY, SAMPLED, GREEDY, SAMPLED.model_copy(update={"seed": 1})]
    res = run(tiny_model_dir / "target", PROMPTS, params, page_size=4, chunk_size=9)
    assert res[0].token_ids == solo_reference[0].token_ids and res[2].token_ids == solo_reference[2].token_ids
    assert all(len(r.token_ids) == 8 for r in res)


def test_stop_tokens_end_with_stop(tiny_model_dir, solo_reference):
    target = tiny_model_dir / "target"
    want = solo_reference[0].token_ids
    stop = want[4]
    first = want.index(stop)
    res = run(target, [PROMPTS[0]], SamplingParams(max_new_tokens=8, stop_token_ids=(stop,)), page_size=4)[0]
    assert res.finish_reason == "stop" and res.token_ids == want[:first + 1]
    # of several stop tokens, the first one generated ends it; the stop token is kept in the output
    res = run(target, [PROMPTS[0]], SamplingParams(max_new_tokens=8, stop_token_ids=(want[6], want[2])))[0]
    end = min(want.index(want[6]), want.index(want[2]))
    assert res.finish_reason == "stop" and res.token_ids == want[:end + 1]
    # a stop on the very first token (sampled by the prefill forward) ends it there
    res = run(target, [PROMPTS[0]], SamplingParams(max_new_tokens=8, stop_token_ids=(want[0],)), chunk_size=5)[0]
    assert res.finish_reason == "stop" and res.token_ids == want[:1]


def test_max_new_tokens_ends_with_length(tiny_model_dir, solo_reference):
    target = tiny_model_dir / "target"
    for n in (1, 3):
        res = run(target, PROMPTS[:2], SamplingParams(max_new_tokens=n, ignore_eos=True), page_size=4)
        assert [r.token_ids for r in res] == [w.token_ids[:n] for w in solo_reference[:2]]
        assert all(r.finish_reason == "length" for r in res)


@pytest.fixture(scope="module")
def eos_model(tiny_model_dir, solo_reference, tmp_path_factory):
    """The tiny target with its EOS set to a token greedy decoding of PROMPTS[0] produces (6th)."""
    path = tmp_path_factory.mktemp("eos") / "target"
    shutil.copytree(tiny_model_dir / "target", path)
    cfg = json.loads((path / "config.json").read_text())
    eos = solo_reference[0].token_ids[5]
    cfg["eos_token_id"] = [cfg["eos_token_id"], eos]
    (path / "config.json").write_text(json.dumps(cfg))
    return path, cfg["eos_token_id"]


def test_eos_ends_generation_unless_ignored(eos_model, solo_reference):
    path, eos_ids = eos_model
    want = solo_reference[0].token_ids
    end = min(want.index(t) for t in eos_ids if t in want)
    res = run(path, [PROMPTS[0]], SamplingParams(max_new_tokens=8), page_size=4)[0]
    assert res.finish_reason == "stop" and res.token_ids == want[:end + 1] and end < 7
    res = run(path, [PROMPTS[0]], SamplingParams(max_new_tokens=8, ignore_eos=True), page_size=4)[0]
    assert res.finish_reason == "length" and res.token_ids == want


def test_text_in_text_out(tiny_model_dir):
    engine = Engine(tiny_model_dir / "target", config=EngineConfig())
    prompt = "def main():\n    return 1"
    res = engine.generate(prompt, SamplingParams(max_new_tokens=5, ignore_eos=True))[0]
    assert res.prompt_ids == engine.tokenizer.encode(prompt)
    assert len(res.token_ids) == 5 and res.text == engine.tokenizer.decode(res.token_ids)
    check_pools_full(engine)


def test_target_only_draws_are_keyed_by_position_and_have_the_target_distribution():
    """``sample`` draws row r's token from (seed, position) alone: the same row in another batch, after other
    draws, draws the same token; over many positions one seed's tokens follow the target's probabilities."""
    import torch
    from scipy.stats import chisquare

    from shared.sampling import sample, target_probs

    params = SamplingParams(temperature=0.8, top_k=6, seed=5)
    logits = torch.randn(1, 12, generator=torch.Generator().manual_seed(3)) * 2
    n = 6000
    drawn = sample(logits.expand(n, -1), [params] * n, [params.seed] * n, list(range(n)))
    alone = [int(sample(logits, [params], [params.seed], [p])[0]) for p in (0, 17, n - 1)]
    assert alone == [int(drawn[p]) for p in (0, 17, n - 1)]
    assert not torch.equal(drawn, sample(logits.expand(n, -1), [params] * n, [params.seed + 1] * n, list(range(n))))
    probs = target_probs(logits, [params])[0]
    kept = probs > 0
    assert int(kept.sum()) == 6 and bool(kept[drawn].all())
    counts = torch.bincount(drawn, minlength=12)[kept].double()
    expected = probs[kept].double() / probs[kept].double().sum() * n
    assert chisquare(counts.tolist(), expected.tolist()).pvalue > 1e-4
