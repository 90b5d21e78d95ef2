"""A decode engine's prefix cache and the hand-off (issue 33, item 3, the decode half): a hand-off's Reserve takes
the pages of the prompt the decode engine holds already (whole pages, keyed with the successor token under a draft,
never the one holding the last position), the sender skips them (the wire format, or ipc's in-place copies), the
received prompt pages join the decode engine's cache at activation, and the output equals the single-process
engine's token for token (greedy and seeded sampling; no draft, EAGLE and EAGLE-3, chain and tree), with the K/V
at every position of every cache equal to the prefill engine's, and every pool full again after. A failover's
resume through warm caches (the prefill takes the prompt's cached pages, the hand-off skips the decode side's)
continues exactly as the uninterrupted stream."""

from __future__ import annotations

import time

import pytest
import torch
from handoff_helpers import (
    engine_config,
    load_models,
    make_engine,
    positions_kv,
    prefill_until_handoff,
    smallest_chunk_bytes,
)

from proto.eyrie.v1 import eyrie_pb2 as pb
from services.prefill.server import held_pages
from shared.engine import Engine
from shared.handoff import PageGuard, PageSource, TransferError, decode_draft_state, encode_draft_state, iter_chunks
from shared.handoff.ipc import write_in_place
from shared.request import Request, Stage
from shared.sampling import SamplingParams

PAGE = 4
SHARED = [(i * 29 + 3) % 500 for i in range(22)]  # five whole pages and two tokens
FIRST = SHARED + [7, 8, 9, 10, 11]
SECOND = SHARED + [40, 41, 42]  # diverges inside page 5: pages 0-4 held
ALIGNED = SHARED + [7, 8]  # six whole pages: the last one holds its last position
GREEDY = SamplingParams(max_new_tokens=12, ignore_eos=True)
SEEDED = SamplingParams(max_new_tokens=12, ignore_eos=True, temperature=0.9, top_p=0.95, seed=1234)
CASES = [(None, 1), ("eagle3", 1), ("eagle3", 4), ("eagle", 1), ("eagle", 4), ("mtp", 1), ("mtp", 4)]


@pytest.fixture(scope="module")
def models(oracle_model_dir):
    return load_models(oracle_model_dir)


def hand_off_cached(prefill: Engine, req: Request, decode: Engine, transport: str) -> tuple[Request, int, int]:
    """``req`` (parked on ``prefill``) to ``decode`` with its cache: the reservation takes the cached pages, the
    sender skips them; the decode side's request (activated), the pages it held and the K/V bytes that travelled."""
    moved = decode.reserve_handoff(req.rid, req.prompt_ids, req.output_ids, req.output_logprobs, req.params,
                                   req.kv_len, cached=True)
    assert moved is not None, "the decode engine refused the request"
    sink = decode.page_sink(moved, PageGuard(), in_place=transport == "ipc")
    assert sink.held == len(moved.prefix_pages)
    source = PageSource(req.rid, prefill.scheduler.caches, prefill.scheduler.page_ids(req), encode_draft_state(req),
                        held=sink.held)
    if transport == "ipc":
        sent = write_in_place(source, decode.kv_pools(), decode.scheduler.page_ids(moved), time.monotonic() + 60).bytes
        blob = source.draft_state
    else:
        last = None
        for chunk in iter_chunks(source, smallest_chunk_bytes(prefill)):
            sink.write(chunk)
            last = chunk
        received = sink.finish(last)
        sent, blob = received.bytes - len(received.draft_state), received.draft_state
    state = decode_draft_state(blob, decode.handoff_schema(), req.kv_len, decode.device)
    assert decode.activate_handoff(moved, req.kv_len, state)
    return moved, sink.held, sent


def disaggregated(models, draft, topk, params, prompts, transport="wire", cache=True):
    """Each prompt prefilled on one engine and handed to a decode engine (its cache on with ``cache``), one after
    the other, each decoded to its end before the next: per prompt, (its tokens, the cached pages its hand-off
    took, the K/V bytes sent, whether the K/V of every committed position arrived equal to the prefill's)."""
    prefill = make_engine(models, draft, engine_config(draft, topk, page_size=PAGE), role="prefill")
    decode = make_engine(models, draft, engine_config(draft, topk, page_size=PAGE, prefix_cache=cache), role="decode")
    out = []
    for prompt in prompts:
        (req,) = prefill_until_handoff(prefill, [prompt], params)
        moved, held, sent = hand_off_cached(prefill, req, decode, transport)
        before, after = positions_kv(prefill, req, req.kv_len), positions_kv(decode, moved, req.kv_len)
        intact = all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(before, after))
        assert prefill.release(req)
        decode.run_until_done()
        out.append((decode.result(moved).token_ids, held, sent, intact))
    assert prefill.is_idle_and_clean(), "the prefill engine kept pages"
    assert decode.scheduler.prefix_cache is None or decode.scheduler.prefix_cache.referenced() == 0
    decode.flush_prefix_cache()
    assert decode.is_idle_and_clean(), "the decode engine kept pages after its requests and its cache"
    return out


def single_process(models, draft, topk, params, prompts) -> list[list[int]]:
    engine = make_engine(models, draft, engine_config(draft, topk, page_size=PAGE))
    return [engine.generate([p], params)[0].token_ids for p in prompts]


@pytest.mark.parametrize("draft,topk", CASES)
def test_a_warm_decode_cache_skips_the_pages_it_holds(models, draft, topk):
    cold = disaggregated(models, draft, topk, GREEDY, [SECOND], cache=False)[0]
    warm = disaggregated(models, draft, topk, GREEDY, [FIRST, SECOND])
    engine = make_engine(models, draft, engine_config(draft, topk, page_size=PAGE))
    aligned_out = engine.generate([ALIGNED], GREEDY)[0].token_ids
    turn = ALIGNED + aligned_out + [99, 98, 97]  # a multi-turn prompt: its first turn's prompt and answer
    again = disaggregated(models, draft, topk, GREEDY, [ALIGNED, turn])
    want = [engine.generate([p], GREEDY)[0].token_ids for p in (FIRST, SECOND, turn)]
    assert [w[0] for w in warm] == want[:2] and [a[0] for a in again] == [aligned_out, want[2]]
    assert cold[1] == 0 and warm[0][1] == 0, "a cold decode cache held pages"
    assert warm[1][1] == len(SHARED) // PAGE, "the second hand-off did not take the shared pages"
    pages = -(-len(SECOND) // PAGE)  # every page carries as many bytes: only the pages not held travelled
    assert warm[1][2] * pages == cold[2] * (pages - warm[1][1]) and warm[1][2] > 0
    # the first turn's 6 pages arrived (the last one holds its last position: with a draft, keyed by the first
    # token it drew, on which the draft's K/V there depends), were cached at activation, and the second turn holds them
    assert again[1][1] == len(ALIGNED) // PAGE
    assert all(w[3] for w in warm + again + [cold]), "the K/V on the decode side differs from the prefill's"


@pytest.mark.parametrize("transport", ["wire", "ipc"])
def test_seeded_sampling_through_a_warm_decode_cache(models, transport):
    out = disaggregated(models, "eagle3", 4, SEEDED, [FIRST, SECOND], transport)
    assert [o[0] for o in out] == single_process(models, "eagle3", 4, SEEDED, [FIRST, SECOND])
    assert out[1][1] == len(SHARED) // PAGE and all(o[3] for o in out)
    cold = disaggregated(models, "eagle3", 4, SEEDED, [SECOND], transport, cache=False)[0]
    assert out[1][2] < cold[2], "the in-place hand-off wrote the held pages too"


def test_cache_off_sends_every_page(models):
    """A decode engine without a cache (or a sender that does not skip) takes no cached page: every page goes."""
    out = disaggregated(models, "eagle3", 1, GREEDY, [FIRST, SECOND], cache=False)
    cold = disaggregated(models, "eagle3", 1, GREEDY, [SECOND], cache=False)[0]
    assert out[1][1] == 0 and out[1][2] == cold[2]


def test_an_aborted_hand_off_gives_its_cached_pages_back_to_the_cache(models):
    """A reservation holding cached pages, aborted before its pages came: the cache keeps them (no request holds
    them any more, so they are evictable) and a flush leaves every pool full."""
    prefill = make_engine(models, "eagle3", engine_config("eagle3", 1, page_size=PAGE), role="prefill")
    decode = make_engine(models, "eagle3", engine_config("eagle3", 1, page_size=PAGE, prefix_cache=True), role="decode")
    (req,) = prefill_until_handoff(prefill, [FIRST], GREEDY)
    hand_off_cached(prefill, req, decode, "wire")
    assert prefill.release(req)
    decode.run_until_done()
    pc = decode.prefix_cache
    cached, free = len(pc), decode.cache.num_free_pages
    moved = decode.reserve_handoff("b", SECOND, [], [], GREEDY, len(SECOND), cached=True)
    assert len(moved.prefix_pages) == len(SHARED) // PAGE and pc.referenced() == len(SHARED) // PAGE
    # the held pages left the free count (they were evictable), and so did the 2 pages of its own
    assert decode.cache.num_free_pages == free - len(SHARED) // PAGE - 2
    assert decode.release(moved, "abort")
    assert (len(pc), pc.referenced(), decode.cache.num_free_pages) == (cached, 0, free)
    assert decode.flush_prefix_cache() == cached and decode.is_idle_and_clean()


def test_the_sender_refuses_a_decode_side_claiming_the_last_position():
    """A Reserve reply whose held pages would cover the position the prefill computes last (a faulty or foreign
    decode instance) fails the hand-off with a clear error rather than leaving that position unsent."""
    reserve = pb.ReserveRequest(committed_len=9)
    assert held_pages(pb.ReserveResponse(cached_pages=2), reserve, PAGE) == 2
    assert held_pages(pb.ReserveResponse(), reserve, PAGE) == 0  # an older decode instance: every page
    with pytest.raises(TransferError, match="cannot hold the last one"):
        held_pages(pb.ReserveResponse(cached_pages=3), reserve, PAGE)


@pytest.mark.parametrize("draft,topk", [(None, 1), ("eagle3", 4), ("mtp", 1)])
def test_a_failover_resume_through_warm_caches_continues_as_if_uninterrupted(models, draft, topk):
    """A failover's resume (``tests/unit/handoff/test_resume.py``) with both caches warm: the request ran once
    through a prefill and a decode engine, each with its prefix cache on; resumed after a decode step (the
    prompt and the client's tokens prefilled again on that prefill engine, handed to that decode engine), the
    prefill takes the prompt's cached pages and samples nothing, the hand-off skips the pages the decode engine
    holds, and the resumed stream continues exactly as the uninterrupted one (seeded sampling: tokens and
    logprobs); both engines' pools are full again after, the caches holding nothing a request references."""
    config = dict(page_size=PAGE, prefix_cache=True, max_context=512)
    prefill = make_engine(models, draft, engine_config(draft, topk, **config), role="prefill")
    decode = make_engine(models, draft, engine_config(draft, topk, **config), role="decode")
    (req,) = prefill_until_handoff(prefill, [FIRST], SEEDED)
    first, held, _ = hand_off_cached(prefill, req, decode, "wire")
    assert held == 0 and prefill.release(req)
    ends = [len(first.output_ids)]  # where a decode step ended: where a client's stream can break
    while decode.scheduler.has_work():
        decode.step()
        if len(first.output_ids) != ends[-1]:
            ends.append(len(first.output_ids))
    tokens, logprobs = first.output_ids, first.output_logprobs
    assert len(tokens) == SEEDED.max_new_tokens and len(ends) > 3
    k = ends[len(ends) // 2]
    resumed = prefill.add_request(FIRST, SEEDED, rid="resumed", output_ids=tokens[:k], output_logprobs=logprobs[:k])
    while resumed.stage is not Stage.HANDOFF:
        assert not any(t for _, t in prefill.step()), "a resumed prefill samples nothing"
    assert resumed.kv_len == len(FIRST) + k - 1
    assert resumed.cached_tokens == len(FIRST) // PAGE * PAGE  # the prompt's whole pages (its tail page is not full)
    moved, held, _ = hand_off_cached(prefill, resumed, decode, "wire")
    assert held == (len(FIRST) - 1) // PAGE, "the resumed hand-off did not skip the prompt pages the decode held"
    assert prefill.release(resumed)
    decode.run_until_done()
    assert moved.output_ids == tokens
    assert moved.output_logprobs[k:] == pytest.approx(logprobs[k:], abs=1e-4)
    for engine in (prefill, decode):
        assert engine.prefix_cache.referenced() == 0 and len(engine.prefix_cache) > 0
        assert engine.is_idle_and_clean()
        engine.flush_prefix_cache()
        assert all(c.allocator.num_free == c.layout.num_pages for c in engine.scheduler.caches)
