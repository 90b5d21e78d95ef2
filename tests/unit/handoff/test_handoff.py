"""The hand-off wire format and the engine-to-engine resume, without gRPC."""

from __future__ import annotations

import pytest
import torch

from shared.config import EngineConfig, SpecConfig
from shared.engine import Engine
from shared.handoff import (
    ChunkWriter,
    SchemaMismatch,
    TransferError,
    check_schema,
    coalesce,
    engine_schema,
    iter_chunks,
)
from shared.sampling import SamplingParams
from shared.spec.state import DraftState

PROMPT = [(i * 13 + 5) % 500 for i in range(23)]
PARAMS = SamplingParams(max_new_tokens=12, ignore_eos=True)


def pair(model_dir, draft, page_size=4, topk=1, decode_overrides=None):
    spec = SpecConfig(topk=topk, steps=3, num_draft_tokens=4 if topk == 1 else 8) if draft else None
    cfg = EngineConfig(page_size=page_size, chunk_size=8, spec=spec)
    d = model_dir / draft if draft else None
    prefill = Engine(model_dir / "target", d, cfg, role="prefill")
    decode = Engine(model_dir / "target", d, cfg.model_copy(update=decode_overrides or {}), role="decode")
    return prefill, decode


def prefill_once(engine: Engine, prompt=PROMPT, params=PARAMS):
    req = engine.add_request(prompt, params, rid="r")
    while not engine.take_handoffs():
        engine.step()
    return req


def hand_off(prefill: Engine, decode: Engine, req, chunk_bytes=4 << 20, corrupt=None):
    state = req.draft_state
    got = decode.reserve_handoff("r", req.prompt_ids, req.output_ids, req.output_logprobs, req.params, req.kv_len)
    assert got is not None
    chunks = list(iter_chunks("r", prefill.scheduler.caches, prefill.page_ids(req),
                              state.to_bytes() if state else b"", chunk_bytes))
    if corrupt is not None:
        corrupt(chunks)
    writer = ChunkWriter(decode.scheduler.caches, decode.page_ids(got))
    for c in chunks:
        writer.write(c)
    writer.finish(chunks[-1])
    st = DraftState.from_bytes(chunks[-1].draft_state) if chunks[-1].draft_state else None
    decode.activate_handoff(got, req.kv_len, st)
    prefill.release(req)
    return got, chunks


@pytest.mark.parametrize("draft, topk, page_size", [(None, 1, 4), ("eagle", 1, 1), ("eagle3", 4, 16), ("mtp", 4, 4)])
def test_resumed_request_equals_single_process(tiny_model_dir, draft, topk, page_size):
    prefill, decode = pair(tiny_model_dir, draft, page_size, topk)
    single = Engine(tiny_model_dir / "target", tiny_model_dir / draft if draft else None, prefill.config)
    want = single.generate([PROMPT], PARAMS)[0].token_ids
    req = prefill_once(prefill)
    got, _ = hand_off(prefill, decode, req, chunk_bytes=1024)
    decode.run_until_done()
    assert decode.result(got).token_ids == want
    assert prefill.is_idle_and_clean() and decode.is_idle_and_clean()


def test_chunks_carry_identical_bytes_and_coalesce(tiny_model_dir):
    prefill, decode = pair(tiny_model_dir, "eagle", page_size=4)
    req = prefill_once(prefill)
    got, chunks = hand_off(prefill, decode, req, chunk_bytes=1 << 20)
    # Every transferred position holds the same K/V on both sides.
    dst_caches, dst_pages = decode.scheduler.caches, decode.page_ids(got)
    for cache, pages in zip(dst_caches, dst_pages):
        assert len(pages) == -(-req.kv_len // 4)
    n_layers = sum(c.spec.num_layers for c in dst_caches)
    assert len(chunks) == n_layers  # fresh pool: one contiguous run per layer, one chunk each
    assert [(r.first, r.page, r.count) for r in coalesce([3, 4, 5, 9, 10, 2])] == [(0, 3, 3), (3, 9, 2), (5, 2, 1)]
    decode.abort("r")
    assert decode.is_idle_and_clean()


def test_fragmented_pages_send_more_runs_with_the_same_bytes(tiny_model_dir):
    prefill, decode = pair(tiny_model_dir, None, page_size=4)
    # Fragment the pool: allocate pages in an interleaved order before the request.
    alloc = prefill.cache.allocator
    taken = alloc.alloc(8)
    alloc.free(taken[::2])
    req = prefill_once(prefill)
    pages = prefill.page_ids(req)[0]
    assert len(coalesce(pages)) > 1
    k_src = torch.cat([prefill.cache.k[0][p * 4:(p + 1) * 4] for p in pages])[:req.kv_len]
    got, chunks = hand_off(prefill, decode, req)
    assert len(chunks) == prefill.cache.spec.num_layers * len(coalesce(pages))
    k_dst = torch.cat([decode.cache.k[0][p * 4:(p + 1) * 4] for p in decode.page_ids(got)[0]])[:req.kv_len]
    assert torch.equal(k_src, k_dst)
    alloc.free(taken[1::2])
    decode.abort("r")
    assert prefill.is_idle_and_clean() and decode.is_idle_and_clean()


def test_corrupted_chunk_is_detected(tiny_model_dir):
    prefill, decode = pair(tiny_model_dir, "eagle")
    req = prefill_once(prefill)

    def flip(chunks):
        k = bytearray(chunks[1].k)
        k[10] ^= 0xFF
        chunks[1].k = bytes(k)

    with pytest.raises(TransferError, match="CRC32"):
        hand_off(prefill, decode, req, corrupt=flip)
    decode.abort("r")
    prefill.release(req)
    assert prefill.is_idle_and_clean() and decode.is_idle_and_clean()


def test_missing_chunk_is_detected(tiny_model_dir):
    prefill, decode = pair(tiny_model_dir, "eagle")
    req = prefill_once(prefill)
    with pytest.raises(TransferError, match="received"):
        hand_off(prefill, decode, req, corrupt=lambda chunks: chunks.pop(0))
    decode.abort("r")
    prefill.release(req)
    assert prefill.is_idle_and_clean() and decode.is_idle_and_clean()


@pytest.mark.parametrize("change, words", [
    (dict(page_size=16), "page_size: decode has 16, prefill has 4"),
    (dict(dtype="bfloat16"), "dtype: decode has bfloat16, prefill has float32"),
    (dict(spec=SpecConfig(topk=2, steps=3, num_draft_tokens=6)), "topk=2"),
])
def test_schema_mismatch_names_both_sides(tiny_model_dir, change, words):
    prefill, decode = pair(tiny_model_dir, "eagle", decode_overrides=change)
    with pytest.raises(SchemaMismatch) as err:
        check_schema(engine_schema(decode), engine_schema(prefill))
    assert words in str(err.value)
    check_schema(engine_schema(prefill), engine_schema(prefill))


def test_schema_differs_across_draft_kinds_and_without_a_draft(tiny_model_dir):
    schemas = {d: engine_schema(pair(tiny_model_dir, d)[0]) for d in (None, "eagle", "eagle3", "mtp")}
    for a in schemas:
        for b in schemas:
            if a != b:
                with pytest.raises(SchemaMismatch):
                    check_schema(schemas[a], schemas[b])


def test_full_decode_refuses_and_leaks_nothing(tiny_model_dir):
    prefill, decode = pair(tiny_model_dir, "eagle", decode_overrides={"num_pages": 10})
    req = prefill_once(prefill)
    blocker = decode.reserve_handoff("b", PROMPT, [1], [0.0], SamplingParams(max_new_tokens=1), 20)
    assert blocker is not None
    assert decode.reserve_handoff("r", req.prompt_ids, req.output_ids, req.output_logprobs, req.params,
                                  req.kv_len) is None
    decode.abort("b")
    prefill.release(req)
    assert prefill.is_idle_and_clean() and decode.is_idle_and_clean()
