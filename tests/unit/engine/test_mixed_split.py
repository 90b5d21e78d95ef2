"""A mixed step's attention split through the engine: its decode rows take the decode launch, its chunk the extend
kernel (``kernels.mixed_attention``), and the output is each prompt's alone.

On the CPU the engine's batches take the torch reference (the extend kernel is for CUDA tensors,
``layers._long_extend``); here the CUDA rule is forced and both kernels run under the interpreter, so the
engine's own wiring runs: ``Attention._extend``, ``ForwardBatch.mixed_split`` made once per forward and shared
by every layer, the decode rows first in the batch (``ModelRunner._target_step``: sliced, not gathered).
tests/gpu/test_mixed_attention_gpu.py runs the kernels on CUDA.
"""

from __future__ import annotations

import functools

import torch
from engine_checks import GREEDY, PROMPTS, check_pools_full, record_logits

import kernels.mixed_attention as mixed
import shared.model.layers as layers
from shared.config import EngineConfig
from shared.engine import Engine

LONG = [50 + (i * 29) % 400 for i in range(40)]  # 40 tokens: 40 x 2 heads per KV head overflow one decode tile


def _run(model_dir, late_prompt: list[int], early: list[int]) -> tuple[dict, dict]:
    """``early`` decodes three steps, then ``late_prompt`` arrives and prefills beside it in one mixed step."""
    engine = Engine(model_dir / "target", config=EngineConfig(chunk_size=None, page_size=4))
    seen = record_logits(engine)
    first = engine.add_request(early, GREEDY)
    for _ in range(3):
        engine.step()
    late = engine.add_request(late_prompt, GREEDY)
    engine.run_until_done()
    out = {"early": engine.result(first).token_ids, "late": engine.result(late).token_ids}
    logits = {"early": torch.stack(seen[first.rid]), "late": torch.stack(seen[late.rid])}
    check_pools_full(engine)
    return out, logits


def test_a_mixed_step_through_the_split_equals_the_reference_path(tiny_model_dir, monkeypatch):
    want, want_logits = _run(tiny_model_dir, LONG, PROMPTS[0])
    splits, real = [], mixed.split_mixed

    def counted(meta, group):
        splits.append(real(meta, group))
        return splits[-1]

    monkeypatch.setattr(mixed, "split_mixed", counted)
    monkeypatch.setattr(layers, "_long_extend", lambda q, batch: batch.attn.max_q_len >= len(LONG))
    monkeypatch.setattr(layers, "mixed_attention", functools.partial(mixed.mixed_attention, backend="triton"))
    got, got_logits = _run(tiny_model_dir, LONG, PROMPTS[0])
    assert got == want
    for k in want_logits:
        assert (got_logits[k] - want_logits[k]).abs().max().item() <= 1e-4
    made = [s for s in splits if s is not None]
    assert len(splits) == 1, "one split per forward, not one per layer (the tiny model has 4)"
    assert len(made) == 1 and made[0].decode.rows == slice(0, 1) and made[0].extend.rows == slice(1, 1 + len(LONG))
