"""The host's work per speculative decode step, on the CPU.

On a GPU the host's per-step bookkeeping (reserving pages, building inputs, committing tokens, statistics,
the scheduler) runs while the device waits between graph launches; it grows with the batch. This script
measures it without a GPU: the tiny trained pair (``models/tiny-pair``), ``--rows`` requests decoding
together (a chain of 2, the fixed policy, the graphs flag on so inputs are padded to buckets as on a GPU,
the draft launched ahead as on a GPU unless ``--no-ahead``), ``--steps`` steps timed after ``--warmup`` ones.

On the CPU the model's reference kernels dominate the wall time, so it prints, per batch, the step's time
outside the model (``host``: ``Engine.step`` less the phases' forwards, ``PhaseGraphs.__call__``) and, per
step, the time of each host function of ``host_functions`` (its callees included, the forwards inside it
not). The functions are timed by wrappers (a clock read before and after each call), not by a profiler,
whose per-call overhead would swamp a Python loop over the batch; ``--cprofile N`` adds cProfile's own-time
table for detail. Times are the main thread's CPU time (``time.thread_time``), so other processes on a
shared machine move them little: compare runs of this script, not its figures with a GPU's.

    python bench/profile_host_cpu.py --rows 64,128 --steps 20 [--out host.json]
"""

from __future__ import annotations

import argparse
import cProfile
import inspect
import io
import json
import pstats
import random
import time

from shared.config import EngineConfig, SpecConfig
from shared.cuda_graphs import PhaseGraphs
from shared.engine import Engine
from shared.sampling import SamplingParams


# The host functions of a speculative decode step and what it calls: (owner, attribute) -> label. Only functions
# called a few times a step: a wrapper's clock reads on a per-request function (Request.commit, KVCache.reserve)
# would cost more than the function.
def host_functions() -> dict[tuple[object, str], str]:
    from shared.scheduler import Scheduler
    from shared.spec.draft_ahead import DraftAhead
    from shared.spec.stats import SpecRecorder
    from shared.spec.worker import SpecWorker

    return {(Scheduler, "schedule"): "scheduler.schedule", (Scheduler, "commit"): "scheduler.commit",
            (SpecWorker, "_reserve"): "worker._reserve",
            (SpecWorker, "_draft"): "worker._draft (its inputs, padding)", (SpecWorker, "_inputs"): "worker._inputs",
            (DraftAhead, "take"): "DraftAhead.take", (DraftAhead, "launch"): "DraftAhead.launch",
            (SpecWorker, "_verify"): "worker._verify (padding, rows taken)",
            (SpecWorker, "_to_host"): "worker._to_host", (SpecWorker, "_commit"): "worker._commit",
            (SpecRecorder, "record"): "SpecRecorder.record",
            (Engine, "_record"): "Engine._record"}


class Timers:
    """Each wrapped function's time per call, less the model forwards inside it (``PhaseGraphs.__call__``)."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.model = 0.0  # the phases' forwards so far

    def wrap(self, owner: object, name: str, label: str | None) -> None:
        raw = inspect.getattr_static(owner, name)
        fn = raw.__func__ if isinstance(raw, staticmethod) else raw

        def timed(*args, **kwargs):
            m0, t0 = self.model, CLOCK()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = CLOCK() - t0
                if label is None:
                    self.model += dt
                else:
                    self.seconds[label] = self.seconds.get(label, 0.0) + dt - (self.model - m0)
                    self.calls[label] = self.calls.get(label, 0) + 1

        setattr(owner, name, staticmethod(timed) if isinstance(raw, staticmethod) else timed)


CLOCK = time.thread_time  # this thread's CPU time: other processes on a shared machine move it little


def build(rows: int, model: str, draft: str, ahead: bool) -> Engine:
    spec = SpecConfig(topk=1, steps=2, num_draft_tokens=3)
    cfg = EngineConfig(max_running=rows, spec=spec, spec_policy="fixed", max_context=512, chunk_size=8192,
                       cuda_graph=True, spec_draft_ahead=ahead)
    engine = Engine(model, draft, cfg)
    rng = random.Random(0)
    for _ in range(rows):
        engine.add_request([rng.randrange(100, 1000) for _ in range(32)],
                           SamplingParams(max_new_tokens=400, ignore_eos=True))
    return engine


def profile(engine: Engine, warmup: int, steps: int, cprofile: int) -> dict:
    for _ in range(warmup):  # the prefill, then decode steps
        engine.step()
    prof = cProfile.Profile() if cprofile else None
    timers = Timers()
    timers.wrap(PhaseGraphs, "__call__", None)
    originals = {key: inspect.getattr_static(*key) for key in [*host_functions(), (PhaseGraphs, "__call__")]}
    for (owner, name), label in host_functions().items():
        timers.wrap(owner, name, label)
    try:
        t0 = CLOCK()
        if prof is not None:
            prof.enable()
        for _ in range(steps):
            engine.step()
        if prof is not None:
            prof.disable()
        total = CLOCK() - t0
    finally:
        for (owner, name), fn in originals.items():
            setattr(owner, name, fn)
    out = {"step_ms": round(total / steps * 1e3, 3), "model_ms": round(timers.model / steps * 1e3, 3),
           "host_ms": round((total - timers.model) / steps * 1e3, 3),
           "funcs": {label: {"ms": round(timers.seconds.get(label, 0.0) / steps * 1e3, 3),
                             "calls_per_step": round(timers.calls.get(label, 0) / steps, 1)}
                     for label in host_functions().values()}}
    if prof is not None:
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(cprofile)
        out["cprofile"] = text.getvalue()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="models/tiny-pair/target")
    ap.add_argument("--draft", default="models/tiny-pair/eagle3")
    ap.add_argument("--rows", default="64,128", help="comma-separated batch sizes")
    ap.add_argument("--steps", type=int, default=20, help="decode steps profiled per batch")
    ap.add_argument("--warmup", type=int, default=5, help="steps run first (the prefill among them)")
    ap.add_argument("--no-ahead", action="store_true", help="no draft launched ahead (the CPU's default)")
    ap.add_argument("--cprofile", type=int, default=0, metavar="N",
                    help="also print cProfile's N functions of most own time (its overhead inflates the figures)")
    ap.add_argument("--out", help="also write the figures as JSON here")
    args = ap.parse_args()
    report = {}
    for rows in [int(x) for x in args.rows.split(",")]:
        r = profile(build(rows, args.model, args.draft, not args.no_ahead), args.warmup, args.steps, args.cprofile)
        report[rows] = r
        print(f"rows {rows}: step {r['step_ms']:.1f} ms, model {r['model_ms']:.1f} ms, host {r['host_ms']:.2f} ms")
        for label, f in r["funcs"].items():
            print(f"  {label:38s} {f['ms']:8.3f} ms/step  {f['calls_per_step']:8.1f} calls/step")
        print(r.pop("cprofile", ""))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(report, fh, indent=2)


if __name__ == "__main__":
    main()
