"""Host time of one Triton launch: ``kernels.launch.fast`` against Triton's ``JITFunction.run``, on CUDA.

Each kernel is called ``--calls`` times in a row at a decode-like shape (the GPU's work is a few us, so the
loop is bound by the host); the figure is wall time per call, the median of ``--reps`` loops, with the
GPU drained before and after each loop.

    python bench/bench_launch.py --out launch.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kernels.fused as fused  # noqa: E402
import kernels.launch as launch  # noqa: E402
import kernels.norm_rope as norm_rope  # noqa: E402


def cases(dev):
    x = torch.randn(1, 4096, device=dev, dtype=torch.bfloat16)
    r, w = torch.randn_like(x), torch.randn(4096, device=dev, dtype=torch.bfloat16)
    gate_up = torch.randn(1, 2 * 14336, device=dev, dtype=torch.bfloat16)
    qkv = torch.randn(1, (32 + 16) * 128, device=dev, dtype=torch.bfloat16)
    cos, sin = torch.randn(1, 64, device=dev), torch.randn(1, 64, device=dev)
    kc = torch.zeros(4096, 8, 128, device=dev, dtype=torch.bfloat16)
    vc, slots = torch.zeros_like(kc), torch.tensor([7], device=dev)
    return {
        "rms_norm (residual)": (norm_rope._rms_norm_kernel, lambda: norm_rope.rms_norm(x, w, 1e-5, r)),
        "silu_mul": (fused._silu_mul_kernel, lambda: fused.silu_mul(gate_up)),
        "rope_store": (fused._rope_store_kernel, lambda: fused.rope_store(qkv, cos, sin, kc, vc, slots, 32, 8)),
    }


def time_loop(call, calls: int, reps: int) -> float:
    per = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
        per.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(per)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_launch: needs CUDA", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    rows = []
    for name, (kernel, call) in cases(dev).items():
        fast = launch.fast(kernel)
        call()  # compiled (and stored by the short path)
        launch._LAUNCHERS[id(kernel)] = kernel  # Triton's own path
        jit_us = time_loop(call, args.calls, args.reps)
        launch._LAUNCHERS[id(kernel)] = fast
        fast_us = time_loop(call, args.calls, args.reps)
        rows.append({"kernel": name, "jit_us": round(jit_us, 2), "fast_us": round(fast_us, 2),
                     "ratio": round(fast_us / jit_us, 3)})
        print(f"{name:22s} JITFunction.run {jit_us:7.2f} us   fast {fast_us:7.2f} us   ({fast_us / jit_us:.2f}x)")
    if args.out:
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "calls": args.calls,
                                        "reps": args.reps, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
