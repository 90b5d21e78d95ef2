"""Decode-like attention as the engine launches it under CUDA graphs: the grid's bound is the engine's context
(not the step's), the split length the engine's, and the launch either one program per (request, KV head)
running every split (serial), or a few programs per block each running every n'th split, merged by the
combine kernel (``kernels.attention.choose_config``). Times each launch and checks every one gives the serial
launch's bits.

    python bench/bench_split_attention.py [--batches 16,32,64,128] [--contexts 640,2048] [--out split.json]

Shape: Llama-3.1-8B's attention (32 query / 8 KV heads x 128, bf16, pages of 16 in a shuffled pool). Rows:
``decode`` (one query per request) and ``tree8`` (8 verified tokens per request under a tree mask, as the
adaptive policy's 8-token tree verifies). Bandwidth = the KV bytes the step must read over the time.
``tailP:T`` rows: ``EYRIE_ATTN_TAIL=P:T``'s launch (``AttnConfig.tail_split``); ``--tails`` adds batches of short
rows with one long one, where it is meant to pay.
"""

from __future__ import annotations

import argparse
import json

import torch

from kernels.attention import AttnConfig, choose_config, choose_split_len, paged_attention
from kernels.attention_ref import AttentionMetadata

HQ, HKV, D, PAGE = 32, 8, 128, 16
TREE8 = [-1, 0, 0, 1, 1, 2, 3, 4]  # parents of an 8-token tree (depth 4)


def tree_mask(parents: list[int]) -> torch.Tensor:
    n = len(parents)
    m = torch.zeros(n, n, dtype=torch.bool)
    for i, p in enumerate(parents):
        m[i, i] = True
        while p >= 0:
            m[i, p] = True
            p = parents[p]
    return m


def case(contexts: list[int], engine_context: int, q_len: int, gen: torch.Generator):
    """(q, k_cache, v_cache, meta) with a request per ``contexts`` entry (its cached keys), ``q_len`` new keys each."""
    batch = len(contexts)
    per_req = [-(-(c + q_len) // PAGE) for c in contexts]
    pages = sum(per_req) + 8
    slots = pages * PAGE
    k = torch.randn(slots, HKV, D, generator=gen, dtype=torch.float32).to("cuda", torch.bfloat16)
    v = torch.randn(slots, HKV, D, generator=gen, dtype=torch.float32).to("cuda", torch.bfloat16)
    order = torch.randperm(pages - 1, generator=gen) + 1  # page 0: the sink
    kv_indices, kv_indptr, first = [], [0], 0
    for context, n in zip(contexts, per_req):
        req_pages = order[first:first + n]
        first += n
        idx = (req_pages[:, None] * PAGE + torch.arange(PAGE)[None, :]).reshape(-1)[:context + q_len]
        kv_indices.append(idx)
        kv_indptr.append(kv_indptr[-1] + context + q_len)
    q = torch.randn(batch * q_len, HQ, D, generator=gen, dtype=torch.float32).to("cuda", torch.bfloat16)
    meta = AttentionMetadata(
        qo_indptr=torch.arange(batch + 1, device="cuda") * q_len,
        kv_indptr=torch.tensor(kv_indptr, device="cuda"), kv_indices=torch.cat(kv_indices).to("cuda"),
        prefix_lens=torch.tensor(contexts, device="cuda"),
        max_q_len=q_len, max_kv_len=engine_context,  # graph-static bounds, as build_uniform_batch sets them
        split_len=choose_split_len(engine_context, HKV, torch.device("cuda")))
    if q_len > 1:
        mask = tree_mask(TREE8[:q_len])
        meta.custom_mask = mask.reshape(-1).repeat(batch).to("cuda")
        meta.mask_indptr = torch.arange(batch + 1, device="cuda") * (q_len * q_len)
    return q, k, v, meta


def time_us(fn, iters: int = 50) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(10):
            fn()
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters // 10):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (iters // 10 * 10)


def point(contexts: list[int], engine_context: int, q_len: int, programs: list[int], gen) -> dict:
    batch, context = len(contexts), contexts[0]
    q, k, v, meta = case(contexts, engine_context, q_len, gen)
    chosen = choose_config(q, HKV, batch, q_len, engine_context, split_len=meta.split_len,
                           has_mask=meta.custom_mask is not None)
    base = dict(block_q=chosen.block_q, block_m=chosen.block_m, block_n=chosen.block_n, num_warps=chosen.num_warps,
                num_stages=chosen.num_stages, split_len=chosen.split_len)
    splits = -(-engine_context // chosen.split_len)
    configs = {"chosen": chosen, "serial": AttnConfig(num_splits=1, **base),
               "one_per_split": AttnConfig(num_splits=splits, **base)}
    configs.update({f"p{p}": AttnConfig(num_splits=p, **base) for p in programs if 1 < p < splits})
    # EYRIE_ATTN_TAIL's launch: P programs per block, a block using cdiv(its splits, T) of them (one alone: serial)
    configs.update({f"tail{p}:{t}": AttnConfig(num_splits=p, tail_split=t, **base)
                    for p in (2, 4) for t in (4, 8) if p < splits})
    out = torch.empty_like(q)
    ref = paged_attention(q, k, v, meta, D ** -0.5, config=configs["serial"])
    kv_bytes = sum(c + q_len for c in contexts) * HKV * D * 2 * 2
    row = {"batch": batch, "context": context, "longest": max(contexts), "q_len": q_len,
           "engine_context": engine_context,
           "split_len": chosen.split_len, "splits": splits, "chosen_programs": chosen.num_splits, "us": {},
           "gb_s": {}, "equal_serial": {}}
    for name, cfg in configs.items():
        got = paged_attention(q, k, v, meta, D ** -0.5, config=cfg)
        row["equal_serial"][name] = bool(torch.equal(got, ref))
        us = time_us(lambda cfg=cfg: paged_attention(q, k, v, meta, D ** -0.5, config=cfg, out=out))
        row["us"][name] = round(us, 1)
        row["gb_s"][name] = round(kv_bytes / us / 1e3, 1)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="8,16,32,64,128")
    ap.add_argument("--contexts", default="640,2048")
    ap.add_argument("--engine-context", type=int, default=4096 + 64, help="the grid's static key bound")
    ap.add_argument("--programs", default="2,3,4,6,8,12")
    ap.add_argument("--tails", default="",
                    help="SHORT:LONG:BATCHES (e.g. 640:2080:33,40,64): batches of SHORT-key rows but one of LONG keys "
                         "(a long prompt's hand-off joining streams: does its row's serial walk set the launch time?)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    gen = torch.Generator().manual_seed(0)
    programs = [int(p) for p in args.programs.split(",")]
    shapes = [[int(c)] * int(b) for c in args.contexts.split(",") for b in args.batches.split(",") if c and b]
    if args.tails:
        short, long, batches = args.tails.split(":")
        shapes += [[int(short)] * (int(b) - 1) + [int(long)] for b in batches.split(",")]
    rows = []
    for q_len in (1, 8):
        for contexts in shapes:
            batch, context = len(contexts), contexts[0]
            if q_len == 8 and batch > 64:
                continue
            row = point(contexts, args.engine_context, q_len, programs, gen)
            rows.append(row)
            best = min(row["us"], key=row["us"].get)
            tail = f"+{max(contexts)}" if max(contexts) != context else ""
            print(f"{'decode' if q_len == 1 else 'tree8':6s} b{batch:<4d} ctx {context:5d}{tail}: chosen "
                  f"(P={row['chosen_programs']}) {row['us']['chosen']:7.1f} us {row['gb_s']['chosen']:6.0f} GB/s"
                  f" | serial {row['us']['serial']:7.1f} | one/split {row['us']['one_per_split']:7.1f} | best "
                  f"{best} {row['us'][best]:.1f} us {row['gb_s'][best]:.0f} GB/s | equal "
                  f"{all(row['equal_serial'].values())}", flush=True)
            torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    return 0 if all(all(r["equal_serial"].values()) for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
