"""Paged attention kernels against their floors, on CUDA.

* decode (one query per request): batch {1, 8, 64} x context {1024, 4096, 8192}, page sizes 1 and 16;
  time, KV bytes moved per second, and that as a fraction of the device-to-device copy bandwidth
  measured in the same run (the floor: the kernel must at least read every K/V byte once);
* extend (causal prefill, prefix 0): the paged kernel (``kernels.attention.paged_attention``, what
  chunks of fewer than 64 queries run) and the extend kernel (``kernels.extend_attention``, what
  longer chunks run; ``bench/bench_extend.py`` studies it further) against
  ``torch.nn.functional.scaled_dot_product_attention(is_causal=True)`` on the same unpaged shapes
  (the faster of SDPA with ``enable_gqa`` and SDPA on K/V expanded to every query head);
* tree verify: N tree nodes per request under an ancestor mask, against decode at the same batch
  and context;
* ``--tune``: a small sweep of launch configurations for decode and extend, best first.

Decode and verify are timed as replays of a CUDA graph of 20 calls (how the decode service runs
them; eager times, which include the host's launch cost, are reported beside them); extend is timed
eagerly. Every figure is a median of several repetitions after a warm-up.

Llama-3-8B attention shape: 32 query heads, 8 KV heads, head dim 128, bfloat16.

    python bench/bench_attention.py --out results/attn.json [--quick] [--tune]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.timing import copy_bandwidth, graph_of, time_cuda, write_json
from kernels.attention import AttnConfig, choose_config, choose_split_len, paged_attention
from kernels.attention_ref import AttentionMetadata
from kernels.extend_attention import extend_attention
from kernels.spec_kernels import ancestor_mask

HQ, HKV, D = 32, 8, 128
DTYPE = torch.bfloat16


def time_graph(fn, calls: int = 20, reps: int = 10) -> float:
    """Median milliseconds per call of ``fn`` replayed from one CUDA graph of ``calls`` invocations: the
    GPU time without the host's launch cost (the decode service replays its phases from graphs)."""
    graph = graph_of(fn, calls=calls, warmup=3)
    return time_cuda(graph.replay, iters=reps, warmup=2) / calls


def paged_layout(lens: list[int], page_size: int, gen: torch.Generator) -> torch.Tensor:
    """kv_indices for requests of ``lens`` tokens on pages handed out in shuffled order."""
    pages_per = [-(-n // page_size) for n in lens]
    order = torch.randperm(sum(pages_per), device="cuda", generator=gen) + 1
    out, used = [], 0
    for n, pp in zip(lens, pages_per):
        pos = torch.arange(n, device="cuda")
        out.append(order[used:used + pp][pos // page_size] * page_size + pos % page_size)
        used += pp
    return torch.cat(out)


def metadata(q_lens: list[int], prefix: list[int], extra: list[int], kv_indices: torch.Tensor,
             masks: torch.Tensor | None = None) -> AttentionMetadata:
    kv_lens = [p + e for p, e in zip(prefix, extra)]
    meta = AttentionMetadata(
        qo_indptr=torch.tensor([0] + q_lens, device="cuda").cumsum(0),
        kv_indptr=torch.tensor([0] + kv_lens, device="cuda").cumsum(0),
        kv_indices=kv_indices, prefix_lens=torch.tensor(prefix, device="cuda"),
        max_q_len=max(q_lens), max_kv_len=max(kv_lens),
        split_len=choose_split_len(max(kv_lens), HKV, torch.device("cuda")),  # an engine at this context's
    )
    if masks is not None:
        meta.custom_mask = masks.reshape(-1)
        meta.mask_indptr = torch.tensor([0] + [q * e for q, e in zip(q_lens, extra)], device="cuda").cumsum(0)
    return meta


class Caches:
    """One K and one V pool big enough for the largest case; every case uses a slice of it."""

    def __init__(self, max_tokens: int, page_size: int):
        slots = (-(-max_tokens // page_size) + 2) * page_size
        self.k = torch.randn(slots, HKV, D, device="cuda", dtype=DTYPE)
        self.v = torch.randn(slots, HKV, D, device="cuda", dtype=DTYPE)
        self.page_size = page_size


def kv_bytes(total_keys: int) -> int:
    return 2 * total_keys * HKV * D * torch.finfo(DTYPE).bits // 8


def bench_decode(caches: Caches, batch: int, ctx: int, gen, copy_bw: float, config: AttnConfig | None = None,
                 iters: int = 30) -> dict:
    kv_indices = paged_layout([ctx] * batch, caches.page_size, gen)
    meta = metadata([1] * batch, [ctx - 1] * batch, [1] * batch, kv_indices)
    q = torch.randn(batch, HQ, D, device="cuda", dtype=DTYPE)
    out = torch.empty_like(q)
    cfg = config or choose_config(q, HKV, batch, 1, ctx, split_len=meta.split_len)

    def call():
        paged_attention(q, caches.k, caches.v, meta, D ** -0.5, config=cfg, out=out)

    ms = time_graph(call)
    bps = kv_bytes(batch * ctx) / (ms / 1e3)
    return {"kind": "decode", "page_size": caches.page_size, "batch": batch, "context": ctx, "ms": ms,
            "eager_ms": time_cuda(call, iters=iters), "kv_GBps": bps / 1e9, "frac_copy_bw": bps / copy_bw,
            "config": cfg.__dict__}


def bench_extend(caches: Caches, batch: int, seq: int, gen, config: AttnConfig | None = None,
                 with_sdpa: bool = True) -> dict:
    kv_indices = paged_layout([seq] * batch, caches.page_size, gen)
    meta = metadata([seq] * batch, [0] * batch, [seq] * batch, kv_indices)
    q = torch.randn(batch * seq, HQ, D, device="cuda", dtype=DTYPE)
    out = torch.empty_like(q)
    cfg = config or choose_config(q, HKV, batch, seq, seq, split_len=meta.split_len)
    ms = time_cuda(lambda: paged_attention(q, caches.k, caches.v, meta, D ** -0.5, config=cfg, out=out), iters=10)
    flops = 4 * batch * HQ * D * seq * (seq + 1) / 2  # causal: half the score matrix, two GEMMs
    row = {"kind": "extend", "page_size": caches.page_size, "batch": batch, "seq": seq, "ms": ms,
           "tflops": flops / (ms / 1e3) / 1e12, "config": cfg.__dict__}
    out_ext = torch.empty_like(q)
    if config is None:  # the extend kernel reads this step's K/V densely: here the cache rows of the chunk
        k_new, v_new = caches.k[kv_indices].contiguous(), caches.v[kv_indices].contiguous()
        ext_ms = time_cuda(lambda: extend_attention(q, k_new, v_new, caches.k, caches.v, meta, D ** -0.5,
                                                    out=out_ext), iters=10)
        row.update(extend_ms=ext_ms, extend_tflops=flops / (ext_ms / 1e3) / 1e12)
    if with_sdpa:
        qs = q.view(batch, seq, HQ, D).transpose(1, 2).contiguous()
        ks = caches.k[kv_indices].view(batch, seq, HKV, D).transpose(1, 2).contiguous()
        vs = caches.v[kv_indices].view(batch, seq, HKV, D).transpose(1, 2).contiguous()
        sdpa = {}
        try:
            sdpa["gqa"] = time_cuda(lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True),
                                    iters=10)
        except (RuntimeError, TypeError) as e:  # older torch or no GQA kernel
            sdpa["gqa_error"] = str(e)[:120]
        ke, ve = ks.repeat_interleave(HQ // HKV, 1), vs.repeat_interleave(HQ // HKV, 1)
        sdpa["expanded"] = time_cuda(lambda: F.scaled_dot_product_attention(qs, ke, ve, is_causal=True), iters=10)
        best = min(v for v in sdpa.values() if isinstance(v, float))
        # Same answer as SDPA (a correctness check of the benchmarked launch, not only its speed).
        ref = F.scaled_dot_product_attention(qs, ke, ve, is_causal=True).transpose(1, 2).reshape(-1, HQ, D)
        row.update(sdpa_ms=best, sdpa_variants=sdpa, ratio_vs_sdpa=best / ms,
                   max_abs_err=(out.float() - ref.float()).abs().max().item())
        if "extend_ms" in row:
            row.update(extend_ratio_vs_sdpa=best / row["extend_ms"],
                       extend_max_abs_err=(out_ext.float() - ref.float()).abs().max().item())
    return row


def bench_verify(caches: Caches, batch: int, ctx: int, n: int, gen, decode_ms: float | None) -> dict:
    kv_indices = paged_layout([ctx + n] * batch, caches.page_size, gen)
    parents = [-1] + [(i - 1) // 2 for i in range(1, n)]  # a binary tree
    masks = ancestor_mask(torch.tensor([parents]), n)[0].to("cuda").expand(batch, n, n).contiguous()
    meta = metadata([n] * batch, [ctx] * batch, [n] * batch, kv_indices, masks)
    q = torch.randn(batch * n, HQ, D, device="cuda", dtype=DTYPE)
    out = torch.empty_like(q)
    def call():
        paged_attention(q, caches.k, caches.v, meta, D ** -0.5, out=out)

    ms = time_graph(call)
    row = {"kind": "verify", "page_size": caches.page_size, "batch": batch, "context": ctx, "nodes": n, "ms": ms,
           "eager_ms": time_cuda(call), "kv_GBps": kv_bytes(batch * (ctx + n)) / (ms / 1e3) / 1e9}
    if decode_ms:
        row["vs_decode"] = ms / decode_ms
    return row


def tune_decode(caches: Caches, batch: int, ctx: int, gen, copy_bw: float, shapes: list[tuple[int, int, int]],
                split_factors: tuple[float, ...]) -> list[dict]:
    """Decode under each (block_n, num_warps, num_stages) x the default split length scaled by each factor (one
    program per split)."""
    rows = []
    q = torch.randn(batch, HQ, D, device="cuda", dtype=DTYPE)
    base = choose_config(q, HKV, batch, 1, ctx, split_len=choose_split_len(ctx, HKV, q.device))
    lens = sorted({max(64, int(base.split_len * f) // 64 * 64) for f in split_factors})
    for block_n, warps, stages in shapes:
        for sl in lens:
            cfg = AttnConfig(block_q=base.block_q, block_m=base.block_m, block_n=block_n, num_splits=-(-ctx // sl),
                             num_warps=warps, num_stages=stages, split_len=sl)
            try:
                rows.append(bench_decode(caches, batch, ctx, gen, copy_bw, cfg, iters=15))
            except Exception as e:  # noqa: BLE001 - out of shared memory etc.: report, go on
                rows.append({"kind": "decode", "config": cfg.__dict__, "error": str(e)[:160]})
    return sorted(rows, key=lambda r: r.get("ms", float("inf")))


def tune_extend(caches: Caches, batch: int, seq: int, gen) -> list[dict]:
    rows = []
    for block_m, block_n, warps, stages in [(128, 64, 8, 3), (128, 64, 8, 2), (128, 128, 8, 2), (128, 64, 4, 3),
                                             (64, 64, 4, 3), (128, 32, 4, 3), (256, 64, 8, 2), (128, 64, 8, 4)]:
        cfg = AttnConfig(block_q=block_m // (HQ // HKV), block_m=block_m, block_n=block_n, num_splits=1,
                         num_warps=warps, num_stages=stages)
        try:
            rows.append(bench_extend(caches, batch, seq, gen, cfg, with_sdpa=False))
        except Exception as e:  # noqa: BLE001
            rows.append({"kind": "extend", "config": cfg.__dict__, "error": str(e)[:160]})
    return sorted(rows, key=lambda r: r.get("ms", float("inf")))


def fmt(row: dict) -> str:
    c = row.get("config", {})
    cfg = (f"bm{c.get('block_m')} bn{c.get('block_n')} w{c.get('num_warps')} s{c.get('num_stages')} "
           f"sp{c.get('num_splits')} sl{c.get('split_len')}") if c else ""
    if "error" in row:
        return f"{row['kind']:7s} {cfg:24s} ERROR {row['error']}"
    if row["kind"] == "decode":
        return (f"decode  ps{row['page_size']:<3d} bs{row['batch']:<3d} ctx{row['context']:<5d} "
                f"{row['ms'] * 1e3:9.1f} us"
                f" {row['kv_GBps']:8.1f} GB/s {100 * row['frac_copy_bw']:6.1f}% of copy"
                f"  (eager {row['eager_ms'] * 1e3:.1f} us)   {cfg}")
    if row["kind"] == "extend":
        s = (f"extend  ps{row['page_size']:<3d} bs{row['batch']:<3d} seq{row['seq']:<5d} {row['ms']:9.3f} ms"
             f" {row['tflops']:7.1f} TFLOP/s")
        if "sdpa_ms" in row:
            s += f"  sdpa {row['sdpa_ms']:.3f} ms  ratio {row['ratio_vs_sdpa']:.2f}  err {row['max_abs_err']:.2e}"
        if "extend_ms" in row:
            s += f"  | extend kernel {row['extend_ms']:.3f} ms {row['extend_tflops']:.1f} TFLOP/s"
            if "extend_ratio_vs_sdpa" in row:
                s += f" ratio {row['extend_ratio_vs_sdpa']:.2f} err {row['extend_max_abs_err']:.2e}"
        return s + f"   {cfg}"
    s = (f"verify  ps{row['page_size']:<3d} bs{row['batch']:<3d} ctx{row['context']:<5d} N{row['nodes']:<3d}"
         f" {row['ms'] * 1e3:9.1f} us {row['kv_GBps']:8.1f} GB/s  (eager {row['eager_ms'] * 1e3:.1f} us)")
    return s + (f"  {row['vs_decode']:.2f}x decode" if "vs_decode" in row else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--quick", action="store_true", help="fewer shapes")
    ap.add_argument("--tune", action="store_true", help="also sweep launch configurations")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_attention needs a CUDA device")
    torch.manual_seed(0)
    gen = torch.Generator(device="cuda").manual_seed(0)
    dev = torch.cuda.get_device_name()
    copy_bw = copy_bandwidth()
    print(f"device {dev}; copy bandwidth {copy_bw / 1e9:.0f} GB/s (read + write); "
          f"heads {HQ}/{HKV} x {D}, {DTYPE}")
    batches, ctxs = ([1, 64], [1024, 4096]) if args.quick else ([1, 8, 64], [1024, 4096, 8192])
    results: dict = {"device": dev, "copy_GBps": copy_bw / 1e9, "torch": torch.__version__, "rows": []}

    def emit(row):
        results["rows"].append(row)
        print(fmt(row), flush=True)
        write_json(args.out, results)  # after every row: a cut-off run still leaves its figures

    decode_ms: dict[tuple[int, int], float] = {}
    for page_size in (1, 16):
        caches = Caches(max(batches) * max(ctxs) + 64 * max(batches), page_size)
        for b in batches:
            for c in ctxs:
                row = bench_decode(caches, b, c, gen, copy_bw)
                decode_ms[(page_size, b, c)] = row["ms"]
                emit(row)
        if page_size == 16:
            for b, c in [(1, 1024), (1, 4096), (8, 4096), (64, 4096)]:
                if (16, b, c) not in decode_ms:
                    continue
                for n in (8, 16, 64):
                    emit(bench_verify(caches, b, c, n, gen, decode_ms[(16, b, c)]))
        del caches
    caches = Caches(16384 + 64, 16)
    for b, s in ([(1, 4096), (4, 2048)] if args.quick else [(1, 2048), (1, 4096), (4, 2048), (1, 8192), (2, 8192)]):
        emit(bench_extend(caches, b, s, gen))
    if args.tune:
        sections = [
            ("tune_decode_bs64_ctx4096", lambda c: tune_decode(
                c, 64, 4096, gen, copy_bw, [(32, 4, 3), (64, 4, 2), (64, 4, 3), (64, 4, 4), (128, 4, 2), (128, 4, 3),
                                            (64, 8, 3), (128, 8, 3), (64, 2, 3)], (1, 2))),
            ("tune_decode_bs1_ctx8192", lambda c: tune_decode(
                c, 1, 8192, gen, copy_bw, [(64, 4, 3), (128, 4, 3)], (0.25, 0.5, 1, 2))),
        ]
        big = Caches(64 * 4096 + 64, 16)
        for name, fn in sections:
            print(f"-- {name} (page 16)", flush=True)
            results[name] = fn(big)[:8]
            for r in results[name]:
                print("   ", fmt(r), flush=True)
            write_json(args.out, results)
        del big
        print("-- tune_extend_bs1_seq4096 (page 16)", flush=True)
        results["tune_extend_bs1_seq4096"] = tune_extend(caches, 1, 4096, gen)
        for r in results["tune_extend_bs1_seq4096"]:
            print("   ", fmt(r), flush=True)
    write_json(args.out, results)


if __name__ == "__main__":
    main()
