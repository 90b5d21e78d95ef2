"""Sweep the page-copy kernel's block size and warps on a GPU: a 4096-token hand-off at Llama-3.1-8B's KV
shape (32 layers, 8 KV heads of 128, bf16, 16-token pages scattered on both sides), each variant's median
device time (CUDA events) against the device's own copy of the same bytes.

    python bench/tune_page_copy.py --json docs/bench/page_copy_tune_h100.json
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
from pathlib import Path

import torch
import triton
import triton.language as tl

from kernels.page_copy import _page_ids, copy_pages, copy_pages_ref


@triton.jit
def _variant_kernel(src, dst, src_ids, dst_ids, src_plane, dst_plane, page_elems, planes,
                    BLOCK: tl.constexpr, PLANES: tl.constexpr, EVICT: tl.constexpr):
    """Candidate: PLANES (K/V, layer) planes of one page per program, loads issued before stores."""
    page = tl.program_id(0)
    plane0 = tl.program_id(1).to(tl.int64) * PLANES
    offs = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < page_elems
    s = tl.load(src_ids + page)
    d = tl.load(dst_ids + page)
    for i in tl.static_range(PLANES):
        src_base = src + (plane0 + i) * src_plane + s * page_elems
        dst_base = dst + (plane0 + i) * dst_plane + d * page_elems
        if EVICT:
            x = tl.load(src_base + offs, mask=mask, eviction_policy="evict_first")
            tl.store(dst_base + offs, x, mask=mask, cache_modifier=".cs")
        else:
            tl.store(dst_base + offs, tl.load(src_base + offs, mask=mask), mask=mask)


def variant(dst, src, src_pages, dst_pages, page_size, block, num_warps, planes_per_program, evict):
    ids = _page_ids(src_pages, dst_pages, src.device)
    planes = src.shape[0] * src.shape[1]
    page_elems = page_size * src.shape[3] * src.shape[4]
    block = min(block, triton.next_power_of_2(page_elems))
    grid = (len(src_pages), planes // planes_per_program, triton.cdiv(page_elems, block))
    _variant_kernel[grid](src, dst, ids[0], ids[1], src.shape[2] * src.shape[3] * src.shape[4],
                          dst.shape[2] * dst.shape[3] * dst.shape[4], page_elems, planes, BLOCK=block,
                          PLANES=planes_per_program, EVICT=evict, num_warps=num_warps)


def timed(fn, repeat: int) -> float:
    """Median seconds of ``fn`` on the current stream, after a warm-up call."""
    fn()
    times = []
    for _ in range(repeat):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--blocks", default="1024,2048,4096,8192,16384")
    ap.add_argument("--warps", default="2,4,8,16")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    n_pages = args.tokens // args.page_size
    slots = 2 * n_pages * args.page_size
    src = torch.randn(2, args.layers, slots, 8, 128, device=dev, dtype=torch.bfloat16)
    dst = torch.zeros_like(src)
    g = torch.Generator().manual_seed(0)
    src_pages = torch.randperm(2 * n_pages, generator=g)[:n_pages].tolist()
    dst_pages = torch.randperm(2 * n_pages, generator=g)[:n_pages].tolist()
    nbytes = 2 * args.layers * n_pages * args.page_size * 8 * 128 * 2
    flat_a = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=dev).normal_()
    flat_b = torch.empty_like(flat_a)
    ref_s = timed(lambda: flat_b.copy_(flat_a), args.repeat)
    expect = torch.zeros_like(src)
    copy_pages_ref(expect, src, src_pages, dst_pages, args.page_size)
    rows = []
    for block in map(int, args.blocks.split(",")):
        for warps in map(int, args.warps.split(",")):
            dst.zero_()
            copy_pages(dst, src, src_pages, dst_pages, args.page_size, block=block, num_warps=warps)
            assert torch.equal(dst, expect), (block, warps)
            run = functools.partial(copy_pages, dst, src, src_pages, dst_pages, args.page_size, block=block,
                                    num_warps=warps)
            s = timed(run, args.repeat)
            rows.append({"block": block, "num_warps": warps, "seconds": s, "gbps": nbytes / s / 1e9,
                         "of_device_copy": ref_s / s})
            print(f"block {block:6d} warps {warps:2d}: {s * 1e3:7.3f} ms {nbytes / s / 1e9:8.1f} GB/s "
                  f"({ref_s / s:.2f} of the device copy)", flush=True)
    for block, warps, per, evict in [(4096, 4, 1, True), (16384, 8, 1, True), (4096, 4, 2, False),
                                     (4096, 8, 4, False), (8192, 8, 2, False), (4096, 4, 2, True),
                                     (2048, 4, 4, True), (16384, 8, 2, True)]:
        dst.zero_()
        run = functools.partial(variant, dst, src, src_pages, dst_pages, args.page_size, block, warps, per, evict)
        run()
        assert torch.equal(dst, expect), (block, warps, per, evict)
        s = timed(run, args.repeat)
        rows.append({"variant": f"planes{per}" + ("-evict" if evict else ""), "block": block, "num_warps": warps,
                     "seconds": s, "gbps": nbytes / s / 1e9, "of_device_copy": ref_s / s})
        print(f"variant {rows[-1]['variant']:14s} block {block:6d} warps {warps:2d}: {s * 1e3:7.3f} ms "
              f"{nbytes / s / 1e9:8.1f} GB/s ({ref_s / s:.2f} of the device copy)", flush=True)
    pairs = sorted(zip(src_pages, dst_pages))  # the same copy, programs in the order of the source pages
    by_src = ([a for a, _ in pairs], [b for _, b in pairs])
    for block, warps in [(4096, 4), (16384, 8)]:
        dst.zero_()
        run = functools.partial(copy_pages, dst, src, *by_src, args.page_size, block=block, num_warps=warps)
        run()
        assert torch.equal(dst, expect), (block, warps, "sorted")
        s = timed(run, args.repeat)
        rows.append({"variant": "sorted-by-source", "block": block, "num_warps": warps, "seconds": s,
                     "gbps": nbytes / s / 1e9, "of_device_copy": ref_s / s})
        print(f"variant sorted-by-source block {block:6d} warps {warps:2d}: {s * 1e3:7.3f} ms "
              f"{nbytes / s / 1e9:8.1f} GB/s ({ref_s / s:.2f} of the device copy)", flush=True)
    best = max(rows, key=lambda r: r["gbps"])
    print(f"device copy {ref_s * 1e3:.3f} ms {nbytes / ref_s / 1e9:.1f} GB/s; best {best}")
    if args.json:
        Path(args.json).write_text(json.dumps({"bytes": nbytes, "device": torch.cuda.get_device_name(),
                                               "device_copy_s": ref_s, "rows": rows, "best": best}, indent=2))


if __name__ == "__main__":
    main()
