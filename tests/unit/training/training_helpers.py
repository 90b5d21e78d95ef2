"""Helpers of the training tests: every position's logits from the engine's own forward."""

from __future__ import annotations

import torch

from shared.engine import Engine
from shared.forward_batch import build_forward_batch


def engine_logits(engine: Engine, prompts: list[list[int]]) -> list[torch.Tensor]:
    """[len(p), V] float32 logits of every position of each prompt, one batched prefill forward."""
    cache = engine.cache
    handles = [cache.open() for _ in prompts]
    try:
        for h, p in zip(handles, prompts):
            cache.reserve(h, len(p))
        ids = torch.tensor([t for p in prompts for t in p])
        pos = torch.cat([torch.arange(len(p)) for p in prompts])
        batch = build_forward_batch(cache, [h.row for h in handles], [0] * len(prompts), [len(p) for p in prompts],
                                    ids, pos, pos)
        logits = engine.model(batch, cache).logits
    finally:
        for h in handles:
            cache.close(h)
    return list(logits.split([len(p) for p in prompts]))
