"""Layouts as users deploy them, on one machine, through the OpenAI API (``bench_serving.py --layouts``).

Each layout is started as a user starts it: separate ``eyrie serve`` processes (``bench/serving_stack.py``),
one Redis, the router's OpenAI API in front; its engines placed by ``services.launch.device_plan`` (what
``eyrie up --prefill-devices ... --decode-devices ...`` does: a device shared by several engines splits 0.9
of it evenly):

    colo1  one decode instance on GPU 0 prefilling its own prompts (no prefill instance: the router's
           EYRIE_LOCAL_PREFILL_MAX_TOKENS covers every prompt)
    pd1    prefill and decode both on GPU 0 (0.45 each)
    pd2    prefill on GPU 0, decode on GPU 1 (1P1D)
    colo2  two colocated decode instances, GPUs 0 and 1 (data parallel)
    pd4    prefill on GPU 0, decode on GPUs 1, 2, 3 (1P3D)
    colo4  four colocated decode instances, GPUs 0-3

On the CPU every device is the CPU (the script runs end to end; its figures mean nothing). Per layout, in
order: the fixed sweep (``--fixed`` prompt:output tokens, greedy, ``ignore_eos``, streaming, closed loop
at each ``--sweep`` concurrency), the long-prompt TTFT (``--probe``), and the mixed workload:
``--streams`` closed-loop streams (C:PROMPT:OUTPUT), issued for ``--mixed-seconds`` then drained, alone
("quiet"), then again while a ``--arrivals`` prompt (PROMPT:OUTPUT:INTERVAL_S) arrives every interval
("with arrivals"). Goodput: requests per second whose TTFT and own inter-token latency p99 both meet the
SLO (``--slo-ttft-s``, ``--slo-itl-s``). Writes the JSON (``--out``, rewritten after every point) and a
markdown table beside it (``.md``), and prints the table. ``--transports`` (one value) is every layout's
``EYRIE_HANDOFF_TRANSPORT``. Each engine service's memory peak (its
``eyrie_gpu_memory_*`` gauges), hand-offs and local prefills are recorded under ``services``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from bench.serving_load import HttpDriver, Point, RequestRecord, make_requests, run_closed_loop, summarize
from bench.serving_stack import ServingStack, handoff_totals, local_prefills, loop_delta, loop_totals

LAYOUTS = {"colo1": ((), (0,)), "pd1": ((0,), (0,)), "pd2": ((0,), (1,)), "colo2": ((), (0, 1)),
           "pd4": ((0,), (1, 2, 3)), "colo4": ((), (0, 1, 2, 3))}  # GPU indices of prefill, decode


def gpus_needed(layout: str) -> int:
    prefill, decode = LAYOUTS[layout]
    return max(prefill + decode) + 1


def instances(layout: str, device: str) -> list[tuple[str, dict]]:
    """The layout's engine services as (role, own flags), placed as ``eyrie up``'s device lists place them."""
    from services.launch import device_plan, role_of

    prefill, decode = LAYOUTS[layout]
    on = (lambda i: f"cuda:{i}") if device.startswith("cuda") else (lambda i: device)
    plan = device_plan([on(i) for i in prefill], [on(i) for i in decode])
    return [(role_of(name), flags) for name, flags in plan.items()]


def parse_layouts(text: str, gpus: int | None) -> tuple[list[str], list[str]]:
    """The layouts asked for that this machine can run, and those left out (too few GPUs) with the reason."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        raise SystemExit(f"--layouts: unknown layout {unknown[0]!r} (known: {', '.join(LAYOUTS)})")
    if gpus is None:  # the CPU: every layout runs (its devices are all the CPU)
        return names, []
    run = [n for n in names if gpus_needed(n) <= gpus]
    return run, [f"{n}: needs {gpus_needed(n)} GPUs, this machine has {gpus}" for n in names if n not in run]


# ---- workloads -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Mixed:
    streams: int  # closed-loop streams
    stream_prompt: int
    stream_output: int
    arrival_prompt: int
    arrival_output: int
    interval_s: float  # an arrival every this many seconds while the streams run


def parse_mixed(streams: str, arrivals: str) -> Mixed:
    c, sp, so = (int(x) for x in streams.split(":"))
    ap, ao, every = arrivals.split(":")
    return Mixed(c, sp, so, int(ap), int(ao), float(every))


def goodput(records: list[RequestRecord], ttft_s: float, itl_s: float) -> dict:
    """Requests that met both SLOs (TTFT, their own ITL p99), per second of the point's wall time."""
    done = [r for r in records if r.arrivals]
    if not done:
        return {"met": 0, "of": len(records), "req_s": 0.0}
    start, end = min(r.sent for r in records), max(r.arrivals[-1][0] for r in done)
    met = sum(1 for r in done if r.ok and r.ttft <= ttft_s and (not r.itls() or np.percentile(r.itls(), 99) <= itl_s))
    return {"met": met, "of": len(records), "req_s": met / (end - start) if end > start else 0.0}


def run_with_arrivals(driver, streams: list, concurrency: int, arrivals: list, interval_s: float,
                      issue_s: float) -> tuple[list[RequestRecord], list[RequestRecord]]:
    """The streams' closed loop while one arrival is sent every ``interval_s`` (each on its own thread, open
    loop) until the streams end; returns (streams' records, arrivals' records)."""
    arrived: list[RequestRecord] = []
    done = threading.Event()
    threads: list[threading.Thread] = []

    def send_arrivals() -> None:
        for spec in arrivals:
            if done.wait(interval_s):
                return
            record = RequestRecord(time.perf_counter(), spec.max_new_tokens)
            arrived.append(record)
            t = threading.Thread(target=driver, args=(spec, record), daemon=True)
            t.start()
            threads.append(t)

    sender = threading.Thread(target=send_arrivals, daemon=True)
    sender.start()
    try:
        records = run_closed_loop(driver, streams, concurrency, issue_s)
    finally:
        done.set()
        sender.join()
    for t in threads:
        t.join()
    return records, arrived


# ---- one layout ------------------------------------------------------------------------------------
class LayoutRun:
    """One layout's stack and its points, saved into the report as they come."""

    def __init__(self, run, name: str, model: str, draft: str | None, workdir: Path):
        self.run, self.name, self.model, self.draft = run, name, model, draft
        self.args = run.args
        self.out: dict = {"layout": name, "instances": [], "points": [], "log_dir": str(workdir / f"logs-{name}")}
        run.report["layouts"].append(self.out)
        self.stack: ServingStack | None = None

    def start(self, flags: dict, budget_s: float) -> HttpDriver:
        args = self.args
        colo = not LAYOUTS[self.name][0]
        placed = instances(self.name, args.device)
        self.out["instances"] = [{"role": role, **own} for role, own in placed]
        # colocated: every prompt prefilled on its decode instance; else conditional disaggregation's bound, if any
        local = args.max_context if colo else getattr(args, "local_prefill", 0) or 0
        env = {"EYRIE_LOCAL_PREFILL_MAX_TOKENS": str(local), "EYRIE_HANDOFF_TRANSPORT": args.transports,
               **self.run.child_env()}
        self.out["transport"] = args.transports
        self.stack = ServingStack(self.model, self.draft, flags, Path(self.out["log_dir"]), env=env, instances=placed)
        t0 = time.perf_counter()
        self.stack.start(min(args.start_timeout_s, budget_s))
        self.out["startup_s"] = round(time.perf_counter() - t0, 2)
        return HttpDriver(self.stack.openai_address, args.request_timeout_s)

    def point(self, name: str, records: list[RequestRecord], point: Point, **extra) -> dict:
        args = self.args
        result = {**summarize(point, records), "point": name,
                  "goodput": goodput(records, args.slo_ttft_s, args.slo_itl_s), **extra}
        if len(records) > 256:  # the JSON stays readable: the figures above carry the point
            result.pop("requests_detail", None)
        self.out["points"].append(result)
        self.run.save()
        print(format_line(self.name, result), flush=True)
        return result

    def measured(self, run: Callable[[], object]) -> tuple[object, dict]:
        """``run()``'s result, and what each engine service's loop did meanwhile (``loop_delta``: busy share, steps
        by kind with their mean time and rows), so a slow point says which engine held it up and how."""
        engines = [name for name in self.stack.ready if name != "router"]
        before = {name: loop_totals(self.stack.metrics(name)) for name in engines}
        t0 = time.perf_counter()
        out = run()
        wall = time.perf_counter() - t0
        return out, {name: loop_delta(before[name], loop_totals(self.stack.metrics(name)), wall) for name in engines}

    def services(self) -> None:
        """Each engine service's memory peak and its hand-offs and local prefills (from its /metrics)."""
        found = {}
        for name in self.stack.ready:
            if name == "router":
                continue
            text = self.stack.metrics(name)
            found[name] = {"gpu_memory": gpu_memory(text), "handoff": handoff_totals(text),
                           "local_prefills": local_prefills(text)}
            if found[name]["gpu_memory"]:
                print(f"{self.name:6s} {name}: GPU memory {found[name]['gpu_memory']}", flush=True)
        self.out["services"] = found


def gpu_memory(metrics_text: str) -> dict:
    """An engine service's ``eyrie_gpu_memory_*`` gauges, GiB (empty off a GPU)."""
    out = {}
    for family in text_string_to_metric_families(metrics_text):
        for s in family.samples:
            if s.name == "eyrie_gpu_memory_peak_bytes":
                out[f"peak_{s.labels['part']}_gib"] = round(s.value / 2 ** 30, 3)
            elif s.name == "eyrie_gpu_memory_budget_bytes":
                out["budget_gib"] = round(s.value / 2 ** 30, 3)
    return out if any(k.startswith("peak_") for k in out) else {}  # the budget gauge exists (at 0) off a GPU


def run_layout(run, name: str, model: str, draft: str | None, workdir: Path, flags: dict, budget_s: float,
               vocab: tuple[int, int], text_ids: list[int] | None) -> dict:
    """Start ``name``, run every workload that fits ``budget_s``, stop it."""
    args, t0 = run.args, time.monotonic()
    lr = LayoutRun(run, name, model, draft, workdir)
    left = lambda: budget_s - (time.monotonic() - t0)  # noqa: E731
    try:
        driver = lr.start(flags, budget_s)
        prompt, output = (int(x) for x in args.fixed.split(":"))
        top = max(int(c) for c in args.sweep.split(","))
        warm = Point("warmup", min(top, 8), min(top, 8), (prompt, prompt), (4, 4), seed=1)
        run_closed_loop(driver, make_requests(warm, vocab, text_ids), warm.concurrency, args.point_seconds)
        for p in workload_points(args):
            if left() < args.point_seconds + 10:
                lr.out.setdefault("skipped", []).append(p.name)
                continue
            records, loops = lr.measured(lambda p=p: run_closed_loop(driver, make_requests(p, vocab, text_ids),
                                                                   p.concurrency, args.point_seconds))
            lr.point(p.name, records, p, loops=loops)
        mixed_points(lr, driver, vocab, text_ids, left)
        lr.services()
    except (RuntimeError, TimeoutError, OSError) as e:
        lr.out["error"] = f"{type(e).__name__}: {e}"
        print(f"layout {name}: {lr.out['error']}", flush=True)
    finally:
        if lr.stack is not None:
            lr.out["exit_codes"] = lr.stack.stop()
        run.save()
    return lr.out


def workload_points(args) -> list[Point]:
    prompt, output = (int(x) for x in args.fixed.split(":"))
    points = [Point("fixed", c, max(args.min_requests, args.waves * c), (prompt, prompt), (output, output))
              for c in (int(c) for c in args.sweep.split(","))]
    probe_prompt, probe_output = (int(x) for x in args.probe.split(":"))
    return points + [Point("probe", 1, args.probe_requests, (probe_prompt,) * 2, (probe_output,) * 2)]


def mixed_points(lr: LayoutRun, driver, vocab, text_ids, left) -> None:
    """The streams quiet, then with arrivals (when the budget still holds both)."""
    args = lr.args
    m, issue_s = parse_mixed(args.streams, args.arrivals), args.mixed_seconds
    # Streams issued for ``issue_s`` seconds (more requests than that can take), then drained.
    streams = Point("streams", m.streams, m.streams * 64, (m.stream_prompt,) * 2, (m.stream_output,) * 2)
    if left() < 2 * issue_s + 2 * args.point_seconds:
        lr.out.setdefault("skipped", []).append("mixed")
        return
    quiet, loops = lr.measured(lambda: run_closed_loop(driver, make_requests(streams, vocab, text_ids), m.streams,
                                                       issue_s))
    lr.point("mixed/quiet", quiet, streams, loops=loops)
    n = int(issue_s / m.interval_s) + 1
    arrival = Point("arrival", 1, n, (m.arrival_prompt,) * 2, (m.arrival_output,) * 2, seed=3)
    (loaded, arrived), loops = lr.measured(lambda: run_with_arrivals(
        driver, make_requests(streams, vocab, text_ids), m.streams, make_requests(arrival, vocab, text_ids),
        m.interval_s, issue_s))
    lr.point("mixed/arrivals", loaded, streams, all_goodput=goodput(loaded + arrived, args.slo_ttft_s, args.slo_itl_s),
             loops=loops)
    lr.point("mixed/arrived", arrived, arrival, loops=loops)  # the same window as the streams


# ---- the report --------------------------------------------------------------------------------------
def fmt(x, scale: float = 1.0, digits: int = 0) -> str:
    return "-" if x is None else f"{x * scale:.{digits}f}"


def format_line(layout: str, p: dict) -> str:
    loops = "".join(f"\n    {name}: busy {d['busy']}, calls {d['calls_share']}, " + ", ".join(
        f"{k} {n} x {d['step_ms'][k]} ms ({d['rows_mean'][k]} rows)" for k, n in d["steps"].items())
        for name, d in p.get("loops", {}).items())
    return (f"{layout:6s} {p['point']:16s} done {p['completed']}/{p['issued']}  tok/s {fmt(p['output_tok_s'], 1, 1)}"
            f"  TTFT p50/p99 {fmt(p['ttft_p50_s'], 1, 3)}/{fmt(p['ttft_p99_s'], 1, 3)} s  ITL p50/p99 "
            f"{fmt(p['itl_p50_s'], 1e3, 1)}/{fmt(p['itl_p99_s'], 1e3, 1)} ms  goodput "
            f"{p['goodput']['met']}/{p['goodput']['of']} ({p['goodput']['req_s']:.2f} req/s)" + loops)


def table(report: dict) -> str:
    """One row per layout: the sweep's tok/s, c32 TTFT, the long prompt's TTFT, the mixed workload, goodput."""
    s = report["settings"]
    sweep = [int(c) for c in s["sweep"].split(",")]
    mid = 32 if 32 in sweep else sweep[-1]
    head = (["layout", "engines"] + [f"c{c} tok/s" for c in sweep]
            + [f"c{mid} TTFT p50 / p99 (s)", f"{s['probe'].split(':')[0]}-token TTFT (s)",
               "streams tok/s quiet -> arrivals", "streams ITL p99 quiet -> arrivals (ms)", "arrivals failed",
               f"goodput c{mid} (req/s)", "goodput with arrivals (req/s)", "failed"])
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(rows + ["| " + " | ".join(row(lay, sweep, mid)) + " |" for lay in report["layouts"]])


def row(lay: dict, sweep: list[int], mid: int) -> list[str]:
    pts = {p["point"]: p for p in lay["points"]}

    def get(name: str, key: str, scale: float = 1.0, digits: int = 0) -> str:
        return fmt(pts[name][key], scale, digits) if name in pts else "-"

    def good(name: str, key: str = "goodput") -> str:
        return fmt(pts[name][key]["req_s"], 1, 2) if name in pts else "-"

    engines = ", ".join(f"{i['role']} {i['device']}" + (f" ({i['gpu_memory_fraction']})"
                                                      if "gpu_memory_fraction" in i else "") for i in lay["instances"])
    arrived = pts.get("mixed/arrived")
    return ([lay["layout"], engines] + [get(f"fixed/c{c}", "output_tok_s") for c in sweep]
            + [f"{get(f'fixed/c{mid}', 'ttft_p50_s', 1, 2)} / {get(f'fixed/c{mid}', 'ttft_p99_s', 1, 2)}",
               get("probe/c1", "ttft_p50_s", 1, 3),
               f"{get('mixed/quiet', 'output_tok_s')} -> {get('mixed/arrivals', 'output_tok_s')}",
               f"{get('mixed/quiet', 'itl_p99_s', 1e3)} -> {get('mixed/arrivals', 'itl_p99_s', 1e3)}",
               f"{arrived['failed']} of {arrived['issued']}" if arrived else "-",
               good(f"fixed/c{mid}"), good("mixed/arrivals", "all_goodput"),
               str(sum(p["failed"] for p in lay["points"])) + (" (error)" if "error" in lay else "")])


def run_layouts(run, model: str, draft: str | None, workdir: Path) -> None:
    """Every layout of ``--layouts`` this machine can run, one after the other, each its share of the time."""
    from bench.bench_serving import engine_flags, prompt_text_ids, prompt_vocab

    args = run.args
    gpus = None
    if args.device.startswith("cuda"):
        import torch

        gpus = torch.cuda.device_count()
        run.report["device"] = f"{gpus} x {torch.cuda.get_device_name(0)}"
    if "," in args.transports:
        raise SystemExit("--layouts takes one --transports value (EYRIE_HANDOFF_TRANSPORT of every layout)")
    names, left_out = parse_layouts(args.layouts, gpus)
    run.report.update(layouts=[], left_out=left_out, slo={"ttft_s": args.slo_ttft_s, "itl_s": args.slo_itl_s})
    flags = {**engine_flags(args), "device": None, "gpu_memory_fraction": None}  # each instance its own
    vocab, text_ids = prompt_vocab(model), prompt_text_ids(model, args.prompts_file)
    for i, name in enumerate(names):
        budget = (run.left() - 5) / (len(names) - i)
        run_layout(run, name, model, draft, workdir, flags, budget, vocab, text_ids)
    markdown = table(run.report)
    Path(args.out).with_suffix(".md").write_text(
        f"Layouts on {run.report.get('device', args.device)}: {args.fixed} fixed sweep, {args.probe} probe, "
        f"streams {args.streams} with arrivals {args.arrivals}, SLO TTFT <= {args.slo_ttft_s} s and ITL p99 <= "
        f"{args.slo_itl_s * 1e3:.0f} ms (raw JSON: {Path(args.out).name})\n\n{markdown}\n")
    print("\n" + markdown)
    for line in left_out:
        print(f"left out: {line}")
