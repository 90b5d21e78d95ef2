"""Where a stack's time to first token goes, per request, from the services' JSON logs.

Each request's lifecycle events (``services/logs.py``) carry timestamps of one host clock; their gaps are
the phases of its TTFT as the router saw it:

    placement     router received -> router placed (instances chosen, Redis record)
    admission     router placed -> prefill received (the Prefill call, the engine loop adding the request)
    queue         prefill received -> decode reserved (waiting for its first chunk to be scheduled; the
                  reservation goes out as that chunk starts)
    compute       decode reserved -> prefill prefill_done (the prompt's chunks and the first token's sampling)
    relay         prefill prefill_done -> router prefill_done (the first token back to the router)
    emit          router prefill_done -> router first_token (the router hands it to the client's stream)

    python bench/ttft_phases.py LOG_DIR [--json out.json]     # LOG_DIR holds router.log, prefill.log, decode.log

Prints p50 / p90 / max per phase (ms) over the requests that have every event; a phase that comes out
negative means the events did not happen in the order above (e.g. a reservation before the Prefill call
returned), and is reported as is.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime
from pathlib import Path

import numpy as np

# (phase, (service, event) it starts at, (service, event) it ends at)
PHASES = [("placement", ("router", "received"), ("router", "placed")),
          ("admission", ("router", "placed"), ("prefill", "received")),
          ("queue", ("prefill", "received"), ("decode", "reserved")),
          ("compute", ("decode", "reserved"), ("prefill", "prefill_done")),
          ("relay", ("prefill", "prefill_done"), ("router", "prefill_done")),
          ("emit", ("router", "prefill_done"), ("router", "first_token"))]


def seconds(ts: str) -> float:
    return datetime.strptime(ts, "%Y-%m-%dT%H:%M:%S.%fZ").timestamp()


def read_events(log_dir: Path) -> dict[str, dict[tuple[str, str], float]]:
    """rid -> (service, event) -> the first time it was logged."""
    events: dict[str, dict[tuple[str, str], float]] = {}
    for role in ("router", "prefill", "decode"):
        path = log_dir / f"{role}.log"
        if not path.exists():
            continue
        for line in path.read_text(errors="replace").splitlines():
            if not line.startswith("{"):
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if rec.get("rid"):
                events.setdefault(rec["rid"], {}).setdefault((rec["service"], rec["event"]), seconds(rec["ts"]))
    return events


def phases(events: dict[str, dict[tuple[str, str], float]]) -> dict[str, list[float]]:
    """Phase -> its seconds for every request that has all the events, in the order of arrival."""
    needed = {key for _, start, end in PHASES for key in (start, end)}
    full = sorted((ev for ev in events.values() if needed <= ev.keys()), key=lambda ev: ev[("router", "received")])
    out = {name: [ev[end] - ev[start] for ev in full] for name, start, end in PHASES}
    out["total"] = [ev[("router", "first_token")] - ev[("router", "received")] for ev in full]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("log_dir", type=Path)
    ap.add_argument("--json", type=Path, help="also write the per-phase figures and per-request seconds here")
    args = ap.parse_args(argv)
    table = phases(read_events(args.log_dir))
    n = len(table["total"])
    if n == 0:
        print(f"ttft_phases: no request with every event in {args.log_dir}", file=sys.stderr)
        return 1
    summary = {name: {q: float(np.percentile(v, p)) * 1e3 for q, p in (("p50_ms", 50), ("p90_ms", 90))}
               | {"max_ms": max(v) * 1e3} for name, v in table.items()}
    print(f"{n} requests with every event ({args.log_dir})")
    for name, s in summary.items():
        print(f"  {name:10s} p50 {s['p50_ms']:8.1f} ms   p90 {s['p90_ms']:8.1f} ms   max {s['max_ms']:8.1f} ms")
    if args.json:
        args.json.write_text(json.dumps({"requests": n, "phases_ms": summary,
                                         "per_request_s": {k: [round(x, 5) for x in v] for k, v in table.items()}},
                                        indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
