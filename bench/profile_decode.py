"""Where a batch-1 decode step of the 8B shape spends its time, and what its GEMVs can reach.

1. GEMV ceilings: each weight shape of one layer (and the LM head) alone, 32 back-to-back in one
   CUDA graph, as achieved read bandwidth (weight bytes / time) against the copy bandwidth.
2. Kernel breakdown: one eager decode step under torch.profiler, CUDA time summed by kernel name,
   against the graph-replayed step time (the difference is launch gaps inside the graph).

    python bench/profile_decode.py --out docs/bench/profile.json
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_decode import fake_requests
from bench.common import build_target, copy_bandwidth, engine_config, param_bytes, time_cuda, write_json
from bench.timing import graph_of
from shared.engine import Engine


def gemv_ceilings(bw: float, batch: int = 1) -> list[dict]:
    shapes = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
              "lm_head": (128256, 4096)}
    rows = []
    for name, (n, k) in shapes.items():
        reps = 4 if name == "lm_head" else 32
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(reps)]  # no cache reuse
        x = torch.randn(batch, k, device="cuda", dtype=torch.bfloat16)
        outs = [torch.empty(batch, n, device="cuda", dtype=torch.bfloat16) for _ in range(reps)]
        def run_all(x=x, ws=ws, outs=outs):
            for w, out in zip(ws, outs):
                torch.matmul(x, w.t(), out=out)

        g = graph_of(run_all)
        ms = time_cuda(g.replay, iters=20) / reps
        nbytes = n * k * 2
        rows.append({"gemm": name, "n": n, "k": k, "batch": batch, "us": ms * 1e3,
                     "read_TBps": nbytes / (ms / 1e3) / 1e12, "of_copy_bw": nbytes / (ms / 1e3) / bw})
        print(f"gemv {name:8s} [{batch}x{k}]x[{k}x{n}]  {ms * 1e3:7.1f} us  "
              f"{nbytes / (ms / 1e3) / 1e12:5.2f} TB/s  ({nbytes / (ms / 1e3) / bw:.2f} of copy BW)", flush=True)
    return rows


def kernel_breakdown(target, ctx: int = 1024) -> dict:
    engine = Engine(target, config=engine_config(ctx, 1))
    reqs = fake_requests(engine, 1, ctx)
    dev = engine.device
    rows = torch.tensor([r.handles[0].row for r in reqs], device=dev)
    lens = torch.full((1,), ctx, dtype=torch.int64, device=dev)
    toks = torch.ones(1, dtype=torch.int64, device=dev)
    engine.cache.reserve(reqs[0].handles[0], ctx + 1)
    g = engine.decode_graphs
    graph_ms = time_cuda(lambda: g(rows, lens, toks))
    g.capture = False
    for _ in range(3):
        g(rows, lens, toks)
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        g(rows, lens, toks)
        torch.cuda.synchronize()
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            key = evt.name[:90]
            by_name[key][0] += evt.device_time_total if hasattr(evt, "device_time_total") else evt.cuda_time_total
            by_name[key][1] += 1
    total_us = sum(v[0] for v in by_name.values())
    top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:25]
    print(f"graph step {graph_ms * 1e3:.0f} us; sum of kernel times {total_us:.0f} us over "
          f"{sum(v[1] for v in by_name.values())} kernels", flush=True)
    for name, (us, n) in top:
        print(f"  {us:8.1f} us  x{n:4d}  {name}", flush=True)
    return {"graph_us": graph_ms * 1e3, "kernel_sum_us": total_us,
            "kernels": [{"name": k, "us": v[0], "count": v[1]} for k, v in top]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    args = ap.parse_args()
    bw = copy_bandwidth()
    print(f"device {torch.cuda.get_device_name()}  copy bandwidth {bw / 1e12:.3f} TB/s", flush=True)
    result = {"device": torch.cuda.get_device_name(), "copy_bw_Bps": bw,
              "gemv_b1": gemv_ceilings(bw, 1), "gemv_b8": gemv_ceilings(bw, 8)}
    target = build_target()
    result["weight_bytes"] = param_bytes(target)
    result["floor_us"] = param_bytes(target) / bw * 1e6
    print(f"weights {result['weight_bytes'] / 1e9:.2f} GB  floor {result['floor_us']:.0f} us", flush=True)
    result["breakdown"] = kernel_breakdown(target)
    write_json(args.out, result)


if __name__ == "__main__":
    main()
