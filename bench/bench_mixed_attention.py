"""A mixed step's attention on CUDA: the whole batch through the extend kernel (before) against its decode rows
through the decode launch and its chunks through the extend kernel (``kernels.mixed_attention``, after).

Issue 30's mixed step at the 8B attention shape (32 query / 8 KV heads x 128, bf16, pages of 16): prefill chunks
of 512 tokens (after a 128-token prefix) beside decode rows at contexts of ~640 (576..703), keys split as an
engine with a 4096-token context splits them. Per shape, one attention layer:

* the bits first: decode rows == the decode launch on a batch of only them, chunk rows == the extend kernel on a
  batch of only them, all == the torch reference within tolerance (``tests/mixed_attention_checks.py``);
* ``before_us``: ``extend_attention`` over the whole batch (this step's K/V gathered from the cache slots, as
  ``Attention.forward`` did); ``after_us``: ``mixed_attention`` (the same gathers for the chunks' rows only),
  eager (mixed steps are not captured: host launch cost included) and replayed from a CUDA graph (device time);
  the two launches of the split alone; ``split_host_us``: making the split (once per forward, not per layer);
* ``decode_floor_us``: the decode rows' K/V bytes at the copy bandwidth measured in the same run.

    python bench/bench_mixed_attention.py [--quick] [--out results/mixed_attention.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.timing import copy_bandwidth, graph_of, time_cuda, write_json
from kernels.attention import choose_split_len, paged_attention
from kernels.extend_attention import extend_attention
from kernels.mixed_attention import mixed_attention, split_mixed
from tests.attention_invariance import Shape
from tests.mixed_attention_checks import check_mixed, mixed_case

SHAPE = Shape(hkv=8, group=4, d=128)
SCALE = SHAPE.d ** -0.5
CHUNK, CHUNK_PREFIX = 512, 128


def batch_shape(chunks: int, decode_rows: int, seed: int) -> tuple[list[int], list[int]]:
    """(q_lens, prefixes): the decode rows first, then the chunks (the engine's order)."""
    g = torch.Generator().manual_seed(seed)
    contexts = (576 + torch.randint(0, 128, (decode_rows,), generator=g)).tolist()
    return [1] * decode_rows + [CHUNK] * chunks, contexts + [CHUNK_PREFIX] * chunks


def graph_us(fn, calls: int = 10) -> float:
    graph = graph_of(fn, calls=calls, warmup=3)
    return 1e3 * time_cuda(graph.replay, iters=10, warmup=2) / calls


def host_us(fn, iters: int = 50) -> float:
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return 1e6 * statistics.median(times)


def bench_shape(chunks: int, decode_rows: int, copy_bw: float, split_len: int) -> dict:
    q_lens, prefixes = batch_shape(chunks, decode_rows, seed=chunks * 1000 + decode_rows)
    case = mixed_case(q_lens, prefixes, 16, "cuda", torch.bfloat16, SHAPE, split_len=split_len, seed=decode_rows)
    split, _ = check_mixed(case, list(range(decode_rows)), SCALE, backend="auto")  # asserts the bits
    k, v, q, loc, meta = case.pool.k, case.pool.v, case.q, case.loc, case.meta
    ext_rows = split.extend.rows
    ext_loc = loc[ext_rows]

    def before():
        extend_attention(q, k[loc], v[loc], k, v, meta, SCALE)

    def after():
        mixed_attention(q, k, v, loc, split, SCALE)

    def decode_only():
        paged_attention(q[split.decode.rows], k, v, split.decode.meta, SCALE)

    def extend_only():
        extend_attention(q[ext_rows], k[ext_loc], v[ext_loc], k, v, split.extend.meta, SCALE)

    decode_keys = sum(p + 1 for p in prefixes[:decode_rows])
    floor_us = 1e6 * 2 * decode_keys * SHAPE.hkv * SHAPE.d * 2 / copy_bw  # K and V, bf16, read once
    row = {"chunks": chunks, "chunk": CHUNK, "chunk_prefix": CHUNK_PREFIX, "decode_rows": decode_rows,
           "decode_context_mean": sum(prefixes[:decode_rows]) / decode_rows + 1, "split_len": split_len,
           "bits": "decode rows == decode launch, chunk rows == extend alone (torch.equal)",
           "before_us": 1e3 * time_cuda(before, iters=30), "after_us": 1e3 * time_cuda(after, iters=30),
           "before_graph_us": graph_us(before), "after_graph_us": graph_us(after),
           "decode_launch_us": 1e3 * time_cuda(decode_only, iters=30),
           "extend_launch_us": 1e3 * time_cuda(extend_only, iters=30),
           "split_host_us": host_us(lambda: split_mixed(meta, SHAPE.group)), "decode_floor_us": floor_us}
    row["speedup"] = row["before_us"] / row["after_us"]
    return row


def fmt(r: dict) -> str:
    return (f"{r['chunks']} x {r['chunk']} chunk + {r['decode_rows']:3d} decode rows"
            f" (ctx ~{r['decode_context_mean']:.0f}):"
            f" before {r['before_us']:7.1f} us (graph {r['before_graph_us']:7.1f}), after {r['after_us']:7.1f} us"
            f" (graph {r['after_graph_us']:7.1f}) = {r['speedup']:.2f}x; decode launch {r['decode_launch_us']:6.1f} us"
            f" (floor {r['decode_floor_us']:5.1f}), extend launch {r['extend_launch_us']:6.1f} us,"
            f" split made once per forward in {r['split_host_us']:5.1f} us host")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--quick", action="store_true", help="only 1 chunk + 100 decode rows")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_mixed_attention needs a CUDA device")
    dev = torch.cuda.get_device_name()
    copy_bw = copy_bandwidth()
    split_len = choose_split_len(4096, SHAPE.hkv, torch.device("cuda"))
    print(f"device {dev}; copy bandwidth {copy_bw / 1e9:.0f} GB/s (read + write); heads {SHAPE.hkv * SHAPE.group}/"
          f"{SHAPE.hkv} x {SHAPE.d}, bf16, pages of 16, split_len {split_len}; per attention layer", flush=True)
    results = {"device": dev, "copy_GBps": copy_bw / 1e9, "torch": torch.__version__, "rows": []}
    shapes = [(1, 100)] if args.quick else [(1, 60), (1, 100), (1, 120), (2, 120)]
    for chunks, rows in shapes:
        results["rows"].append(bench_shape(chunks, rows, copy_bw, split_len))
        print(fmt(results["rows"][-1]), flush=True)
        write_json(args.out, results)  # after every row: a cut-off run still leaves its figures


if __name__ == "__main__":
    main()
