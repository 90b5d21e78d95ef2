"""Speculation that pays by default, through the stack (issue 31): plain decoding, the defaults with a draft (the
adaptive policy over the default tree's shapes), the fixed chain of 3 and the fixed best tree, each served by
router + prefill + decode on one GPU (``--layout pd1``; ``colo1``: router + one decode instance prefilling its own
prompts) and driven over the OpenAI API at every concurrency of the sweep.

    python -m bench.house.policy_stack --out $OUT            # H100: ~6.5 min (bench/gpu_session.sh policy)
    python -m bench.house.policy_stack --out /tmp/p --smoke  # the CPU form: small shapes, the script only

1. ``bench.house.widen_tiny``: the tiny trained pair widened to 8B shape and 128256 ids (greedy output and
   acceptance are the tiny pair's) and its held-out text, which the prompts are windows of;
2. per configuration (``RUNS``): the stack started (``bench/serving_stack.py``, as ``eyrie up`` runs it: both
   engines on the one GPU with CUDA graphs), the greedy check (``--check`` prompts, their token ids over the
   OpenAI API, each must equal plain's), a warm-up at the largest concurrency, then each point of ``--sweep``: a
   closed loop of ``--fixed`` requests issued for ``--point-seconds`` (then drained), its output tok/s, TTFT and
   inter-token latency, and from the decode instance's /metrics the decode steps per kind (each tree shape, and
   plain) and per shape the drafts and accepted tokens of the point;
3. the table: each point's tok/s, default / plain and default / the best fixed shape (the issue's bar: both
   >= 0.95), TTFT default / plain (the bar: within 5%), and the kind the default ran most.

``OUT/policy_stack.json`` is rewritten after every point (a run cut off keeps what it measured); points that do
not fit ``--deadline-s`` are skipped and listed. The services' logs go to ``--work``/logs-NAME. Exit status
(``outcome``): 1 when a configuration failed or requests failed, 3 when only a greedy check left plain's output
(the first differing token of each check prompt is printed and kept), 0 otherwise.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.house.adaptive import log, widen  # noqa: E402
from bench.serving_load import HttpDriver, Point, make_requests, run_closed_loop, summarize  # noqa: E402
from bench.serving_stack import ServingStack  # noqa: E402

BAR, TTFT_BAR = 0.95, 0.05
# name -> the services' tree and policy flags (plain: no draft). ``default`` gives none: the settings' defaults.
RUNS = {"plain": None, "default": {},
        "chain3": {"spec_topk": 1, "spec_steps": 3, "spec_policy": "fixed"},
        "tree": {"spec_topk": 4, "spec_steps": 4, "spec_draft_tokens": 8, "spec_policy": "fixed"},
        # the defaults but for one setting, for comparisons (not in the default ``--runs``)
        "backlog0": {"spec_draft_backlog": 0}}
DEFAULT_RUNS = "plain,default,chain3,tree"
LAYOUTS = ("pd1", "colo1")
SPEC_SERIES = ("eyrie_spec_decode_num_steps_total", "eyrie_spec_decode_num_drafts_total",
               "eyrie_spec_decode_num_accepted_tokens_total")
GPU = dict(shape=[], heldout_bytes=400_000, vocab=128256, dtype="bfloat16", sweep="1,8,32,64,128", fixed="256:128",
           point_seconds=10.0, deadline_s=370.0, start_timeout_s=120.0, check=4, check_tokens=48,
           engine={"device": "cuda", "dtype": "bfloat16", "cuda_graph": True, "page_size": 16, "num_pages": 4096,
                   "max_running": 128, "max_context": 1024, "chunk_size": 512}, runs=DEFAULT_RUNS, layout="pd1")
SMOKE = dict(shape=["--hidden", "256", "--layers", "5", "--intermediate", "640", "--heads", "2", "--kv-heads", "1"],
             heldout_bytes=40_000, vocab=4096, dtype="float32", sweep="1,2", fixed="24:6", point_seconds=2.0,
             deadline_s=900.0, start_timeout_s=300.0, check=1, check_tokens=6,
             engine={"device": "cpu", "dtype": "float32", "page_size": 4, "num_pages": 256, "max_running": 4,
                     "max_context": 128, "chunk_size": 32}, runs=DEFAULT_RUNS, layout="pd1")


def greedy_ids(address: str, prompt: list[int], tokens: int, timeout_s: float = 120.0) -> list[int]:
    """The greedy continuation of ``prompt`` over the OpenAI API (not streamed), as token ids."""
    host, port = address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    try:
        conn.request("POST", "/v1/completions", json.dumps({
            "model": "eyrie", "prompt": prompt, "max_tokens": tokens, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True}), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        body = json.loads(resp.read())
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {body}")
        return list(body["choices"][0]["token_ids"])
    finally:
        conn.close()


def spec_counts(stack: ServingStack) -> dict[str, dict[str, float]]:
    """The decode instance's speculation series by name and kind (``shape`` label)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(stack.metrics("decode")):
        for s in family.samples:
            if s.name in SPEC_SERIES:
                out.setdefault(s.name, {})[s.labels["shape"]] = s.value
    return out


def spec_delta(before: dict, after: dict) -> dict:
    """A point's decode steps per kind, and per shape its drafts and accept length (1 + accepted / drafts)."""
    d = {name: {k: v - before.get(name, {}).get(k, 0.0) for k, v in kinds.items()} for name, kinds in after.items()}
    steps = {k: int(v) for k, v in d.get(SPEC_SERIES[0], {}).items() if v}
    drafts, accepted = d.get(SPEC_SERIES[1], {}), d.get(SPEC_SERIES[2], {})
    accept = {k: round(1 + accepted.get(k, 0) / n, 3) for k, n in drafts.items() if n}
    return {"steps": steps, "most": max(steps, key=steps.get) if steps else None, "accept_length": accept}


def run_config(name: str, flags: dict | None, pair: dict, text_ids: list[int], s: dict, work: Path,
               deadline: float, record: dict, save) -> None:
    """One configuration's stack: started, checked, warmed, swept; its points into ``record`` as they come."""
    vocab = (2, s["vocab"])
    t0 = time.monotonic()
    colo = s["layout"] == "colo1"  # one decode instance prefilling every prompt itself; pd1: a prefill instance too
    stack = ServingStack(pair["target"], pair["draft"] if flags is not None else None, {**s["engine"], **(flags or {})},
                         work / f"logs-{name}", instances=[("decode", {})] if colo else None,
                         env={"EYRIE_LOCAL_PREFILL_MAX_TOKENS": str(s["engine"]["max_context"] if colo else 0)}
                         ).start(min(s["start_timeout_s"], max(1.0, deadline - t0)))
    record["start_s"] = round(time.monotonic() - t0, 1)
    try:
        check = make_requests(Point("check", 1, s["check"], (64, 64), (s["check_tokens"],) * 2, seed=7), vocab,
                              text_ids)
        record["greedy"] = [greedy_ids(stack.openai_address, r.prompt_ids, r.max_new_tokens) for r in check]
        drive = HttpDriver(stack.openai_address, 120.0)
        top = max(int(c) for c in s["sweep"].split(","))
        prompt, output = (int(x) for x in s["fixed"].split(":"))
        run_closed_loop(drive, make_requests(Point("warmup", top, top, (prompt, prompt), (4, 4), seed=1), vocab,
                                             text_ids), top, 60.0)
        for c in (int(x) for x in s["sweep"].split(",")):
            if time.monotonic() + s["point_seconds"] + 15 > deadline:
                record.setdefault("skipped", []).append(c)
                continue
            point = Point("fixed", c, max(4 * c, 64), (prompt, prompt), (output, output))
            before = spec_counts(stack) if flags is not None else {}
            records = run_closed_loop(drive, make_requests(point, vocab, text_ids), c, s["point_seconds"])
            summary = {k: v for k, v in summarize(point, records).items() if k != "requests_detail"}
            if flags is not None:
                summary["spec"] = spec_delta(before, spec_counts(stack))
            record.setdefault("points", []).append(summary)
            log(f"policy: {name} c{c}: {summary['output_tok_s'] or 0:.1f} tok/s, {summary['failed']} failed, "
                f"TTFT p50 {summary['ttft_p50_s'] or 0:.3f} s, ran most {summary.get('spec', {}).get('most')}")
            save()
    finally:
        record["exit_codes"] = stack.stop()


def table(runs: dict[str, dict], sweep: list[int]) -> list[dict]:
    """Per concurrency: tok/s and TTFT p50 per configuration, and the default's ratios to plain and the best
    fixed shape."""
    rows = []
    for c in sweep:
        point = {n: next((p for p in r.get("points", []) if p["concurrency"] == c), None) for n, r in runs.items()}
        tok = {n: p and p["output_tok_s"] for n, p in point.items()}
        ttft = {n: p and p["ttft_p50_s"] for n, p in point.items()}
        fixed = {n: v for n, v in tok.items() if (RUNS.get(n) or {}).get("spec_policy") == "fixed" and v}
        best = max(fixed, key=fixed.get) if fixed else None
        d = tok.get("default")
        rows.append({"concurrency": c, "tok_s": tok, "ttft_p50_s": ttft, "best_fixed": best,
                     "default_vs_plain": d / tok["plain"] if d and tok.get("plain") else None,
                     "default_vs_best_fixed": d / fixed[best] if d and best else None,
                     "ttft_default_vs_plain": ttft["default"] / ttft["plain"]
                     if ttft.get("default") and ttft.get("plain") else None,
                     "default_ran_most": (point.get("default") or {}).get("spec", {}).get("most")})
    return rows


def print_table(rows: list[dict], names: list[str]) -> None:
    print(f"\noutput tok/s through the stack (OpenAI API); bars: default / plain and default / best fixed >= {BAR}, "
          f"TTFT default / plain within {TTFT_BAR:.0%}")
    print("conc " + "".join(f"{n:>10s}" for n in names) + "  /plain  /fixed  ttft  default ran most")
    fmt = lambda v, w=8: f"{v:{w}.3f}" if v is not None else " " * (w - 1) + "-"  # noqa: E731
    for r in rows:
        cells = "".join(f"{r['tok_s'].get(n) or 0:10.1f}" for n in names)
        print(f"{r['concurrency']:4d} {cells}{fmt(r['default_vs_plain'])}{fmt(r['default_vs_best_fixed'])}"
              f"{fmt(r['ttft_default_vs_plain'], 6)}  {r['default_ran_most']}")


def run(args) -> dict:
    s = {**(SMOKE if args.smoke else GPU), **{k: v for k, v in vars(args).items() if v is not None and k in GPU}}
    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    pair = widen(out, work, s)
    deadline = time.monotonic() + s["deadline_s"]
    from bench.bench_serving import prompt_text_ids

    text_ids = prompt_text_ids(pair["target"], pair["prompts_file"])
    names = [n for n in RUNS if n in s["runs"].split(",")]
    result = {"settings": s, "runs_flags": {n: RUNS[n] for n in names}, "widen": pair,
              # the services as clients of an MPS server (bench/gpu_session.sh POLICY_MPS=1): kernels of the two
              # processes sharing the GPU run side by side instead of in time slices
              "mps": bool(os.environ.get("CUDA_MPS_PIPE_DIRECTORY")), "runs": {}}
    path = out / "policy_stack.json"

    def save() -> None:
        result["rows"] = table(result["runs"], [int(c) for c in s["sweep"].split(",")])
        plain = result["runs"].get("plain", {}).get("greedy")
        result["greedy_equal"] = {n: r.get("greedy") == plain for n, r in result["runs"].items()
                                  if n != "plain" and plain is not None and "greedy" in r}
        result["greedy_first_diff"] = {n: [first_diff(a, b) for a, b in zip(r["greedy"], plain)]
                                       for n, r in result["runs"].items()
                                       if n != "plain" and plain is not None and "greedy" in r}
        result["wall_s"] = round(time.monotonic() - t0, 1)
        path.write_text(json.dumps(result, indent=1))

    for i, name in enumerate(names):
        share = time.monotonic() + (deadline - time.monotonic()) / (len(names) - i)  # an even share of what is left
        result["runs"][name] = {}
        try:
            run_config(name, RUNS[name], pair, text_ids, s, work, share, result["runs"][name], save)
        except Exception as e:  # noqa: BLE001 (one configuration's failure: recorded, the others still run)
            result["runs"][name]["error"] = f"{type(e).__name__}: {e}"[:2000]
            log(f"policy: {name} failed: {result['runs'][name]['error']}")
        save()
    print_table(result["rows"], names)
    print(f"greedy output equal to plain's: {result['greedy_equal']} (first differing token per check prompt: "
          f"{result['greedy_first_diff']}); wall {result['wall_s']} s")
    return result


def first_diff(a: list[int], b: list[int]) -> int | None:
    """The index of the first token where ``a`` and ``b`` differ (one ending first counts), None when equal."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def outcome(result: dict) -> tuple[int, str]:
    """The exit status and why: 1 when a configuration failed (an error, or requests that failed), 3 when all ran
    but a configuration's greedy output left plain's (in bf16 the verify's batched projections round differently
    from a plain step's, which can flip a near-tie: ``batch_invariant`` is the exact mode), 0 otherwise. Apart, so
    a failure is never read as the known rounding, nor the other way round."""
    broken = [f"{n}: {r['error']}" for n, r in result["runs"].items() if r.get("error")]
    broken += [f"{n} c{p['concurrency']}: {p['failed']} requests failed" for n, r in result["runs"].items()
               for p in r.get("points", []) if p.get("failed")]
    if broken:
        return 1, "; ".join(broken)
    differ = {n: d for n, d in result.get("greedy_first_diff", {}).items() if any(i is not None for i in d)}
    if differ:
        return 3, f"greedy output left plain's (first differing token per check prompt): {differ}"
    return 0, "every configuration ran, no request failed, greedy equal to plain's"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--work", default="/tmp/eyrie-policy", help="the widened pair and the services' logs")
    p.add_argument("--smoke", action="store_true", help="small shapes on the CPU: checks the script only")
    p.add_argument("--sweep", help="concurrencies, in the order run")
    p.add_argument("--fixed", help="PROMPT:OUTPUT tokens per request")
    p.add_argument("--point-seconds", type=float, help="seconds each point issues requests (then drains)")
    p.add_argument("--deadline-s", type=float, help="the whole run's budget after the widening")
    p.add_argument("--runs", help=f"which of {','.join(RUNS)} to run (comma-separated)")
    p.add_argument("--layout", choices=LAYOUTS, help="pd1: router + prefill + decode on the one device (default); "
                   "colo1: router + one decode instance prefilling its own prompts")
    code, why = outcome(run(p.parse_args(argv)))
    print(f"policy_stack: exit {code}: {why}")
    return code


if __name__ == "__main__":
    sys.exit(main())
