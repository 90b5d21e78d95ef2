"""How large each KV pool of an engine is: one function, used for the target's cache and the draft's.

Without ``num_pages`` a pool holds ``max_running`` requests of ``max_context`` tokens. On a GPU it also stays
within ``gpu_memory_fraction`` of the device (as vLLM's ``gpu_memory_utilization``): the engine's weights
(target and draft, measured once loaded), a reserve for activations, logits and CUDA graphs, and every pool
(target and draft caches share one page count) must fit in that fraction of the device's total memory, and
in what is free on it now (another engine may share the device). ``pages_within_budget`` is that
arithmetic on injected figures, so it runs on the CPU; ``device_memory`` reads the figures off a GPU.

The reserve is measured, not guessed, on a single-GPU engine (as vLLM's profile run): before its pools exist
the engine runs its largest steps once (``shared/memory/profile.py``: a full prefill chunk, the largest
eager decode step, the largest graph-captured one) and ``profiled_reserve`` turns their peaks into the bytes
kept free: the eager peak, a graph step's peak per captured phase that runs the target (the engine's graphs
share one pool, ``shared.cuda_graphs.GraphPool``: a bound, not a sum that is reached), the draft's phases, the
outputs every captured batch size keeps (``graph_output_reserve``) and the memory outside PyTorch's allocator
(CUDA context, cuBLAS and Triton). Graph capture itself stops at the batch size that would pass the fraction
(``shared.cuda_graphs.CaptureBudget``; larger batches then run eagerly). After warm-up the service checks
the process's real peak against the fraction (``Footprint``, ``check_footprint``). The pools leave
``POOL_MARGIN`` of the fraction unassigned: the profile does not measure everything the engine takes later
(the graph pool's fragmentation, CUDA graph objects, kernels loaded after the profile, allocator rounding),
and the peak check allows only ``FOOTPRINT_SLACK`` past the fraction.

Every figure is this process's own: PyTorch's allocator statistics are per process and NVML's figure is the
process's entry in the device's process list, so an engine sharing the GPU (a prefill and a decode service
starting together) neither counts the other's memory in its reserve nor in its peak. Only ``free`` is the
whole device's, and it only lowers the page count (when another process holds more than its share).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.config import EngineConfig
from shared.errors import RequestError
from shared.memory.kv_cache import CacheLayout, KVCache
from shared.model.config import ModelConfig
from shared.model.loader import parse_dtype

GiB = 1 << 30
BASE_RESERVE = 1 << 30  # outside the caching allocator's count: the CUDA context, cuBLAS and Triton workspaces
FOOTPRINT_SLACK = 1.01  # the measured peak may pass fraction x total by 1% (the allocator's rounding) at most
POOL_MARGIN = 0.03  # of fraction x total, left out of the pools: what the profile run does not measure


def make_cache(config: ModelConfig, num_layers: int, engine: EngineConfig, max_context: int) -> KVCache:
    """A pool of ``num_layers`` layers of ``config``'s K/V shape: ``engine.num_pages`` pages, or enough
    for ``max_running`` requests of ``max_context`` tokens (plus the decode step's headroom)."""
    positions = max_context + engine.headroom  # a decode step near the end of the context writes past it
    num_pages = engine.num_pages or default_pages(engine, positions)
    return KVCache(CacheLayout(
        num_layers=num_layers, num_kv_heads=config.num_key_value_heads, head_dim=config.head_dim,
        dtype=parse_dtype(engine.dtype), device=torch.device(engine.device), page_size=engine.page_size,
        num_pages=num_pages, max_reqs=engine.max_running, max_context=positions, shareable=engine.shareable_kv,
        context=max_context,
    ))


def default_pages(engine: EngineConfig, max_context: int) -> int:
    """Pages for ``max_running`` requests of ``max_context`` positions (headroom included by the caller)."""
    return engine.max_running * -(-max_context // engine.page_size)


def page_bytes(config: ModelConfig, num_layers: int, engine: EngineConfig) -> int:
    """K and V bytes of one page of a pool of ``num_layers`` layers of ``config``'s shape."""
    elem = torch.empty((), dtype=parse_dtype(engine.dtype)).element_size()
    return 2 * num_layers * engine.page_size * config.num_key_value_heads * config.head_dim * elem


def activation_reserve(config: ModelConfig, engine: EngineConfig, max_context: int) -> int:
    """Bytes kept free for one step's activations and logits (twice: eager and a graph's private pool)."""
    elem = torch.empty((), dtype=parse_dtype(engine.dtype)).element_size()
    chunk = engine.chunk_size or max_context
    per_token = 6 * config.hidden_size + 3 * config.intermediate_size  # residual, norms, q/k/v/o, gate/up/down
    rows = engine.max_running * (engine.spec.num_draft_tokens if engine.spec else 1)
    logits = rows * config.vocab_size * 4 * 3  # float32 logits, their log-softmax, the sampler's probabilities
    return BASE_RESERVE + 2 * (chunk * per_token * elem + logits)


@dataclass(frozen=True)
class DeviceMemory:
    """A device's memory as one engine sizes its pools (bytes)."""

    total: int  # the device's whole memory
    free: int  # free on the device now, after this engine's weights (other processes' use counts too)
    weights: int  # this engine's weights, target and draft, as loaded (the allocator's segments holding them)


def device_memory(device: torch.device, reserved_before: int) -> DeviceMemory:
    """The figures of ``device`` now; ``reserved_before``: what this process's allocator held before the weights.
    The weights are what the allocator holds now, its cached free blocks released first: their segments, the
    rounding inside them included (``memory_allocated`` would miss it, and the peak check counts it)."""
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return DeviceMemory(total=total, free=free, weights=torch.cuda.memory_reserved(device) - reserved_before)


def pages_within_budget(fraction: float, memory: DeviceMemory, reserve: int, bytes_per_page: int,
                        request_pages: int, most_pages: int, margin: float = 0.0) -> int:
    """Pages per pool (``bytes_per_page``: one page of every pool together) that fit in ``fraction`` of the
    device after the weights, ``reserve`` and ``margin`` of the fraction (``POOL_MARGIN`` for an engine), and
    in its free memory after the reserve and margin; at most ``most_pages`` (``max_running`` requests of
    ``max_context``). Fewer than ``request_pages`` (one request of ``max_context``) is a ``RequestError``
    naming every figure."""
    kept = int(margin * fraction * memory.total)
    budget = int(fraction * memory.total) - memory.weights - reserve - kept
    room = min(budget, memory.free - reserve - kept)
    pages = max(0, room) // bytes_per_page - 1  # each pool holds one page more: the padding rows' sink
    if pages < request_pages:
        unmeasured = f", a margin of {kept / GiB:.2f} GiB ({margin:.0%} of the share)" if kept else ""
        raise RequestError("gpu_memory_fraction", (
            f"the KV pools do not fit: {fraction} x {memory.total / GiB:.2f} GiB total = "
            f"{fraction * memory.total / GiB:.2f} GiB, minus the weights ({memory.weights / GiB:.2f} GiB){unmeasured} "
            f"and the activation and graph reserve ({reserve / GiB:.2f} GiB), leaves {budget / GiB:.2f} GiB "
            f"({memory.free / GiB:.2f} GiB free on the device now); one request of max_context needs "
            f"{request_pages} pages = {request_pages * bytes_per_page / GiB:.2f} GiB. Raise gpu_memory_fraction, "
            f"lower max_context, or give num_pages"))
    return min(pages, most_pages)


@dataclass(frozen=True)
class StepPeaks:
    """Bytes each profiled step took above what was reserved before it (PyTorch's allocator, at its peak),
    and the memory outside the allocator the process holds (None where it cannot be read: no NVML)."""

    prefill: int  # a full prefill chunk's forward (the features the draft reads included)
    decode: int  # the largest eager decode step (every row's logits: a verify's)
    graph: int  # the largest graph-captured decode step (0 without graphs)
    non_torch: int | None  # CUDA context, cuBLAS handles and workspaces, Triton modules


def graph_target_phases(engine: EngineConfig) -> int:
    """Graph pools to keep room for: one, shared by every captured phase (``shared.cuda_graphs.GraphPool``: a
    step replays one graph at a time, so the pool needs the largest graph step's intermediates, the profiled
    one), or none without a captured phase that runs the target."""
    if not engine.cuda_graph:
        return 0
    on = set(engine.cuda_graph_phases)
    return int("decode" in on) if engine.spec is None else int(bool({"decode", "verify"} & on))


def draft_phase_reserve(config: ModelConfig, engine: EngineConfig) -> int:
    """The draft's captured phases (draft steps and extend): their float32 logits and probabilities over the
    vocabulary for every row of the largest captured batch, twice each, for the shape with the most rows (the
    phases share the graph pool: one runs at a time); a shape's rows are its own verified tokens per request
    (a chain of 3 has 4, not the configured tree's 16)."""
    if engine.spec is None or not engine.cuda_graph:
        return 0
    rows = engine.graph_max_bs * max(s.num_draft_tokens for s in engine.spec_shapes())
    return 2 * rows * config.vocab_size * 4 * 2


def draft_backlog_reserve(engine: EngineConfig, features: int) -> int:
    """An adaptive engine's draft backlog (``shared/spec/backlog.py``): ``spec_draft_backlog`` positions of the
    draft's ``features`` per request slot. ``features``: the hidden width the draft reads per token (0: no draft)."""
    if not features or engine.spec is None or engine.spec_policy != "adaptive":
        return 0
    return (engine.max_running + 1) * engine.spec_draft_backlog * features * parse_dtype(engine.dtype).itemsize


def graph_output_reserve(config: ModelConfig, engine: EngineConfig, features: int) -> int:
    """The outputs the captured phases keep: one set per phase at its largest batch size (every batch size of a
    phase writes into the same buffer, ``shared.cuda_graphs.SharedOutputs``): a verify phase's logits and
    features for each of its shape's tokens per row, an adaptive engine's plain step's and a plain engine's
    decode logits for one. ``features``: the hidden width the draft reads per token (0 without a draft)."""
    if not engine.cuda_graph:
        return 0
    from shared.cuda_graphs import default_buckets

    on = set(engine.cuda_graph_phases)
    rows = max(default_buckets(engine.graph_max_bs))  # the largest batch size's graph, one row each
    width = (config.vocab_size + features) * parse_dtype(engine.dtype).itemsize
    if engine.spec is None:
        return rows * width * int("decode" in on)
    shapes = engine.spec_shapes() if engine.spec_policy == "adaptive" else (engine.spec,)
    tokens = sum(s.num_draft_tokens for s in shapes) * int("verify" in on)
    plain = int(engine.spec_policy == "adaptive" and "decode" in on)
    return rows * (tokens + plain) * width


def profiled_reserve(peaks: StepPeaks, target_phases: int, draft_phases: int) -> int:
    """Bytes to keep free beside weights and pools: the eager peak (the prefill chunk's or the decode step's,
    whichever is larger: the allocator reuses one's blocks for the other), a graph pool of the profiled graph
    step per target phase, the draft's phases, and the memory outside PyTorch (``BASE_RESERVE`` where it
    could not be measured)."""
    outside = BASE_RESERVE if peaks.non_torch is None else peaks.non_torch
    return max(peaks.prefill, peaks.decode) + target_phases * peaks.graph + draft_phases + outside


@dataclass(frozen=True)
class Footprint:
    """A process's memory on its GPU at its peak (bytes): PyTorch's allocator (``max_memory_reserved``) and
    the rest the process holds (its NVML figure less what the allocator holds now; None without NVML)."""

    torch_peak: int
    non_torch: int | None
    device_total: int
    fraction: float

    @property
    def peak(self) -> int:
        return self.torch_peak + (self.non_torch or 0)

    @property
    def budget(self) -> int:
        return int(self.fraction * self.device_total)

    def as_dict(self) -> dict:
        gib = lambda n: None if n is None else round(n / GiB, 3)  # noqa: E731
        return {"peak_gib": gib(self.peak), "torch_peak_gib": gib(self.torch_peak),
                "non_torch_gib": gib(self.non_torch), "budget_gib": gib(self.budget), "fraction": self.fraction,
                "device_total_gib": gib(self.device_total)}


def check_footprint(fp: Footprint) -> None:
    """A ``RequestError`` naming the figures when the process's peak passes its fraction of the device (past
    ``FOOTPRINT_SLACK``): the memory another engine on the GPU was promised."""
    if fp.peak <= fp.budget * FOOTPRINT_SLACK:
        return
    outside = "unmeasured" if fp.non_torch is None else f"{fp.non_torch / GiB:.2f} GiB"
    raise RequestError("gpu_memory_fraction", (
        f"this engine's peak is {fp.peak / GiB:.2f} GiB (PyTorch {fp.torch_peak / GiB:.2f} GiB, outside it "
        f"{outside}), above {fp.fraction} x {fp.device_total / GiB:.2f} GiB = {fp.budget / GiB:.2f} GiB; raise "
        f"gpu_memory_fraction, lower max_running, chunk_size or max_context, or give num_pages"))
