"""Where one engine's host waits for the device: every synchronizing CUDA call of a closed loop's steps, by the
engine's lines that made it (``torch.cuda.set_sync_debug_mode("warn")``).

A step is meant to wait once: for its sampled (or verified) tokens, read back to commit them. Any other wait
stops the host launching while the device drains the queue, so an eager step (a mixed step, a draft's extend)
then costs its kernels plus the host's launches after the wait, not the larger of the two. Run on a GPU:

    python bench/find_syncs.py --model /tmp/wide/target --draft /tmp/wide/eagle3 --concurrency 128 \
        --prompt 256 --output 128 --out syncs.json

Reported: the steps watched (after a warm-up loop and the graphs' capture, which may wait as they like), the
waits in all and per step, and each site (the innermost frames of ``shared/``, ``kernels/`` and ``services/``)
with its count, most first.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
import warnings
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_serving import prompt_text_ids, prompt_vocab  # noqa: E402
from bench.profile_engine import build_engine, closed_loop, engine_args  # noqa: E402
from bench.serving_load import Point, make_requests  # noqa: E402

OURS = ("/shared/", "/kernels/", "/services/")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    engine_args(ap)
    ap.add_argument("--concurrency", type=int, default=128)
    ap.add_argument("--frames", type=int, default=3, help="frames of ours that name a site")
    ap.add_argument("--out", required=True)
    return ap.parse_args(argv)


def site_of(stack: list[traceback.FrameSummary], frames: int) -> str:
    """The innermost ``frames`` frames of the project's code, innermost first."""
    ours = [f for f in stack if any(p in f.filename for p in OURS)]
    return " <- ".join(f"{f.filename.split(str(ROOT) + '/')[-1]}:{f.lineno}({f.name})"
                       for f in reversed(ours[-frames:]))


class SyncLog:
    """Collects the synchronizing calls torch reports while ``watching`` (as warnings) by site."""

    def __init__(self, torch, frames: int):
        self.torch, self.frames = torch, frames
        self.sites: Counter[str] = Counter()
        self.watching = False
        self._show = warnings.showwarning

    def __enter__(self) -> SyncLog:
        def show(message, category, filename, lineno, file=None, line=None):
            if self.watching and "synchroniz" in str(message):
                self.sites[site_of(traceback.extract_stack()[:-1], self.frames)] += 1
            else:
                self._show(message, category, filename, lineno, file, line)

        warnings.showwarning = show
        warnings.simplefilter("always")
        if self.torch.cuda.is_available():
            self.torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc) -> None:
        if self.torch.cuda.is_available():
            self.torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = self._show


class Watched:
    """``closed_loop``'s step log: the engine's steps, each run while ``sync`` watches (its hook installed or
    not: a warm-up loop runs before it is)."""

    def __init__(self, engine, sync: SyncLog):
        self.engine, self.sync, self.steps = engine, sync, []

    def step(self):
        self.sync.watching = True
        try:
            events = self.engine.step()
        finally:
            self.sync.watching = False
        self.steps.append(None)
        return events


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    engine = build_engine(args)
    engine.capture_graphs()
    vocab, text_ids = tuple(prompt_vocab(args.model)), prompt_text_ids(args.model, args.prompts_file)
    c, log = args.concurrency, SyncLog(torch, args.frames)
    closed_loop(Watched(engine, log), make_requests(Point("warmup", c, c, (args.prompt,) * 2, (4, 4), seed=1),
                                                    vocab, text_ids), c)
    point = Point("fixed", c, args.waves * c, (args.prompt,) * 2, (args.output,) * 2, seed=c)
    watched = Watched(engine, log)
    with log:
        closed_loop(watched, make_requests(point, vocab, text_ids), c)
    steps, total = len(watched.steps), sum(log.sites.values())
    report = {"args": vars(args), "steps": steps, "syncs": total, "syncs_per_step": round(total / max(1, steps), 3),
              "sites": [{"count": n, "per_step": round(n / max(1, steps), 3), "site": s}
                        for s, n in log.sites.most_common()]}
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"{steps} steps, {total} synchronizing calls ({report['syncs_per_step']} a step)")
    for r in report["sites"][:30]:
        print(f"  {r['count']:7d} {r['per_step']:7.3f}/step  {r['site']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
