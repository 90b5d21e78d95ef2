"""Chunked prefill and continuous batching change nothing: chunk size x page size x batch composition.

The reference is each prompt run alone with its whole prompt in one forward at page size 1
(``solo_reference``). Every configuration must give the same tokens, and the same logits (every
row sampled from, full vocabulary) to float32 noise.
"""

from __future__ import annotations

import pytest
import torch
from engine_checks import GREEDY, PROMPTS, check_pools_full, record_logits, record_plans

from shared.config import EngineConfig
from shared.engine import Engine


@pytest.fixture(scope="module")
def solo_logits(tiny_model_dir):
    """Every logits row each prompt samples from when run alone, whole prompt, page size 1."""
    engine = Engine(tiny_model_dir / "target", config=EngineConfig(chunk_size=None, page_size=1))
    rows = []
    for p in PROMPTS:
        seen = record_logits(engine)
        req = engine.generate([p], GREEDY)[0]
        rows.append(torch.stack(seen[req.rid]))
    return rows


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("chunk_size", [1, 3, 17, None])
def test_chunked_prefill_matches_whole_prompts(tiny_model_dir, solo_reference, solo_logits, chunk_size, page_size):
    """All four prompts in one batch, prefilled ``chunk_size`` tokens per step, equal each prompt alone."""
    engine = Engine(tiny_model_dir / "target", config=EngineConfig(chunk_size=chunk_size, page_size=page_size))
    seen = record_logits(engine)
    plans = record_plans(engine)
    results = engine.generate(PROMPTS, GREEDY)
    check_pools_full(engine)
    if chunk_size is not None:  # the prompts really were cut: no step prefilled more than chunk_size tokens
        assert max(sum(chunks) for _, chunks, _ in plans) == chunk_size
        assert sum(len(chunks) for _, chunks, _ in plans) >= sum(-(-len(p) // chunk_size) for p in PROMPTS)
    for got, want, want_logits in zip(results, solo_reference, solo_logits):
        assert got.token_ids == want.token_ids
        assert got.finish_reason == "length"
        assert torch.allclose(torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=1e-5, rtol=0)
        got_logits = torch.stack(seen[got.rid])
        assert got_logits.shape == want_logits.shape == (8, 512)
        assert (got_logits - want_logits).abs().max().item() <= 1e-4


def test_mixed_prefill_and_decode_in_one_forward(tiny_model_dir, solo_reference):
    """A request arriving while another decodes is prefilled in the same forward as the decode token."""
    engine = Engine(tiny_model_dir / "target", config=EngineConfig(chunk_size=8, page_size=4))
    forwards: list[int] = []
    hook = engine.model.register_forward_hook(lambda _m, args, _out: forwards.append(args[0].num_tokens))
    first = engine.add_request(PROMPTS[1], GREEDY)
    for _ in range(3):
        engine.step()
    assert first.stage.name == "DECODING" and len(first.output_ids) == 3
    plans = record_plans(engine)
    seen_before = len(forwards)
    late = engine.add_request(PROMPTS[2], GREEDY)  # 29 tokens: four chunks of at most 8
    engine.run_until_done()
    hook.remove()
    forwards = forwards[seen_before:]
    assert len(forwards) == len(plans), "one forward per step"
    mixed = [(d, c, n) for (d, c, _), n in zip(plans, forwards) if d and c]
    assert len(mixed) >= 4, f"expected every chunk of the late prompt to ride with a decode token: {plans}"
    for decode, chunks, tokens in mixed:
        assert tokens == decode + sum(chunks)
    assert engine.result(first).token_ids == solo_reference[1].token_ids
    assert engine.result(late).token_ids == solo_reference[2].token_ids
    check_pools_full(engine)


def test_batch_order_and_arrival_time_do_not_matter(tiny_model_dir, solo_reference):
    """Prompts submitted in reverse, one every other step, still give each prompt's solo output."""
    engine = Engine(tiny_model_dir / "target", config=EngineConfig(chunk_size=5, page_size=4))
    reqs = {}
    for i in reversed(range(len(PROMPTS))):
        reqs[i] = engine.add_request(PROMPTS[i], GREEDY)
        engine.step()
        engine.step()
    engine.run_until_done()
    for i, req in reqs.items():
        assert engine.result(req).token_ids == solo_reference[i].token_ids
    check_pools_full(engine)


def test_starts_next_says_whether_the_next_step_runs_a_waiting_requests_first_chunk(tiny_model_dir):
    """What the prefill service asks before starting a request's hand-off on arrival: a request behind a long
    prompt starts only once that prompt leaves room in a step's chunk budget, and the answer says so."""
    engine = Engine(tiny_model_dir / "target", config=EngineConfig(chunk_size=8, page_size=4), role="prefill")
    long = engine.add_request(list(range(3, 23)), GREEDY)  # 20 tokens: chunks of 8, 8, 4
    assert engine.starts_next(long)
    short = engine.add_request(list(range(5, 9)), GREEDY)
    said, ran = [], []
    while short.kv_len == 0:
        said.append(engine.starts_next(short))
        engine.step()
        ran.append(short.kv_len > 0)
    assert said == ran == [False, False, True]
    for req in (long, short):  # prefill role: parked for their hand-offs, which this test does not make
        engine.release(req, "abort")
