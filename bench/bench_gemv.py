"""The decode-step projections at a few rows: Triton skinny GEMM (kernels/gemv.py) vs cuBLAS.

For each weight shape of one Llama-3.1-8B layer and its LM head, at M rows of x (M=1: a decode step
at batch 1; M=8: verify of 8 draft tokens, or batch 8), time 32 different weight matrices back to
back in one CUDA graph (so no weight is in L2 when it is read) and report achieved weight-read
bandwidth against the device-to-device copy bandwidth measured in the same run. ``--tune`` sweeps the
kernel's launch configurations and prints the best per shape. Every variant is checked against
float64 before it is timed.

    python bench/bench_gemv.py [--tune] [--out docs/bench/gemv.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.timing import copy_bandwidth, graph_of, time_cuda  # noqa: E402
from kernels.gemv import choose_config, linear  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}


def measure(name, n, k, m, bw, configs):
    reps = 4 if name == "lm_head" else 32
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(reps)]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    outs = [torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for _ in range(reps)]
    ref = (x.double() @ ws[0].double().t())
    rows = []
    for cfg in configs:
        backend = "torch" if cfg is None else "triton"
        try:
            got = linear(x, ws[0], backend=backend, config=cfg)
            err = ((got.double() - ref).norm() / ref.norm()).item()
            if not err < 1e-2:
                print(f"  {name} m={m} {cfg}: WRONG (rel err {err:.2e})", flush=True)
                continue

            def run(cfg=cfg, backend=backend, ws=ws, outs=outs):
                for w, o in zip(ws, outs):
                    if backend == "torch":
                        torch.matmul(x, w.t(), out=o)
                    else:
                        linear(x, w, backend=backend, config=cfg, out=o)

            g = graph_of(run)
            us = time_cuda(g.replay) / reps * 1e3
        except Exception as e:  # a configuration the compiler refuses (shared memory, registers)
            print(f"  {name} m={m} {cfg}: failed ({type(e).__name__}: {str(e)[:80]})", flush=True)
            continue
        gbps = n * k * 2 / (us / 1e6)
        rows.append({"gemm": name, "n": n, "k": k, "m": m, "config": cfg or "cublas", "us": us,
                     "of_copy_bw": gbps / bw})
    del ws, outs
    torch.cuda.empty_cache()
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tune", action="store_true")
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--out")
    args = ap.parse_args()
    bw = copy_bandwidth()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name()}  copy bandwidth {bw / 1e12:.3f} TB/s  SMs {sms}", flush=True)
    results = []
    for m in (int(r) for r in args.rows.split(",")):
        for name, (n, k) in SHAPES.items():
            configs = [None, choose_config(m, n, k, sms)]
            if args.tune:
                bks = (256, 512, 1024) if m == 1 else (128, 256, 512)
                bns = (8, 16, 32) if m == 1 else (16, 32, 64)
                configs += [c for c in itertools.product(bns, bks, (4, 8), (3, 4))
                            if c not in configs and c[0] * c[1] <= 16384]
            rows = measure(name, n, k, m, bw, configs)
            results += rows
            cub = next((r for r in rows if r["config"] == "cublas"), None)
            default = next((r for r in rows if r["config"] == configs[1]), None)
            best = min((r for r in rows if r["config"] != "cublas"), key=lambda r: r["us"], default=None)
            print(f"{name:8s} m={m:2d}  cublas {cub['us']:7.1f} us ({cub['of_copy_bw']:.2f})  "
                  f"triton default {default['us'] if default else float('nan'):7.1f} us "
                  f"({default['of_copy_bw'] if default else float('nan'):.2f})  "
                  f"best {best['config']} {best['us']:7.1f} us ({best['of_copy_bw']:.2f})", flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "copy_bw_Bps": bw,
                                              "rows": results}, indent=1))


if __name__ == "__main__":
    main()
