"""Issue 16's measurement of a trained pair: accept lengths, widening exactness, batch-1 speed at 8B shape.

    python -m bench.house.measure --target /tmp/house --draft /tmp/house-eagle3 --out measure.json --device cuda
    python -m bench.house.measure --random-pair --accept-from measure.json --out speed.json --device cuda

Stages, each skipped (and listed under ``skipped``) once ``--deadline-s`` would be passed:

1. ``acceptance``: the small pair on held-out prompts, for chains of 3, 5 and 7 drafts and trees of
   topk 4 with 8 and 16 verified tokens, greedy and at temperature 0.8 (accept length = committed tokens
   per verify, the engine's count).
2. ``exactness``: the pair widened in memory to ``--shape`` (``shared/training/widen.py``), greedy on
   ``--check`` held-out prompts in ``--check-dtype`` next to the small pair: equal tokens, accept lengths.
3. ``speed``: the widened pair at batch 1 in the warmed engine (CUDA graphs on CUDA): output tok/s of
   plain decoding and of each configuration, and ``speedup = accept_length x decode_step / iteration``
   (the decode step is plain decoding's time per token, the iteration one verify step's time), with the
   accept length a 2.5x speedup would need.
4. ``stack`` (``--stack-requests`` > 0): the widened pair written to disk and served as ``eyrie up`` serves
   it (router, prefill and decode, each its own process on the one device: ``bench/serving_stack.py``),
   without the head and with it (the configuration fastest in ``speed``, else chain5); ``--stack-requests``
   batch-1 requests of ``--speed-tokens`` over gRPC after one warm-up: end-to-end output tok/s through the
   services and the speedup. Each stack starts only when ``STACK_MIN_S`` remain before the deadline.

``--random-pair`` times a random pair of the house shape widened alike instead (no training: the cost of a
step does not depend on the weights) and takes the accept lengths of ``--accept-from`` (an earlier run's
JSON) for the speedups: the second call when one device call cannot hold training and timing.
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from shared.config import EngineConfig, SpecConfig
from shared.engine import Engine
from shared.model.config import ModelConfig
from shared.model.factory import write_checkpoint
from shared.model.layers import fuse_projections
from shared.model.llama import LlamaForCausalLM
from shared.model.loader import build_module, load_target, load_weights, parse_dtype, read_state_dict
from shared.sampling import SamplingParams
from shared.training.widen import LLAMA31_8B, Shape, widen_eagle3, widen_target


@dataclass(frozen=True)
class SpecShape:
    name: str
    topk: int
    steps: int
    num_draft_tokens: int

    def config(self) -> SpecConfig:
        return SpecConfig(topk=self.topk, steps=self.steps, num_draft_tokens=self.num_draft_tokens)


CONFIGS = (SpecShape("chain3", 1, 3, 4), SpecShape("chain5", 1, 5, 6), SpecShape("chain7", 1, 7, 8),
           SpecShape("tree_topk4_n8", 4, 5, 8), SpecShape("tree_topk4_n16", 4, 5, 16))
TEMPERATURES = (0.0, 0.8)
TARGET_SPEEDUP = 2.5
SHAPES = {"8b": LLAMA31_8B, "small": Shape(6, 256, 512, 2, 1)}  # small: the CPU form's


class Clock:
    """The stage deadline: ``left()`` seconds remain of ``budget_s`` from construction; ``stages`` holds
    each finished stage's wall seconds (``lap``)."""

    def __init__(self, budget_s: float | None):
        self.t0, self.budget_s = time.perf_counter(), budget_s
        self.stages: dict[str, float] = {}
        self._mark = self.t0

    def left(self) -> float:
        return float("inf") if self.budget_s is None else self.budget_s - (time.perf_counter() - self.t0)

    def lap(self, stage: str) -> None:
        """``stage`` ran from the previous lap (or the start) until now."""
        now = time.perf_counter()
        self.stages[f"{stage}_s"] = round(now - self._mark, 2)
        self._mark = now


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


# ---- prompts ----------------------------------------------------------------------------------------
def heldout_prompts(target_dir: Path, count: int, length: int) -> list[list[int]]:
    """The first ``length`` tokens of ``count`` held-out documents long enough to have them."""
    from shared.model.tokenizer import Tokenizer

    tok = Tokenizer(target_dir)
    prompts = []
    for line in (target_dir / "corpus" / "heldout.jsonl").read_text().splitlines():
        ids = tok.encode(json.loads(line)["text"])
        if len(ids) >= length:
            prompts.append(ids[:length])
        if len(prompts) == count:
            break
    if not prompts:
        raise SystemExit(f"measure: no held-out document of {length} tokens in {target_dir}/corpus/heldout.jsonl")
    return prompts


# ---- 1. acceptance ----------------------------------------------------------------------------------
def acceptance(target: LlamaForCausalLM, head_dir: Path, prompts: list[list[int]], new_tokens: int, device: str,
               dtype: str, clock: Clock, skipped: list[str]) -> list[dict]:
    rows = []
    for shape in CONFIGS:
        for temperature in TEMPERATURES:
            if clock.left() < 20:
                skipped.append(f"acceptance {shape.name} t={temperature}")
                continue
            config = EngineConfig(device=device, dtype=dtype, max_running=len(prompts), chunk_size=None,
                                  max_context=max(map(len, prompts)) + new_tokens + 32, spec=shape.config(),
                                  spec_policy="fixed")
            engine = Engine(target, draft=head_dir, config=config)
            params = [SamplingParams(max_new_tokens=new_tokens, ignore_eos=True, temperature=temperature, seed=i)
                      for i in range(len(prompts))]
            engine.generate(prompts, params)
            t = engine.spec_stats.totals
            rows.append({"config": shape.name, "topk": shape.topk, "steps": shape.steps,
                         "num_draft_tokens": shape.num_draft_tokens, "temperature": temperature,
                         "accept_length": round(t.accept_length, 4), "accept_rate": round(t.accept_rate, 4),
                         "verify_steps": t.verify_steps})
            log(f"measure: {shape.name} t={temperature}: accept length {rows[-1]['accept_length']}")
    return rows


# ---- 2. widening --------------------------------------------------------------------------------------
def module_from_state(cfg: dict, state: dict[str, torch.Tensor], dtype: str, device: str) -> LlamaForCausalLM:
    model = build_module(LlamaForCausalLM, ModelConfig.from_hf_dict(cfg), parse_dtype(dtype), torch.device(device))
    load_weights(model, state)
    return fuse_projections(model).eval()


@dataclass
class WidePair:
    state: dict[str, torch.Tensor]  # the wide target's tensors (the small checkpoint's dtype, CPU)
    config: dict  # its config.json
    head_dir: Path  # the wide EAGLE-3 head, written
    layer_of: list[int]


def widen(target_cfg: dict, target_state: dict, head_cfg: dict, head_state: dict, shape: Shape,
          work: Path) -> WidePair:
    state, wcfg, plan = widen_target(target_state, target_cfg, shape)
    dstate, dwcfg = widen_eagle3(head_state, head_cfg, target_cfg, shape)
    write_checkpoint(work / "eagle3-wide", dwcfg, dstate)
    return WidePair(state=state, config=wcfg, head_dir=work / "eagle3-wide", layer_of=list(plan.layer_of))


def greedy_pair(target, head_dir: Path, prompts: list[list[int]], new_tokens: int, device: str, dtype: str):
    config = EngineConfig(device=device, dtype=dtype, max_running=len(prompts), chunk_size=None,
                          max_context=max(map(len, prompts)) + new_tokens + 32, spec=CONFIGS[1].config(),
                          spec_policy="fixed")
    engine = Engine(target, draft=head_dir, config=config)
    tokens = [r.token_ids for r in engine.generate(prompts, SamplingParams(max_new_tokens=new_tokens,
                                                                          ignore_eos=True))]
    return tokens, round(engine.spec_stats.totals.accept_length, 4)


def exactness(small_dir: Path, small_head: Path, wide: WidePair, prompts: list[list[int]], new_tokens: int,
              device: str, dtype: str) -> dict:
    """Greedy tokens and accept length (chain of 5) of the small and the wide pair, both in ``dtype``."""
    small_tokens, small_len = greedy_pair(load_target(small_dir, dtype, device), small_head, prompts, new_tokens,
                                          device, dtype)
    model = module_from_state(wide.config, wide.state, dtype, device)
    wide_tokens, wide_len = greedy_pair(model, wide.head_dir, prompts, new_tokens, device, dtype)
    del model
    same = sum(a == b for a, b in zip(small_tokens, wide_tokens))
    return {"dtype": dtype, "prompts": len(prompts), "new_tokens": new_tokens, "outputs_equal": same == len(prompts),
            "prompts_equal": same, "accept_length_small": small_len, "accept_length_wide": wide_len}


# ---- 3. speed ---------------------------------------------------------------------------------------
def batch1_speed(model: LlamaForCausalLM, head_dir: Path | None, shape: SpecShape | None, prompts: list[list[int]],
                 new_tokens: int, device: str, dtype: str) -> dict:
    """Output tok/s at batch 1 in a warmed engine (graphs captured, one request run first)."""
    config = EngineConfig(device=device, dtype=dtype, max_running=1, chunk_size=None, cuda_graph=device != "cpu",
                          cuda_graph_max_bs=1, max_context=max(map(len, prompts)) + new_tokens + 32,
                          spec=None if shape is None else shape.config(), spec_policy="fixed")
    engine = Engine(model, draft=head_dir if shape is not None else None, config=config)
    engine.capture_graphs()
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    engine.generate(prompts[0], SamplingParams(max_new_tokens=min(new_tokens, 32), ignore_eos=True))
    before = engine.spec_stats.totals.verify_steps if shape is not None else 0
    sync(device)
    t0 = time.perf_counter()
    tokens = sum(len(engine.generate(p, params)[0].token_ids) for p in prompts)
    sync(device)
    seconds = time.perf_counter() - t0
    row = {"config": "plain" if shape is None else shape.name, "tokens": tokens, "seconds": round(seconds, 4),
           "tok_per_s": round(tokens / seconds, 2)}
    if shape is not None:
        iterations = engine.spec_stats.totals.verify_steps - before
        # Each request's first token comes from its prefill, every other from a verify.
        row.update(verify_steps=iterations, accept_length=round((tokens - len(prompts)) / iterations, 4),
                   iteration_s=round(seconds / iterations, 6))
    else:
        row["decode_step_s"] = round(seconds / tokens, 6)
    return row


def speedups(rows: list[dict], accept_from: dict[str, float] | None) -> list[dict]:
    """Each configuration's speedup over plain decoding: measured, and by the formula with the accept
    length measured here or taken from ``accept_from``; the accept length 2.5x would need."""
    plain = next(r for r in rows if r["config"] == "plain")
    out = []
    for r in rows:
        if r["config"] == "plain":
            continue
        accept = (accept_from or {}).get(r["config"], r["accept_length"])
        out.append({"config": r["config"], "measured": round(r["tok_per_s"] / plain["tok_per_s"], 4),
                    "accept_length": accept,
                    "formula": round(accept * plain["decode_step_s"] / r["iteration_s"], 4),
                    "accept_length_for_2.5x": round(TARGET_SPEEDUP * r["iteration_s"] / plain["decode_step_s"], 3)})
    return out


def speed(model: LlamaForCausalLM, head_dir: Path, prompts: list[list[int]], new_tokens: int, device: str,
          dtype: str, clock: Clock, skipped: list[str], accept_from: dict[str, float] | None) -> dict:
    rows = [batch1_speed(model, None, None, prompts, new_tokens, device, dtype)]
    log(f"measure: plain {rows[0]['tok_per_s']} tok/s")
    for shape in CONFIGS:
        if clock.left() < 30:
            skipped.append(f"speed {shape.name}")
            continue
        rows.append(batch1_speed(model, head_dir, shape, prompts, new_tokens, device, dtype))
        log(f"measure: {shape.name} {rows[-1]['tok_per_s']} tok/s, accept length {rows[-1]['accept_length']}")
    return {"rows": rows, "speedups": speedups(rows, accept_from)}


# ---- 4. the stack -------------------------------------------------------------------------------------
STACK_MIN_S = 45  # seconds one stack needs: two engines load the 8B shape and capture graphs, a few requests
STACK_WRITE_MIN_S = 2 * STACK_MIN_S + 15  # writing the wide target too (16 GB at the 8B shape)


def write_wide_target(wide: WidePair, small_dir: Path, work: Path) -> Path:
    """The wide target as a checkpoint the services load: its tensors, config and the small target's
    tokenizer; in shared memory when it has room (loading twice from there is faster than from disk)."""
    from safetensors.torch import save_file

    size = sum(t.numel() * t.element_size() for t in wide.state.values())
    shm = Path("/dev/shm")
    base = work
    if shm.is_dir() and shutil.disk_usage(shm).free > 2 * size:
        base = Path(tempfile.mkdtemp(prefix="house-wide-", dir=shm))
    out = base / "target-wide"
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(wide.config, indent=1))
    save_file({k: v.contiguous() for k, v in wide.state.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (small_dir / name).exists():
            shutil.copy(small_dir / name, out / name)
    return out


def serve_batch1(model_dir: Path, head_dir: Path | None, shape: SpecShape | None, prompts: list[list[int]],
                 new_tokens: int, device: str, dtype: str, clock: Clock, log_dir: Path) -> dict:
    """One stack (without a head when ``head_dir`` is None): one warm-up request, then ``prompts`` one at a
    time; the stack's output tok/s, TTFT and ITL as its gRPC client saw them."""
    from bench.serving_load import GrpcDriver, Point, RequestSpec, run_closed_loop, summarize
    from bench.serving_stack import ServingStack

    # max_running 32: the services' graphs are captured up to batch 32 (their default), the pools stay small.
    flags = {"device": device, "dtype": dtype, "cuda_graph": device.startswith("cuda"), "max_running": 32,
             "max_context": max(map(len, prompts)) + new_tokens + 32, "gpu_memory_fraction": 0.4}
    if shape is not None:
        flags.update(spec_topk=shape.topk, spec_steps=shape.steps, spec_draft_tokens=shape.num_draft_tokens)
    name = "plain" if shape is None else shape.name
    row: dict = {"config": name}
    t0 = time.perf_counter()
    stack = ServingStack(str(model_dir), None if head_dir is None else str(head_dir), flags, log_dir / name)
    try:
        stack.start(max(10.0, clock.left() - 15))
        row["startup_s"] = round(time.perf_counter() - t0, 2)
        driver = GrpcDriver(stack.grpc_address, timeout_s=max(10.0, clock.left() - 5))
        specs = [RequestSpec(list(p), new_tokens) for p in prompts]
        run_closed_loop(driver, specs[:1], 1, clock.left() - 10)  # warm-up: first-request paths, not timed
        records = run_closed_loop(driver, specs, 1, clock.left() - 10)
        point = Point("fixed", 1, len(specs), (len(prompts[0]), len(prompts[-1])), (new_tokens, new_tokens))
        got = summarize(point, records)
        row.update({k: got[k] for k in ("completed", "failed", "errors", "output_tokens", "duration_s")},
                   output_tok_s=round(got["output_tok_s"] or 0.0, 2),
                   ttft_p50_s=got["ttft_p50_s"], itl_p50_s=got["itl_p50_s"])
    except (RuntimeError, TimeoutError, OSError) as e:
        row["error"] = f"{type(e).__name__}: {e}"
    finally:
        row["exit_codes"] = stack.stop()
    log(f"measure: stack {name}: {row.get('output_tok_s')} tok/s {row.get('error', '')}")
    return row


def fastest_config(speed_record: dict | None) -> SpecShape:
    """The configuration with the most tok/s in the ``speed`` stage (chain5 when there was none)."""
    rows = [r for r in (speed_record or {}).get("rows", []) if r["config"] != "plain"]
    best = max(rows, key=lambda r: r["tok_per_s"])["config"] if rows else "chain5"
    return next(c for c in CONFIGS if c.name == best)


def stack(wide: WidePair, small_dir: Path, speed_record: dict | None, prompts: list[list[int]], new_tokens: int,
          device: str, dtype: str, clock: Clock, skipped: list[str], work: Path) -> dict:
    model_dir = write_wide_target(wide, small_dir, work)
    out: dict = {"model_dir": str(model_dir), "log_dir": str(work / "stack"), "rows": []}
    try:
        for shape in (None, fastest_config(speed_record)):
            name = "plain" if shape is None else shape.name
            if clock.left() < STACK_MIN_S:
                skipped.append(f"stack {name}")
                continue
            out["rows"].append(serve_batch1(model_dir, None if shape is None else wide.head_dir, shape, prompts,
                                            new_tokens, device, dtype, clock, work / "stack"))
    finally:
        if model_dir.parent != work:
            shutil.rmtree(model_dir.parent, ignore_errors=True)
    rate = {r["config"]: r.get("output_tok_s") for r in out["rows"] if not r.get("error") and not r.get("failed")}
    if len(rate) == 2 and rate.get("plain"):
        out["speedup"] = round(rate[out["rows"][1]["config"]] / rate["plain"], 4)
    return out


# ---- the random pair (timing only) ----------------------------------------------------------------------
def random_pair(work: Path, seed: int, tiny: bool) -> tuple[dict, dict, dict, dict]:
    """(target config, target state, head config, head state) of the house shape (``tiny``: the CPU form's),
    random: what a step costs does not depend on the weights."""
    from bench.house.train_target import TINY, HouseConfig, model_config
    from shared.training.corpus import vocab_maps
    from shared.training.dense import new_llama
    from shared.training.heads import head_config, head_state, new_head

    tcfg = model_config(HouseConfig(out=str(work), **({**TINY, "num_hidden_layers": 4} if tiny else {})))
    torch.manual_seed(seed)
    target = new_llama(ModelConfig.from_hf_dict(tcfg), torch.device("cpu"))
    vd = min(32000, tcfg["vocab_size"])
    hcfg = head_config("eagle3", tcfg, 1, vd)
    head = new_head("eagle3", hcfg, target, torch.device("cpu"))
    d2t, t2d = vocab_maps(torch.arange(vd), tcfg["vocab_size"])
    head.d2t.copy_(d2t)
    dtype = torch.bfloat16
    tstate = {k: v.detach().to(dtype) for k, v in target.state_dict().items()}
    return tcfg, tstate, hcfg, head_state(head, t2d, dtype)


# ---- the run ------------------------------------------------------------------------------------------
def run(args) -> dict:
    clock, skipped = Clock(args.deadline_s), []
    work = Path(tempfile.mkdtemp(prefix="house-measure-"))
    shape = SHAPES[args.shape]
    record = {"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
              "torch": torch.__version__, "settings": {k: str(v) for k, v in vars(args).items()},
              "shape": vars(shape), "skipped": skipped}
    accept_from = None
    record["stages"] = clock.stages
    if args.random_pair:
        tcfg, tstate, hcfg, hstate = random_pair(work, args.seed, tiny=args.shape == "small")
        prompts = [list(range(10 + i, 10 + i + args.prompt_len)) for i in range(args.speed_prompts)]
        if args.accept_from:
            rows = json.loads(Path(args.accept_from).read_text())["acceptance"]
            accept_from = {r["config"]: r["accept_length"] for r in rows if r["temperature"] == 0.0}
    else:
        tcfg = json.loads((args.target / "config.json").read_text())
        hcfg = json.loads((args.draft / "config.json").read_text())
        prompts = heldout_prompts(args.target, args.prompts, args.prompt_len)
        small = load_target(args.target, args.dtype, args.device)
        clock.lap("load")
        record["acceptance"] = acceptance(small, args.draft, prompts, args.new_tokens, args.device, args.dtype,
                                          clock, skipped)
        del small
        clock.lap("acceptance")
        tstate, hstate = read_state_dict(args.target), read_state_dict(args.draft)
    t0 = time.perf_counter()
    wide = widen(tcfg, tstate, hcfg, hstate, shape, work)
    record["widen"] = {"seconds": round(time.perf_counter() - t0, 2), "layer_of": wide.layer_of,
                       "rms_norm_eps": wide.config["rms_norm_eps"]}
    clock.lap("widen")
    if not args.random_pair and args.check and clock.left() > 90:
        record["exactness"] = exactness(args.target, args.draft, wide, prompts[:args.check], args.check_tokens,
                                        args.device, args.check_dtype)
        log(f"measure: widened pair equal to the small one: {record['exactness']['outputs_equal']}")
        clock.lap("exactness")
    elif args.check and not args.random_pair:
        skipped.append("exactness")
    if clock.left() > 60:
        model = module_from_state(wide.config, wide.state, args.dtype, args.device)
        record["speed"] = speed(model, wide.head_dir, prompts[:args.speed_prompts], args.speed_tokens, args.device,
                                args.dtype, clock, skipped, accept_from)
        del model
        clock.lap("speed")
    else:
        skipped.append("speed")
    if args.stack_requests and not args.random_pair:
        if clock.left() > STACK_WRITE_MIN_S:
            save(record, args.out)  # what is measured so far stays, whatever happens to the services
            gc.collect()  # the speed stage's engines (their graphs' pools): the services need that memory
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
            try:
                record["stack"] = stack(wide, args.target, record.get("speed"), prompts[:args.stack_requests],
                                        args.speed_tokens, args.device, args.dtype, clock, skipped, work)
            except Exception as e:  # noqa: BLE001 (the last, optional stage: its failure is recorded, not fatal)
                record["stack"] = {"error": f"{type(e).__name__}: {e}"}
            clock.lap("stack")
        else:
            skipped.append("stack")
    record["seconds"] = round(time.perf_counter() - clock.t0, 1)
    return record


def parse(argv: list[str] | None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", type=Path, help="the small target (with corpus/heldout.jsonl)")
    p.add_argument("--draft", type=Path, help="its EAGLE-3 head")
    p.add_argument("--random-pair", action="store_true", help="time a random pair of the house shape instead")
    p.add_argument("--accept-from", help="an earlier run's JSON: its greedy accept lengths for the speedups")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--shape", default="8b", choices=sorted(SHAPES))
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--prompts", type=int, default=16, help="held-out prompts of the acceptance stage")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--check", type=int, default=4, help="prompts of the exactness stage (0: skip it)")
    p.add_argument("--check-tokens", type=int, default=64)
    p.add_argument("--check-dtype", default="float32")
    p.add_argument("--speed-prompts", type=int, default=4)
    p.add_argument("--speed-tokens", type=int, default=256)
    p.add_argument("--stack-requests", type=int, default=0,
                   help="batch-1 requests through the served stack, without and with the head (0: no stack stage)")
    p.add_argument("--deadline-s", type=float, help="skip the stages that would start after this many seconds")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if not args.random_pair and (args.target is None or args.draft is None):
        p.error("--target and --draft are needed (or --random-pair)")
    return args


def save(record: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1))


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    record = run(args)
    save(record, args.out)
    print(json.dumps({k: record[k] for k in ("device", "skipped", "seconds") if k in record}
                     | {"speedups": record.get("speed", {}).get("speedups")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
