"""The cost of sampling features on an EAGLE-3 decode iteration: each mode against a plain one.

Question answered (one JSON): how much longer is one EAGLE-3 decode step (draft, verify, acceptance,
compaction, draft extend) when every request of the batch uses a feature, at batch 1 and 32, greedy
and sampled, for a chain and a tree? At Llama-3.1-8B's shape (bf16, random weights, CUDA graphs
captured), each request ``--prompt-len`` tokens in (their K/V reserved; values irrelevant to timing).

Modes, one function each (``MODES``: a mode maps the sampling kind and a seed to the request's
parameters):
  plain      no feature: the step replays its graphs and drafts the next step ahead
  penalised  presence, frequency and repetition penalties, logit_bias (and min_p when sampled): every
             tree node's logits are processed from its own prefix's counts (eagerly, between the
             verify and extend graphs), and the next step is drafted ahead as in plain

Random weights accept nothing in any mode, so every mode does the same work per token: the difference
is the feature's. Ceiling printed beside each ratio: 1.5 (a penalised step within half a plain one).

    python bench/bench_features.py --out docs/bench/features_h100.json
    python bench/bench_features.py --dry-run     # a tiny model on the CPU: checks the script end to end
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import build_draft, build_target, engine_config, llama8b_config, write_json
from bench.timing import timer_ms
from shared.config import SpecConfig
from shared.engine import Engine
from shared.model.factory import PRESETS, llama_hf_config
from shared.sampling import SamplingParams
from shared.spec.state import DraftState

SHAPES = {"chain": SpecConfig(topk=1, steps=5, num_draft_tokens=6),
          "tree": SpecConfig(topk=4, steps=4, num_draft_tokens=8)}
TEMPERATURE = 0.8
CEILING = 1.5


def plain_params(sampled: bool, seed: int) -> SamplingParams:
    return SamplingParams(temperature=TEMPERATURE if sampled else 0.0, seed=seed, ignore_eos=True)


def penalised_params(sampled: bool, seed: int) -> SamplingParams:
    return plain_params(sampled, seed).model_copy(update=dict(
        presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1, min_p=0.05 if sampled else 0.0,
        logit_bias=((5, 2.0), (17, -1.0), (123, 0.5))))


MODES = {"plain": plain_params, "penalised": penalised_params}


def room(args, spec: SpecConfig) -> int:
    """Positions a request may grow by while timed (every step commits at most steps + 1 tokens)."""
    return 24 + (args.iter_calls * args.iter_iters + args.iter_warmup) * (spec.steps + 1)


def start_requests(engine: Engine, batch: int, mode: str, sampled: bool, args) -> list:
    """``batch`` requests of ``mode`` resumed straight into the decode loop at ``prompt_len`` positions,
    with distinct prompts (the penalties count real, varied tokens) and room to grow while timed."""
    w, vocab, ctx = engine.speculator, engine.model.config.vocab_size, args.prompt_len
    k = w.spec.topk
    reqs = []
    for b in range(batch):
        prompt = [2 + (7 * i + 131 * b) % (vocab - 2) for i in range(ctx)]
        params = MODES[mode](sampled, seed=1000 + b).model_copy(update={"max_new_tokens": room(args, w.spec) - 8})
        req = engine.reserve_handoff(f"{mode}-{int(sampled)}-{b}", prompt, [2], [0.0], params, ctx)
        assert req is not None, "pool too small for the benchmark"
        engine.activate_handoff(req, ctx, DraftState(
            bonus_token=2, committed_len=ctx, hidden=torch.zeros(w.draft.hidden_width, device=engine.device,
                                                                 dtype=w.dtype),
            topk_p=torch.full((k,), 1.0 / k, device=engine.device),
            topk_ids=torch.arange(3, 3 + k, dtype=torch.int64, device=engine.device)))
        reqs.append(req)
    return reqs


def time_mode(engine: Engine, batch: int, mode: str, sampled: bool, args) -> float:
    """Milliseconds of one decode step of ``batch`` requests of ``mode``, steps back to back as a serving
    loop runs them; the requests are aborted afterwards."""
    w = engine.speculator
    reqs = start_requests(engine, batch, mode, sampled, args)
    ms = timer_ms(lambda: w.decode_step(reqs), iters=args.iter_iters, warmup=args.iter_warmup, calls=args.iter_calls)
    assert all(r.finish_reason is None for r in reqs), "a request ran out of room while timed"
    for r in reqs:
        engine.abort(r.rid)
    w.drop_ahead()
    return ms


def bench_batch(target, draft, args, shape: str, batch: int) -> list[dict]:
    """Every mode, greedy and sampled, on one engine; rows with each mode's ratio to plain."""
    spec = SHAPES[shape]
    engine = Engine(target, draft, engine_config(args.prompt_len + room(args, spec), batch, spec=spec,
                                                 device=args.device, dtype=args.dtype))
    graphs = engine.capture_graphs()
    rows = []
    for sampled in (False, True):
        times = {mode: time_mode(engine, batch, mode, sampled, args) for mode in args.modes}
        for mode, ms in times.items():
            rows.append({"shape": shape, "batch": batch, "sampling": "sampled" if sampled else "greedy",
                         "mode": mode, "ms": ms, "over_plain": ms / times["plain"], "graphs_captured": graphs})
    assert engine.is_idle_and_clean()
    return rows


def build(args):
    if args.dry_run:
        tcfg, dtype = llama_hf_config(**PRESETS["tiny"]), torch.float32
    else:
        tcfg, dtype = llama8b_config(), torch.bfloat16
    target = build_target(args.device, dtype, tcfg)
    return target, build_draft("eagle3", target, args.device, dtype, tcfg)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--modes", default=",".join(MODES), help="plain is always timed (the ratios' base)")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--iter-iters", type=int, default=7, help="timed repetitions of the iteration")
    ap.add_argument("--iter-calls", type=int, default=10, help="decode steps per timed repetition")
    ap.add_argument("--iter-warmup", type=int, default=2, help="decode steps before the timed ones")
    ap.add_argument("--dry-run", action="store_true",
                    help="tiny model on the CPU, short prompts, few steps: checks the script, times nothing real")
    args = ap.parse_args(argv)
    args.device, args.dtype = ("cpu", "float32") if args.dry_run else ("cuda", "bfloat16")
    if args.dry_run:
        args.batches, args.prompt_len, args.iter_iters, args.iter_calls, args.iter_warmup = "1,2", 24, 1, 2, 1
    args.modes = ["plain"] + [m for m in args.modes.split(",") if m != "plain"]
    unknown = [m for m in args.modes if m not in MODES] + [s for s in args.shapes.split(",") if s not in SHAPES]
    if unknown:
        ap.error(f"unknown modes or shapes: {unknown}")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.dry_run:
        torch.set_num_threads(1)  # a tiny model: as fast on one thread, and steadier on a shared CPU
    torch.manual_seed(0)
    t0 = time.time()
    target, draft = build(args)
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    shapes = args.shapes.split(",")
    settings = {"device": device, "model": "tiny" if args.dry_run else "llama3-8b-shape", "dtype": args.dtype,
                "draft": "eagle3 (random weights)", "shapes": {s: SHAPES[s].model_dump() for s in shapes},
                "cuda_graph": True, "prompt_len": args.prompt_len,
                "modes": {m: MODES[m](True, 0).model_dump(exclude={"seed"}, exclude_defaults=True) for m in args.modes},
                "iter_iters": args.iter_iters, "iter_calls": args.iter_calls, "torch": torch.__version__}
    print("settings " + " ".join(f"{k}={v}" for k, v in settings.items()), flush=True)
    results = {"settings": settings, "iteration": []}
    for shape in shapes:
        for batch in [int(b) for b in args.batches.split(",")]:
            for row in bench_batch(target, draft, args, shape, batch):
                results["iteration"].append(row)
                print(f"{shape:5s} batch {batch:3d} {row['sampling']:7s} {row['mode']:10s} {row['ms']:8.3f} ms  "
                      f"x{row['over_plain']:.3f} plain (ceiling {CEILING})", flush=True)
            write_json(args.out, results)
    results["wall_s"] = time.time() - t0
    write_json(args.out, results)
    return results


if __name__ == "__main__":
    main()
