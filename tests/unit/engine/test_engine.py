"""Chunked prefill, batching, memory accounting and sampling of the single-process engine."""

from __future__ import annotations

import pytest
import torch

from shared.config import EngineConfig
from shared.engine import Engine
from shared.request import RequestError
from shared.sampling import SamplingParams

PROMPTS = [list(range(3, 24)), [7, 8, 9], [100 + (i * 37) % 300 for i in range(29)], [42] * 10]
GREEDY = SamplingParams(max_new_tokens=8, ignore_eos=True)


def run(model_dir, prompts=PROMPTS, params=GREEDY, **cfg):
    engine = Engine(model_dir / "target", config=EngineConfig(**cfg))
    results = engine.generate(prompts, params)
    assert engine.is_idle_and_clean(), f"leak with {cfg}"
    return results


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """Each prompt alone, whole-prompt prefill, page size 1."""
    return [run(tiny_model_dir, [p], chunk_size=None, page_size=1)[0] for p in PROMPTS]


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("chunk_size", [1, 3, 17, None])
def test_chunked_prefill_matches_whole_prompts(tiny_model_dir, reference, chunk_size, page_size):
    results = run(tiny_model_dir, chunk_size=chunk_size, page_size=page_size)
    for got, want in zip(results, reference):
        assert got.token_ids == want.token_ids
        assert torch.allclose(torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=1e-5)


def test_mixed_prefill_and_decode_batches(tiny_model_dir, reference):
    """A request that arrives while others decode shares their forward (one mixed batch)."""
    engine = Engine(tiny_model_dir / "target", config=EngineConfig(chunk_size=8, page_size=4))
    first = engine.add_request(PROMPTS[1], GREEDY)
    for _ in range(3):
        engine.step()
    assert first.output_ids, "the first request should be decoding"
    late = engine.add_request(PROMPTS[2], GREEDY)
    sched = engine.scheduler
    mixed = False
    while engine.scheduler.has_work():
        decoding = [r for r in sched.running if r.phase.name == "DECODING"]
        prefilling = [r for r in sched.running if r.phase.name == "PREFILLING"] or list(sched.waiting)
        mixed |= bool(decoding) and bool(prefilling)
        engine.step()
    assert mixed, "no step mixed prefill chunks with decode tokens"
    assert engine.result(first).token_ids == reference[1].token_ids
    assert engine.result(late).token_ids == reference[2].token_ids
    assert engine.is_idle_and_clean()


def test_small_pool_queues_instead_of_failing(tiny_model_dir, reference):
    """With room for about one request at a time, the scheduler queues the rest; all finish."""
    results = run(tiny_model_dir, chunk_size=16, page_size=4, num_pages=20, max_running=4)
    assert [r.token_ids for r in results] == [r.token_ids for r in reference]


def test_request_that_can_never_fit_is_rejected(tiny_model_dir):
    engine = Engine(tiny_model_dir / "target", config=EngineConfig(page_size=4, num_pages=8))
    with pytest.raises(RequestError) as err:
        engine.add_request(list(range(3, 40)), SamplingParams(max_new_tokens=8))  # 12 pages > 8
    assert err.value.field == "max_new_tokens"
    assert engine.is_idle_and_clean()


def test_counters_move_and_return(tiny_model_dir):
    engine = Engine(tiny_model_dir / "target", config=EngineConfig(page_size=4, chunk_size=8))
    cache = engine.cache
    total_pages, total_rows = cache.spec.num_pages, cache.req_to_token.num_rows
    req = engine.add_request(PROMPTS[0], GREEDY)
    engine.step()
    assert cache.num_free_pages < total_pages and cache.num_free_rows == total_rows - 1
    engine.run_until_done()
    assert req.finish_reason == "length"
    assert (cache.num_free_pages, cache.num_free_rows) == (total_pages, total_rows)


@pytest.mark.parametrize("when", ["waiting", "mid_prefill", "mid_decode"])
def test_abort_returns_everything(tiny_model_dir, when):
    engine = Engine(tiny_model_dir / "target", config=EngineConfig(page_size=4, chunk_size=8))
    req = engine.add_request(PROMPTS[2], GREEDY)
    other = engine.add_request(PROMPTS[1], GREEDY)
    steps = {"waiting": 0, "mid_prefill": 2, "mid_decode": 9}[when]
    for _ in range(steps):
        engine.step()
    assert (req.phase.name == "DECODING") == (when == "mid_decode")
    assert engine.abort(req.rid)
    assert not engine.abort(req.rid)
    engine.run_until_done()
    assert engine.result(req).finish_reason == "abort"
    assert other.finish_reason == "length"
    assert engine.is_idle_and_clean()


def test_stop_tokens_and_lengths(tiny_model_dir, reference):
    want = reference[0].token_ids
    stop = want[4]
    first = want.index(stop)
    res = run(tiny_model_dir, [PROMPTS[0]], SamplingParams(max_new_tokens=8, stop_token_ids=(stop,)), page_size=4)[0]
    assert res.finish_reason == "stop" and res.token_ids == want[:first + 1]
    res = run(tiny_model_dir, [PROMPTS[0]], SamplingParams(max_new_tokens=3), page_size=4)[0]
    assert res.finish_reason == "length" and res.token_ids == want[:3]


def test_eos_ends_generation_unless_ignored(tmp_path, reference):
    """A checkpoint whose EOS is a token greedy decoding produces stops there."""
    import json
    import shutil

    from shared.model.factory import make_model

    src = tmp_path / "m"

    make_model("tiny", src, seed=0)
    cfg_path = src / "target" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    eos = reference[0].token_ids[5]
    cfg["eos_token_id"] = [eos]
    cfg_path.write_text(json.dumps(cfg))
    res = run(src, [PROMPTS[0]], SamplingParams(max_new_tokens=8), page_size=4)[0]
    assert res.finish_reason == "stop" and res.token_ids[-1] == eos
    assert len(res.token_ids) == reference[0].token_ids.index(eos) + 1
    res = run(src, [PROMPTS[0]], SamplingParams(max_new_tokens=8, ignore_eos=True), page_size=4)[0]
    assert res.token_ids == reference[0].token_ids
    shutil.rmtree(src)


def test_seeded_sampling_is_reproducible_and_top_k_1_is_greedy(tiny_model_dir, reference):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=123, max_new_tokens=8, ignore_eos=True)
    a = run(tiny_model_dir, PROMPTS[:2], params, page_size=4)
    b = run(tiny_model_dir, PROMPTS[:2], params, page_size=16, chunk_size=5)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    other = run(tiny_model_dir, PROMPTS[:2], params.model_copy(update={"seed": 7}), page_size=4)
    assert [r.token_ids for r in other] != [r.token_ids for r in a]
    topk1 = run(tiny_model_dir, PROMPTS[:2], SamplingParams(temperature=0.8, top_k=1, seed=1, max_new_tokens=8,
                                                             ignore_eos=True), page_size=4)
    assert [r.token_ids for r in topk1] == [r.token_ids for r in reference[:2]]


def test_text_in_text_out(tiny_model_dir):
    res = run(tiny_model_dir, ["def main():\n    return 1"], SamplingParams(max_new_tokens=5, ignore_eos=True))[0]
    assert len(res.token_ids) == 5 and isinstance(res.text, str) and res.text
