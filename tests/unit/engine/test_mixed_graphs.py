"""shared/mixed_graphs.py on the CPU: the target's forward in pieces between its attentions (the pieces run eagerly
here, on the same buffers and padded buckets the CUDA graphs capture) gives each request what the eager forward
gives it: the same greedy tokens and logits within float tolerance, with and without an EAGLE-3 head (whose
features come from the pieces' buffers); padding rows write only the sink slot; what the pieces cannot run takes
the eager forward. tests/gpu/test_mixed_graphs_gpu.py replays the captured graphs on CUDA.
"""

from __future__ import annotations

import pytest
import torch
from engine_checks import check_pools_full

from shared.config import EngineConfig, SpecConfig
from shared.engine import Engine
from shared.mixed_graphs import BUCKET, Buffers, MixedGraphs, buffer_bytes, reserve_bytes, unsupported
from shared.sampling import SamplingParams
from tests.mixed_graphs_checks import run_late_prompt

CHUNK = 96
LONG = [50 + (i * 29) % 400 for i in range(200)]  # chunks of 96, 96, 8: two run in pieces
SHORT = [list(range(3, 24)), [100 + (i * 37) % 300 for i in range(29)]]
GREEDY = SamplingParams(max_new_tokens=6, ignore_eos=True)


def _engine(model_dir, draft: str | None, pieces: bool) -> tuple[Engine, list]:
    config = EngineConfig(chunk_size=CHUNK, page_size=4, max_running=8,
                          spec=SpecConfig(topk=1, steps=2, num_draft_tokens=3) if draft else None,
                          spec_policy="fixed")
    engine = Engine(model_dir / "target", model_dir / draft if draft else None, config)
    used = []
    if pieces:
        r = engine.runner
        w = r.speculator
        mg = MixedGraphs(r.model, r.cache, CHUNK + 8, True, capture=False,
                         aux_layers=w.aux_layers if w is not None and w.capture_mode == "aux" else ())
        inner = mg.forward

        def counted(batch, *args, **kwargs):
            used.append(batch.input_ids.shape[0])
            return inner(batch, *args, **kwargs)

        mg.forward = counted
        r.mixed_graphs = mg
    return engine, used


def _run(model_dir, draft: str | None, pieces: bool):
    engine, used = _engine(model_dir, draft, pieces)
    out, logits, features = run_late_prompt(engine, SHORT, LONG, GREEDY)
    check_pools_full(engine)
    return out, logits, used, features


@pytest.mark.parametrize("draft", [None, "eagle3", "eagle"])
def test_pieces_give_the_eager_forwards_tokens_and_logits(tiny_model_dir, draft):
    want, want_logits, _, want_features = _run(tiny_model_dir, draft, pieces=False)
    got, got_logits, used, got_features = _run(tiny_model_dir, draft, pieces=True)
    assert got == want
    for g, w in zip(got_logits, want_logits):
        assert g.shape == w.shape and (g - w).abs().max().item() <= 1e-4
    assert len(got_features) == len(want_features) and (len(want_features) > 0) == (draft is not None)
    for g, w in zip(got_features, want_features):
        assert g.shape == w.shape and (g - w).abs().max().item() <= 1e-4
    # the late prompt's first two chunks (96 queries each, beside the decode rows) ran in pieces, the 8-token tail not
    assert len(used) == 2 and all(CHUNK <= t <= CHUNK + 2 for t in used)


def test_padding_rows_store_only_in_the_sink_slot(tiny_model_dir):
    engine, used = _engine(tiny_model_dir, None, pieces=True)
    cache = engine.runner.cache
    stores = []
    mg = engine.runner.mixed_graphs
    inner = mg.forward

    def watched(batch, *args, **kwargs):
        before = [k.clone() for k in cache.k]
        out = inner(batch, *args, **kwargs)
        changed = set()
        for k0, k1 in zip(before, cache.k):
            changed |= set(torch.nonzero((k0 != k1).flatten(1).any(1)).flatten().tolist())
        stores.append((changed, set(batch.out_cache_loc.tolist()), batch.input_ids.shape[0]))
        return out

    mg.forward = watched
    engine.generate([LONG[:CHUNK + 4]], GREEDY)  # a full bucket (96 rows), then a 4-token chunk: eager
    engine.generate([LONG[100:170]], GREEDY)  # 70 rows in the 96-row bucket: the last 26 rows are padding
    assert [t for _, _, t in stores] == [CHUNK, 70]
    changed, loc, t = stores[1]
    assert 0 not in loc  # none of the request's slots is the sink
    # the rows past 70 held the first prompt's slots: written again, they would show here
    assert changed <= loc | {0} and loc <= changed | {0} and 0 in changed
    check_pools_full(engine)


def test_short_chunks_masks_and_unsupported_models_stay_eager(tiny_model_dir):
    engine, used = _engine(tiny_model_dir, None, pieces=True)
    engine.generate([LONG[:EXTEND_SHORT]], GREEDY)  # a 40-token prompt: the paged launch's batch, not pieces
    assert used == []
    mg = engine.runner.mixed_graphs
    assert mg.bucket(CHUNK + 8) == -(-(CHUNK + 8) // BUCKET) * BUCKET and mg.bucket(10_000) is None
    r = engine.runner
    r.model.tp = object()
    assert unsupported(r.model, r.cache) == "tensor parallelism"
    off = MixedGraphs(r.model, r.cache, CHUNK, True, capture=False)
    assert not off.enabled and off.why_not == "tensor parallelism" and off.buckets == []
    r.model.tp = None
    r.model.model.layers[1].self_attn.q_norm = object()
    assert "q/k norms" in unsupported(r.model, r.cache)
    r.model.model.layers[1].self_attn.q_norm = None
    assert unsupported(r.model, r.cache) is None


EXTEND_SHORT = 40


def test_the_memory_reserve_covers_the_buffers(tiny_model_dir):
    engine, _ = _engine(tiny_model_dir, "eagle3", pieces=True)
    r = engine.runner
    mc, aux = r.model.config, r.speculator.aux_layers
    buf = Buffers.allocate(r.model, r.cache.req_to_token.table.dtype, 160, aux)
    held = sum(t.numel() * t.element_size() for t in vars(buf).values() if t is not None)
    reserved = buffer_bytes(mc.hidden_size, mc.num_attention_heads, mc.num_key_value_heads, mc.head_dim, 160,
                            len(aux), r.model.model.embed_tokens.weight.element_size())
    assert held <= reserved <= held + 160 * 4


def test_the_services_setting_reaches_the_runner(tiny_model_dir, monkeypatch):
    """``EYRIE_CUDA_GRAPH_MIXED`` becomes the engine's ``cuda_graph_mixed``; on the CPU the runner's pieces stay off
    (CUDA graphs are CUDA's) and its steps run eagerly."""
    from services.settings import load_settings

    monkeypatch.setenv("EYRIE_CUDA_GRAPH_MIXED", "1")
    settings = load_settings("decode", model=str(tiny_model_dir / "target"), cuda_graph=True)
    config = settings.engine_config()
    assert config.cuda_graph_mixed and config.cuda_graph
    engine = Engine(tiny_model_dir / "target", None, config)
    mg = engine.runner.mixed_graphs
    assert not mg.enabled and mg.why_not == "off" and mg.buckets == []
    assert engine.generate([LONG[:CHUNK]], GREEDY)[0].token_ids
    check_pools_full(engine)


def test_the_reserve_is_the_largest_buckets_buffers_and_a_chunks_peak(tiny_model_dir):
    mc = Engine(tiny_model_dir / "target", None, EngineConfig()).runner.model.config
    on = EngineConfig(cuda_graph=True, cuda_graph_mixed=True, chunk_size=100, max_running=8, dtype="bfloat16")
    rows = 128  # 108 tokens at most, rounded up to the bucket
    want = 1000 + buffer_bytes(mc.hidden_size, mc.num_attention_heads, mc.num_key_value_heads, mc.head_dim, rows, 3, 2)
    assert reserve_bytes(mc, on, 3, 1000) == want
    assert reserve_bytes(mc, on.model_copy(update={"cuda_graph_mixed": False}), 3, 1000) == 0
