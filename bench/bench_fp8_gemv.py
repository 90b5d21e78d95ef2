"""The FP8 skinny GEMM (kernels/fp8_gemv.py) at the 8B's projection shapes: its launch configurations timed
against the copy bandwidth, to tune ``choose_config`` on a GPU (it holds kernels/gemv.py's bf16 shapes).

For each format (``channel``: per-channel scales; ``block``: 128 x 128; ``dense``: the bf16 LM head through the
same launch) and each shape of one Llama-3.1-8B layer, at M rows of x (1: a batch-1 decode step; 8: a verify of 7
drafts; both the tl.dot launch, one row under ``EYRIE_FP8_ONE_ROW=tile`` the older one-row code and its
candidates), up to 32 different weights (about 2 GiB) are multiplied back to back in one CUDA graph (no weight in
L2 when it is read) for the default configuration and, with ``--tune``, every candidate (in both ``tl.dot`` operand
orders: ``x_left``); each is checked against the dequantized product first. Prints the default's and the best's
microseconds and their share of the copy bandwidth (FP8 bytes and scales read / time).

    python bench/bench_fp8_gemv.py --tune [--rows 1,8] [--out $OUT/fp8_gemv.json]
    python bench/bench_fp8_gemv.py --splits 1,2,4,8 [--rows 1,8]   # split-K: a few launches x each split count

Every row's ``split`` is the count of programs sharing K (``kernels/fp8_gemv.py choose_split``: the default's
``auto``).
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
from kernels.fp8_gemv import TILE_ROWS, choose_config, choose_split, fp8_linear, fp8_linear_ref, unit_scale  # noqa: E402
from shared.model import fp8  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
HEAD = {"lm_head": (128256, 4096)}  # format ``dense``: an FP8 model's bf16 LM head (same_rows_linear)
REPS = 32


def tile_rows(m: int) -> int:
    """The launch's rows per program: 16 at every row count (the tl.dot code), 1 for one row only under
    ``EYRIE_FP8_ONE_ROW=tile`` (the older one-row code, as kernels/fp8_gemv.py decides)."""
    return 1 if m == 1 and os.environ.get("EYRIE_FP8_ONE_ROW", "dot") == "tile" else TILE_ROWS


def candidates(m: int, k: int, bk: int) -> list[tuple[tuple[int, int, int, int], bool]]:
    """(launch configuration, x_left): the tl.dot code in both operand orders (x's rows left or the weight's)."""
    if tile_rows(m) == 1:
        grid = itertools.product((8, 16, 32), (1024, 2048, 4096), (4, 8), (3, 4))
        return [(c, False) for c in grid if c[0] * c[1] <= 32768 and c[1] <= k]
    bks = (64, 128) if bk < k else (256, 512)
    grid = itertools.product((16, 32, 64), bks, (4, 8), (3, 4), (False, True))
    return [(c[:4], c[4]) for c in grid if c[1] <= min(bk, k)]


def split_candidates(m: int, k: int, bk: int, splits: list[int]) -> list[tuple[tuple[int, int, int, int], bool, int]]:
    """(launch configuration, x_left, split): the tl.dot code (x's rows left) at a few tile shapes near the
    default, each at every split count asked for."""
    shapes = [(16, 256, 4, 4), (32, 256, 4, 4), (32, 128, 4, 4), (64, 256, 4, 4), (32, 512, 4, 3)]
    step = min(bk, k)
    return [(c, True, sp) for c in shapes for sp in splits if c[1] <= step and k // sp >= c[1]]


def weights(fmt: str, n: int, k: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Enough different weights that none is in L2 when it is read (at most REPS, about 2 GiB): FP8 with its
    scales, or (``dense``) bf16 with the unit scale, as ``same_rows_linear`` runs an FP8 model's LM head."""
    reps = max(2, min(REPS, (2 << 30) // (n * k * (2 if fmt == "dense" else 1))))
    if fmt == "dense":
        return [(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02, unit_scale(torch.device("cuda")))
                for _ in range(reps)]
    return [fp8.quantize(torch.randn(n, k, device="cuda") * 0.02, fmt, (128, 128)) for _ in range(reps)]


def measure(fmt: str, name: str, n: int, k: int, m: int, bw: float, tune: bool, sms: int,
            splits: list[int] | None = None) -> list[dict]:
    block = (1, k) if fmt == "channel" else (n, k) if fmt == "dense" else (128, 128)
    ws = weights(fmt, n, k)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    ref = fp8_linear_ref(x.float(), ws[0][0], ws[0][1], block).double()
    cfg0 = choose_config(tile_rows(m), n, k, min(block[1], k), sms)
    split0 = 1 if tile_rows(m) == 1 else choose_split(n, k, cfg0[0], cfg0[1], sms)
    default = (cfg0, os.environ.get("EYRIE_FP8_DOT", "xw") == "xw", split0)
    configs = [default] + ([(c, xl, split0) for c, xl in candidates(m, k, block[1]) if (c, xl, split0) != default]
                           if tune else [])
    if splits and tile_rows(m) > 1:
        configs += [c for c in split_candidates(m, k, block[1], splits) if c not in configs]
    rows = []
    for cfg, x_left, split in configs:
        try:
            got = fp8_linear(x, ws[0][0], ws[0][1], block, config=cfg, x_left=x_left, split=split)
            err = ((got.double() - ref).norm() / ref.norm()).item()
            if not err < 1e-2:
                print(f"  {fmt} {name} m={m} {cfg} x_left={x_left} split={split}: WRONG (rel err {err:.2e})",
                      flush=True)
                continue
            if m > 1 and not torch.equal(fp8_linear(x[:1], ws[0][0], ws[0][1], block, config=cfg, x_left=x_left,
                                                    split=split), got[:1]):
                print(f"  {fmt} {name} m={m} {cfg} split={split}: row 0's bits differ alone", flush=True)
                continue

            def run(cfg=cfg, ws=ws, x_left=x_left, split=split):
                for q, s in ws:
                    fp8_linear(x, q, s, block, config=cfg, x_left=x_left, split=split)

            us = time_cuda(graph_of(run).replay) / len(ws) * 1e3
        except Exception as e:  # noqa: BLE001 - a configuration the compiler refuses (registers, shared memory)
            print(f"  {fmt} {name} m={m} {cfg}: failed ({type(e).__name__}: {str(e)[:80]})", flush=True)
            continue
        nbytes = n * k * ws[0][0].element_size() + ws[0][1].numel() * 4
        rows.append({"format": fmt, "gemm": name, "n": n, "k": k, "m": m, "config": list(cfg), "x_left": x_left,
                     "split": split, "us": us, "of_copy_bw": nbytes / (us / 1e6) / bw,
                     "default": (cfg, x_left, split) == default})
    del ws
    torch.cuda.empty_cache()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tune", action="store_true")
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--splits", help="split-K counts to try at a few launches, e.g. 1,2,4,8")
    ap.add_argument("--formats", default="channel,block,dense")
    ap.add_argument("--out")
    args = ap.parse_args()
    bw = copy_bandwidth()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name()}  copy bandwidth {bw / 1e12:.3f} TB/s  SMs {sms}", flush=True)
    results = []
    for fmt in args.formats.split(","):
        for m in (int(r) for r in args.rows.split(",")):
            for name, (n, k) in (HEAD if fmt == "dense" else SHAPES).items():
                rows = measure(fmt, name, n, k, m, bw, args.tune, sms,
                               [int(v) for v in args.splits.split(",")] if args.splits else None)
                results += rows
                d = next((r for r in rows if r["default"]), None)
                best = min(rows, key=lambda r: r["us"], default=None)
                if d is None or best is None:
                    print(f"{fmt:7s} {name:8s} m={m:2d}  default failed", flush=True)
                    continue
                print(f"{fmt:7s} {name:8s} m={m:2d}  default {tuple(d['config'])} split {d['split']} {d['us']:7.1f} us "
                      f"({d['of_copy_bw']:.2f})  best {tuple(best['config'])} x_left={best['x_left']} split "
                      f"{best['split']} {best['us']:7.1f} us ({best['of_copy_bw']:.2f})", flush=True)
                for xl in (False, True):  # the best of each operand order
                    b = min((r for r in rows if r["x_left"] == xl), key=lambda r: r["us"], default=None)
                    if b is not None:
                        print(f"{'':16s} best with x_left={xl}: {tuple(b['config'])} {b['us']:7.1f} us "
                              f"({b['of_copy_bw']:.2f})", flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "copy_bw_Bps": bw,
                                              "rows": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
