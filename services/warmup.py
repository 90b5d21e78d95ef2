"""Before an engine service says it is ready: one request through its engine, then its memory peak.

The warm-up request is a prompt of one full prefill chunk (the largest step a prefill runs; off a GPU a
short one) and, on a decode engine, a few output tokens (its decode and speculative steps, graphs
replayed). Then, on a GPU, the process's peak (PyTorch's ``max_memory_reserved`` and the memory outside
it, by NVML) is logged, exported on /metrics and, where the configuration set ``gpu_memory_fraction``,
checked against that fraction of the device. Either failing stops start-up with one line naming why: the
service never turns ready (no 200 on /health, no SERVING on gRPC health, no entry in Redis), and
``eyrie serve`` exits 2.
"""

from __future__ import annotations

import time
import uuid

from services.logs import ServiceLog
from services.telemetry import Telemetry
from shared.config import DEFAULT_GPU_MEMORY_FRACTION
from shared.memory.sizing import Footprint, check_footprint
from shared.request import RequestError, Stage
from shared.sampling import SamplingParams

WARMUP_OUTPUT = 4  # output tokens of a decode engine's warm-up request
CPU_WARMUP_TOKENS = 16  # the warm-up prompt off a GPU (on one: a full prefill chunk)


def warm_up(engine) -> dict:
    """One request through ``engine`` (an ``Engine`` or a tensor-parallel ``Leader``), its pages released
    after, and its prompt's pages flushed from the prefix cache (made-up ids: a cache summary must not publish
    them); a ``RequestError`` (field ``warmup``) naming what failed."""
    config, prefill = engine.config, engine.role == "prefill"
    output = 1 if prefill else max(1, min(WARMUP_OUTPUT, engine.max_context - 2))  # a tiny context: fewer
    chunk = config.chunk_size or engine.max_context
    if engine.device.type != "cuda":  # no memory peak to reach off a GPU: a short prompt proves the engine works
        chunk = min(chunk, CPU_WARMUP_TOKENS)
    n = max(1, min(chunk, engine.max_context - config.headroom - output - 1))
    vocab = engine.handoff_schema().vocab_size
    ids = [1 + i % (vocab - 1) for i in range(n)]
    t0, req = time.perf_counter(), None
    try:
        req = engine.add_request(ids, SamplingParams(max_new_tokens=output, ignore_eos=True),
                                 rid=f"warmup-{uuid.uuid4().hex[:8]}")
        for _ in range(n + output + 16):  # a step per chunk and per token at worst, and a margin
            engine.step()
            if req.finish_reason is not None or (prefill and req.stage is Stage.HANDOFF):
                break
        else:
            raise RuntimeError(f"the request was unfinished after {n + output + 16} steps (stage {req.stage.value})")
        if req.finish_reason not in (None, "length"):
            raise RuntimeError(f"the request ended with {req.finish_reason!r}")
    except Exception as e:  # an engine error (a CUDA or cuBLAS failure): the service cannot serve
        first = (str(e).strip().splitlines() or [""])[0]  # one line: a CUDA error's text runs on
        raise RequestError("warmup", f"the warm-up request ({n} prompt tokens) failed: {type(e).__name__}: {first}"
                           ) from e
    finally:
        if req is not None and engine.holds(req):
            engine.release(req, "warmup")
        if engine.prefix_cache is not None:
            engine.flush_prefix_cache()
    return {"prompt_tokens": n, "output_tokens": len(req.output_ids), "seconds": round(time.perf_counter() - t0, 3)}


def footprint(engine) -> Footprint | None:
    """The process's memory peak on its engine's GPU so far (None off CUDA)."""
    if engine.device.type != "cuda":
        return None
    import torch

    from shared.memory.nvml import outside_torch, process_used_bytes

    device = engine.device
    torch.cuda.synchronize(device)
    torch_peak = max(getattr(engine, "load_peak", 0), torch.cuda.max_memory_reserved(device))
    non_torch = outside_torch(process_used_bytes(device), torch.cuda.memory_reserved(device))
    _, total = torch.cuda.mem_get_info(device)
    return Footprint(torch_peak=torch_peak, non_torch=non_torch, device_total=total,
                     fraction=engine.config.gpu_memory_fraction or DEFAULT_GPU_MEMORY_FRACTION)


def check_ready(engine, fraction_set: bool, telemetry: Telemetry, log: ServiceLog) -> None:
    """Warm ``engine`` up, then record its memory peak and (``fraction_set``: the configuration promised a
    fraction of the GPU) hold it to that fraction; raises ``RequestError`` naming the failure."""
    telemetry.set_state("warming_up")
    try:
        facts = warm_up(engine)
    except RequestError as e:
        log.event("warmup_failed", level=40, reason=str(e))
        telemetry.errors_total.labels("warmup_failed").inc()
        raise
    log.event("warmed_up", **facts)
    telemetry.skip_counts(engine.load())  # /metrics counts the requests served, not the warm-up
    fp = footprint(engine)
    if fp is None:
        return
    peaks = getattr(engine, "step_peaks", None)
    log.event("gpu_memory", **fp.as_dict(), step_peaks_gib=None if peaks is None else {
        k: None if v is None else round(v / 2 ** 30, 3) for k, v in vars(peaks).items()},
        plan=getattr(engine, "memory_plan", None))  # what the pools were sized by: which part overran
    telemetry.observe_footprint(fp)
    if fraction_set:
        check_footprint(fp)
