"""The start-up profile run: what an engine's largest steps take, measured before its KV pools are sized.

As vLLM's profile run: on a throwaway cache just large enough, the target runs a full prefill chunk (with
the features an EAGLE draft reads; on a decode engine beside a plain step's rows, as a step may fold
them), the largest eager decode step (every row's logits, as a verify step) and the largest
graph-captured one, each followed by the sampler's float32 work over its logits. Each step's peak above
what the allocator held before it, and the memory outside PyTorch then (NVML), become the reserve the
pools leave free (``shared/memory/sizing.profiled_reserve``)."""

from __future__ import annotations

import torch

from shared.config import EngineConfig
from shared.forward_batch import build_forward_batch
from shared.memory.kv_cache import CacheLayout, KVCache
from shared.memory.nvml import outside_torch, process_used_bytes
from shared.memory.sizing import StepPeaks
from shared.model.loader import parse_dtype


def profile_steps(model, config: EngineConfig, max_context: int, capture: str = "none",
                  aux_layers: tuple[int, ...] = (), decodes: bool = True) -> StepPeaks:
    """Run ``model``'s largest steps once on ``config.device`` and measure their peaks (0 off CUDA, where only
    the steps run); ``decodes``: False for a prefill engine (its steps are prefill chunks only, and it captures
    no graph)."""
    device = torch.device(config.device)
    chunk = min(config.chunk_size or max_context, max_context)
    width = config.spec.num_draft_tokens if config.spec is not None else 1
    graph_rows = config.graph_max_bs if config.cuda_graph and decodes else 0
    cache = _throwaway_cache(model.config, config, chunk, width, device)
    running = config.max_running if decodes else 0
    # A decode engine's prefill chunk may share its forward with a plain step's rows (one token each).
    steps = {"prefill": [(chunk, True)] + [(1, False)] * running, "decode": [(width, False)] * running,
             "graph": [(width, False)] * graph_rows}
    peaks = {}
    for name, rows in steps.items():
        peaks[name] = _step_peak(model, cache, rows, device, capture, aux_layers) if rows else 0
    del cache
    non_torch = None
    if device.type == "cuda":
        torch.cuda.empty_cache()
        non_torch = outside_torch(process_used_bytes(device), torch.cuda.memory_reserved(device))
    return StepPeaks(prefill=peaks["prefill"], decode=peaks["decode"], graph=peaks["graph"], non_torch=non_torch)


def _throwaway_cache(mc, config: EngineConfig, chunk: int, width: int, device: torch.device) -> KVCache:
    """Room for one chunk beside ``max_running`` one-token rows, or for ``max_running`` rows of ``width``
    positions, whichever needs more pages."""
    ps = config.page_size
    pages = max(-(-chunk // ps) + config.max_running, config.max_running * -(-width // ps))
    return KVCache(CacheLayout(num_layers=mc.num_hidden_layers, num_kv_heads=mc.num_key_value_heads,
                               head_dim=mc.head_dim, dtype=parse_dtype(config.dtype), device=device, page_size=ps,
                               num_pages=pages, max_reqs=config.max_running + 1,
                               max_context=max(chunk, width) + config.headroom))


@torch.inference_mode()
def _step_peak(model, cache: KVCache, rows: list[tuple[int, bool]], device: torch.device, capture: str,
               aux_layers: tuple[int, ...]) -> int:
    """The allocator's peak above its reservation before one forward of ``rows`` (query length, whether only
    the last position needs logits), its logits' log-softmax and softmax included."""
    handles = [cache.open() for _ in rows]
    try:
        for h, (n, _) in zip(handles, rows):
            cache.reserve(h, n)
        ids, pos, logit_rows = [], [], []
        for n, last_only in rows:
            pos += range(n)
            logit_rows += [len(pos) - 1] if last_only else range(len(pos) - n, len(pos))
        ids = torch.ones(len(pos), dtype=torch.int64)
        positions = torch.tensor(pos, dtype=torch.int64)
        before = _reset_peak(device)
        batch = build_forward_batch(cache, [h.row for h in handles], [0] * len(rows), [n for n, _ in rows], ids,
                                    positions, positions, logits_rows=torch.tensor(logit_rows, dtype=torch.int64))
        out = model(batch, cache, capture=capture, aux_layers=aux_layers)
        probs = torch.softmax(out.logits, dim=-1), torch.log_softmax(out.logits, dim=-1)
        del out, probs, batch
        return _peak_since(device, before)
    finally:
        for h in handles:
            cache.close(h)


def _reset_peak(device: torch.device) -> int:
    """On CUDA: the allocator emptied of cached blocks (the previous step's would hide this step's need), its
    peak statistics reset; what it reserves now. 0 elsewhere."""
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_reserved(device)


def _peak_since(device: torch.device, before: int) -> int:
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    return max(0, torch.cuda.max_memory_reserved(device) - before)
