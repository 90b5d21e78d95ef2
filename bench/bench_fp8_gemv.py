"""The FP8 skinny GEMM (kernels/fp8_gemv.py) at the 8B's projection shapes: its launch configurations timed
against the copy bandwidth, to tune ``choose_config`` on a GPU (it holds kernels/gemv.py's bf16 shapes).

For each format (``channel``: per-channel scales; ``block``: 128 x 128) and each shape of one Llama-3.1-8B
layer, at M rows of x (1: a batch-1 decode step; 8: a verify of 7 drafts; both the tl.dot launch, one row
under ``EYRIE_FP8_ONE_ROW=tile`` the older one-row code and its candidates), 32 different FP8 weights are
multiplied back to back in one CUDA graph (no weight in L2 when it is read) for the default configuration and,
with ``--tune``, every candidate; each is checked against the dequantized product first. Prints the default's
and the best's microseconds and their share of the copy bandwidth (FP8 bytes and scales read / time).

    python bench/bench_fp8_gemv.py --tune [--rows 1,8] [--out $OUT/fp8_gemv.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.timing import copy_bandwidth, graph_of, time_cuda  # noqa: E402
from kernels.fp8_gemv import TILE_ROWS, choose_config, fp8_linear, fp8_linear_ref  # noqa: E402
from shared.model import fp8  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
REPS = 32


def tile_rows(m: int) -> int:
    """The launch's rows per program: 16 at every row count (the tl.dot code), 1 for one row only under
    ``EYRIE_FP8_ONE_ROW=tile`` (the older one-row code, as kernels/fp8_gemv.py decides)."""
    return 1 if m == 1 and os.environ.get("EYRIE_FP8_ONE_ROW", "dot") == "tile" else TILE_ROWS


def candidates(m: int, k: int, bk: int) -> list[tuple[int, int, int, int]]:
    if tile_rows(m) == 1:
        grid = itertools.product((8, 16, 32), (1024, 2048, 4096), (4, 8), (3, 4))
        return [c for c in grid if c[0] * c[1] <= 32768 and c[1] <= k]
    bks = (64, 128) if bk < k else (128, 256, 512)
    return [c for c in itertools.product((16, 32, 64, 128), bks, (4, 8), (3, 4)) if c[1] <= min(bk, k)]


def measure(fmt: str, name: str, n: int, k: int, m: int, bw: float, tune: bool, sms: int) -> list[dict]:
    block = (1, k) if fmt == "channel" else (128, 128)
    ws = [fp8.quantize(torch.randn(n, k, device="cuda") * 0.02, fmt, (128, 128)) for _ in range(REPS)]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    ref = fp8_linear_ref(x.float(), ws[0][0], ws[0][1], block).double()
    default = choose_config(tile_rows(m), n, k, min(block[1], k), sms)
    configs = [default] + ([c for c in candidates(m, k, block[1]) if c != default] if tune else [])
    rows = []
    for cfg in configs:
        try:
            got = fp8_linear(x, ws[0][0], ws[0][1], block, config=cfg)
            err = ((got.double() - ref).norm() / ref.norm()).item()
            if not err < 1e-2:
                print(f"  {fmt} {name} m={m} {cfg}: WRONG (rel err {err:.2e})", flush=True)
                continue

            def run(cfg=cfg, ws=ws):
                for q, s in ws:
                    fp8_linear(x, q, s, block, config=cfg)

            us = time_cuda(graph_of(run).replay) / REPS * 1e3
        except Exception as e:  # noqa: BLE001 - a configuration the compiler refuses (registers, shared memory)
            print(f"  {fmt} {name} m={m} {cfg}: failed ({type(e).__name__}: {str(e)[:80]})", flush=True)
            continue
        nbytes = n * k + ws[0][1].numel() * 4
        rows.append({"format": fmt, "gemm": name, "n": n, "k": k, "m": m, "config": list(cfg), "us": us,
                     "of_copy_bw": nbytes / (us / 1e6) / bw, "default": cfg == default})
    del ws
    torch.cuda.empty_cache()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tune", action="store_true")
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--formats", default="channel,block")
    ap.add_argument("--out")
    args = ap.parse_args()
    bw = copy_bandwidth()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name()}  copy bandwidth {bw / 1e12:.3f} TB/s  SMs {sms}", flush=True)
    results = []
    for fmt in args.formats.split(","):
        for m in (int(r) for r in args.rows.split(",")):
            for name, (n, k) in SHAPES.items():
                rows = measure(fmt, name, n, k, m, bw, args.tune, sms)
                results += rows
                d = next((r for r in rows if r["default"]), None)
                best = min(rows, key=lambda r: r["us"], default=None)
                if d is None or best is None:
                    print(f"{fmt:7s} {name:8s} m={m:2d}  default failed", flush=True)
                    continue
                print(f"{fmt:7s} {name:8s} m={m:2d}  default {tuple(d['config'])} {d['us']:7.1f} us "
                      f"({d['of_copy_bw']:.2f})  best {tuple(best['config'])} {best['us']:7.1f} us "
                      f"({best['of_copy_bw']:.2f})", flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "copy_bw_Bps": bw,
                                              "rows": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
