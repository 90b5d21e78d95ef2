"""Speculation that never loses, measured: the adaptive policy against plain decoding and fixed speculation
at Llama-3.1-8B's shape with a trained pair's acceptance (issue 16, part 5).

    python -m bench.house.adaptive --out $OUT            # H100: ~7 min (bench/house/gpu_adaptive.sh)
    python -m bench.house.adaptive --out /tmp/a --smoke  # the CPU form: small shapes, the script only

1. ``bench.house.widen_tiny``: the tiny trained pair widened to 8B shape and 128256 ids (exact: its greedy
   output and acceptance are the tiny pair's), plus its held-out text;
2. ``bench/bench_serving.py --skip-stack`` (the warmed single-process engine, greedy, prompts drawn from the
   held-out text so the head's acceptance is real) at each concurrency of ``--sweep`` for ``plain`` (no
   head), each fixed shape the adaptive policy chooses among: ``chain1``, ``chain2``, ``chain3`` (EAGLE-3
   chains) and ``tree`` (topk 4, 4 steps, 8 verified tokens), and ``adaptive`` (``--spec-policy adaptive``
   configured with the tree: its default candidates are the tree and the chains of 3, 2 and 1);
3. the table: each point's output tok/s, the best fixed configuration and adaptive / max(plain, best fixed),
   the issue's bar being 0.95.

``OUT`` gets plain.json, chain1.json, chain2.json, chain3.json, tree.json, adaptive.json (bench_serving's
reports) and adaptive_table.json (the table, the settings and the widening's record): seven files. Each run
gets an even share of what is left of ``--deadline-s``; a run's points that do not fit are skipped (listed in
its JSON).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BAR = 0.95
# name -> bench_serving flags: plain, then every shape the adaptive run chooses among (the tree's default
# candidates, shared/config.default_candidates), the widest last.
TREE = ["--spec-topk", "4", "--spec-steps", "4", "--spec-draft-tokens", "8"]
FIXED = {"plain": ["--draft", "none"],
         **{f"chain{d}": ["--spec-topk", "1", "--spec-steps", str(d), "--spec-draft-tokens", str(d + 1),
                          "--spec-policy", "fixed"] for d in (1, 2, 3)},
         "tree": [*TREE, "--spec-policy", "fixed"]}
ADAPTIVE = TREE + ["--spec-policy", "adaptive"]  # chooses among the tree, the chains and plain steps
# The sweep runs in this order (a run cut off by its deadline loses its last points); the table is sorted.
# On the GPU: the configurations the bar compares against (plain, the chain of 3 and the tree: --runs adds
# chain1,chain2), 6 waves of requests per point so that a point lasts seconds, not one ramp (2 waves gave
# 1.5-2.6 s points at c8/c32 and +-30% between calls).
GPU = dict(shape=[], heldout_bytes=400_000, vocab=128256, dtype="bfloat16", sweep="1,64,8,32", fixed="256:128",
           point_seconds=20.0, deadline_s=525.0, serving=["--waves", "6"], runs="plain,chain3,tree,adaptive")
# The CPU form: the vocabulary widened and one identity layer added (tests/unit/training/test_widen_tiny.py
# checks a wider shape), little held-out text, two points; graph-shaped steps (padded to the graphs' batch
# buckets, run eagerly on the CPU), so the adaptive engine's plain steps take the GPU run's path.
SMOKE = dict(shape=["--hidden", "256", "--layers", "5", "--intermediate", "640", "--heads", "2", "--kv-heads",
                    "1"],
             heldout_bytes=40_000, vocab=4096, dtype="float32", sweep="1,2", fixed="24:8", point_seconds=10.0,
             deadline_s=300.0, serving=["--smoke", "--waves", "1", "--min-requests", "2", "--cuda-graph", "on"],
             runs=",".join([*FIXED, "adaptive"]))


def log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def widen(out: Path, work: Path, settings: dict) -> dict:
    cmd = [sys.executable, "-m", "bench.house.widen_tiny", "--out", str(work / "pair"), "--vocab",
           str(settings["vocab"]), "--dtype", settings["dtype"], "--record", str(work / "widen.json"),
           "--heldout-bytes", str(settings["heldout_bytes"]),
           *settings["shape"]]
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    log(f"adaptive: widened in {time.perf_counter() - t0:.1f} s")
    return json.loads((work / "widen.json").read_text())


def serve_bench(name: str, flags: list[str], pair: dict, out: Path, work: Path, settings: dict,
                budget_s: float) -> dict:
    """One bench_serving run of the engine alone; its report (written to OUT/NAME.json)."""
    report = out / f"{name}.json"
    probe = settings["fixed"].split(":")[0] + ":4"  # warms the prompt length (the probe is not measured)
    cmd = [sys.executable, "bench/bench_serving.py", "--skip-stack", "--model", pair["target"],
           "--prompts-file", pair["prompts_file"], "--workloads", "fixed", "--fixed", settings["fixed"],
           "--probe", probe, "--sweep", settings["sweep"], "--point-seconds", str(settings["point_seconds"]),
           "--deadline-s", str(budget_s), "--engine-budget-s", str(budget_s - 10), "--out", str(report),
           "--workdir", str(work / name), *settings["serving"], *flags]
    if "--draft" not in flags:
        cmd += ["--draft", pair["draft"]]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    log(f"adaptive: {name} exit {done.returncode} in {time.perf_counter() - t0:.1f} s")
    if done.returncode != 0 or not report.exists():
        log(done.stdout[-2000:] + done.stderr[-2000:])
        return {"engine": {"points": []}, "exit_code": done.returncode}
    return json.loads(report.read_text())


def tok_s(report: dict) -> dict[int, float]:
    """Concurrency -> output tok/s of a report's engine points."""
    return {p["concurrency"]: p["output_tok_s"] for p in report.get("engine", {}).get("points", [])
            if p["output_tok_s"] is not None}


def faster_fixed(reports: dict[str, dict], c: int) -> str | None:
    """The fixed speculative configuration with the most tok/s at concurrency ``c`` (the first of ``FIXED``'s
    order among those run on a tie, e.g. when none has the point; None before any ran)."""
    names = [n for n in FIXED if n != "plain" and n in reports]
    speeds = {n: tok_s(reports[n]).get(c, 0.0) for n in names}
    return max(names, key=lambda n: (speeds[n], -names.index(n)), default=None)


def table(reports: dict[str, dict], sweep: list[int]) -> list[dict]:
    rows = []
    for c in sweep:
        speeds = {n: tok_s(r).get(c) for n, r in reports.items()}
        accept = {n: point_spec(r, c) for n, r in reports.items() if n != "plain"}
        fixed = [s for n, s in speeds.items() if n != "adaptive" and s is not None]
        best = max(fixed) if fixed else None
        ratio = speeds.get("adaptive") / best if best and speeds.get("adaptive") else None
        rows.append({"concurrency": c, "tok_s": speeds, "best_fixed_or_plain": best, "adaptive_ratio": ratio,
                     "best_fixed": faster_fixed(reports, c),
                     "meets_bar": None if ratio is None else ratio >= BAR, "spec": accept})
    return rows


def point_spec(report: dict, c: int) -> dict | None:
    for p in report.get("engine", {}).get("points", []):
        if p["concurrency"] == c:
            return p.get("spec")
    return None


def print_table(rows: list[dict], names: list[str]) -> None:
    print(f"\noutput tok/s, engine alone (adaptive on the tree with its default shapes; bar adaptive / "
          f"max(plain, fixed) >= {BAR})")
    print("conc  " + "".join(f"{n:>10s}" for n in names) + "     ratio  accept(adaptive)  adaptive's steps by shape")
    for r in rows:
        cells = "".join(f"{r['tok_s'].get(n) or 0:10.1f}" for n in names)
        ratio = "-" if r["adaptive_ratio"] is None else f"{r['adaptive_ratio']:.3f}"
        s = r["spec"].get("adaptive") or {}
        accept = "-" if s.get("accept_length") is None else f"{s['accept_length']:.2f}"
        steps = " ".join(f"{n}:{k}" for n, k in {**s.get("shape_steps", {}), "plain": s.get("plain_steps")}.items())
        print(f"{r['concurrency']:4d}  {cells}  {ratio:>8s}  {accept:>15s}  {steps}")


def run(args) -> dict:
    settings = {**(SMOKE if args.smoke else GPU), **{k: v for k, v in vars(args).items()
                                                     if v is not None and k in GPU}}
    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    pair = widen(out, work, settings)
    sweep = sorted(int(c) for c in settings["sweep"].split(","))
    reports: dict[str, dict] = {}
    order = [n for n in [*FIXED, "adaptive"] if n in settings["runs"].split(",")]
    result = {"settings": settings, "adaptive_flags": ADAPTIVE, "padding": pair["padding"], "widen": pair}
    for i, name in enumerate(order):
        budget = (settings["deadline_s"] - (time.monotonic() - t0)) / (len(order) - i)
        reports[name] = serve_bench(name, FIXED.get(name, ADAPTIVE), pair, out, work, settings, budget)
        adaptive = reports.get("adaptive", {}).get("engine", {})
        result.update(rows=table(reports, sweep), wall_s=round(time.monotonic() - t0, 1),
                      policy_step_s=adaptive.get("policy_step_s"),
                      graph_capture_s=adaptive.get("graph_capture_s"),  # every shape's and the plain step's
                      graph_capture_mib=adaptive.get("graph_capture_mib"),
                      fixed_graph_capture_s=reports.get("tree", {}).get("engine", {}).get("graph_capture_s"),
                      fixed_graph_capture_mib=reports.get("tree", {}).get("engine", {}).get("graph_capture_mib"))
        (out / "adaptive_table.json").write_text(json.dumps(result, indent=1))  # kept if the call is cut off
    print_table(result["rows"], order)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--work", default="/tmp/eyrie-adaptive", help="the widened pair and the runs' logs")
    p.add_argument("--smoke", action="store_true", help="small shapes on the CPU: checks the script only")
    p.add_argument("--sweep")
    p.add_argument("--fixed", help="PROMPT:OUTPUT tokens per request")
    p.add_argument("--point-seconds", type=float)
    p.add_argument("--deadline-s", type=float)
    p.add_argument("--runs", help=f"which of {','.join([*FIXED, 'adaptive'])} to run (comma-separated)")
    run(p.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
