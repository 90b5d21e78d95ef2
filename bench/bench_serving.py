"""The serving benchmark: the disaggregated stack against the single-process engine, one command.

Writes (or takes, ``--model``) a checkpoint, Llama-3.1-8B's shape with random bf16 weights by default
(sharded safetensors, a tokenizer padded to 128256 ids: ``bench/serving_model.py``), then on the same device:

1. the single-process engine, in a subprocess (loaded, graphs captured, warmed), driven in-process through
   the engine API at each point's concurrency; the device-to-device copy bandwidth is measured there too;
2. the stack as ``eyrie up`` runs it (``bench/serving_stack.py``: embedded Redis, prefill, decode, router with
   the OpenAI API; both engines on the one device, each with ``--num-pages`` pages), driven over the router's
   streaming gRPC ``Generate`` and over the OpenAI API's streaming ``/v1/completions``.

The workload (``bench/serving_load.py``, the same token ids on both sides, greedy, ``ignore_eos``): a
concurrency sweep (``--sweep``) of fixed-length requests (``--fixed 512:256``) and of mixed lengths
(``--mixed-prompt 64:1024 --mixed-output 16:512``), and a long-prompt TTFT probe at concurrency 1
(``--probe 4096:8``). Each point sends ``--waves`` x concurrency requests (at least ``--min-requests``), none
after ``--point-seconds``. Reported per point: TTFT p50/p99, inter-token latency p50/p99, output tok/s and
the stack/engine ratios; per transport, the hand-off bandwidth from the prefill service's /metrics
(``eyrie_handoff_bytes_total`` / ``eyrie_handoff_seconds_sum``: whole hand-offs, reserve and acknowledgement
included) beside the device-to-device copy bandwidth. The JSON (``--out``) is rewritten after every point, so a
run cut off by its time limit keeps what it measured; points that no longer fit ``--deadline-s`` are skipped
and listed. An outside load generator (guidellm) as a cross-check of the same endpoint: bench/outside_load.sh
(bench/README.md; bench/fetch_wheels.sh fetches its wheels for the GPU machine).

    python bench/bench_serving.py --out out/serving.json                  # H100: the 8B shape, ~9 min
    python bench/bench_serving.py --smoke --out /tmp/smoke.json           # tiny model on the CPU, < 1 min
    python bench/bench_serving.py --transports grpc-stream --workloads fixed --sweep 1,32   # another transport
    python bench/bench_serving.py --layouts colo1,pd1,pd2,colo2 --model DIR/target --draft DIR/eagle3 \
        --prompts-file DIR/heldout.jsonl --out out/layouts.json   # layouts as deployed (bench/serving_layouts.py)

``--smoke`` checks the script end to end (CI runs it); its figures mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.ideal import annotate, format_ideal, measured_in_subprocess, model_shape  # noqa: E402
from bench.serving_load import (  # noqa: E402
    GrpcDriver,
    HttpDriver,
    Point,
    make_requests,
    run_closed_loop,
    run_engine_point,
    summarize,
)
from bench.timing import write_json  # noqa: E402

GPU_DEFAULTS = dict(preset="llama3-8b-shape", device="cuda", dtype="bfloat16", cuda_graph=True, sweep="1,8,32,64",
                    fixed="512:256", mixed_prompt="64:1024", mixed_output="16:512", probe="4096:8", num_pages=4096,
                    max_running=64, max_context=8192, chunk_size=512, point_seconds=30.0, deadline_s=540.0,
                    start_timeout_s=300.0, waves=2, min_requests=4, probe_requests=3, engine_budget_s=200.0)
SMOKE_DEFAULTS = dict(preset="tiny", device="cpu", dtype="float32", cuda_graph=False, sweep="1,2", fixed="32:8",
                      mixed_prompt="8:48", mixed_output="2:12", probe="200:4", num_pages=None, max_running=4,
                      max_context=512, chunk_size=64, point_seconds=10.0, deadline_s=150.0, start_timeout_s=120.0,
                      waves=1, min_requests=2, probe_requests=1, engine_budget_s=100.0)
# --layouts (bench/serving_layouts.py): the workloads, pools sized by each engine's memory fraction.
LAYOUT_GPU_DEFAULTS = dict(sweep="1,32,64,128", fixed="512:256", probe="3584:8", num_pages=0, waves=1, min_requests=1,
                           probe_requests=2, point_seconds=20.0, streams="32:256:384", arrivals="2048:32:0.5",
                           mixed_seconds=12.0)
LAYOUT_SMOKE_DEFAULTS = dict(sweep="1,2", fixed="32:8", probe="200:4", waves=1, min_requests=2, probe_requests=1,
                             point_seconds=10.0, streams="2:16:12", arrivals="64:4:0.5", mixed_seconds=3.0)
# The smoke run's processes use one CPU thread each: on a small shared machine torch's default (a thread per
# core, spinning at every barrier) makes a tiny model's step ten times slower.
SMOKE_ENV = {"OMP_NUM_THREADS": "1"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny model on the CPU (CI): checks the script only")
    ap.add_argument("--out", default="out/serving/bench_serving.json")
    ap.add_argument("--model", help="target checkpoint directory (default: write one under --workdir)")
    ap.add_argument("--draft", default="none", help="none | eagle3 (a random head written beside the model) | DIR")
    ap.add_argument("--workdir", help="where the checkpoint and the services' logs go (default: a temp dir)")
    ap.add_argument("--preset", help="shape of the written checkpoint (llama3-8b-shape, tiny)")
    ap.add_argument("--device")
    ap.add_argument("--dtype")
    ap.add_argument("--cuda-graph", choices=["on", "off"])
    ap.add_argument("--sweep", help="concurrencies, comma-separated")
    ap.add_argument("--workloads", default="fixed,probe,mixed", help="any of fixed, probe, mixed")
    ap.add_argument("--apis", default="grpc,http", help="the stack's APIs: grpc, http")
    ap.add_argument("--fixed", help="PROMPT:OUTPUT tokens of the fixed workload")
    ap.add_argument("--mixed-prompt", help="LO:HI prompt tokens of the mixed workload")
    ap.add_argument("--mixed-output", help="LO:HI output tokens of the mixed workload")
    ap.add_argument("--probe", help="PROMPT:OUTPUT of the long-prompt TTFT probe (concurrency 1)")
    ap.add_argument("--probe-requests", type=int, help="requests of the probe (default 3)")
    ap.add_argument("--waves", type=int, help="requests per point = waves x concurrency (default 2) ...")
    ap.add_argument("--min-requests", type=int, help="... and at least this many (default 4)")
    ap.add_argument("--point-seconds", type=float, help="no new request of a point after this many seconds")
    ap.add_argument("--request-timeout-s", type=float, default=300.0)
    ap.add_argument("--deadline-s", type=float, help="the whole run's budget: later points are skipped")
    ap.add_argument("--start-timeout-s", type=float, help="the stack's start-up deadline")
    ap.add_argument("--engine-budget-s", type=float, help="the engine phase's share of --deadline-s (the stack "
                                                          "gets the rest)")
    ap.add_argument("--num-pages", type=int, help="KV pages per pool, each engine")
    ap.add_argument("--max-running", type=int)
    ap.add_argument("--max-context", type=int)
    ap.add_argument("--chunk-size", type=int)
    ap.add_argument("--prefill-chunk-size", type=int,
                    help="the stack's prefill service's per-step token budget (default: --chunk-size, as the engine)")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--spec-topk", type=int, default=1)
    ap.add_argument("--spec-steps", type=int, default=3)
    ap.add_argument("--spec-draft-tokens", type=int)
    ap.add_argument("--spec-policy", choices=["fixed", "adaptive"], help="per decode step: always speculate, or "
                                                                         "speculate where it pays (default: the "
                                                                         "engine's, adaptive)")
    ap.add_argument("--spec-candidates", help="with --spec-policy adaptive: the tree shapes it chooses among besides "
                                              "the configured one (EYRIE_SPEC_CANDIDATES; default: chains of 1..3)")
    ap.add_argument("--prompts-file", help="text (or JSONL of {\"text\"}) the prompts are windows of, tokenized "
                                           "by the model's tokenizer (default: random token ids)")
    ap.add_argument("--transports", default="auto", help="one stack run per hand-off transport: auto, ipc, "
                                                         "grpc-stream (EYRIE_HANDOFF_TRANSPORT)")
    ap.add_argument("--local-prefill", default="0", help="one stack run per value: prompts of at most this many "
                    "tokens are prefilled on the decode instance (EYRIE_LOCAL_PREFILL_MAX_TOKENS; 0 = every prompt "
                    "through the prefill service)")
    ap.add_argument("--skip-engine", action="store_true")
    ap.add_argument("--mps", choices=("auto", "on", "off"), default="off",
                    help="the stack's services under a private CUDA MPS daemon, as `eyrie up --mps` (default: off, "
                         "as eyrie up; the single-process engine never is)")
    ap.add_argument("--skip-stack", action="store_true")
    ap.add_argument("--gpu-memory-fraction", type=float, help="each engine's share of the GPU (EYRIE_GPU_MEMORY_"
                                                             "FRACTION; with it, leave --num-pages 0 to size pools)")
    ap.add_argument("--layouts", help="instead of the stack against the engine: each layout as users deploy it "
                    "(colo1, pd1, pd2, colo2, pd4, colo4: bench/serving_layouts.py), one table")
    ap.add_argument("--streams", help="--layouts' mixed workload: CONCURRENCY:PROMPT:OUTPUT of the closed-loop streams")
    ap.add_argument("--arrivals", help="--layouts' mixed workload: PROMPT:OUTPUT:INTERVAL_S of the prompts arriving "
                    "while the streams run")
    ap.add_argument("--mixed-seconds", type=float, help="--layouts' mixed workload: seconds the streams are issued "
                    "for, quiet and then with arrivals (default 12)")
    ap.add_argument("--slo-ttft-s", type=float, default=1.0, help="goodput's SLO: TTFT at most this (default 1 s)")
    ap.add_argument("--slo-itl-s", type=float, default=0.05, help="goodput's SLO: a request's inter-token latency "
                    "p99 at most this (default 50 ms)")
    ap.add_argument("--engine-worker", nargs=2, metavar=("PLAN", "RESULT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.layouts:
        for k, v in (LAYOUT_SMOKE_DEFAULTS if args.smoke else LAYOUT_GPU_DEFAULTS).items():
            if getattr(args, k, None) is None:
                setattr(args, k, v)
    for k, v in (SMOKE_DEFAULTS if args.smoke else GPU_DEFAULTS).items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    if isinstance(args.cuda_graph, str):
        args.cuda_graph = args.cuda_graph == "on"
    return args


def pair(text: str) -> tuple[int, int]:
    lo, hi = (int(x) for x in text.split(":"))
    return lo, hi


# ---- the plan ------------------------------------------------------------------------------------
def build_points(args) -> list[Point]:
    """Every measured point, most important first (the deadline cuts the tail)."""
    sweep = [int(c) for c in args.sweep.split(",")]
    workloads = args.workloads.split(",")
    prompt, output = pair(args.fixed)
    points = []
    if "fixed" in workloads:
        points += [Point("fixed", c, max(args.min_requests, args.waves * c), (prompt, prompt), (output, output))
                   for c in sweep]
    if "probe" in workloads:
        prompt, output = pair(args.probe)
        points.append(Point("probe", 1, args.probe_requests, (prompt, prompt), (output, output)))
    if "mixed" in workloads:
        points += [Point("mixed", c, max(args.min_requests, args.waves * c), pair(args.mixed_prompt),
                         pair(args.mixed_output)) for c in sweep]
    return points


def warmup_points(args) -> list[Point]:
    """Short requests of every prompt shape at the largest concurrency: kernels compiled, pools touched."""
    top = max(int(c) for c in args.sweep.split(","))
    prompt, _ = pair(args.fixed)
    long_prompt, _ = pair(args.probe)
    return [Point("warmup", top, top, (prompt, prompt), (4, 4), seed=1),
            Point("warmup", 1, 1, (long_prompt, long_prompt), (2, 2), seed=2)]


def engine_flags(args) -> dict:
    """The settings prefill, decode and the single-process engine share (``eyrie serve`` flags)."""
    return {"device": args.device, "dtype": args.dtype, "cuda_graph": args.cuda_graph, "page_size": args.page_size,
            "num_pages": args.num_pages or None, "max_running": args.max_running, "max_context": args.max_context,
            "gpu_memory_fraction": args.gpu_memory_fraction,
            "chunk_size": args.chunk_size, "spec_topk": args.spec_topk, "spec_steps": args.spec_steps,
            "spec_draft_tokens": args.spec_draft_tokens, "spec_policy": args.spec_policy,
            "spec_candidates": args.spec_candidates}


def prompt_vocab(model: str) -> tuple[int, int]:
    """Prompt ids: the tokenizer's trained ids past BOS and EOS (not the padding)."""
    from bench.serving_model import BPE_VOCAB

    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    return 2, min(vocab, BPE_VOCAB)


def prompt_text_ids(model: str, prompts_file: str | None) -> list[int] | None:
    """The prompts file tokenized as one stream (documents joined), or None for random ids."""
    if not prompts_file:
        return None
    from shared.model.tokenizer import Tokenizer

    path = Path(prompts_file)
    lines = path.read_text().splitlines() if path.suffix == ".jsonl" else [json.dumps({"text": path.read_text()})]
    tok = Tokenizer(model)
    return [i for line in lines if line.strip() for i in tok.encode(json.loads(line)["text"])]


class Run:
    """The run's clock and its JSON, rewritten after every point."""

    def __init__(self, args):
        self.t0, self.args = time.monotonic(), args
        self.report: dict = {"settings": {k: v for k, v in vars(args).items() if k != "engine_worker"},
                             "skipped": []}

    def child_env(self) -> dict:
        return SMOKE_ENV if self.args.smoke else {}

    def left(self) -> float:
        return self.args.deadline_s - (time.monotonic() - self.t0)

    def fits(self, point: Point, where: str) -> bool:
        """Whether a point may start: it needs its issue time plus a margin before the deadline."""
        if self.left() > self.args.point_seconds + 15:
            return True
        self.report["skipped"].append(f"{where} {point.name}")
        return False

    def save(self) -> None:
        engine_points = self.report.get("engine", {}).get("points", [])
        for stack in self.report.get("stacks", []):
            stack["ratios"] = ratios(engine_points, stack["points"])
        self.report["wall_s"] = round(time.monotonic() - self.t0, 1)
        write_json(self.args.out, self.report)


# ---- the engine side (a subprocess) --------------------------------------------------------------
def run_engine_phase(run: Run, model: str, draft: str | None, points: list[Point], workdir: Path) -> dict:
    plan = {"model": model, "draft": draft, "flags": engine_flags(run.args), "vocab": prompt_vocab(model),
            "prompts_file": run.args.prompts_file,
            "points": [p.__dict__ for p in points], "warmup": [p.__dict__ for p in warmup_points(run.args)],
            "point_seconds": run.args.point_seconds,
            "deadline": time.time() + min(run.left() - 5, run.args.engine_budget_s)}
    plan_path, result_path = workdir / "engine_plan.json", workdir / "engine_result.json"
    plan_path.write_text(json.dumps(plan))
    cmd = [sys.executable, __file__, "--engine-worker", str(plan_path), str(result_path)]
    with open(workdir / "engine.log", "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=log, start_new_session=True,
                                env={**os.environ, **run.child_env()})
        try:
            proc.wait(max(10.0, min(run.left() - 2, run.args.engine_budget_s + 30)))
        except subprocess.TimeoutExpired:
            pass
        finally:  # past its time, or this run is stopping
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    result = json.loads(result_path.read_text()) if result_path.exists() else {"points": []}
    result["exit_code"] = proc.returncode
    if proc.returncode != 0:
        result["log_tail"] = (workdir / "engine.log").read_text(errors="replace")[-3000:]
    return result


def engine_worker(plan_path: str, result_path: str) -> int:
    """In the subprocess: load the engine as the services would, warm it, run every point that fits."""
    plan = json.loads(Path(plan_path).read_text())
    watch_parent()
    import torch

    from services.settings import EngineSettings
    from shared.engine import Engine

    result: dict = {"device": device_facts(plan["flags"]["device"]), "points": [], "skipped": []}
    t0 = time.perf_counter()
    settings = EngineSettings(model=plan["model"], draft=plan["draft"],
                              **{k: v for k, v in plan["flags"].items() if v is not None})
    engine = Engine(settings.model, settings.draft, settings.engine_config())
    reserved = torch.cuda.memory_reserved(engine.device) if engine.device.type == "cuda" else 0
    engine.capture_graphs()
    result["graph_capture_s"] = engine.graph_capture_s()  # per phase (an adaptive engine's plain step's too)
    if engine.device.type == "cuda":  # the graphs' memory pools (every shape's, an adaptive engine's)
        result["graph_capture_mib"] = round((torch.cuda.memory_reserved(engine.device) - reserved) / 2 ** 20, 1)
    vocab, text_ids = tuple(plan["vocab"]), prompt_text_ids(plan["model"], plan.get("prompts_file"))
    for p in map(Point.from_dict, plan["warmup"]):
        run_engine_point(engine, make_requests(p, vocab, text_ids), p.concurrency, plan["point_seconds"])
    result["startup_s"] = round(time.perf_counter() - t0, 2)
    for p in map(Point.from_dict, plan["points"]):
        if time.time() + plan["point_seconds"] + 10 > plan["deadline"]:
            result["skipped"].append(p.name)
            continue
        before = spec_counters(engine)
        records = run_engine_point(engine, make_requests(p, vocab, text_ids), p.concurrency, plan["point_seconds"])
        result["points"].append({**summarize(p, records), **spec_delta(before, spec_counters(engine))})
        print(format_point("engine", result["points"][-1]), file=sys.stderr, flush=True)
        write_json(result_path, result)
    if engine.spec_policy is not None:  # what the policy measured: seconds per step kind and batch bucket
        measured = getattr(engine.spec_policy.cost, "seconds", {})
        result["policy_step_s"] = {f"{k}/{b}": s for (k, b), s in sorted(measured.items())}
        prior = getattr(engine.spec_policy.cost, "prior", {})  # timed from the captured graphs at start
        result["policy_graph_s"] = {f"{k}/{b}": s for (k, b), s in sorted(prior.items())}
    write_json(result_path, result)
    return 0


def spec_counters(engine) -> dict | None:
    """The engine's speculative counters now (None without a draft)."""
    if engine.spec_stats is None:
        return None
    t = engine.spec_stats.totals
    return {"verify_steps": t.verify_steps, "committed_tokens": t.committed_tokens, **engine.spec_policy.choices,
            **{f"shape:{n}": k for n, k in engine.spec_policy.shapes.items()}}


def spec_delta(before: dict | None, after: dict | None) -> dict:
    """A point's speculation: accept length over its verifies, and the policy's steps of each kind."""
    if before is None:
        return {}
    d = {k: after[k] - before.get(k, 0) for k in after}
    return {"spec": {"accept_length": d["committed_tokens"] / d["verify_steps"] if d["verify_steps"] else None,
                     "verify_steps": d["verify_steps"], "spec_steps": d["spec"], "plain_steps": d["plain"],
                     "shape_steps": {k[len("shape:"):]: n for k, n in d.items() if k.startswith("shape:") and n}}}


def watch_parent() -> None:
    """Exit when the benchmark that started this process is gone (it may have been killed)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(3)

    threading.Thread(target=watch, daemon=True).start()


def device_facts(device: str) -> dict:
    """The device's name and its copy bandwidth now: bytes copied per second (one way) and read + write."""
    import torch

    if device.startswith("cuda"):
        from bench.timing import copy_bandwidth

        read_write = copy_bandwidth(1 << 30)
        name = torch.cuda.get_device_name()
    else:
        src = torch.empty(64 << 20, dtype=torch.uint8).fill_(1)
        dst = torch.empty_like(src)
        best = min(timed(lambda: dst.copy_(src)) for _ in range(5))
        read_write, name = 2 * src.numel() / best, "cpu"
    return {"name": name, "d2d_copy_gbps": read_write / 2 / 1e9, "d2d_read_write_gbps": read_write / 1e9}


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# ---- the stack side --------------------------------------------------------------------------------
def run_stack_phase(run: Run, model: str, draft: str | None, points: list[Point], transport: str,
                    workdir: Path, local_prefill: int = 0) -> dict:
    """One stack run over ``points``: hand-offs over ``transport``; prompts of at most ``local_prefill`` tokens
    prefilled on the decode instance (conditional disaggregation, 0 = none)."""
    from bench.serving_stack import ServingStack, handoff_delta, handoff_totals, local_prefills

    args = run.args
    t0 = time.perf_counter()
    label = transport + (f"+local{local_prefill}" if local_prefill else "")
    prefill_flags = {"chunk_size": args.prefill_chunk_size} if args.prefill_chunk_size else None
    env = {"EYRIE_HANDOFF_TRANSPORT": transport, "EYRIE_LOCAL_PREFILL_MAX_TOKENS": str(local_prefill),
           **run.child_env()}
    stack = ServingStack(model, draft, engine_flags(args), workdir / f"logs-{label}", prefill_flags=prefill_flags,
                         env=env, mps=args.mps)
    out: dict = {"transport": transport, "label": label, "local_prefill_max_tokens": local_prefill, "points": [],
                 "log_dir": str(stack.log_dir)}
    run.report["stacks"].append(out)  # saved with every point from now on
    try:
        stack.start(min(args.start_timeout_s, max(10.0, run.left() - 10)))
        out["mps"] = stack.mps_daemon is not None
        drivers = {"grpc": GrpcDriver(stack.grpc_address, args.request_timeout_s),
                   "http": HttpDriver(stack.openai_address, args.request_timeout_s)}
        vocab, text_ids = prompt_vocab(model), prompt_text_ids(model, args.prompts_file)
        for p in warmup_points(args):
            run_closed_loop(drivers["grpc"], make_requests(p, vocab, text_ids), p.concurrency, args.point_seconds)
        out["startup_s"] = round(time.perf_counter() - t0, 2)
        first = handoff_totals(stack.metrics("prefill"))
        for api, p in stack_order(points, args.apis.split(",")):
            if not run.fits(p, f"stack[{label}] {api}"):
                continue
            before = handoff_totals(stack.metrics("prefill"))
            records = run_closed_loop(drivers[api], make_requests(p, vocab, text_ids), p.concurrency,
                                      args.point_seconds)
            result = {"api": api, **summarize(p, records),
                      "handoff": handoff_delta(before, handoff_totals(stack.metrics("prefill")))}
            out["points"].append(result)
            print(format_point(f"stack[{label}] {api}", result), flush=True)
            run.save()
        out["handoff"] = handoff_delta(first, handoff_totals(stack.metrics("prefill")))
        out["local_prefills"] = local_prefills(stack.metrics("decode"))  # warm-up included
    except (RuntimeError, TimeoutError, OSError) as e:
        out["error"] = f"{type(e).__name__}: {e}"
        print(f"stack[{label}]: {out['error']}", file=sys.stderr, flush=True)
    finally:
        out["exit_codes"] = stack.stop()
    return out


def stack_order(points: list[Point], apis: list[str]) -> list[tuple[str, Point]]:
    """gRPC's fixed sweep and probe first, then the same over HTTP, then the mixed sweeps."""
    first = [p for p in points if p.workload != "mixed"]
    mixed = [p for p in points if p.workload == "mixed"]
    return [(a, p) for group in (first, mixed) for a in apis for p in group]


# ---- the report ------------------------------------------------------------------------------------
def ratios(engine_points: list[dict], stack_points: list[dict]) -> list[dict]:
    """Per stack point with an engine twin: stack / engine for tok/s, TTFT p50 and ITL p50."""
    by_name = {p["point"]: p for p in engine_points}
    out = []
    for s in stack_points:
        e = by_name.get(s["point"])
        if e is None:
            continue
        out.append({"point": s["point"], "api": s["api"],
                    **{f"{k}_ratio": div(s[k], e[k]) for k in ("output_tok_s", "ttft_p50_s", "itl_p50_s")}})
    return out


def div(a, b):
    return a / b if a is not None and b else None


def fmt(x, scale: float = 1.0, digits: int = 3) -> str:
    return "-" if x is None else f"{x * scale:.{digits}f}"


def format_point(where: str, p: dict) -> str:
    spec = p.get("spec")
    accept = "" if spec is None else (f"  accept {fmt(spec['accept_length'], 1, 2)} "
                                      f"(spec/plain steps {spec['spec_steps']}/{spec['plain_steps']})")
    return (f"{where:24s} {p['point']:10s} done {p['completed']}/{p['issued']}  tok/s {fmt(p['output_tok_s'], 1, 1)}  "
            f"TTFT p50/p99 {fmt(p['ttft_p50_s'])}/{fmt(p['ttft_p99_s'])} s  "
            f"ITL p50/p99 {fmt(p['itl_p50_s'], 1e3, 2)}/{fmt(p['itl_p99_s'], 1e3, 2)} ms{accept}")


def print_summary(report: dict) -> None:
    settings = report["settings"]
    print(f"\nserving benchmark: {settings['preset']} {settings['dtype']} on {settings['device']} "
          f"(graphs {settings['cuda_graph']}, draft {settings['draft']}, pages {settings['num_pages']}, "
          f"max_running {settings['max_running']}, chunk {settings['chunk_size']})")
    device = report.get("engine", {}).get("device")
    if device:
        print(f"device {device['name']}: device-to-device copy {device['d2d_copy_gbps']:.1f} GB/s "
              f"(read + write {device['d2d_read_write_gbps']:.1f} GB/s)")
    for p in report.get("engine", {}).get("points", []):
        print(format_point("engine", p))
    for stack in report.get("stacks", []):
        for p in stack["points"]:
            print(format_point(f"stack[{stack.get('label', stack['transport'])}] {p['api']}", p))
        for name, h in stack.get("handoff", {}).items():
            share = div(h.get("gbps"), device["d2d_copy_gbps"]) if device else None
            print(f"hand-off [{name}]: {h['bytes'] / 1e9:.3f} GB in {h['seconds']:.3f} s over {h['count']:.0f} "
                  f"hand-offs: {fmt(h.get('gbps'), 1, 2)} GB/s ({fmt(share, 100, 1)}% of the device copy)")
        for r in stack.get("ratios", []):
            print(f"stack[{stack.get('label', stack['transport'])}]/engine {r['api']:4s} {r['point']:10s} tok/s "
                  f"{fmt(r['output_tok_s_ratio'], 1, 2)}  TTFT p50 {fmt(r['ttft_p50_s_ratio'], 1, 2)}  "
                  f"ITL p50 {fmt(r['itl_p50_s_ratio'], 1, 2)}")
    if report["skipped"]:
        print(f"skipped (deadline): {', '.join(report['skipped'])}")


# ---- main --------------------------------------------------------------------------------------------
def prepare_model(run: Run, workdir: Path) -> tuple[str, str | None]:
    args = run.args
    model, draft = args.model, None if args.draft == "none" else args.draft
    if model is None:
        import torch

        from bench.serving_model import write_serving_model

        shard = 200_000 if args.smoke else None  # the smoke run shards its tiny model too
        written = write_serving_model(workdir / "model", args.preset, args.device, getattr(torch, args.dtype),
                                      draft == "eagle3", **({"shard_bytes": shard} if shard else {}))
        run.report["model"] = written
        model = written["target"]
        draft = written.get("draft", draft)
    return model, draft


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.engine_worker:
        return engine_worker(*args.engine_worker)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `timeout`: stop the services, keep the JSON
    run = Run(args)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="eyrie-serving-"))
    workdir.mkdir(parents=True, exist_ok=True)
    model, draft = prepare_model(run, workdir)
    rates = None if args.smoke else measured_in_subprocess(args.device)  # the roofline's rates (issue 30)
    if args.layouts:
        from bench.serving_layouts import run_layouts

        run_layouts(run, model, draft, workdir)
        annotate(run.report, rates, model_shape(model))
        print("\n".join(format_ideal(run.report)))
        run.save()
        return 0
    points = build_points(args)
    if not args.skip_engine:
        run.report["engine"] = run_engine_phase(run, model, draft, points, workdir)
        run.save()
    run.report["stacks"] = []
    if not args.skip_stack:
        for local in (int(n) for n in args.local_prefill.split(",")):
            for transport in args.transports.split(","):
                run_stack_phase(run, model, draft, points, transport, workdir, local)
                run.save()
    annotate(run.report, rates, model_shape(model))
    run.save()
    print_summary(run.report)
    print("\n".join(format_ideal(run.report)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
