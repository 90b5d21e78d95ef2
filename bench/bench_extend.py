"""Extend (causal prefill) attention against torch SDPA, on CUDA.

* no prefix: one request of T in {2048, 4096, 8192, 16384} tokens, and 4 requests x 4096:
  ``kernels.extend_attention.extend_attention`` against
  ``torch.nn.functional.scaled_dot_product_attention(is_causal=True)`` on the same unpaged shapes,
  SDPA taken at its best over {enable_gqa=True, K/V expanded to every query head} x {default
  dispatch, cuDNN, flash}; the paged kernel (``kernels.attention.paged_attention``) for reference;
* with prefix: 4096 cached tokens (paged cache, page size 16, pages shuffled) + 4096 new tokens,
  against SDPA on the dense equivalent with the bottom-right causal alignment (the
  ``causal_lower_right`` bias, which the flash backend runs, or an explicit boolean mask);
* ``--tune``: a sweep of BLOCK_M / BLOCK_N / num_warps / num_stages / warp_specialize (and the
  pointer-load path) at 8192 tokens, best first; the three best re-timed on the prefix case.

Every launch is checked against SDPA's output first (relative norm error < 1e-2); a variant that
fails to compile or differs is reported, not timed. Times are medians over repetitions of several
back-to-back calls between two CUDA events (the host's launch cost hidden, as in a busy server).
Causal FLOPs: 4 * Hq * D * (q_len * prefix + q_len^2 / 2) per request (two GEMMs, half the square).

Llama-3-8B attention shape: 32 query heads, 8 KV heads, head dim 128, bfloat16. About 3 minutes on
an H100 with ``--tune``.

    python bench/bench_extend.py --out results/extend.json [--tune]
    python bench/bench_extend.py --tune-shapes --write-table   # time every candidate, record the best per shape
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.timing import time_cuda, write_json
from kernels.attention import paged_attention
from kernels.attention_ref import AttentionMetadata
from kernels.extend_attention import (
    TUNED_TABLE,
    ExtendConfig,
    choose_extend_config,
    extend_attention,
    table_key,
    tma_supported,
)

HQ, HKV, D = 32, 8, 128
G = HQ // HKV
DTYPE = torch.bfloat16
SCALE = D ** -0.5
MAX_REL_ERR = 1e-2
PAIRED_ROUNDS = 5
FINALISTS = 3  # the sweep's fastest launches raced against the rules' launch on every shape
MARGIN = 0.02  # a finalist displaces the launch chosen now only when its median ratio is this much better


def time_ms(fn, reps: int = 7, calls: int = 8, warmup: int = 3) -> float:
    """Median milliseconds per call, each repetition timing ``calls`` back-to-back calls."""
    return time_cuda(fn, iters=reps, warmup=warmup, calls=calls)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def causal_flops(q_lens: list[int], prefix: list[int]) -> float:
    return sum(4 * HQ * D * (n * p + n * n / 2) for n, p in zip(q_lens, prefix))


class Case:
    """Inputs of one benchmark shape: q / k_new / v_new [T, H, D], the paged caches and the metadata,
    and the dense SDPA layout [B, H, S, D] of the same tensors (prefix included, for one request)."""

    def __init__(self, batch: int, seq: int, prefix: int, page_size: int, gen: torch.Generator):
        T = batch * seq
        self.batch, self.seq, self.prefix = batch, seq, prefix
        self.q_lens, self.prefixes = [seq] * batch, [prefix] * batch
        self.q = torch.randn(T, HQ, D, device="cuda", generator=gen).to(DTYPE)
        self.k_new = torch.randn(T, HKV, D, device="cuda", generator=gen).to(DTYPE)
        self.v_new = torch.randn(T, HKV, D, device="cuda", generator=gen).to(DTYPE)
        kv_len = prefix + seq
        if prefix == 0:  # the cache is k_new itself, identity slots (the paged kernel's best case)
            self.k_cache, self.v_cache = self.k_new, self.v_new
            kv_indices = torch.arange(T, device="cuda")
        else:  # pages of `page_size` slots in shuffled order, page 0 unused
            pages = -(-kv_len // page_size)
            kv_indices = torch.empty(0, dtype=torch.int64, device="cuda")
            slots = (batch * pages + 1) * page_size
            self.k_cache = torch.randn(slots, HKV, D, device="cuda", generator=gen).to(DTYPE)
            self.v_cache = torch.randn(slots, HKV, D, device="cuda", generator=gen).to(DTYPE)
            order = torch.randperm(batch * pages, device="cuda", generator=gen) + 1
            pos = torch.arange(kv_len, device="cuda")
            per = [order[b * pages:(b + 1) * pages][pos // page_size] * page_size + pos % page_size
                   for b in range(batch)]
            kv_indices = torch.cat(per)
            new = torch.cat([p[prefix:] for p in per])
            self.k_cache[new], self.v_cache[new] = self.k_new, self.v_new  # the cache holds this step's rows too
        self.meta = AttentionMetadata(
            qo_indptr=torch.arange(batch + 1, device="cuda") * seq,
            kv_indptr=torch.arange(batch + 1, device="cuda") * kv_len,
            kv_indices=kv_indices, prefix_lens=torch.full((batch,), prefix, device="cuda"),
            max_q_len=seq, max_kv_len=kv_len)
        self.out = torch.empty_like(self.q)
        # Dense layout for SDPA: [B, H, S, D], keys of the whole context.
        self.qs = self.q.view(batch, seq, HQ, D).transpose(1, 2).contiguous()
        ks = self.k_cache[kv_indices].view(batch, kv_len, HKV, D).transpose(1, 2).contiguous()
        vs = self.v_cache[kv_indices].view(batch, kv_len, HKV, D).transpose(1, 2).contiguous()
        self.kv = {"gqa": (ks, vs), "expanded": (ks.repeat_interleave(G, 1), vs.repeat_interleave(G, 1))}
        self.flops = causal_flops(self.q_lens, self.prefixes)

    def dense_to_rows(self, o: torch.Tensor) -> torch.Tensor:
        return o.transpose(1, 2).reshape(-1, HQ, D)

    def extend(self, config: ExtendConfig | None = None):
        return lambda: extend_attention(self.q, self.k_new, self.v_new, self.k_cache, self.v_cache, self.meta,
                                        SCALE, out=self.out, config=config)

    def paged(self):
        return lambda: paged_attention(self.q, self.k_cache, self.v_cache, self.meta, SCALE, out=self.out)


def _sdpa_backend(name: str):
    if name == "default":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel([{"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[name]])


def sdpa_calls(case: Case) -> dict:
    """name -> zero-argument SDPA call on the dense shape; causal: is_causal, or for q shorter than k the
    bottom-right aligned causal bias / an explicit boolean mask."""
    calls = {}
    masks = {}
    if case.prefix == 0:
        masks["causal"] = {"is_causal": True}
    else:
        with contextlib.suppress(ImportError):
            from torch.nn.attention.bias import causal_lower_right
            masks["lower_right"] = {"attn_mask": causal_lower_right(case.seq, case.seq + case.prefix)}
        tril = torch.ones(case.seq, case.seq + case.prefix, dtype=torch.bool, device="cuda").tril(case.prefix)
        masks["bool_mask"] = {"attn_mask": tril}
    def make(k, v, kw, backend):
        def call():
            with _sdpa_backend(backend):
                return F.scaled_dot_product_attention(case.qs, k, v, scale=SCALE, **kw)
        return call

    for layout, (k, v) in case.kv.items():
        extra = {"enable_gqa": True} if layout == "gqa" else {}
        for mask_name, mask in masks.items():
            for backend in ("default", "cudnn", "flash"):
                calls[f"{layout}/{mask_name}/{backend}"] = make(k, v, {**mask, **extra}, backend)
    return calls


def bench_sdpa(case: Case) -> tuple[dict, torch.Tensor | None]:
    """Times of every SDPA variant that runs (errors reported), and the output of the fastest."""
    times, best, best_out = {}, None, None
    calls = sdpa_calls(case)
    case.sdpa_calls = calls
    for name, call in calls.items():
        try:
            out = call()
            torch.cuda.synchronize()
            ms = time_ms(call)
        except Exception as e:  # noqa: BLE001 - backend not available for this shape / build
            times[name] = f"error: {str(e).splitlines()[0][:100]}"
            continue
        times[name] = ms
        if best is None or ms < best:
            best, best_out = ms, out
    return times, best_out


def bench_kernel(case: Case, fn, ref_rows: torch.Tensor | None) -> dict:
    """Correctness against SDPA's output (when there is one) first, then the time."""
    try:
        fn()
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - compile error, out of shared memory: report, go on
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"}
    row = {}
    if ref_rows is not None:
        row["rel_err"] = rel_err(case.out, ref_rows)
        if not row["rel_err"] < MAX_REL_ERR:
            return {**row, "error": f"mismatch: rel err {row['rel_err']:.3e} vs SDPA"}
    row["ms"] = time_ms(fn)
    row["tflops"] = case.flops / (row["ms"] / 1e3) / 1e12
    return row


def paired_ratio(ours, sdpa, rounds: int = PAIRED_ROUNDS) -> dict:
    """SDPA's time over ours, timed in alternation (SDPA, ours, SDPA, ours, ...): a clock or power state
    that drifts during the run moves both sides of each pair alike, so the median of the per-round
    ratios is steadier than a ratio of two times taken minutes apart (earlier runs saw the same launch
    move 4-10% between its first and a later timing). ``race`` with one launch."""
    return race(sdpa, {"ours": ours}, rounds)["ours"]


def race(sdpa, calls: dict, rounds: int = PAIRED_ROUNDS) -> dict:
    """Several launches against SDPA: every round times each launch right after SDPA (the launches'
    order rotated round by round), so each ratio compares two timings taken moments apart; returns each
    launch's ratios (SDPA's time over its), their median, min and max."""
    names = list(calls)
    ratios: dict = {n: [] for n in names}
    for r in range(rounds):
        k = r % len(names)
        for n in names[k:] + names[:k]:
            t_sdpa, t_ours = time_ms(sdpa), time_ms(calls[n])
            ratios[n].append(t_sdpa / t_ours)
    out = {}
    for n, v in ratios.items():
        v = sorted(v)
        out[n] = {"ratios": v, "median": v[len(v) // 2], "min": v[0], "max": v[-1]}
    return out


def shape_row(case: Case, sdpa: bool = True, paged: bool = True, tune: list[ExtendConfig] | None = None) -> dict:
    row = {"batch": case.batch, "seq": case.seq, "prefix": case.prefix, "gflop": case.flops / 1e9}
    ref_rows = None
    if sdpa:
        times, best_out = bench_sdpa(case)
        ok = {k: v for k, v in times.items() if isinstance(v, float)}
        row["sdpa_variants"] = times
        if ok:
            name = min(ok, key=ok.get)
            row.update(sdpa_best=name, sdpa_ms=ok[name], sdpa_tflops=case.flops / (ok[name] / 1e3) / 1e12)
            ref_rows = case.dense_to_rows(best_out)
    cfg = choose_extend_config(case.q, case.seq, tma_supported(case.q, case.k_new, case.v_new), G)
    row["config"] = cfg.__dict__
    row["extend"] = bench_kernel(case, case.extend(cfg), ref_rows)
    if "ms" in row["extend"] and "sdpa_ms" in row:
        row["ratio_vs_sdpa"] = row["sdpa_ms"] / row["extend"]["ms"]  # throughput of extend / SDPA's
        row["paired"] = paired_ratio(case.extend(cfg), case.sdpa_calls[row["sdpa_best"]])
    if paged:
        row["paged"] = bench_kernel(case, case.paged(), ref_rows)
    if tune:
        best_call = case.sdpa_calls[row["sdpa_best"]] if "sdpa_best" in row else None
        tune_shape(case, row, tune, ref_rows, best_call)
    return row


def fmt_shape(row: dict) -> str:
    name = f"bs{row['batch']} seq{row['seq']}" + (f" +prefix{row['prefix']}" if row["prefix"] else "")
    s = f"{name:22s}"
    e = row["extend"]
    s += f" extend {e['ms']:7.3f} ms {e['tflops']:6.1f} TF/s" if "ms" in e else f" extend ERROR {e.get('error')}"
    if "sdpa_ms" in row:
        s += f" | sdpa {row['sdpa_ms']:7.3f} ms {row['sdpa_tflops']:6.1f} TF/s ({row['sdpa_best']})"
    if "ratio_vs_sdpa" in row:
        s += f" | ratio {row['ratio_vs_sdpa']:.2f}"
    if "paired" in row:
        pr = row["paired"]
        s += f" (paired median {pr['median']:.3f}, {pr['min']:.3f}-{pr['max']:.3f})"
    if "rel_err" in e:
        s += f" err {e['rel_err']:.1e}"
    p = row.get("paged", {})
    if "ms" in p:
        s += f" | paged {p['tflops']:6.1f} TF/s"
    return s


def fmt_cfg(c: ExtendConfig) -> str:
    return (f"bm{c.block_m} bn{c.block_n} w{c.num_warps} s{c.num_stages}{f' p{c.pack}' if c.pack > 1 else ''}"
            f"{' ws' if c.warp_specialize else ''}{' hm' if c.head_major else ''}{' rm' if c.request_major else ''}"
            f"{'' if c.tma else ' pointer'}")


def shape_configs() -> list[ExtendConfig]:
    """The candidates ``--tune-shapes`` times on every shape: tile shapes x GQA packing x launch order.
    All compile for sm_90a with Triton 3.6 without spilling and within the SM's shared memory
    (``python bench/compile_extend.py``)."""
    cands = [  # (block_m, block_n, warps, stages, pack, head_major, request_major)
        (64, 64, 4, 3, 1, False, False), (64, 64, 4, 3, 2, False, False), (64, 64, 4, 3, 2, True, False),
        (64, 64, 4, 3, 4, False, False), (64, 64, 4, 2, 2, False, False), (64, 64, 4, 4, 1, False, False),
        (128, 128, 8, 3, 1, True, False), (128, 128, 8, 2, 1, True, False), (128, 128, 8, 3, 2, False, False),
        (128, 128, 8, 3, 2, True, False), (128, 128, 8, 3, 4, False, False), (128, 64, 8, 3, 1, False, False),
        (128, 64, 8, 3, 1, True, False), (128, 64, 8, 3, 2, False, False),
        # request by request (the same launches as above in a batch of one)
        (64, 64, 4, 3, 1, False, True), (64, 64, 4, 3, 1, True, True), (128, 128, 8, 3, 1, True, True),
        (64, 64, 4, 3, 4, False, True),
    ]
    return [ExtendConfig(bm, bn, w, st, True, head_major=hm, pack=pk, request_major=rm)
            for bm, bn, w, st, pk, hm, rm in cands]


def table_rows(rows: list[dict]) -> list[dict]:
    """Rows of the tuned table from ``--tune-shapes`` results, one for every shape without a prefix, keyed
    by the shape's longest request and its token count, in ascending order
    (``kernels.extend_attention.pick_tuned`` takes the last row a call meets, so every shape gets a row,
    even where the launch chosen now stays). With a final (``row['race']``): the finalist with the best
    median paired ratio to SDPA, where it beats the launch chosen now (``row['config']``: the table's or the rules') by
    more than ``MARGIN``, else the launch chosen now; without one, the candidate with the least mean time
    among those that matched SDPA."""
    out = []
    for row in rows:
        timed = [t for t in row.get("tune", []) if "ms" in t]
        if row.get("prefix", 0) or not (timed or row.get("race")):
            continue
        if row.get("race"):
            default = next((r for r in row["race"] if r["config"] == row["config"]), None)
            best = max(row["race"], key=lambda r: r["median"])
            if default is not None and best["median"] <= default["median"] * (1 + MARGIN):
                best = default
            measured = {"paired_ratio_vs_sdpa": round(best["median"], 3), "paired_min": round(best["min"], 3),
                        "paired_max": round(best["max"], 3)}
        else:
            best = min(timed, key=lambda t: t["ms"])
            measured = {"ms": round(best["ms"], 4), "tflops": round(best["tflops"], 1)}
            if "ratio_vs_sdpa" in best:
                measured["ratio_vs_sdpa"] = round(best["ratio_vs_sdpa"], 3)
        out.append({"min_max_q_len": row["seq"], "min_tokens": row["batch"] * row["seq"], "config": best["config"],
                    "measured": measured})
    return sorted(out, key=lambda r: (r["min_max_q_len"], r["min_tokens"]))


def merge_table(table: dict, device: str, key: str, rows: list[dict], provenance: dict) -> dict:
    """``table`` with this device's rows for ``key`` replaced (other devices and keys kept)."""
    devices = dict(table.get("devices", {}))
    entry = dict(devices.get(device, {}))
    entry[key] = rows
    entry.setdefault("_provenance", {})[key] = provenance
    devices[device] = entry
    return {**table, "devices": devices}


def tune_shape(case: Case, row: dict, configs: list[ExtendConfig], ref_rows: torch.Tensor, sdpa_call) -> None:
    """Every candidate on this shape, twice (forward then reverse order, against clock drift), and SDPA's
    best again at the end; ``row['tune']`` gets each candidate's two times and their mean. Then a final
    (``race``): the ``FINALISTS`` fastest and the launch chosen now, each timed right after SDPA, in
    ``row['race']`` (the GPU slows as it warms: SDPA's own time rose 5-19% between its first and last
    timing on one shape in the 2026-11-23 run, so only ratios of neighbouring timings compare)."""
    times: dict[int, list] = {i: [] for i in range(len(configs))}
    errs: dict[int, dict] = {}
    for order in (range(len(configs)), reversed(range(len(configs)))):
        for i in order:
            r = bench_kernel(case, case.extend(configs[i]), ref_rows)
            if "ms" in r:
                times[i].append(r["ms"])
                errs[i] = {"rel_err": r.get("rel_err")}
            else:
                errs[i] = r
    if sdpa_call is not None:
        row["sdpa_ms_again"] = time_ms(sdpa_call)
        row["sdpa_ms_mean"] = (row["sdpa_ms"] + row["sdpa_ms_again"]) / 2
        # The final: the fastest few and the launch chosen now, each timed right after SDPA, round after round.
        ranked = sorted((i for i in times if times[i]), key=lambda i: sum(times[i]) / len(times[i]))
        final = {fmt_cfg(configs[i]): configs[i] for i in ranked[:FINALISTS]}
        default = ExtendConfig(**row["config"])
        final.setdefault(fmt_cfg(default), default)
        result = race(sdpa_call, {name: case.extend(cfg) for name, cfg in final.items()})
        row["race"] = [{"config": final[name].__dict__, **r} for name, r in result.items()]
        for name, r in result.items():
            print(f"    final {name:30s} paired ratio median {r['median']:.3f} ({r['min']:.3f}-{r['max']:.3f})",
                  flush=True)
    out = []
    for i, cfg in enumerate(configs):
        r = {"config": cfg.__dict__, **errs.get(i, {})}
        if times[i]:
            ms = sum(times[i]) / len(times[i])
            r.update(ms_runs=times[i], ms=ms, tflops=case.flops / (ms / 1e3) / 1e12)
            if "sdpa_ms_mean" in row:
                r["ratio_vs_sdpa"] = row["sdpa_ms_mean"] / ms
        out.append(r)
        print(f"    {fmt_cfg(cfg):30s} " + (f"{r['ms']:7.3f} ms {r['tflops']:6.1f} TF/s"
                                            + (f" ratio {r['ratio_vs_sdpa']:.3f}" if "ratio_vs_sdpa" in r else "")
                                            if "ms" in r else f"ERROR {r.get('error')}"), flush=True)
    row["tune"] = out


def tune_configs(tma: bool) -> list[ExtendConfig]:
    """128 query rows need 8 warps (4 spill registers on sm90); block_n must divide block_m. On sm90
    Triton 3.9 compiles warp_specialize=True to the same code (one variant kept to notice a change)."""
    shapes = [  # (block_m, block_n, warps, stages, warp_specialize)
        (128, 128, 8, 2, False), (128, 128, 8, 3, False),
        (128, 64, 8, 2, False), (128, 64, 8, 3, False), (128, 64, 8, 4, False),
        (128, 128, 8, 2, True),
        (64, 64, 4, 2, False), (64, 64, 4, 3, False), (64, 64, 4, 4, False), (64, 32, 4, 3, False),
        (64, 64, 8, 3, False), (64, 32, 4, 4, False), (32, 32, 4, 3, False), (64, 64, 4, 3, True),
    ]
    cfgs = [ExtendConfig(bm, bn, w, s, tma, ws) for bm, bn, w, s, ws in shapes if tma or not ws]
    if tma:  # the pointer-load path for comparison
        cfgs += [ExtendConfig(128, 64, 8, 2, False), ExtendConfig(128, 128, 8, 2, False)]
    return cfgs


def tune(case: Case, ref_rows: torch.Tensor, tma: bool, emit) -> list[dict]:
    rows = []
    for cfg in tune_configs(tma):
        t0 = time.time()
        r = {"config": cfg.__dict__, **bench_kernel(case, case.extend(cfg), ref_rows)}
        rows.append(r)
        emit(f"    {fmt_cfg(cfg):28s} " + (f"{r['ms']:7.3f} ms {r['tflops']:6.1f} TF/s err {r['rel_err']:.1e}"
                                            if "ms" in r else f"ERROR {r['error']}") + f"   ({time.time() - t0:.1f} s)")
    return sorted(rows, key=lambda r: r.get("ms", float("inf")))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--tune", action="store_true", help="sweep launch configurations at 8192 tokens")
    ap.add_argument("--tune-shapes", action="store_true",
                    help="every candidate of shape_configs() (tiles, GQA packing, launch order) on every shape "
                         "(the paged kernel's column is left out)")
    ap.add_argument("--write-table", nargs="?", const=str(TUNED_TABLE), metavar="PATH",
                    help="with --tune-shapes: write each shape's fastest candidate into the tuned table "
                         f"(default {TUNED_TABLE.name} beside the kernel), this device's rows replaced")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_extend needs a CUDA device")
    warnings.filterwarnings("ignore", category=UserWarning)  # SDPA explains every backend it skips
    t_start = time.time()
    gen = torch.Generator(device="cuda").manual_seed(0)
    dev = torch.cuda.get_device_name()
    import triton
    results: dict = {"device": dev, "torch": torch.__version__, "triton": triton.__version__,
                     "heads": [HQ, HKV, D], "dtype": str(DTYPE), "rows": []}
    print(f"device {dev}; torch {torch.__version__}, triton {triton.__version__}; heads {HQ}/{HKV} x {D}, {DTYPE}",
          flush=True)

    def emit_row(row):
        results["rows"].append(row)
        print(fmt_shape(row), flush=True)
        write_json(args.out, results)  # after every row: a cut-off run still leaves its figures

    tune = shape_configs() if args.tune_shapes else None
    for batch, seq in [(1, 2048), (1, 4096), (1, 8192), (1, 16384), (4, 4096)]:
        emit_row(shape_row(Case(batch, seq, 0, 16, gen), paged=not tune, tune=tune))
        torch.cuda.empty_cache()
    prefix_case = Case(1, 4096, 4096, 16, gen)
    emit_row(shape_row(prefix_case, paged=not tune, tune=tune))

    if args.tune:
        case = Case(1, 8192, 0, 16, gen)
        ref = case.dense_to_rows(F.scaled_dot_product_attention(case.qs, *case.kv["expanded"], is_causal=True,
                                                                scale=SCALE))
        tma = tma_supported(case.q, case.k_new, case.v_new)
        print(f"-- tune bs1 seq8192 (tensor descriptors: {tma})", flush=True)
        rows = tune(case, ref, tma, lambda s: print(s, flush=True))
        results["tune_seq8192"] = rows
        write_json(args.out, results)
        del case
        torch.cuda.empty_cache()
        ref_p = prefix_case.dense_to_rows(F.scaled_dot_product_attention(
            prefix_case.qs, *prefix_case.kv["expanded"], scale=SCALE,
            attn_mask=torch.ones(4096, 8192, dtype=torch.bool, device="cuda").tril(4096)))
        print("-- the three best at prefix 4096 + 4096 new", flush=True)
        top = []
        for r in [r for r in rows if "ms" in r][:3]:
            cfg = ExtendConfig(**r["config"])
            p = {"config": r["config"], **bench_kernel(prefix_case, prefix_case.extend(cfg), ref_p)}
            top.append(p)
            print(f"    {fmt_cfg(cfg):28s} " + (f"{p['ms']:7.3f} ms {p['tflops']:6.1f} TF/s" if "ms" in p
                                                else f"ERROR {p['error']}"), flush=True)
        results["tune_prefix4096_seq4096"] = top
        if rows and "ms" in rows[0]:
            best = ExtendConfig(**rows[0]["config"])
            results["best"] = rows[0]["config"]
            print(f"best at 8192: {fmt_cfg(best)}  {rows[0]['tflops']:.1f} TF/s -> set HOPPER_CONFIG = {best!r}",
                  flush=True)
    if args.write_table and tune:
        import json
        path = Path(args.write_table)
        old = json.loads(path.read_text()) if path.exists() else {}
        rows = table_rows(results["rows"])
        key = table_key(DTYPE, D, G)
        prov = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "triton": triton.__version__,
                "command": "python " + " ".join(sys.argv)}
        path.write_text(json.dumps(merge_table(old, dev, key, rows, prov), indent=1) + "\n")
        print(f"wrote {len(rows)} rows for {dev} / {key} to {path}", flush=True)
    results["elapsed_s"] = time.time() - t_start
    print(f"elapsed {results['elapsed_s']:.0f} s", flush=True)
    write_json(args.out, results)


if __name__ == "__main__":
    main()
