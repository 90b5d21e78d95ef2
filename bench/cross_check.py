"""The serving benchmark's own client against an outside one (guidellm), on one running stack: where they disagree.

Starts the stack once (``bench/serving_stack.py``: embedded Redis, prefill, decode, router with the OpenAI API),
then at each concurrency of ``--sweep`` drives its streaming ``/v1/completions`` with bench_serving's HTTP client
(``bench/serving_load.py``), then with guidellm (``bench/outside_load.sh``: synthetic text of the same token count,
the same output length, ``ignore_eos``), then with bench_serving's client again (the two runs of ours bound what
the machine's drift alone moves), and prints each figure both ways with the ratio guidellm / ours:

- TTFT p50 (both: send to first streamed token);
- ITL p50, guidellm's definition (each request's mean gap between tokens after the first, then the median over
  requests) and ours (the median over every token gap, the definition bench_serving reports);
- occupancy: the share of the point's window each client kept its requests in flight;
- output tok/s: tokens over the time from the first request sent to the last token received (for guidellm from
  its per-request times; the JSON also keeps the figure over guidellm's own benchmark duration).

    python bench/cross_check.py --out out/cross_check.json                      # the CPU, the tiny pair
    python bench/cross_check.py --model CKPT --device cuda --dtype bfloat16 --prompt 512 --output 256 \\
        --sweep 1,8,32 --requests 64 --out out/cross_check.json                # a GPU (not yet run there)

``--model`` needs a ``tokenizer.json`` (guidellm tokenizes its synthetic prompts with it, offline).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.serving_load import HttpDriver, Point, make_requests, run_closed_loop, summarize  # noqa: E402
from bench.timing import write_json  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(ROOT / "models" / "tiny-pair" / "target"))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--sweep", default="1,4", help="concurrencies, comma-separated")
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens per request")
    ap.add_argument("--output", type=int, default=16, help="output tokens per request")
    ap.add_argument("--requests", type=int, default=16, help="requests per point and client")
    ap.add_argument("--point-seconds", type=float, default=120.0)
    ap.add_argument("--out", default="out/cross_check.json")
    ap.add_argument("--workdir", help="logs and guidellm's JSON (default: a temporary directory)")
    ap.add_argument("--guidellm", default=f"{sys.executable} -m guidellm", help="the guidellm command")
    return ap.parse_args(argv)


def ours(address: str, point: Point, vocab: int, seconds: float) -> dict:
    """bench_serving's HTTP client at ``point``: its summary plus guidellm's ITL definition."""
    records = run_closed_loop(HttpDriver(address, 300.0), make_requests(point, (2, vocab)), point.concurrency,
                              seconds)
    per_request = [statistics.mean(r.itls()) for r in records if len(r.itls()) > 0]
    s = summarize(point, records)
    busy = sum(r.arrivals[-1][0] - r.sent for r in records if r.arrivals)
    return {"completed": s["completed"], "failed": s["failed"], "ttft_p50_s": s["ttft_p50_s"],
            "itl_request_mean_p50_s": statistics.median(per_request) if per_request else None,
            "itl_token_p50_s": s["itl_p50_s"], "output_tok_s": s["output_tok_s"],
            "occupancy": busy / (s["duration_s"] * point.concurrency) if s["duration_s"] > 0 else None}


def guidellm_points(path: Path) -> dict[int, dict]:
    """guidellm's JSON -> concurrency -> the same figures as ``ours`` (TTFT and ITL from each request's record:
    ``time_to_first_token_ms``, ``inter_token_latency_ms``, its mean gap after the first token)."""
    out = {}
    for b in json.loads(path.read_text())["benchmarks"]:
        ok = b["requests"]["successful"]
        ttft = [r["time_to_first_token_ms"] / 1e3 for r in ok if r.get("time_to_first_token_ms") is not None]
        itl = [r["inter_token_latency_ms"] / 1e3 for r in ok if r.get("inter_token_latency_ms") is not None]
        tokens = sum(r.get("output_tokens") or 0 for r in ok)
        # Ours' window: the first request sent to the last token received (guidellm's duration also holds its
        # scheduler's start and the last response's wind-down).
        window = max((r["info"]["timings"]["last_token_iteration"] for r in ok), default=0.0) - \
            min((r["request_start_time"] for r in ok), default=0.0)
        busy = sum(r["info"]["timings"]["last_token_iteration"] - r["request_start_time"] for r in ok)
        streams = int(b["config"]["strategy"]["streams"])
        out[streams] = {
            "completed": len(ok), "failed": b["metrics"]["request_totals"]["errored"],
            "ttft_p50_s": statistics.median(ttft) if ttft else None,
            "itl_request_mean_p50_s": statistics.median(itl) if itl else None, "itl_token_p50_s": None,
            "output_tok_s": tokens / window if window > 0 else None,
            "output_tok_s_reported": tokens / b["duration"] if b["duration"] > 0 else None,
            "occupancy": busy / (window * streams) if window > 0 else None,
            # guidellm's own: how late each request went out after the time its scheduler set for it
            "dispatch_delay_p50_s": statistics.median(r["request_dispatch_delay"] for r in ok) if ok else None}
    return out


def run_guidellm(args, address: str, tokenizer: str, work: Path) -> dict[int, dict]:
    env = {**os.environ, "PROMPT_TOKENS": str(args.prompt), "OUTPUT_TOKENS": str(args.output), "SWEEP": args.sweep,
           "REQUESTS": str(args.requests), "POINT_SECONDS": str(int(args.point_seconds)), "GUIDELLM": args.guidellm}
    done = subprocess.run(["bash", str(ROOT / "bench" / "outside_load.sh"), f"http://{address}", tokenizer,
                           str(work / "guidellm")], env=env, capture_output=True, text=True)
    (work / "guidellm.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise RuntimeError(f"guidellm exit {done.returncode}: {(done.stdout + done.stderr)[-1500:]}")
    return guidellm_points(work / "guidellm" / "guidellm.json")


# occupancy: the share of the point's window the client had its `concurrency` requests in flight (each request
# from its send to its last token); below 1, the client's own gaps between requests cost throughput.
FIGURES = ("ttft_p50_s", "itl_request_mean_p50_s", "output_tok_s", "occupancy")


def compare(first: dict, outside: dict, second: dict) -> dict:
    """Per figure: guidellm / ours (each run of ours), and whether guidellm lies outside ours' two runs."""
    out = {}
    for k in FIGURES:
        a, g, b = first.get(k), outside.get(k), second.get(k)
        if None in (a, g, b) or not a or not b:
            out[k] = None
            continue
        out[k] = {"ratio_first": g / a, "ratio_second": g / b, "outside_ours": not min(a, b) <= g <= max(a, b)}
    return out


def main(argv: list[str] | None = None) -> int:
    from bench.serving_stack import ServingStack

    args = parse_args(argv)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="eyrie-cross-"))
    work.mkdir(parents=True, exist_ok=True)
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    flags = {"device": args.device, "dtype": args.dtype, "max_context": 4 * (args.prompt + args.output)}
    env = {"OMP_NUM_THREADS": "1"} if args.device == "cpu" else {}
    stack = ServingStack(args.model, None, flags, work / "logs", env=env).start(300)
    report = {"settings": vars(args), "points": []}
    try:
        address = stack.openai_address
        sweep = [int(c) for c in args.sweep.split(",")]
        points = [Point("fixed", c, args.requests, (args.prompt,) * 2, (args.output,) * 2) for c in sweep]
        ours(address, Point("warmup", max(sweep), max(sweep), (args.prompt,) * 2, (4, 4), seed=1), vocab, 60)
        first = {p.concurrency: ours(address, p, vocab, args.point_seconds) for p in points}
        outside = run_guidellm(args, address, str(Path(args.model)), work)
        second = {p.concurrency: ours(address, p, vocab, args.point_seconds) for p in points}
        for c in sweep:
            row = {"concurrency": c, "ours_first": first[c], "guidellm": outside.get(c, {}), "ours_second": second[c]}
            row["compare"] = compare(first[c], row["guidellm"], second[c])
            report["points"].append(row)
            print(format_row(row), flush=True)
    finally:
        report["exit_codes"] = stack.stop()
        write_json(args.out, report)
    return 0


def format_row(row: dict) -> str:
    def f(d: dict, k: str, scale: float = 1.0) -> str:
        return "-" if d.get(k) is None else f"{d[k] * scale:.1f}"

    parts = [f"c{row['concurrency']}:"]
    for k, unit, scale in (("ttft_p50_s", "TTFT p50 ms", 1e3), ("itl_request_mean_p50_s", "ITL p50 ms", 1e3),
                           ("output_tok_s", "tok/s", 1.0), ("occupancy", "occupancy %", 100.0)):
        c = row["compare"].get(k)
        ratio = "-" if c is None else f"{c['ratio_first']:.2f}/{c['ratio_second']:.2f}"
        parts.append(f"{unit} ours {f(row['ours_first'], k, scale)}|{f(row['ours_second'], k, scale)} guidellm "
                     f"{f(row['guidellm'], k, scale)} (x{ratio})")
    return "  ".join(parts)


if __name__ == "__main__":
    sys.exit(main())
