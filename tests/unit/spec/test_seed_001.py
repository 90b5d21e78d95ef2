"""Seed 001: each step of a multi-layer draft reads only its own pools.

SGLang's multi-layer EAGLE ran every step with step 0's request-to-token pool, silently reading the
wrong K/V. Here each cache (the target's and one per draft layer) is given a different layout (its
own number of dummy rows and pages ahead of the requests), so that each cache's requests live in
their own range of pages, disjoint from every other cache's, and every slot is poisoned with NaN
before the requests arrive (they overwrite only what they own). Then, for chain and tree:

* every draft forward ran on the cache of its step (cache i for step i), and every slot it wrote or
  read lies in that cache's range and in no other, and no NaN came out;
* the draft-loop logits equal running each layer by hand on fresh caches of its own;
* accept lengths step by step equal those of a clean engine (no poison, no offsets), the output
  equals target-only greedy decoding, and no NaN appears anywhere;
* a negative control that builds every step's batch from step 0's map (the SGLang bug) is caught.
"""

from __future__ import annotations

import pytest
import torch
from draft_reference import DraftCalls, reference_chain, reference_extend
from spec_helpers import PROMPTS

import shared.spec.phases as phases
from shared.sampling import SamplingParams

BATCH = [PROMPTS[0], PROMPTS[3], PROMPTS[4]]  # 3, 37 and 18 tokens
PARAMS = SamplingParams(max_new_tokens=16, ignore_eos=True)
PAGES = 64  # each cache's requests get pages from their own range of this many (3 requests need < 64)


def offset_and_poison(engine):
    """Cache j (0 = the target, 1 + i = draft cache i) gets j dummy rows and j * PAGES dummy pages
    ahead of the requests, so their pages there come from (j * PAGES, (j + 1) * PAGES]; then every
    slot but the sink page is set to NaN. Returns the dummies, to close at the end."""
    dummies = []
    for j, cache in enumerate(engine.scheduler.caches):
        dummies.append((cache, [cache.open() for _ in range(j)], cache.allocator.alloc(j * PAGES)))
        ps = cache.page_size
        for layer in range(len(cache.k)):
            cache.k[layer][ps:] = float("nan")
            cache.v[layer][ps:] = float("nan")
    return dummies


def close_dummies(dummies) -> None:
    for cache, handles, pages in dummies:
        for h in handles:
            cache.close(h)
        cache.allocator.free(pages)


def check_accesses(engine, calls) -> int:
    """Every draft forward ran on its step's cache and touched only its own range of pages (the
    requests' pages there; the rest of the range is NaN, and NaN is checked for). Padding rows touch
    page 0, which is never handed out, and only it: with drafting ahead on the GPU, the rows of
    requests that ended since the draft was launched become padding, and write and read their scratch
    tokens there. A row that reads page 0 reads nothing else."""
    w = engine.speculator
    n = 0
    for call in calls.calls:
        c = call.cache_index
        assert call.cache is w.caches[c], "a draft forward ran on another step's cache"
        j = 1 + c
        wrote = call.out_cache_loc.cpu() // call.cache.page_size
        assert (((wrote > j * PAGES) & (wrote <= (j + 1) * PAGES)) | (wrote == 0)).all(), \
            f"draft cache {c} wrote slots outside its own pages (another cache's layout)"
        read, ptr = call.kv_indices.cpu() // call.cache.page_size, call.kv_indptr.cpu().tolist()
        for lo, hi in zip(ptr, ptr[1:]):
            row = read[lo:hi]
            if (row == 0).any():
                assert (row == 0).all(), f"draft cache {c}: a row read the padding page and real pages"
            else:
                assert ((row > j * PAGES) & (row <= (j + 1) * PAGES)).all(), \
                    f"draft cache {c} read slots outside its own pages (another cache's layout)"
        assert not torch.isnan(call.logits).any() and not torch.isnan(call.hidden).any(), "read a poisoned slot"
        n += 1
    return n


def run(models, spec, poison: bool, check: bool):
    engine = models.engine("mtp", **spec, page_size=4, chunk_size=16, num_pages=(spec["steps"] + 2) * PAGES)
    dummies = offset_and_poison(engine) if poison else []
    reqs = [engine.add_request(p, PARAMS) for p in BATCH]
    accepts, checked, by_hand = [], 0, 0
    while engine.scheduler.has_work():
        first_decode = all(r.draft_state is not None for r in reqs) and not by_hand
        states = [(r.all_ids[:r.kv_len], r.all_ids[r.kv_len]) if r.draft_state else None for r in reqs]
        with DraftCalls(engine) as calls:
            accepts.append([(r.rid, len(t)) for r, t in engine.step()])
        if check:
            checked += check_accesses(engine, calls)
        if check and first_decode and spec["topk"] == 1:
            for b, (committed, bonus) in enumerate(states):  # each layer by hand, on fresh caches
                for i, (call, want) in enumerate(zip(calls.loop(), reference_chain(engine, reference_extend(
                        engine, committed, bonus)))):
                    assert call.cache_index == i + 1 == want.cache_index
                    assert torch.allclose(call.logits[b], want.logits, atol=1e-4), f"layer {i + 1} by hand"
                    by_hand += 1
    close_dummies(dummies)
    assert engine.is_idle_and_clean()
    return [engine.result(r) for r in reqs], accepts, checked, by_hand


SPECS = pytest.mark.parametrize("spec", [dict(topk=1, steps=4), dict(topk=2, steps=3, ndt=6)], ids=["chain", "tree"])


@SPECS
def test_each_step_reads_only_its_own_pools(oracle_models, spec):
    check_own_pools(oracle_models, spec)


@pytest.mark.gpu
@SPECS
def test_each_step_reads_only_its_own_pools_cuda(oracle_models_cuda, spec):
    """The same on the GPU, where batches are built by Triton kernels (kv_indices from each cache's
    rows: one column of the [batch, caches] row map, a strided view)."""
    check_own_pools(oracle_models_cuda, spec)


def check_own_pools(models, spec):
    want = models.reference(BATCH, PARAMS)
    clean, clean_accepts, _, _ = run(models, spec, poison=False, check=False)
    got, accepts, checked, by_hand = run(models, spec, poison=True, check=True)
    assert [r.token_ids for r in got] == [r.token_ids for r in want] == [r.token_ids for r in clean]
    assert accepts == clean_accepts, "the offsets or the poison changed what the draft proposed"
    assert max(n for step in accepts for _, n in step) >= 3, "no accepted run: the draft was not exercised"
    assert checked >= 20
    assert by_hand == (3 * 3 if spec["topk"] == 1 else 0)


def test_negative_control_step_zero_map_is_caught(oracle_models, monkeypatch):
    """Build every draft-loop batch from step 0's request-to-token map (cache index 0): caught."""
    real = phases.build_uniform_batch

    def step_zero_map(cache, rows, *args, **kwargs):
        first = cache_zero[0]
        if cache is not first and any(cache is c for c in all_caches[0]):
            proxy = type("Proxy", (), {"req_to_token": first.req_to_token, "spec": cache.layout,
                                       "layout": cache.layout, "page_size": cache.page_size})()
            return real(proxy, rows, *args, **kwargs)
        return real(cache, rows, *args, **kwargs)

    cache_zero, all_caches = [], []
    engine = oracle_models.engine("mtp", topk=1, steps=4, page_size=4, chunk_size=16, num_pages=6 * PAGES)
    cache_zero.append(engine.speculator.caches[0])
    all_caches.append(engine.speculator.caches)
    dummies = offset_and_poison(engine)
    monkeypatch.setattr(phases, "build_uniform_batch", step_zero_map)
    reqs = [engine.add_request(p, PARAMS) for p in BATCH]
    while any(r.draft_state is None for r in reqs):
        engine.step()
    with DraftCalls(engine) as calls:
        engine.step()
    with pytest.raises(AssertionError, match="outside its own pages"):
        check_accesses(engine, calls)
    monkeypatch.undo()
    for r in reqs:
        engine.abort(r.rid)
    close_dummies(dummies)
    assert engine.is_idle_and_clean()
