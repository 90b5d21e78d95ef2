"""How large each KV pool of an engine is: one function, used for the target's cache and the draft's."""

from __future__ import annotations

import torch

from shared.config import EngineConfig
from shared.memory.kv_cache import CacheLayout, KVCache
from shared.model.config import ModelConfig
from shared.model.loader import parse_dtype


def make_cache(config: ModelConfig, num_layers: int, engine: EngineConfig, max_context: int) -> KVCache:
    """A pool of ``num_layers`` layers of ``config``'s K/V shape: ``engine.num_pages`` pages, or enough
    for ``max_running`` requests of ``max_context`` tokens (plus the decode step's headroom)."""
    max_context += engine.headroom  # a decode step near the end of the context writes past it
    num_pages = engine.num_pages or engine.max_running * -(-max_context // engine.page_size)
    return KVCache(CacheLayout(
        num_layers=num_layers, num_kv_heads=config.num_key_value_heads, head_dim=config.head_dim,
        dtype=parse_dtype(engine.dtype), device=torch.device(engine.device), page_size=engine.page_size,
        num_pages=num_pages, max_reqs=engine.max_running, max_context=max_context, shareable=engine.shareable_kv,
    ))
