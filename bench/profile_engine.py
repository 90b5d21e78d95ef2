"""Where an engine's time goes under a closed-loop load (issue 30 item 1): each step's kind, rows, prefill tokens,
host wall time and device span, summed per step kind, beside the device's own kernel time over a window.

The engine runs in-process as the services build it (``EngineSettings``, graphs captured, warmed), the
fixed workload (prompt:output tokens, real text with ``--prompts-file``) at each concurrency in a closed loop.
Per step: its kind (``decode`` / ``mixed`` / ``prefill``, with the speculative shape the policy chose or
``plain``), its decode rows and prefill tokens, the wall time of ``Engine.step`` (which waits for the device)
and the device span between CUDA events recorded at its start and end, the tokens it committed and, for a
speculative step, what the policy believed when it chose it (its expected tokens per request, its ms and a
plain step's ms at that batch); the point ends with the policy's summary, and ``clean``: the figures over the
steps outside the profiler's window and the steps that paid a Triton compile (compare those). A window of
steps runs under ``torch.profiler``: the kernels' summed time against the window's wall time says how long the
GPU sat idle, and the top kernels say what the busy time was. The graphs' own costs (timed at capture) are the
floor each decode kind could reach.

    python bench/profile_engine.py --model DIR --draft DIR --prompts-file F --concurrency 64,128 --out prof.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_serving import prompt_text_ids, prompt_vocab  # noqa: E402
from bench.serving_load import Point, make_requests  # noqa: E402


def engine_args(ap: argparse.ArgumentParser) -> None:
    """The engine and closed-loop workload flags of the in-process benches (``build_engine``; with
    ``--concurrency`` of their own)."""
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft", default=None)
    ap.add_argument("--prompts-file", default=None)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--waves", type=int, default=2, help="requests per point = waves x concurrency")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--output", type=int, default=256)
    ap.add_argument("--max-running", type=int, default=128)
    ap.add_argument("--spec-policy", default=None)
    ap.add_argument("--chunk-size", type=int, default=None)
    ap.add_argument("--gpu-memory-fraction", type=float, default=0.9)
    ap.add_argument("--mixed-graphs", action="store_true",
                    help="steps with prefill chunks in CUDA graph pieces (`cuda_graph_mixed`, shared/mixed_graphs.py)")


def build_engine(args: argparse.Namespace):
    """The engine of ``engine_args``' flags, as the services build it (``EngineSettings``; graphs on CUDA, not
    captured yet)."""
    from services.settings import EngineSettings
    from shared.engine import Engine

    cuda = args.device.startswith("cuda")
    flags = {"device": args.device, "dtype": args.dtype, "max_running": args.max_running,
             "gpu_memory_fraction": args.gpu_memory_fraction if cuda else None, "cuda_graph": cuda}
    if args.spec_policy:
        flags["spec_policy"] = args.spec_policy
    if args.chunk_size:
        flags["chunk_size"] = args.chunk_size
    if getattr(args, "mixed_graphs", False):
        flags["cuda_graph_mixed"] = True
    settings = EngineSettings(model=args.model, draft=args.draft, **flags)
    return Engine(settings.model, settings.draft, settings.engine_config())


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    engine_args(ap)
    ap.add_argument("--concurrency", default="64,128")
    ap.add_argument("--profile-steps", type=int, default=40, help="steps in the torch.profiler window")
    ap.add_argument("--profile-after", type=int, default=20,
                    help="the window starts this many steps past the first c (the first wave's prefill chunks)")
    ap.add_argument("--cprofile", action="store_true", help="the window under cProfile (host functions), not torch's")
    ap.add_argument("--annotate", action="store_true",
                    help="the window reports the engine's phases apart (ranges: the draft's extend, catch-up, the "
                         "target's step ...; a range costs a few us of host time a call)")
    ap.add_argument("--out", required=True)
    return ap.parse_args(argv)


class StepLog:
    """Wraps an engine's scheduler and shape choice to learn each step's kind; times each step."""

    def __init__(self, engine):
        import torch

        self.engine, self.torch, self.steps = engine, torch, []
        self.plan, self.shape, self.estimate = None, None, None
        schedule, choose = engine.scheduler.schedule, engine._choose_shape

        def scheduled():
            self.plan, self.shape = schedule(), None
            return self.plan

        def chosen(plan, **kw):
            self.shape = choose(plan, **kw)
            self.estimate = self._estimate(plan)
            return self.shape

        engine.scheduler.schedule, engine._choose_shape = scheduled, chosen

    def _estimate(self, plan) -> list | None:
        """What the policy believed when it chose: the chosen shape's expected tokens per request and its ms per
        step, and a plain step's ms, at this batch (None for a plain or mixed step, or without a policy)."""
        policy = self.engine.spec_policy
        if policy is None or self.shape is None or not plan.decode:
            return None
        b = len(plan.decode)
        spec_s, plain_s = policy._cost(b, self.shape), policy._cost(b, "plain")
        tokens = policy._candidate(self.shape).tokens
        return [None if tokens is None else round(tokens, 3), None if spec_s is None else round(spec_s * 1e3, 2),
                None if plain_s is None else round(plain_s * 1e3, 2)]

    def step(self):
        torch, cuda = self.torch, self.engine.device.type == "cuda"
        start, end = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if cuda else (0, 0)
        t0 = time.perf_counter()
        if cuda:
            start.record()
        events = self.engine.step()
        if cuda:
            end.record()
            end.synchronize()
        wall = time.perf_counter() - t0
        plan = self.plan
        committed = sum(len(toks) for _, toks in events)
        if plan is not None and not plan.empty:
            kind = "mixed" if plan.prefill and plan.decode else "decode" if plan.decode else "prefill"
            self.steps.append({"kind": kind, "shape": (self.shape or "plain") if plan.decode else "-",
                               "rows": len(plan.decode), "prefill_tokens": sum(c.end - c.start for c in plan.prefill),
                               "chunks": len(plan.prefill), "wall_ms": wall * 1e3, "tokens": committed,
                               "estimate": self.estimate,
                               "device_ms": start.elapsed_time(end) if cuda else wall * 1e3})
        return events


class CompileLog:
    """Triton kernels compiled while the engine serves (each a stall of every request in the step that met it):
    per compile, the step it happened in, the kernel, its seconds, its constexpr values and how its cache key
    differs from the nearest one compiled before (``_key_difference``)."""

    def __init__(self, log: StepLog):
        self.entries: list[list] = []
        try:
            from triton.runtime.jit import JITFunction
        except ImportError:
            return
        original = getattr(JITFunction, "_do_compile", None)
        if original is None:  # another Triton: not counted
            return
        entries = self.entries

        def timed(fn, key, signature, device, constexprs, *rest):
            known = _cached_keys(fn, device)  # what this kernel compiled before: the new key's nearest differs how
            t0 = time.perf_counter()
            try:
                return original(fn, key, signature, device, constexprs, *rest)
            finally:
                entries.append([len(log.steps), getattr(fn, "__name__", str(fn)), round(time.perf_counter() - t0, 3),
                                str(constexprs)[:300], _key_difference(str(key), known)])

        JITFunction._do_compile = timed


def _cached_keys(fn, device) -> list[str]:
    """The cache keys ``fn`` has compiled on ``device`` (Triton 3.x: ``device_caches[device][0]``); [] elsewhere."""
    try:
        return [str(k) for k in fn.device_caches[device][0]]
    except (AttributeError, KeyError, IndexError, TypeError):
        return []


def _key_difference(key: str, known: list[str]) -> str:
    """How ``key`` differs from the nearest of ``known`` (what made Triton compile again: a specialization, an
    option): the differing comma-separated parts, the new one's then the old one's; "" when none was known."""
    if not known:
        return ""
    parts = key.split(",")

    def changed(other: str) -> list[tuple[str, str]]:
        theirs = other.split(",")
        return [(a, b) for a, b in zip(parts, theirs) if a != b] + [(a, "") for a in parts[len(theirs):]]

    diff = min((changed(k) for k in known), key=len)
    return "; ".join(f"{a.strip()} (was {b.strip()})" for a, b in diff)[:600]


def closed_loop(log: StepLog, specs, concurrency: int, on_step=None) -> dict:
    """Closed loop over ``specs`` at ``concurrency``; output tokens and seconds."""
    from shared.sampling import SamplingParams

    pending, inflight, tokens = list(reversed(specs)), set(), 0
    t0 = time.perf_counter()
    while pending or inflight:
        while pending and len(inflight) < concurrency:
            spec = pending.pop()
            req = log.engine.add_request(spec.prompt_ids, SamplingParams(max_new_tokens=spec.max_new_tokens,
                                                                         ignore_eos=True))
            inflight.add(req.rid)
        if on_step is not None:
            on_step(len(log.steps))
        for req, toks in log.step():
            tokens += len(toks)
            if req.finish_reason is not None:
                inflight.discard(req.rid)
    return {"output_tokens": tokens, "seconds": time.perf_counter() - t0}


def by_kind(steps: list[dict]) -> dict:
    """Per (kind, shape, rows bucket): steps, wall and device time summed and mean, prefill tokens."""
    groups: dict[str, dict] = defaultdict(lambda: {"steps": 0, "wall_s": 0.0, "device_s": 0.0, "rows": 0,
                                                   "prefill_tokens": 0})
    for s in steps:
        rows = s["rows"]
        bucket = 1 << max(0, (rows - 1).bit_length()) if rows else 0
        g = groups[f"{s['kind']}/{s['shape']}/rows<={bucket}"]
        g["steps"] += 1
        g["wall_s"] += s["wall_ms"] / 1e3
        g["device_s"] += s["device_ms"] / 1e3
        g["rows"] += rows
        g["prefill_tokens"] += s["prefill_tokens"]
    total = sum(g["wall_s"] for g in groups.values()) or 1.0
    for g in groups.values():
        n = g["steps"]
        g.update(wall_ms_mean=round(g["wall_s"] / n * 1e3, 3), device_ms_mean=round(g["device_s"] / n * 1e3, 3),
                 rows_mean=round(g["rows"] / n, 1), share_of_wall=round(g["wall_s"] / total, 3),
                 wall_s=round(g["wall_s"], 3), device_s=round(g["device_s"], 3))
    return dict(sorted(groups.items(), key=lambda kv: -kv[1]["wall_s"]))


RANGE_PREFIX = "eyrie."
# The engine's phases a profiler window reports apart (its ``ranges``): the draft's parts and the target's
ANNOTATED = {
    "shared.spec.worker.SpecWorker": ("draft_extend", "catch_up", "leave_behind", "plain_extend", "step", "_draft",
                                      "_verify"),
    "shared.spec.policy.SpecPolicy": ("choose",),
    "shared.scheduler.Scheduler": ("schedule",),
    "shared.model_runner.ModelRunner": ("_target_step", "_plain_step", "_decode_step", "_sample_and_commit"),
}


_ANNOTATED_ORIGINALS: list[tuple[type, str, object]] = []


def unannotate() -> None:
    """Undo ``annotate`` (tests: the classes are the process's)."""
    while _ANNOTATED_ORIGINALS:
        cls, name, fn = _ANNOTATED_ORIGINALS.pop()
        setattr(cls, name, fn)


def annotate(torch) -> None:
    """Wrap the methods of ``ANNOTATED`` in ``torch.profiler.record_function`` ranges (``eyrie.<Class>.<name>``):
    a profiler window then reports the kernels each launched (a range's device time includes its children's)."""
    import functools
    import importlib
    import inspect

    for path, names in ANNOTATED.items():
        module, cls_name = path.rsplit(".", 1)
        cls = getattr(importlib.import_module(module), cls_name)
        for name in names:
            fn = getattr(cls, name, None)
            if fn is None:
                continue

            _ANNOTATED_ORIGINALS.append((cls, name, fn))
            label = f"{RANGE_PREFIX}{cls_name}.{name}"
            if inspect.isgeneratorfunction(fn):  # a step's generator: the range spans it to its end (its host
                def wrapped(*a, _fn=fn, _label=label, **k):  # wait at the yield included)
                    with torch.profiler.record_function(_label):
                        return (yield from _fn(*a, **k))
            else:
                def wrapped(*a, _fn=fn, _label=label, **k):
                    with torch.profiler.record_function(_label):
                        return _fn(*a, **k)
            setattr(cls, name, functools.wraps(fn)(wrapped))


def profile_window(torch, start_at: int, count: int):
    """A callback for ``closed_loop`` that starts torch.profiler at step ``start_at`` and stops ``count`` later;
    ``result()`` is then the window's wall, kernel time summed and top kernels."""
    from torch.profiler import ProfilerActivity, profile

    state = {"prof": None, "t0": 0.0, "wall": 0.0, "done": False}

    def on_step(n: int) -> None:
        if state["done"]:
            return
        if state["prof"] is None and n >= start_at:
            cuda = torch.cuda.is_available()
            if cuda:
                torch.cuda.synchronize()
            state["prof"] = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []))
            state["prof"].__enter__()
            state["t0"] = time.perf_counter()
        elif state["prof"] is not None and n >= start_at + count:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            state["wall"] = time.perf_counter() - state["t0"]
            state["prof"].__exit__(None, None, None)
            state["done"] = True

    def result() -> dict:
        prof = state["prof"]
        if prof is None or not state["done"]:
            return {}
        kernels = [e for e in prof.key_averages() if getattr(e, "device_type", None) is not None
                   and str(e.device_type).endswith("CUDA") and e.self_device_time_total > 0]
        total_us = sum(e.self_device_time_total for e in kernels)
        top = sorted(kernels, key=lambda e: -e.self_device_time_total)[:20]
        # The engine's own ranges (``annotate``): the kernels each launched, summed, and its host time
        # (a range is two entries of one key: the host's, with its host time, and the device's, the span of its
        # kernels on the device, idle gaps between them included)
        ranges: dict[str, dict] = {}
        for e in prof.key_averages():
            if e.key.startswith(RANGE_PREFIX):
                r = ranges.setdefault(e.key, {"calls": 0, "device_ms": 0.0, "host_ms": 0.0})
                r["calls"] = max(r["calls"], e.count)
                r["device_ms"] = round(r["device_ms"] + e.device_time_total / 1e3, 2)
                r["host_ms"] = round(r["host_ms"] + e.cpu_time_total / 1e3, 2)
        return {"steps": count, "wall_ms": round(state["wall"] * 1e3, 2), "kernel_ms": round(total_us / 1e3, 2),
                "device_busy": round(total_us / 1e6 / state["wall"], 3) if state["wall"] else None,
                "ranges": dict(sorted(ranges.items(), key=lambda kv: -kv[1]["device_ms"])),
                "top_kernels": [{"name": e.key[:120], "calls": e.count, "ms": round(e.self_device_time_total / 1e3, 2)}
                                for e in top]}

    return on_step, result


def cprofile_window(start_at: int, count: int, top: int = 80):
    """As ``profile_window``, with cProfile: the host functions with the most own and cumulative time per step."""
    import cProfile
    import pstats

    state = {"prof": None, "done": False, "t0": 0.0, "wall": 0.0}

    def on_step(n: int) -> None:
        if state["done"]:
            return
        if state["prof"] is None and n >= start_at:
            state["prof"], state["t0"] = cProfile.Profile(), time.perf_counter()
            state["prof"].enable()
        elif state["prof"] is not None and n >= start_at + count:
            state["prof"].disable()
            state["wall"], state["done"] = time.perf_counter() - state["t0"], True

    def result() -> dict:
        if not state["done"]:
            return {}
        stats = pstats.Stats(state["prof"])
        stats.strip_dirs()

        def rows(key: str) -> list:
            stats.sort_stats(key)
            out = []
            for fn in stats.fcn_list[:top]:
                cc, nc, tt, ct, _ = stats.stats[fn]
                out.append({"function": f"{fn[0]}:{fn[1]}({fn[2]})", "calls_per_step": round(nc / count, 1),
                            "own_ms_per_step": round(tt / count * 1e3, 3),
                            "cum_ms_per_step": round(ct / count * 1e3, 3)})
            return out

        return {"steps": count, "wall_ms": round(state["wall"] * 1e3, 2), "by_own": rows("tottime"),
                "by_cumulative": rows("cumulative")}

    return on_step, result


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    if args.annotate:
        annotate(torch)
    engine = build_engine(args)
    t0 = time.perf_counter()
    engine.capture_graphs()
    report: dict = {"args": vars(args), "graph_capture_s": round(time.perf_counter() - t0, 1),
                    "graph_costs_ms": {f"{k}/{b}": round(s * 1e3, 3)
                                       for (k, b), s in sorted(engine.graph_costs.items())},
                    "chunk_size": engine.scheduler.chunk_size, "points": []}
    vocab, text_ids = tuple(prompt_vocab(args.model)), prompt_text_ids(args.model, args.prompts_file)
    log = StepLog(engine)
    compiles = CompileLog(log)
    report["graphs"] = {g.name: max(g.captured_sizes, default=0) for g in engine.phase_graphs()}
    top = max(int(c) for c in args.concurrency.split(","))
    closed_loop(log, make_requests(Point("warmup", top, top, (args.prompt,) * 2, (4, 4), seed=1), vocab, text_ids), top)
    for c in (int(x) for x in args.concurrency.split(",")):
        log.steps, compiles.entries[:] = [], []
        point = Point("fixed", c, args.waves * c, (args.prompt,) * 2, (args.output,) * 2, seed=c)
        window_of = (lambda a, b: cprofile_window(a, b)) if args.cprofile else (
            lambda a, b: profile_window(torch, a, b))
        on_step, window = window_of(c + args.profile_after, args.profile_steps)
        ran = closed_loop(log, make_requests(point, vocab, text_ids), c, on_step)
        steps = log.steps
        # The steps neither inside the profiler's window (its host tracing slows a step in proportion to its host
        # ops: the draft's path twice the target's, H100 c128) nor paying a Triton compile
        start = c + args.profile_after
        skip = set(range(start, start + args.profile_steps)) | {e[0] for e in compiles.entries}
        clean = [s for i, s in enumerate(steps) if i not in skip]
        clean_s = sum(s["wall_ms"] for s in clean) / 1e3
        entry = {"concurrency": c, "requests": point.requests,
                 "output_tok_s": round(ran["output_tokens"] / ran["seconds"], 1),
                 "seconds": round(ran["seconds"], 2), "steps": len(steps),
                 # over the steps' own time: the point's elapsed time also holds the profiler's start (seconds)
                 "steps_tok_s": round(ran["output_tokens"] / max(1e-9, sum(s["wall_ms"] for s in steps) / 1e3), 1),
                 "wall_s": round(sum(s["wall_ms"] for s in steps) / 1e3, 3),
                 "device_span_s": round(sum(s["device_ms"] for s in steps) / 1e3, 3),
                 "by_kind": by_kind(steps), "profile_window": window(), "compiles": list(compiles.entries),
                 "clean": {"steps": len(clean), "wall_s": round(clean_s, 3),
                           "tok_s": round(sum(s["tokens"] for s in clean) / clean_s, 1) if clean_s else None,
                           "by_kind": by_kind(clean)},
                 "timeline": [[s["kind"][0], s["shape"], s["rows"], s["prefill_tokens"], round(s["wall_ms"], 2),
                               round(s["device_ms"], 2), s["chunks"], s["tokens"], s["estimate"]] for s in steps],
                 "policy": None if engine.spec_policy is None else engine.spec_policy.summary()}
        report["points"].append(entry)
        print(f"c{c}: {entry['output_tok_s']} tok/s over {entry['seconds']} s ({entry['steps_tok_s']} over the steps' "
              f"time), {len(steps)} steps; {entry['clean']['tok_s']} tok/s over the {len(clean)} steps outside the "
              f"profiler's window and compiles", flush=True)
        for name, g in list(entry["by_kind"].items())[:8]:
            print(f"  {name:40s} {g['steps']:5d} steps  wall {g['wall_ms_mean']:8.2f} ms  device "
                  f"{g['device_ms_mean']:8.2f} ms  rows {g['rows_mean']:6.1f}  share {g['share_of_wall']:.2f}",
                  flush=True)
        if entry["compiles"]:
            print(f"  {len(entry['compiles'])} Triton compiles, {sum(c[2] for c in entry['compiles']):.1f} s: "
                  + ", ".join(f"step {c[0]} {c[1]} {c[2]} s" for c in entry["compiles"][:12]), flush=True)
            for c in entry["compiles"][:12]:
                print(f"    step {c[0]} {c[1]}: {c[4] or 'its first compile'}", flush=True)
        w = entry["profile_window"]
        if w and args.cprofile:
            print(f"  host window {w['steps']} steps, {w['wall_ms']} ms; per step, own / cumulative ms:", flush=True)
            for r in w["by_own"][:18]:
                print(f"    {r['own_ms_per_step']:8.3f} {r['cum_ms_per_step']:8.3f} {r['calls_per_step']:7.1f}  "
                      f"{r['function']}", flush=True)
            for r in w["by_cumulative"][:22]:
                print(f"    cum {r['cum_ms_per_step']:8.3f}  {r['function']}", flush=True)
        elif w:
            print(f"  window {w['steps']} steps: wall {w['wall_ms']} ms, kernels {w['kernel_ms']} ms "
                  f"(busy {w['device_busy']})", flush=True)
            for k in w["top_kernels"][:10]:
                print(f"    {k['ms']:9.2f} ms  {k['calls']:6d}  {k['name']}", flush=True)
            for name, r in w.get("ranges", {}).items():
                print(f"    range {name}: {r['calls']} calls, kernels {r['device_ms']} ms, host {r['host_ms']} ms",
                      flush=True)
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
