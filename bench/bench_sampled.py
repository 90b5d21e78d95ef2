"""Sampled vs greedy speculative decoding: end-to-end throughput and the decode iteration.

Questions answered (one JSON):
  throughput  output tok/s of ``Engine.generate`` in-process (8B shape, bf16, EAGLE-3 head with random
              weights, chain of 5 steps, CUDA graphs, engine warmed), 512-token prompts, 256 new tokens
              each, at every batch: greedy vs temperature 0.8, and sampled / greedy (floor 0.9)
  iteration   one EAGLE-3 decode step (draft, verify + acceptance + extend graph, the next draft
              launched ahead) at batch 1 with a greedy vs a sampled request (ceiling 1.05)
Random weights accept nothing in either mode, so both do the same work per token: the difference is
verification alone. Greedy and sampled runs alternate on one engine per batch (the median of
``--repeats`` each), so drift in clocks hits both alike.

    python bench/bench_sampled.py --out docs/bench/sampled_h100.json
    python bench/bench_sampled.py --dry-run      # a tiny model on the CPU: checks the script end to end

Grammar mode (``--grammar``, its own function ``bench_grammar_iteration``): one EAGLE-3 decode step at
batches 1 and 32 (``--grammar-batches``), every request under a JSON schema (an object whose string field
stays open: the model writes inside it while timed) vs the same requests without one. With a schema the
step replays the verify and extend graphs with the masks applied eagerly between them, reads the tree
back and builds each node's mask on the host
(llguidance over a ``bench/grammar_vocab.py`` tokenizer of the model's vocabulary size).

    python bench/bench_sampled.py --grammar --out docs/bench/grammar_h100.json
    python bench/bench_sampled.py --grammar --dry-run
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import build_draft, build_target, engine_config, llama8b_config, write_json
from bench.grammar_vocab import write_tokenizer
from bench.timing import timer_ms
from shared.config import SpecConfig
from shared.engine import Engine
from shared.model.factory import PRESETS, llama_hf_config
from shared.model.tokenizer import Tokenizer
from shared.sampling import SamplingParams
from shared.spec.state import DraftState

SPEC = SpecConfig(topk=1, steps=5, num_draft_tokens=6)
TEMPERATURE = 0.8


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def mode_params(mode: str, new_tokens: int, seed: int) -> SamplingParams:
    temperature = TEMPERATURE if mode == "sampled" else 0.0
    return SamplingParams(temperature=temperature, seed=seed, max_new_tokens=new_tokens, ignore_eos=True)


def prompts_for(batch: int, length: int, vocab: int) -> list[list[int]]:
    """Distinct prompts (no prefix sharing to help or hurt), token ids away from the special ones."""
    return [[2 + (7 * i + 131 * b) % (vocab - 2) for i in range(length)] for b in range(batch)]


def generate_once(engine: Engine, prompts: list[list[int]], mode: str, new_tokens: int) -> dict:
    params = [mode_params(mode, new_tokens, seed=1000 + b) for b in range(len(prompts))]
    sync()
    t0 = time.perf_counter()
    results = engine.generate(prompts, params)
    sync()
    wall = time.perf_counter() - t0
    assert all(len(r.token_ids) == new_tokens for r in results), "a request stopped early"
    decode = max(r.latency_s - r.ttft_s for r in results)
    return {"wall_s": wall, "out_tok_s": len(prompts) * new_tokens / wall,
            "decode_tok_s": len(prompts) * (new_tokens - 1) / decode,
            "accept_length": statistics.mean(r.spec_stats["accept_length"] for r in results)}


def bench_throughput(target, draft, args, batch: int) -> dict:
    vocab = target.config.vocab_size
    engine = Engine(target, draft, engine_config(args.prompt_len + args.new_tokens, batch, spec=SPEC,
                                                 device=args.device, dtype=args.dtype))
    graphs = engine.capture_graphs()
    prompts = prompts_for(batch, args.prompt_len, vocab)
    for mode in ("greedy", "sampled"):  # warm: Triton compilation, allocator, the prefill shapes
        generate_once(engine, prompts, mode, min(8, args.new_tokens))
    runs = {"greedy": [], "sampled": []}
    for _ in range(args.repeats):
        for mode in runs:
            runs[mode].append(generate_once(engine, prompts, mode, args.new_tokens))
    assert engine.is_idle_and_clean()
    row = {"batch": batch, "graphs_captured": graphs}
    for mode, rs in runs.items():
        for key in ("out_tok_s", "decode_tok_s", "wall_s", "accept_length"):
            row[f"{mode}_{key}"] = statistics.median(r[key] for r in rs)
    row["sampled_over_greedy"] = row["sampled_out_tok_s"] / row["greedy_out_tok_s"]
    row["decode_sampled_over_greedy"] = row["sampled_decode_tok_s"] / row["greedy_decode_tok_s"]
    return row


def bench_iteration(target, draft, args) -> dict:
    """One request at ``prompt_len`` positions (its K/V reserved, values irrelevant to timing), decode
    steps back to back as a serving loop runs them, greedy and then sampled."""
    room = 24 + args.iter_calls * (args.iter_iters + 2) * (SPEC.steps + 1)
    engine = Engine(target, draft, engine_config(args.prompt_len + room, 1, spec=SPEC, device=args.device,
                                                 dtype=args.dtype))
    engine.capture_graphs()
    dev, w = engine.device, engine.speculator
    row = {"batch": 1, "context": args.prompt_len}
    for mode in ("greedy", "sampled"):
        ctx = args.prompt_len
        req = engine.reserve_handoff(f"it-{mode}", [1] * ctx, [2], [0.0], mode_params(mode, room - 8, seed=5), ctx)
        assert req is not None, "pool too small for the benchmark"
        engine.activate_handoff(req, ctx, DraftState(
            bonus_token=2, committed_len=ctx, hidden=torch.zeros(draft.hidden_width, device=dev, dtype=w.dtype),
            topk_p=torch.ones(1, device=dev), topk_ids=torch.zeros(1, dtype=torch.int64, device=dev)))
        row[f"{mode}_ms"] = timer_ms(lambda: w.decode_step([req]), iters=args.iter_iters, warmup=2,  # noqa: B023
                                     calls=args.iter_calls)
        assert req.finish_reason is None, "the request ran out of room while timed"
        engine.abort(req.rid)
        w.drop_ahead()
    row["sampled_over_greedy"] = row["sampled_ms"] / row["greedy_ms"]
    row["ahead_used"] = w.ahead.used
    return row


# A JSON object whose string field stays open for the whole timed run (minLength): the masks are those of
# free text inside a JSON string, for every tree node.
GRAMMAR_SCHEMA = ('{"type": "object", "properties": {"text": {"type": "string", "minLength": 4096}}, '
                  '"required": ["text"]}')
GRAMMAR_PREFIX = '{"text": "'  # the output the requests arrive with (inside the string)


def grammar_engine(target, draft, args, batch: int, room: int) -> Engine:
    """An engine with a tokenizer of the target's vocabulary size (written once to ``args.vocab_dir``)."""
    vocab_dir = Path(args.vocab_dir) / str(target.config.vocab_size)
    if not (vocab_dir / "tokenizer.json").exists():
        write_tokenizer(vocab_dir, target.config.vocab_size)
    return Engine(target, draft, engine_config(args.prompt_len + room, batch, spec=SPEC, device=args.device,
                                               dtype=args.dtype), tokenizer=Tokenizer(vocab_dir))


def bench_grammar_iteration(target, draft, args, batch: int) -> dict:
    """``batch`` requests at ``prompt_len`` positions inside a JSON string, decode steps back to back,
    without and then with the schema (same tokens arrived with, same positions)."""
    room = 24 + args.iter_calls * (args.iter_iters + 2) * (SPEC.steps + 1)
    engine = grammar_engine(target, draft, args, batch, room)
    engine.capture_graphs()
    dev, w = engine.device, engine.speculator
    prefix = engine.tokenizer.encode(GRAMMAR_PREFIX)
    ctx = args.prompt_len
    row = {"batch": batch, "context": ctx, "schema": GRAMMAR_SCHEMA}
    for mode in ("plain", "json"):
        params = SamplingParams(max_new_tokens=room - 8, ignore_eos=True,
                                json_schema=GRAMMAR_SCHEMA if mode == "json" else None)
        reqs = []
        for b in range(batch):
            req = engine.reserve_handoff(f"g-{mode}-{b}", [1] * (ctx - len(prefix) + 1), prefix, [0.0] * len(prefix),
                                         params, ctx)
            assert req is not None, "pool too small for the benchmark"
            engine.activate_handoff(req, ctx, DraftState(
                bonus_token=prefix[-1], committed_len=ctx,
                hidden=torch.zeros(draft.hidden_width, device=dev, dtype=w.dtype),
                topk_p=torch.ones(1, device=dev), topk_ids=torch.zeros(1, dtype=torch.int64, device=dev)))
            reqs.append(req)
        row[f"{mode}_ms"] = timer_ms(lambda: w.decode_step(reqs), iters=args.iter_iters, warmup=2,  # noqa: B023
                                     calls=args.iter_calls)
        assert all(r.finish_reason is None for r in reqs), "a request ended while timed"
        if mode == "json":
            row["json_output_sample"] = engine.tokenizer.decode(reqs[0].output_ids[:40])
        for r in reqs:
            engine.abort(r.rid)
        w.drop_ahead()
    assert engine.is_idle_and_clean()
    row["json_over_plain"] = row["json_ms"] / row["plain_ms"]
    return row


def run_grammar(target, draft, args, settings: dict) -> None:
    results = {"settings": {**settings, "mode": "grammar", "schema": GRAMMAR_SCHEMA}, "iteration": []}
    for batch in [int(b) for b in args.grammar_batches.split(",")]:
        row = bench_grammar_iteration(target, draft, args, batch)
        results["iteration"].append(row)
        print(f"grammar iteration bs={batch:3d} ctx={row['context']}  plain {row['plain_ms']:.3f} ms  json "
              f"{row['json_ms']:.3f} ms  json/plain {row['json_over_plain']:.3f}", flush=True)
        write_json(args.out, results)


def build(args):
    if args.dry_run:
        tcfg = llama_hf_config(**PRESETS["tiny"])
        dtype = torch.float32
    else:
        tcfg, dtype = llama8b_config(), torch.bfloat16
    target = build_target(args.device, dtype, tcfg)
    return target, build_draft("eagle3", target, args.device, dtype, tcfg)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--iter-iters", type=int, default=7, help="timed repetitions of the iteration")
    ap.add_argument("--iter-calls", type=int, default=10, help="decode steps per timed repetition")
    ap.add_argument("--grammar", action="store_true", help="the grammar mode only (JSON schema vs plain iteration)")
    ap.add_argument("--grammar-batches", default="1,32")
    ap.add_argument("--vocab-dir", default="/tmp/eyrie-grammar-vocab", help="where the benchmark tokenizer is kept")
    ap.add_argument("--dry-run", action="store_true",
                    help="tiny model on the CPU, short prompts and outputs: checks the script, times nothing real")
    args = ap.parse_args()
    args.device, args.dtype = ("cpu", "float32") if args.dry_run else ("cuda", "bfloat16")
    if args.dry_run:
        args.batches, args.prompt_len, args.new_tokens, args.repeats = "1,2", 24, 12, 1
        args.iter_iters, args.iter_calls, args.grammar_batches = 2, 2, "1,3"
    torch.manual_seed(0)
    t0 = time.time()
    target, draft = build(args)
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    settings = {"device": device, "model": "tiny" if args.dry_run else "llama3-8b-shape", "dtype": args.dtype,
                "draft": "eagle3 (random weights)", "spec": SPEC.model_dump(), "cuda_graph": True,
                "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "temperature": TEMPERATURE,
                "repeats": args.repeats, "torch": torch.__version__}
    print("settings " + " ".join(f"{k}={v}" for k, v in settings.items()), flush=True)
    if args.grammar:
        return run_grammar(target, draft, args, settings)
    results = {"settings": settings, "throughput": [], "iteration": None}
    for batch in [int(b) for b in args.batches.split(",")]:
        row = bench_throughput(target, draft, args, batch)
        results["throughput"].append(row)
        print(f"batch {batch:3d}  greedy {row['greedy_out_tok_s']:8.1f} tok/s  sampled {row['sampled_out_tok_s']:8.1f} "
              f"tok/s  sampled/greedy {row['sampled_over_greedy']:.3f} (floor 0.9; decode only "
              f"{row['decode_sampled_over_greedy']:.3f})  accept length {row['greedy_accept_length']:.2f} / "
              f"{row['sampled_accept_length']:.2f}", flush=True)
        write_json(args.out, results)
    it = bench_iteration(target, draft, args)
    results["iteration"] = it
    print(f"iteration bs=1 ctx={it['context']}  greedy {it['greedy_ms']:.3f} ms  sampled {it['sampled_ms']:.3f} ms  "
          f"sampled/greedy {it['sampled_over_greedy']:.3f} (ceiling 1.05)", flush=True)
    results["wall_s"] = time.time() - t0
    write_json(args.out, results)


if __name__ == "__main__":
    main()
