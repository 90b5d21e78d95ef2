"""Seed 000: chunked prefill feeds the draft the right tail token, for every draft kind.

The draft extend of a prefill chunk [s, e) takes tokens s+1 .. e; for a chunk that stops inside the
prompt the tail token (at e) is the next prompt token, not a sampled one (SGLang fixed the single-
layer worker and left the multi-layer one as a TODO). Here, for EAGLE, EAGLE-3 and the multi-layer
draft: chunked and unchunked prefill leave the same draft K/V in every draft cache, the same draft
hidden state and first tree level, both equal to a by-hand computation, and then the same accept
lengths step after step; every draft-extend forward was fed exactly the tokens s+1 .. e.
"""

from __future__ import annotations

import pytest
import torch
from draft_reference import DraftCalls, assert_kv_close, assert_matches_reference, engine_kv
from spec_helpers import GREEDY, KINDS, PROMPTS

PAIR = [PROMPTS[1], PROMPTS[3]]  # 53 and 37 tokens: chunks of 5 cut both, and share steps


def prefill_then_decode(engine, prompts):
    """Run to the end; returns, per request, its state and caches right after its prefill, the
    per-step committed token counts after it (its accept lengths, the last one possibly cut), and
    each prefill-time draft-extend span with the token ids and positions the draft was fed."""
    reqs = [engine.add_request(p, GREEDY) for p in prompts]
    snap, accepts, spans = {}, {r.rid: [] for r in reqs}, []
    with DraftCalls(engine) as calls:
        extend = engine.speculator.launch_extend

        def recording_extend(span_list, features, finals, *args, **kwargs):
            first = len(calls.calls)
            launched = extend(span_list, features, finals, *args, **kwargs)
            for call in calls.calls[first:]:  # one forward per draft cache
                offset = 0
                for r, s, e in span_list:
                    spans.append((r, s, e, call.input_ids[offset:offset + e - s].tolist(),
                                  call.positions[offset:offset + e - s].tolist()))
                    offset += e - s
            return launched

        engine.speculator.launch_extend = recording_extend
        while engine.scheduler.has_work():
            events = engine.step()
            for r, toks in events:
                if r.rid in snap:
                    accepts[r.rid].append(len(toks))
            for r in reqs:
                if r.rid not in snap and r.draft_state is not None:
                    assert_matches_reference(engine, r, f"after prefill of {r.rid}")
                    snap[r.rid] = (engine_kv(engine, r, r.prompt_len), r.draft_state)
    assert engine.is_idle_and_clean()
    return reqs, snap, accepts, spans


@pytest.mark.parametrize("kind", KINDS)
def test_chunked_equals_unchunked(oracle_models, kind):
    spec = dict(topk=2, steps=3, ndt=6)
    whole = oracle_models.fixed(kind, **spec, page_size=4, chunk_size=None)
    chunked = oracle_models.fixed(kind, **spec, page_size=4, chunk_size=5)
    reqs_w, snap_w, acc_w, spans_w = prefill_then_decode(whole, PAIR)
    reqs_c, snap_c, acc_c, spans_c = prefill_then_decode(chunked, PAIR)
    n_caches = len(chunked.speculator.caches)
    assert n_caches == (3 if kind == "mtp" else 1)

    for rw, rc in zip(reqs_w, reqs_c):
        (tk_w, tv_w, dk_w, dv_w), st_w = snap_w[rw.rid]
        (tk_c, tv_c, dk_c, dv_c), st_c = snap_c[rc.rid]
        assert_kv_close(tk_c, tk_w, "target K", atol=1e-5)
        assert_kv_close(tv_c, tv_w, "target V", atol=1e-5)
        for c in range(n_caches):  # every layer of a multi-layer draft, not only the first
            assert_kv_close(dk_c[c], dk_w[c], f"{kind} draft cache {c} K", atol=1e-5)
            assert_kv_close(dv_c[c], dv_w[c], f"{kind} draft cache {c} V", atol=1e-5)
        assert (st_c.committed_len, st_c.bonus_token) == (st_w.committed_len, st_w.bonus_token)
        assert torch.allclose(st_c.hidden, st_w.hidden, atol=1e-5)
        assert torch.allclose(st_c.topk_p, st_w.topk_p, atol=1e-5) and torch.equal(st_c.topk_ids, st_w.topk_ids)
        assert rc.output_ids == rw.output_ids
        assert acc_c[rc.rid] == acc_w[rw.rid], f"{kind}: accept lengths differ chunked vs whole"
        assert max(acc_c[rc.rid]) >= 2, "the oracle draft should have had drafts accepted"

    # The tail token of every prefill-time draft extend: chunks cut inside a prompt end with the next
    # prompt token; the chunk that completes the prompt ends with the token the target sampled.
    cut = 0
    for r, s, e, ids, pos in spans_c:
        assert pos == list(range(s, e))
        assert ids == r.all_ids[s + 1:e + 1]
        if e < r.prompt_len:
            assert ids[-1] == r.prompt_ids[e], f"{kind}: tail of chunk [{s}, {e}) is not the next prompt token"
            cut += 1
        else:
            assert ids[-1] == r.output_ids[0], f"{kind}: tail of the final chunk is not the sampled token"
    assert cut >= 10 * n_caches, f"only {cut} chunks cut inside a prompt were seen"
    assert all(e == r.prompt_len for r, s, e, _, _ in spans_w)
