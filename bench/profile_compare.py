"""Runs of ``bench/profile_engine.py`` side by side: each run's tok/s over its clean steps (outside the profiler's
window and compiles) per concurrency, the median step of each kind that carries the time (mixed steps and plain
decode steps at the point's top bucket), and, for labels run more than once (``--repeat`` in
``bench/gpu_session.sh profile``: the engines alternated on one machine), the median of the runs and their spread,
then each label's median against the first label's.

On one H100 the same plain engine's c128 mixed steps took 23.6 and 29.1 ms on two machines the same night, and an
adaptive run on the slower one paid 12 ms a mixed step more than plain where the faster paid under 1: a single run
of each engine says little. Alternating them and taking the medians does (METHOD.md: a difference smaller than the
spread of one version's repeats is noise).

    python bench/profile_compare.py plain=out/profile_plain_r*.json adaptive=out/profile_adaptive_r*.json
"""

from __future__ import annotations

import argparse
import glob
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.timing import write_json  # noqa: E402


def load(pattern: str) -> list[dict]:
    """The report of every file matching ``pattern`` (sorted: r1, r2, ...)."""
    files = sorted(glob.glob(pattern))
    if not files:
        raise SystemExit(f"profile_compare: no file matches {pattern!r}")
    return [json.load(open(f)) for f in files]


def point_summary(point: dict) -> dict:
    """Clean tok/s and the median wall ms of the point's mixed and plain decode steps at its widest rows."""
    timeline = point.get("timeline", [])
    top = max((t[2] for t in timeline), default=0)
    wide = [t for t in timeline if t[2] >= 0.75 * top]

    def median_ms(kind: str, shape: str | None = None) -> float | None:
        xs = [t[4] for t in wide if t[0] == kind and (shape is None or t[1] == shape)]
        return round(statistics.median(xs), 2) if xs else None

    clean = point.get("clean") or {}  # (reports before the clean figure: the steps' own tok/s)
    return {"tok_s": clean.get("tok_s") or point.get("steps_tok_s"), "mixed_ms": median_ms("m"),
            "decode_ms": median_ms("d", "plain")}


def summarize(labelled: dict[str, list[dict]]) -> dict:
    """{concurrency: {label: {"runs": [...], "median": tok/s, "spread": max/min - 1, "vs_first": ratio}}}."""
    out: dict[int, dict] = {}
    for label, reports in labelled.items():
        for report in reports:
            for point in report["points"]:
                runs = out.setdefault(point["concurrency"], {}).setdefault(label, {"runs": []})["runs"]
                runs.append(point_summary(point))
    for by_label in out.values():
        first = None
        for entry in by_label.values():
            rates = [r["tok_s"] for r in entry["runs"] if r["tok_s"]]
            entry["median"] = statistics.median(rates) if rates else None
            entry["spread"] = round(max(rates) / min(rates) - 1, 3) if len(rates) > 1 else None
            first = first or entry["median"]
            entry["vs_first"] = round(entry["median"] / first, 3) if entry["median"] and first else None
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="LABEL=GLOB: the profile_engine reports of one engine")
    ap.add_argument("--out", help="the summary as JSON")
    args = ap.parse_args(argv)
    labelled = {}
    for spec in args.runs:
        label, sep, pattern = spec.partition("=")
        if not sep or not label or not pattern:
            print(f"profile_compare: {spec!r} is not LABEL=GLOB", file=sys.stderr)
            return 2
        labelled[label] = load(pattern)
    summary = summarize(labelled)
    for c, by_label in sorted(summary.items()):
        print(f"c{c}:")
        for label, e in by_label.items():
            runs = ", ".join(f"{r['tok_s']} ({r['mixed_ms']} / {r['decode_ms']} ms)" for r in e["runs"])
            print(f"  {label:12s} median {e['median']} tok/s  spread {e['spread']}  vs first {e['vs_first']}"
                  f"   runs: {runs}")
    write_json(args.out, summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
