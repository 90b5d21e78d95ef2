"""Timing helpers every benchmark shares: torch only, so kernel benchmarks need not import the engine.

* ``time_cuda(fn)``: median milliseconds of ``fn`` over several runs, CUDA events around each, after a
  warm-up (module load, compilation, allocator);
* ``graph_of(fn)``: ``fn`` captured as one CUDA graph (warmed up on a side stream first), to time
  device work without the host's launch cost;
* ``copy_bandwidth()``: device-to-device copy bandwidth measured now, read + write counted: the
  bandwidth every floor in docs/benchmarks.md divides by;
* ``timer_ms(fn)``: ``time_cuda`` on a GPU, the wall clock's median per call on the CPU (dry runs);
* ``write_json(path, payload)``.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch


def time_cuda(fn, iters: int = 30, warmup: int = 5, calls: int = 1) -> float:
    """Median milliseconds per call of ``fn`` over ``iters`` repetitions of ``calls`` back-to-back calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def graph_of(fn, calls: int = 1, warmup: int = 1) -> torch.cuda.CUDAGraph:
    """``calls`` invocations of ``fn`` captured as one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):  # compile and warm up outside the capture
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write counted), measured now."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = time_cuda(lambda: dst.copy_(src), iters=20)
    return 2 * nbytes / (ms / 1e3)


def write_json(path: str | None, payload: dict) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(payload, indent=1))


def timer_ms(fn, iters: int, warmup: int, calls: int) -> float:
    """Median milliseconds per call of ``fn``: CUDA events on a GPU, the wall clock on the CPU."""
    if torch.cuda.is_available():
        return time_cuda(fn, iters=iters, warmup=warmup, calls=calls)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) * 1e3 / calls)
    return statistics.median(times)
