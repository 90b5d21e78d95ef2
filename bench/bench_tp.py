"""Tensor parallelism on two GPUs at Llama-3.1-8B's shape: the decode step, its floor, and the hand-off.

Three parts, one JSON (``--out``, rewritten after each part, so a run cut off by ``--deadline-s`` keeps what it
measured; a part that no longer fits is listed under ``skipped``, one that failed under ``errors``):

  decode   the target decode step at batch 1 and 32 (``--batches``), ``--context`` tokens of K/V per request,
           under CUDA graphs (eager beside it): TP 1 on cuda:0 in this process, then TP 2 over NCCL in two
           processes, rank r on cuda:r (rank 0's time, the slower rank's beside it). Random bf16 weights built
           in memory (``bench/common.py``); the K/V is left as the pool holds it (timing does not depend on it).
  floor    per row and rank: (weight bytes the step reads + the K/V bytes it reads) / the copy bandwidth of that
           GPU measured in this run; for TP 2 plus the collectives measured alone: the step's all-reduces (two per
           layer and the embedding's) of [batch, hidden] and the LM head's all-gather of [batch, vocab / 2], the
           same sizes and count as the step's, in one CUDA graph.
  handoff  one request's target K/V (``--handoff-tokens``, every layer, the destination pages scattered as an
           allocator leaves them) written from cuda:0 into pools a second process holds on cuda:1, exported with
           ``shared.handoff.ipc.export_pools`` and written with ``write_in_place`` (the same-host hand-off's path
           to a peer GPU), against torch's copy cuda:0 -> cuda:1 of the same bytes.

    python bench/bench_tp.py --out out/tp.json               # 2 GPUs (H200: about 2-3 minutes)
    python bench/bench_tp.py --smoke --out /tmp/tp.json      # tiny model, CPU, gloo: checks the script only

``--smoke`` runs every part on the CPU (two gloo ranks, shared-memory pools); its figures mean nothing.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_decode import kv_bytes, read_bytes, warm_up_gpu  # noqa: E402
from bench.bench_handoff import figures, make_cache, pages, writes_into_another_process  # noqa: E402
from bench.common import build_target, copy_bandwidth, engine_config, llama8b_config, write_json  # noqa: E402
from bench.timing import timer_ms  # noqa: E402
from shared.engine import Engine  # noqa: E402
from shared.follower import Follower  # noqa: E402
from shared.model.factory import PRESETS, llama_hf_config  # noqa: E402
from shared.parallel import TPGroup, free_address, join_ranks, rank_device, start_ranks  # noqa: E402
from shared.sampling import SamplingParams  # noqa: E402

GPU = dict(device="cuda", dtype="bfloat16", batches="1,32", context=1024, iters=30, handoff_tokens=4096, repeat=5,
           deadline_s=400.0)
SMOKE = dict(device="cpu", dtype="float32", batches="1,2", context=32, iters=2, handoff_tokens=64, repeat=2,
             deadline_s=100.0)
NEEDS_S = {"tp1": 30, "tp2": 60, "handoff": 20}  # a part starts only with this much of the deadline left


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny model on the CPU, gloo: checks the script only")
    ap.add_argument("--out", default="out/tp/bench_tp.json")
    ap.add_argument("--batches", help="decode batch sizes, comma-separated (1,32)")
    ap.add_argument("--context", type=int, help="K/V tokens per request (1024)")
    ap.add_argument("--iters", type=int, help="timed replays per figure (30)")
    ap.add_argument("--handoff-tokens", type=int, help="tokens of the request handed off (4096)")
    ap.add_argument("--repeat", type=int, help="hand-off and peer-copy repeats (5)")
    ap.add_argument("--deadline-s", type=float, help="the whole run's budget (400): later parts are skipped")
    args = ap.parse_args(argv)
    for k, v in (SMOKE if args.smoke else GPU).items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    args.batches = [int(b) for b in str(args.batches).split(",")]
    return args


def target_config(args) -> dict:
    return llama_hf_config(**PRESETS["tiny"]) if args.smoke else llama8b_config()


# ---- decode: one rank's step times and floor ----------------------------------------------------------------
def decode_rows(tp: TPGroup | None, args) -> list[dict]:
    """On this rank (``tp`` None: TP 1, alone): for each batch, the decode step's times, graph and eager, and the
    bytes its floor divides; under TP also the step's collectives timed alone."""
    cuda = args.device.startswith("cuda")
    device = rank_device(args.device, tp.rank if tp else 0)
    if cuda:
        torch.cuda.set_device(torch.device(device))
        warm_up_gpu(2.0)
    bw = copy_bandwidth() if cuda else None
    torch.manual_seed(0)
    target = build_target(device, getattr(torch, args.dtype), target_config(args))
    rows = []
    for bs in args.batches:
        config = engine_config(args.context, bs, device=args.device, dtype=args.dtype, cuda_graph=cuda)
        built = Engine if tp is None or tp.rank == 0 else Follower  # rank 1 follows rank 0's engine
        engine = built(target, config=config.model_copy(update={"tensor_parallel": tp.size if tp else 1}), tp=tp)
        reqs = idle_requests(engine, tp, bs, args.context)
        row = {"tp": tp.size if tp else 1, "rank": tp.rank if tp else 0, "batch": bs, "context": args.context,
               **step_ms(engine, reqs, args.context, args.iters), "weight_bytes": read_bytes(engine.model),
               "kv_bytes": kv_bytes(engine, bs * args.context), "copy_bw_Bps": bw}
        if tp is not None:
            row["collectives_ms"] = collectives_ms(tp, engine.model, bs, args.iters)
        row["floor_ms"] = None if bw is None else (row["weight_bytes"] + row["kv_bytes"]) / bw * 1e3 + row.get(
            "collectives_ms", 0.0)
        rows.append(row)
        if tp is None or tp.rank == 0:
            print(fmt_row(row), flush=True)
        del engine, reqs
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    return rows


def idle_requests(engine: Engine, tp: TPGroup | None, batch: int, ctx: int) -> list:
    """``batch`` requests holding ``ctx`` positions of K/V each, ready to decode. Made through the scheduler
    alone (the engine's hand-off path would wait for K/V from a prefill): on rank 0, the other ranks replaying
    its reservations and activations (``Follower.follow``), so every rank holds the same."""
    if tp is not None and tp.rank != 0:
        reqs = engine.follow()
    else:
        reqs = []
        for i in range(batch):
            params = SamplingParams(max_new_tokens=64, ignore_eos=True, seed=i)
            req = engine.scheduler.admit_handoff(f"b{i}", [1] * ctx, [2], [0.0], params, ctx)
            assert req is not None, "pool too small for the benchmark"
            engine.scheduler.activate(req, ctx, None)
            reqs.append(req)
        engine.release_followers()
    for req in reqs:
        engine.cache.reserve(req.handles[0], ctx + 1)  # the slot the step writes
    return reqs


def step_ms(engine: Engine, reqs: list, ctx: int, iters: int) -> dict:
    """The decode phase's milliseconds per call (the graph's inputs copied in, replayed, outputs copied out),
    under its CUDA graph and eagerly. Every rank calls it the same number of times (each call holds collectives)."""
    dev, bs = engine.device, len(reqs)
    rows = torch.tensor([r.handles[0].row for r in reqs], device=dev)
    lens = torch.full((bs,), ctx, dtype=torch.int64, device=dev)
    toks = torch.ones(bs, dtype=torch.int64, device=dev)
    g = engine.decode_graphs
    with engine.on_device():
        graph_ms = timer_ms(lambda: g(rows, lens, toks), iters=iters, warmup=min(5, iters), calls=1)
        captured = g.captured_sizes
        g.capture = False
        eager_ms = timer_ms(lambda: g(rows, lens, toks), iters=max(2, iters // 3), warmup=1, calls=1)
    return {"graph_ms": graph_ms, "eager_ms": eager_ms, "graphs": captured,
            "graph_failures": len(engine.graph_failures)}


def collectives_ms(tp: TPGroup, target, bs: int, iters: int) -> float:
    """Milliseconds of a decode step's collectives alone: 2 per layer and the embedding's all-reduce of
    [bs, hidden], the LM head's all-gather of [bs, its vocabulary shard]; one CUDA graph on a GPU."""
    w = target.lm_head.weight
    x = torch.zeros(bs, target.config.hidden_size, dtype=w.dtype, device=w.device)
    logits = torch.zeros(bs, w.shape[0], dtype=w.dtype, device=w.device)

    def step() -> None:
        for _ in range(2 * target.config.num_hidden_layers + 1):
            tp.all_reduce(x)
        tp.all_gather(logits)

    if w.is_cuda:
        graph = graphed(step)
        return timer_ms(graph.replay, iters=iters, warmup=3, calls=1)
    return timer_ms(step, iters=iters, warmup=1, calls=1)


def graphed(fn) -> torch.cuda.CUDAGraph:
    """``fn`` run once on a side stream, then captured (thread-local mode, as the engine's phases are)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
        fn()
    return graph


def fmt_row(r: dict) -> str:
    floor = "" if r["floor_ms"] is None else f"  floor {r['floor_ms']:6.3f} ms  x{r['graph_ms'] / r['floor_ms']:.2f}"
    coll = f"  (collectives alone {r['collectives_ms']:.3f} ms)" if "collectives_ms" in r else ""
    return (f"decode TP {r['tp']} bs={r['batch']:3d} ctx={r['context']:5d}: graph {r['graph_ms']:7.3f} ms  "
            f"eager {r['eager_ms']:7.3f} ms{floor}{coll}")


def _tp2_rank(tp: TPGroup, out: str, args: argparse.Namespace) -> None:
    rows = decode_rows(tp, args)
    Path(out, f"rank{tp.rank}.json").write_text(json.dumps(rows))


def run_tp2(args, deadline: float) -> list[dict]:
    """The TP-2 rows: rank 0's, each with the slower rank's graph time beside it."""
    with tempfile.TemporaryDirectory(prefix="eyrie-bench-tp-") as out:
        procs = start_ranks(range(2), 2, free_address(), args.device, _tp2_rank, (out, args))
        codes = join_ranks(procs, deadline)
        if codes != [0, 0]:
            raise RuntimeError(f"the TP-2 ranks exited with {codes} (their stderr says why)")
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(2)]
    for row, other in zip(*ranks):
        row["slowest_rank_graph_ms"] = max(row["graph_ms"], other["graph_ms"])
        row["rank1_floor_ms"] = other["floor_ms"]
    return ranks[0]


# ---- hand-off: CUDA IPC into a peer GPU's pools against torch's peer copy ------------------------------------
def handoff_rows(args) -> list[dict]:
    cfg = target_config(args)
    src_dev, dst_dev = ("cuda:0", "cuda:1") if args.device.startswith("cuda") else ("cpu", "cpu")
    shape = dict(tokens=args.handoff_tokens, layers=cfg["num_hidden_layers"], kv_heads=cfg["num_key_value_heads"],
                 head_dim=cfg["hidden_size"] // cfg["num_attention_heads"], page_size=16, dtype=args.dtype,
                 contiguous=False)
    src_args, dst_args = argparse.Namespace(**shape, device=src_dev), argparse.Namespace(**shape, device=dst_dev)
    src = make_cache(src_args, False)
    src.pool.normal_()
    src_pages, dst_pages = pages(src_args)
    nbytes = len(src_pages) * src.page_size * src.pool[:, :, 0].numel() * src.pool.element_size()  # K and V
    peer = peer_copy(src_dev, dst_dev, nbytes, args.repeat)  # first: it also enables peer access both ways
    ipc = ipc_write(dst_args, src, src_pages, dst_pages, args.repeat)
    ipc["of_peer_copy"] = ipc["gbps"] / peer["gbps"]
    for r in (ipc, peer):
        print(f"handoff {r['transport']:18s} {r['bytes'] / 1e6:8.1f} MB in {r['seconds'] * 1e3:8.3f} ms "
              f"(median of {r['repeats']}): {r['gbps']:7.2f} GB/s, best {r['best_gbps']:7.2f}", flush=True)
    print(f"handoff ipc / peer copy: {ipc['of_peer_copy']:.2f}", flush=True)
    access = torch.cuda.can_device_access_peer(0, 1) if src_dev.startswith("cuda") else None
    return [{**ipc, "settings": shape, "from": src_dev, "to": dst_dev, "peer_access": access},
            {**peer, "from": src_dev, "to": dst_dev}]


def peer_copy(src_dev: str, dst_dev: str, nbytes: int, repeat: int) -> dict:
    """torch's copy of ``nbytes`` contiguous bytes from ``src_dev`` to ``dst_dev`` (bytes written per second)."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=src_dev)
    b = torch.empty(nbytes, dtype=torch.uint8, device=dst_dev)
    a[:1024].copy_(b[:1024])  # the other direction once: peer access enabled both ways
    times = []
    for _ in range(repeat + 1):  # the first one warms
        sync(src_dev, dst_dev)
        t0 = time.perf_counter()
        b.copy_(a)
        sync(src_dev, dst_dev)
        times.append(time.perf_counter() - t0)
    return {"transport": "torch peer copy", **figures(nbytes, times[1:])}


def ipc_write(dst_args, src, src_pages: list[int], dst_pages: list[int], repeat: int) -> dict:
    """``write_in_place`` from this process into pools a second process holds on ``dst_args.device``."""
    nbytes, times, landed = writes_into_another_process(dst_args, src, src_pages, dst_pages, repeat)
    return {"transport": "ipc write_in_place", **figures(nbytes, times), "landed": landed > 0}


def sync(*devices: str) -> None:
    for d in devices:
        if d.startswith("cuda"):
            torch.cuda.synchronize(d)


# ---- the run ------------------------------------------------------------------------------------------------
def run_part(name: str, results: dict, deadline: float, fn) -> None:
    if deadline - time.monotonic() < NEEDS_S[name]:
        results["skipped"].append(name)
        print(f"{name}: skipped (deadline)", flush=True)
        return
    print(f"{name}: starting, {deadline - time.monotonic():.1f} s left", flush=True)
    try:
        fn()
    except Exception as e:  # noqa: BLE001 (a part that fails leaves the others' figures)
        results["errors"][name] = f"{type(e).__name__}: {e}"
        print(f"{name}: failed: {results['errors'][name]}", flush=True)


def print_table(results: dict) -> None:
    print(f"\n{results['device']}, context {results['settings']['context']}, {results['settings']['dtype']}")
    print(f"{'TP':>3} {'batch':>5} {'graph ms':>9} {'eager ms':>9} {'floor ms':>9} {'x floor':>8} {'coll. ms':>9}")
    for r in results["decode"]:
        floor = r["floor_ms"] or float("nan")
        print(f"{r['tp']:>3} {r['batch']:>5} {r['graph_ms']:9.3f} {r['eager_ms']:9.3f} {floor:9.3f} "
              f"{r['graph_ms'] / floor:8.2f} {r.get('collectives_ms', float('nan')):9.3f}")
    for r in results["handoff"]:
        print(f"hand-off {r['transport']}: {r['gbps']:.2f} GB/s ({r['from']} -> {r['to']})")


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    deadline = time.monotonic() + args.deadline_s
    if args.smoke:
        torch.set_num_threads(1)
    elif torch.cuda.device_count() < 2:
        raise SystemExit("bench_tp needs two GPUs (or --smoke)")
    results = {"settings": {k: v for k, v in vars(args).items() if k != "out"},
               "device": torch.cuda.get_device_name(0) if not args.smoke else "cpu (smoke)",
               "decode": [], "handoff": [], "skipped": [], "errors": {}}
    parts = (("tp1", lambda: results["decode"].extend(decode_rows(None, args))),
             ("tp2", lambda: results["decode"].extend(run_tp2(args, deadline))),
             ("handoff", lambda: results["handoff"].extend(handoff_rows(args))))
    for name, fn in parts:
        run_part(name, results, deadline, fn)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        write_json(args.out, results)
    print_table(results)
    return results


if __name__ == "__main__":
    main()
