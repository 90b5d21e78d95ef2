"""Where the host's time goes in a speculative decode step at a large batch (8B shape, EAGLE-3, graphs,
drafting ahead): ``SpecWorker.decode_step`` run back to back under cProfile, the functions with the most
own time and the most cumulative time, beside the step's wall time and its two graphs' device time.

The batch x context grid (docs/benchmarks.md) shows the iteration growing past the graphs' sum from
batch 32 on; this says which host code that is.

    python bench/profile_spec_host.py --batch 64 --context 1024 --out docs/bench/profile_spec_host.json
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_decode import spec_engine
from bench.common import build_draft, build_target, write_json
from bench.timing import time_cuda


def top(stats: pstats.Stats, key: str, n: int) -> list[dict]:
    stats.sort_stats(key)
    rows = []
    for func in stats.fcn_list[:n]:
        cc, nc, tt, ct, _ = stats.stats[func]
        rows.append({"function": f"{Path(func[0]).name}:{func[1]}({func[2]})", "calls": nc,
                     "own_ms": tt * 1e3, "cum_ms": ct * 1e3})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=20, help="decode steps profiled")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("profile_spec_host needs a CUDA device")
    target = build_target()
    draft = build_draft("eagle3", target)
    engine, reqs = spec_engine(target, draft, args.context, 1, 5, 6, batch=args.batch, room=1024)
    w = engine.speculator
    w._reserve(reqs)
    inp = w._inputs(reqs)
    tree = w.graphs["draft"](inp)
    graphs_ms = (time_cuda(lambda: w.graphs["draft"](inp), iters=10)
                 + time_cuda(lambda: w.graphs["verify_extend"](inp, tree), iters=10))
    for _ in range(3):
        w.decode_step(reqs)
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for _ in range(args.steps):
        w.decode_step(reqs)
    torch.cuda.synchronize()
    prof.disable()
    step_ms = (time.perf_counter() - t0) / args.steps * 1e3
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.strip_dirs()
    result = {"device": torch.cuda.get_device_name(), "batch": args.batch, "context": args.context,
              "steps": args.steps, "step_ms_profiled": step_ms, "graphs_ms": graphs_ms,
              "by_own_time": top(stats, "tottime", args.top), "by_cumulative": top(stats, "cumulative", args.top)}
    print(f"batch {args.batch} context {args.context}: step {step_ms:.2f} ms under the profiler, "
          f"draft + verify/extend graphs {graphs_ms:.2f} ms")
    for key in ("by_own_time", "by_cumulative"):
        print(f"-- {key} (per step)")
        for r in result[key]:
            print(f"  {r['own_ms'] / args.steps:8.3f} own {r['cum_ms'] / args.steps:8.3f} cum "
                  f"{r['calls'] / args.steps:8.1f} calls  {r['function']}")
    write_json(args.out, result)


if __name__ == "__main__":
    main()
