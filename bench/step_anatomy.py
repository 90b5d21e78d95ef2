"""The kernels of one step kind at one batch size, from the captured graphs the adaptive policy's costs come from:
each (kind, batch) is replayed on padding rows (``shared.spec.graph_costs``) under torch.profiler, and its kernel
time per step is listed by kernel, beside the step's timed cost. Finds which kernel makes a bucket slower than
the next larger one (at capture on an H100: chain1 at 32 rows 21 ms, at 64 rows 9.6 ms).

    python bench/step_anatomy.py --model /tmp/wide/target --draft /tmp/wide/eagle3 \\
        --cases plain/32,plain/64,chain1/32,chain1/64 [--max-running 64] [--out anatomy.json]
"""

from __future__ import annotations

import argparse
import functools
import json


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft", default=None)
    ap.add_argument("--cases", default="plain/16,plain/32,plain/64,chain1/16,chain1/32,chain1/64,chain3/16,chain3/32")
    ap.add_argument("--max-running", type=int, default=64)
    ap.add_argument("--replays", type=int, default=10)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--out", default=None)
    return ap.parse_args(argv)


def kernels_of(torch, step, replays: int, top: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            step()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    total = sum(e.self_device_time_total for e in events) / replays
    rows = sorted(events, key=lambda e: -e.self_device_time_total)[:top]
    return {"kernel_ms_per_step": round(total / 1e3, 3),
            "top": [{"name": e.key[:100], "calls_per_step": e.count / replays,
                     "us_per_step": round(e.self_device_time_total / replays, 1)} for e in rows]}


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from services.settings import EngineSettings
    from shared.engine import Engine
    from shared.spec.graph_costs import time_step

    settings = EngineSettings(model=args.model, draft=args.draft, device="cuda", dtype="bfloat16",
                              max_running=args.max_running, gpu_memory_fraction=0.9, cuda_graph=True)
    engine = Engine(settings.model, settings.draft, settings.engine_config())
    engine.capture_graphs()
    worker = engine.runner.speculator
    report = {"costs_ms": {f"{k}/{b}": round(s * 1e3, 3) for (k, b), s in sorted(engine.graph_costs.items())},
              "cases": {}}
    for case in args.cases.split(","):
        kind, bs = case.split("/")
        inp = worker.padding_inputs(int(bs))
        step = (functools.partial(worker.plain_padding_step, inp) if kind == "plain"
                else functools.partial(worker.padding_step, kind, inp))
        try:
            entry = kernels_of(torch, step, args.replays, args.top)
            entry["timed_ms"] = round(time_step(step) * 1e3, 3)
        except Exception as e:  # a kind not captured at this size
            entry = {"error": f"{type(e).__name__}: {e}"[:300]}
        report["cases"][case] = entry
        print(f"{case}: timed {entry.get('timed_ms')} ms, kernels {entry.get('kernel_ms_per_step')} ms/step",
              flush=True)
        for r in entry.get("top", []):
            print(f"    {r['us_per_step']:9.1f} us  x{r['calls_per_step']:<6.1f} {r['name']}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
