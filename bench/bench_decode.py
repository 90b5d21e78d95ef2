"""Decode-side step times on the 8B shape vs the bandwidth floor, eager vs CUDA graph.

Questions answered (one table each, all in one JSON):
  decode   target decode step, batch x context, eager and graph, vs floor = (weights + KV) / copy BW
  verify   verify of N draft tokens at batch 1 vs a single-token decode step
  spec     EAGLE draft loop, verify, extend and the whole iteration at batch 1 (steps=5, topk=1)
  spec_grid  (--spec-grid) draft loop, verify, verify+extend and the whole iteration at --batches x
           --contexts, graph and eager, the iteration with and without drafting ahead
  plain_step (--plain-step) the adaptive policy's plain step in an engine with a draft at --batches x
           --contexts against a plain engine's decode step: under its graphs (target decode with the draft's
           features, then the draft extend over the new position), with the extend eager, all eager
The K/V of each request is reserved to the context length and left as it is (timing does not
depend on its values), so no 8k-token prefill is needed.

    python bench/bench_decode.py --out docs/bench/decode.json
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import build_draft, build_target, copy_bandwidth, engine_config, param_bytes, time_cuda, write_json
from shared.config import SpecConfig
from shared.engine import Engine
from shared.model.fp8 import mark_same_rows
from shared.sampling import SamplingParams
from shared.stepping import drive


def fake_requests(engine: Engine, batch: int, ctx: int, max_new: int = 64, draft_state=None):
    """Requests holding ``ctx`` positions of K/V in every cache, ready to decode (from ``draft_state()``
    when given: a fresh draft state per request)."""
    reqs = []
    for i in range(batch):
        params = SamplingParams(max_new_tokens=max_new, ignore_eos=True)
        req = engine.reserve_handoff(f"b{i}", [1] * ctx, [2], [0.0], params, ctx)
        assert req is not None, "pool too small for the benchmark"
        engine.activate_handoff(req, ctx, draft_state() if draft_state else None)
        reqs.append(req)
    return reqs


def kv_bytes(engine: Engine, tokens: int) -> int:
    c = engine.cache.layout
    return 2 * c.num_layers * tokens * c.num_kv_heads * c.head_dim * torch.tensor([], dtype=c.dtype).element_size()


def bench_target_decode(target, bw, batches, contexts, rows_out):
    for ctx in contexts:
        for bs in batches:
            try:
                engine = Engine(target, config=engine_config(ctx, bs))
            except torch.OutOfMemoryError:
                gc.collect()
                torch.cuda.empty_cache()
                kv_gb = kv_bytes_for(target, ctx + 128) * bs / 1e9
                rows_out.append({"batch": bs, "context": ctx, "fits": False, "kv_GB": kv_gb})
                print(f"decode bs={bs:3d} ctx={ctx:5d} does not fit: {kv_gb:.0f} GB of KV beside the weights",
                      flush=True)
                continue
            reqs = fake_requests(engine, bs, ctx)
            dev = engine.device
            rows = torch.tensor([r.handles[0].row for r in reqs], device=dev)
            lens = torch.full((bs,), ctx, dtype=torch.int64, device=dev)
            toks = torch.ones(bs, dtype=torch.int64, device=dev)
            for r in reqs:
                engine.cache.reserve(r.handles[0], ctx + 1)
            g = engine.decode_graphs
            ms_graph = time_cuda(lambda: g(rows, lens, toks))  # noqa: B023, F821 (called at once)
            g.capture = False
            ms_eager = time_cuda(lambda: g(rows, lens, toks), iters=10)  # noqa: B023, F821
            floor_ms = (param_bytes(target) + kv_bytes(engine, bs * ctx)) / bw * 1e3
            read_floor_ms = (read_bytes(target) + kv_bytes(engine, bs * ctx)) / bw * 1e3
            row = {"batch": bs, "context": ctx, "eager_ms": ms_eager, "graph_ms": ms_graph, "floor_ms": floor_ms,
                   "graph_over_floor": ms_graph / floor_ms, "read_floor_ms": read_floor_ms,
                   "graph_over_read_floor": ms_graph / read_floor_ms, "tok_per_s": bs / ms_graph * 1e3}
            rows_out.append(row)
            print(f"decode bs={bs:3d} ctx={ctx:5d} eager {ms_eager:7.2f} ms  graph {ms_graph:7.2f} ms  "
                  f"floor {floor_ms:6.2f} ms  x{ms_graph / floor_ms:.3f}  "
                  f"(read floor {read_floor_ms:6.2f} ms  x{ms_graph / read_floor_ms:.3f})", flush=True)
            del engine, reqs, g
            gc.collect()
            torch.cuda.empty_cache()


def spec_engine(target, draft, ctx, topk, steps, n, batch=1, room=1024, policy="fixed"):
    """An engine with ``batch`` requests holding ``ctx`` positions, each with ``room`` more to generate."""
    spec = SpecConfig(topk=topk, steps=steps, num_draft_tokens=n)
    config = engine_config(ctx + room, batch, spec=spec).model_copy(update={"spec_policy": policy})
    engine = Engine(target, draft, config)
    dev = engine.device
    k = topk
    from shared.spec.state import DraftState

    def state():
        return DraftState(bonus_token=2, committed_len=ctx, hidden=torch.zeros(draft.hidden_width, device=dev,
                          dtype=torch.bfloat16), topk_p=torch.full((k,), 1.0 / k, device=dev),
                          topk_ids=torch.arange(k, device=dev))
    return engine, fake_requests(engine, batch, ctx, max_new=room - 24, draft_state=state)


def bench_spec(target, draft, bw, ctx, results, verify_ns=(4, 8, 16, 32, 64)):
    w_bytes = param_bytes(target)
    floor_ms = (w_bytes + kv_bytes_for(target, ctx)) / bw * 1e3
    # Verify cost vs N at batch 1.
    for n in verify_ns:
        topk = 1 if n <= 8 else 4
        steps = n - 1 if topk == 1 else 5
        if topk > 1 and n > 1 + topk + (steps - 1) * topk * topk:
            continue
        engine, reqs = spec_engine(target, draft, ctx, topk, steps, n)
        w = engine.speculator
        w._reserve(reqs)
        inp = w._inputs(reqs)
        tree = w.graphs["draft"](inp)
        ms = time_cuda(lambda: w.graphs["verify"](inp, tree))  # noqa: B023
        results["verify"].append({"num_draft_tokens": n, "graph_ms": ms, "floor_ms": floor_ms})
        print(f"verify N={n:3d} {ms:7.2f} ms", flush=True)
        del engine, reqs, w
        gc.collect()
        torch.cuda.empty_cache()
    # The whole EAGLE iteration, chain steps=5.
    engine, reqs = spec_engine(target, draft, ctx, 1, 5, 6)
    w = engine.speculator
    w._reserve(reqs)
    inp = w._inputs(reqs)
    tree = w.graphs["draft"](inp)
    logits, feats = w.graphs["verify"](inp, tree)
    acc = w.phases.accept(inp, tree, logits)
    row = time_phases(w, {"draft": lambda: w.graphs["draft"](inp), "verify": lambda: w.graphs["verify"](inp, tree),
                          "extend": lambda: w.graphs["extend"](inp, tree, acc, logits, feats),
                          "verify_extend": lambda: w.graphs["verify_extend"](inp, tree)}, 20, 5)

    def iteration():
        engine.speculator.decode_step(reqs)

    # The steady state serves the same batch step after step: the next step's draft is launched
    # ahead (the host's bookkeeping overlaps it); then the same without drafting ahead.
    # Iterations back to back as a serving loop runs them (no synchronisation between them but each
    # step's own wait for its tokens), timed ten at a time.
    w.ahead.enabled = True
    row["iteration_graph_ms"] = time_cuda(iteration, iters=7, warmup=2, calls=10)
    row["ahead_used"], row["ahead_dropped"] = w.ahead.used, w.ahead.dropped
    w.ahead.enabled = False
    row["iteration_graph_no_ahead_ms"] = time_cuda(iteration, iters=7, warmup=2, calls=10)
    w.ahead.enabled = True
    row["draft_graph_speedup"] = row["draft_eager_ms"] / row["draft_graph_ms"]
    row["floor_ms"] = floor_ms
    results["spec"].append(row)
    print({k: round(v, 3) for k, v in row.items()}, flush=True)


def bench_spec_grid(target, draft, batches, contexts, results):
    """Every speculative phase at batch x context, CUDA graph and eager (chain, steps=5, topk=1): the draft
    loop, verify of 6 tokens, verify + accept + extend, and the whole iteration (graph with and without
    drafting ahead, eager). A fresh engine per cell; iterations run back to back, as a serving loop runs
    them; a cell whose KV does not fit beside the weights is recorded as such."""
    for ctx in contexts:
        for bs in batches:
            cell = {"batch": bs, "context": ctx}
            try:
                engine, reqs = spec_engine(target, draft, ctx, 1, 5, 6, batch=bs, room=1024)
                spec_cell(engine.speculator, reqs, cell)
                del engine, reqs
            except torch.OutOfMemoryError:
                cell["fits"] = False
            results["spec_grid"].append(cell)
            print(fmt_spec_cell(cell), flush=True)
            gc.collect()
            torch.cuda.empty_cache()


def time_phases(w, phases: dict, graph_iters: int, eager_iters: int) -> dict:
    """``{name}_graph_ms`` and ``{name}_eager_ms`` of each phase call; graphs are left on."""
    row = {}
    for graphs in (True, False):
        for g in w.graphs.values():
            g.capture = graphs
        tag = "graph" if graphs else "eager"
        for name, call in phases.items():
            row[f"{name}_{tag}_ms"] = time_cuda(call, iters=graph_iters if graphs else eager_iters)
    for g in w.graphs.values():
        g.capture = True
    return row


def spec_cell(w, reqs, cell: dict) -> None:
    w._reserve(reqs)
    inp = w._inputs(reqs)
    tree = w.graphs["draft"](inp)
    phases = {"draft": lambda: w.graphs["draft"](inp), "verify": lambda: w.graphs["verify"](inp, tree),
              "verify_extend": lambda: w.graphs["verify_extend"](inp, tree)}
    cell.update(time_phases(w, phases, 10, 3))

    def iteration():
        w.decode_step(reqs)

    for name, graphs, ahead in (("iteration_graph_ms", True, True), ("iteration_graph_no_ahead_ms", True, False),
                                ("iteration_eager_ms", False, False)):
        for g in w.graphs.values():
            g.capture = graphs
        w.ahead.enabled = ahead
        cell[name] = time_cuda(iteration, iters=3 if graphs else 2, warmup=1, calls=8 if graphs else 2)
    cell.update(ahead_used=w.ahead.used, ahead_mismatched=w.ahead.mismatched,
                all_running=all(r.finish_reason is None for r in reqs))  # the batch never shrank
    cell["draft_graph_speedup"] = cell["draft_eager_ms"] / cell["draft_graph_ms"]
    cell["ahead_speedup"] = cell["iteration_graph_no_ahead_ms"] / cell["iteration_graph_ms"]


def bench_plain_step(target, draft, batches, contexts, results, room: int = 512):
    """Whole plain decode steps, back to back as a serving loop runs them (each waits for its tokens): a
    plain engine's (``ModelRunner._decode_step``) and an adaptive engine's with a draft
    (``ModelRunner._plain_step``) with its graphs, with the draft extend eager, and all eager (the eager target
    step). A fresh pair of engines per cell."""
    for ctx in contexts:
        for bs in batches:
            cell = {"batch": bs, "context": ctx}
            try:
                cell["plain_engine_ms"] = plain_engine_ms(target, bs, ctx, room)
                gc.collect()
                torch.cuda.empty_cache()
                engine, reqs = spec_engine(target, draft, ctx, 1, 3, 4, batch=bs, room=room, policy="adaptive")
                plain_step_cell(engine, reqs, cell)
                del engine, reqs
            except torch.OutOfMemoryError:
                cell["fits"] = False
            results["plain_step"].append(cell)
            print(fmt_plain_cell(cell), flush=True)
            gc.collect()
            torch.cuda.empty_cache()


def plain_engine_ms(target, bs: int, ctx: int, room: int) -> float:
    """Milliseconds per decode step of an engine without a draft (its decode graph, captured by the warm-up)."""
    engine = Engine(target, config=engine_config(ctx + room, bs))
    reqs = fake_requests(engine, bs, ctx, max_new=room - 24)
    return time_cuda(lambda: drive(engine.runner._decode_step(reqs)), iters=5, warmup=2, calls=8)


def plain_step_cell(engine: Engine, reqs, cell: dict) -> None:
    graphs = engine.speculator.graphs  # the warm-up steps capture the one bucket timed
    captures = graphs["plain_extend"].capture
    for name, plain_on, extend_captured in (("graph", True, captures), ("eager_extend", True, False),
                                            ("eager", False, False)):
        graphs["plain"].enabled, graphs["plain_extend"].capture = plain_on, extend_captured
        cell[f"plain_step_{name}_ms"] = time_cuda(lambda: drive(engine.runner._plain_step(reqs)), iters=5,  # noqa: B023
                                                  warmup=2, calls=8)
    graphs["plain"].enabled, graphs["plain_extend"].capture = True, captures
    cell["all_running"] = all(r.finish_reason is None for r in reqs)
    cell["graph_over_plain_engine"] = cell["plain_step_graph_ms"] / cell["plain_engine_ms"]


def fmt_plain_cell(c: dict) -> str:
    head = f"plain step bs={c['batch']:3d} ctx={c['context']:5d}"
    if c.get("fits") is False:
        return f"{head} does not fit beside the weights"
    return (f"{head} plain engine {c['plain_engine_ms']:6.2f}  with draft: graphs {c['plain_step_graph_ms']:6.2f} "
            f"(x{c['graph_over_plain_engine']:.3f}), extend eager {c['plain_step_eager_extend_ms']:6.2f}, "
            f"eager {c['plain_step_eager_ms']:6.2f} ms")


def fmt_spec_cell(c: dict) -> str:
    head = f"spec bs={c['batch']:3d} ctx={c['context']:5d}"
    if c.get("fits") is False:
        return f"{head} does not fit beside the weights"
    pairs = "  ".join(f"{n} {c[n + '_graph_ms']:6.2f}/{c[n + '_eager_ms']:6.2f}"
                      for n in ("draft", "verify", "verify_extend"))
    return (f"{head} {pairs}  iteration {c['iteration_graph_ms']:6.2f} (no ahead "
            f"{c['iteration_graph_no_ahead_ms']:6.2f}, eager {c['iteration_eager_ms']:6.2f}) ms, graph/eager")


def read_bytes(target) -> int:
    """The weight bytes a decode step actually reads: every weight but the input embedding table, of
    which it reads one row per token (unless the LM head shares it, which the step reads whole)."""
    emb = target.model.embed_tokens.weight
    tied = target.lm_head.weight.data_ptr() == emb.data_ptr()
    return param_bytes(target) - (0 if tied else emb.numel() * emb.element_size())


def kv_bytes_for(target, ctx):
    c = target.config
    return 2 * c.num_hidden_layers * ctx * c.num_key_value_heads * c.head_dim * 2


def warm_up_gpu(seconds: float = 3.0) -> None:
    """Matrix products for a few seconds, so the first configuration is not timed on idle clocks."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    end = time.time() + seconds
    while time.time() < end:
        a @ a
        torch.cuda.synchronize()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--contexts", default="1024,4096,8192")
    ap.add_argument("--draft", default="eagle", choices=["eagle", "eagle3"])
    ap.add_argument("--skip-decode", action="store_true")
    ap.add_argument("--verify-ns", default="4,8,16,32,64", help="draft tokens of the verify-cost sweep")
    ap.add_argument("--spec-grid", action="store_true",
                    help="also time every speculative phase and the whole iteration, graph and eager, at "
                         "--batches x --contexts")
    ap.add_argument("--plain-step", action="store_true",
                    help="also time the adaptive policy's plain step (with a draft) against a plain engine's "
                         "decode step at --batches x --contexts, graph and eager")
    ap.add_argument("--batch-invariant", action="store_true",
                    help="the engine's batch_invariant: every projection of the target and its LM head through the "
                         "launch whose row output does not depend on the row count (its price against the default)")
    args = ap.parse_args()
    torch.manual_seed(0)
    t0 = time.time()
    warm_up_gpu()
    bw = copy_bandwidth()
    print(f"device {torch.cuda.get_device_name()}  copy bandwidth {bw / 1e12:.3f} TB/s", flush=True)
    target = build_target()
    if args.batch_invariant:
        mark_same_rows(target, every_row_count=True)
    print(f"target weights {param_bytes(target) / 1e9:.2f} GB, batch_invariant {args.batch_invariant}", flush=True)
    results = {"device": torch.cuda.get_device_name(), "copy_bw_Bps": bw, "batch_invariant": args.batch_invariant,
               "decode": [], "verify": [], "spec": [],
               "spec_grid": [], "plain_step": []}
    if not args.skip_decode:
        bench_target_decode(target, bw, [int(x) for x in args.batches.split(",")],
                            [int(x) for x in args.contexts.split(",")], results["decode"])
        write_json(args.out, results)
    draft = build_draft(args.draft, target)
    bench_spec(target, draft, bw, 1024, results, [int(x) for x in args.verify_ns.split(",")])
    write_json(args.out, results)
    if args.spec_grid:
        bench_spec_grid(target, draft, [int(x) for x in args.batches.split(",")],
                        [int(x) for x in args.contexts.split(",")], results)
    if args.plain_step:
        bench_plain_step(target, draft, [int(x) for x in args.batches.split(",")],
                         [int(x) for x in args.contexts.split(",")], results)
    results["wall_s"] = time.time() - t0
    write_json(args.out, results)


if __name__ == "__main__":
    main()
