"""The tiny trained pair: a Llama target of a few MB with a real BPE tokenizer, and its EAGLE-3 head.

    python -m bench.house.tiny_pair --out $OUT          # on a GPU, about 3 minutes: what models/tiny-pair holds
    python -m bench.house.tiny_pair --out /tmp/tp --smoke  # the same pipeline on the CPU in seconds (the test)

The house pipeline at a small size: the target by ``bench.house.train_target`` (Python sources of the
standard library and a few pure-Python packages, whole packages held out; a byte-level BPE of 2048
ids; 4 layers of 256), the head by ``eyrie train-draft`` (online features, the unrolled objective,
windows ending in the target's own greedy continuation). Then, on the CPU in float32 (what
``eyrie up --demo`` runs): accept length on held-out prompts for chains of 3 and 5 and a tree, greedy,
and the demo prompt's completion.

``OUT`` gets ``tiny-pair.tar`` (``target/`` and ``eagle3/``: checkpoint, config and tokenizer files,
plus ``tiny_pair.json``; unpack it into ``models/tiny-pair/``) and ``tiny_pair.json``, the training
record: packages and versions, settings, commands, loss curve, held-out perplexity, the head's
acceptance curve, the CPU accept lengths and samples.
"""

from __future__ import annotations

import argparse
import json
import sys
import tarfile
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch

from bench.house.train_target import EOS, TINY, HouseConfig, build_house, chat_renderer

DEMO_PROMPT = "def fibonacci(n):"
# Standard-library packages present in every CPython (the same files on the CPU and the GPU machine for
# one Python version), then pure-Python packages of the GPU image; held out: whole packages.
TRAIN_PACKAGES = ("asyncio", "email", "json", "importlib", "unittest", "concurrent", "xml", "multiprocessing",
                  "collections", "urllib", "argparse", "pathlib", "typing", "dataclasses", "functools", "inspect",
                  "enum", "ast", "textwrap", "string", "shutil", "subprocess", "tarfile", "zipfile", "threading",
                  "socket", "pickle", "difflib", "tokenize", "pdb", "re", "ctypes", "tomllib", "sqlite3", "wsgiref",
                  "idlelib", "test", "setuptools", "pip", "networkx")
HELDOUT_PACKAGES = ("http", "logging", "csv", "shlex", "configparser")

TARGET = dict(train_packages=TRAIN_PACKAGES, heldout_packages=HELDOUT_PACKAGES, bpe_vocab=2048, vocab_size=2048,
              tokenizer_sample_bytes=24_000_000, hidden_size=256, intermediate_size=640, num_hidden_layers=4,
              num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096, seq_len=256, batch=64,
              steps=100_000, time_budget_s=90.0, lr=3e-3, warmup=100, eval_every=1000, eval_windows=64,
              log_every=100, sample_tokens=48, device="cuda", dtype="bfloat16")
HEAD = dict(steps=1500, lr=1e-3, batch_tokens=16384, seq_len=256, ttt_steps=7, eval_every=500, eval_prompts=16,
            eval_prompt_len=64, eval_new_tokens=64, regenerate=64, max_windows=8192, log_every=50, warmup=50,
            device="cuda", dtype="bfloat16", progress=False)
SMOKE_TARGET = {**TINY, "max_position_embeddings": 1024}
SMOKE_HEAD = dict(steps=30, lr=3e-3, batch_tokens=512, seq_len=64, ttt_steps=3, eval_every=0, eval_prompts=2,
                  eval_prompt_len=16, eval_new_tokens=8, regenerate=8, max_windows=32, log_every=10, warmup=5,
                  device="cpu", dtype="float32", progress=False)
# The CPU measurement: (name, topk, steps, verified tokens) greedy on held-out prompts.
CPU_CONFIGS = (("chain3", 1, 3, 4), ("chain5", 1, 5, 6), ("tree_topk4_n8", 4, 4, 8))
PAIR_FILES = {"target": ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"),
              "eagle3": ("config.json", "model.safetensors")}


def log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def heldout_stream(target_dir: Path, max_docs: int = 64) -> torch.Tensor:
    """The held-out packages' documents, tokenized and joined (EOS between documents)."""
    from shared.model.tokenizer import Tokenizer

    tok = Tokenizer(target_dir)
    lines = (target_dir / "corpus" / "heldout.jsonl").read_text().splitlines()[:max_docs]
    ids, eos = [], tok.token_id(EOS)
    for line in lines:
        ids += tok.encode(json.loads(line)["text"]) + [eos]
    return torch.tensor(ids, dtype=torch.int64)


def cpu_acceptance(target_dir: Path, head_dir: Path, prompts: int, prompt_len: int, new_tokens: int) -> dict:
    """Accept length of each CPU configuration on held-out prompts (float32, greedy), and whether every
    configuration's output is the same (verification is lossless)."""
    from shared.config import EngineConfig, SpecConfig
    from shared.engine import Engine
    from shared.model.loader import load_target
    from shared.sampling import SamplingParams
    from shared.training.evaluate import heldout_prompts

    target = load_target(target_dir, "float32", "cpu")
    chosen = heldout_prompts(heldout_stream(target_dir), prompts, prompt_len)
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    out, outputs = {}, []
    for name, topk, steps, n in CPU_CONFIGS:
        config = EngineConfig(max_running=len(chosen), max_context=prompt_len + new_tokens + 16, chunk_size=None,
                              spec=SpecConfig(topk=topk, steps=steps, num_draft_tokens=n), spec_policy="fixed")
        engine = Engine(target, draft=head_dir, config=config)
        outputs.append([r.token_ids for r in engine.generate(chosen, params)])
        totals = engine.spec_stats.totals
        out[name] = {"topk": topk, "steps": steps, "num_draft_tokens": n,
                     "accept_length": round(totals.accept_length, 4), "accept_rate": round(totals.accept_rate, 4),
                     "verify_steps": totals.verify_steps}
    out["prompts"], out["prompt_len"], out["new_tokens"] = len(chosen), prompt_len, new_tokens
    out["outputs_equal"] = all(o == outputs[0] for o in outputs)
    return out


def demo(target_dir: Path, head_dir: Path, new_tokens: int) -> dict:
    """What ``eyrie generate --prompt DEMO_PROMPT`` prints with the pair (CPU, float32, chain of 3)."""
    from shared.config import EngineConfig, SpecConfig
    from shared.engine import Engine
    from shared.sampling import SamplingParams

    config = EngineConfig(max_running=1, max_context=256, spec=SpecConfig(topk=1, steps=3, num_draft_tokens=4),
                          spec_policy="fixed")
    engine = Engine(target_dir, draft=head_dir, config=config)
    r = engine.generate(DEMO_PROMPT, SamplingParams(max_new_tokens=new_tokens))[0]
    return {"prompt": DEMO_PROMPT, "completion": r.text, "accept_length": round(engine.spec_stats.totals.accept_length,
                                                                                 4)}


def pack(out: Path, work: Path, record: dict) -> Path:
    """``out/tiny-pair.tar``: the pair's files under target/ and eagle3/, and the record."""
    (work / "tiny_pair.json").write_text(json.dumps(record, indent=1))
    tar = out / "tiny-pair.tar"
    with tarfile.open(tar, "w") as t:
        for sub, names in PAIR_FILES.items():
            for name in names:
                t.add(work / sub / name, arcname=f"{sub}/{name}")
        t.add(work / "tiny_pair.json", arcname="tiny_pair.json")
    return tar


def abridged(curve: list[dict], points: int = 60) -> list[dict]:
    every = max(1, len(curve) // points)
    return curve[::every] + ([curve[-1]] if curve and (len(curve) - 1) % every else [])


def build_pair(out: Path, work: Path, smoke: bool, target_overrides: dict, head_overrides: dict,
               cpu_prompts: int, cpu_new_tokens: int) -> dict:
    from shared.training.trainer import TrainConfig, train_draft

    t0 = time.perf_counter()
    house_cfg = HouseConfig(out=str(work / "target"), **{**(SMOKE_TARGET if smoke else TARGET), **target_overrides})
    house = build_house(house_cfg, log=log)
    log(f"tiny-pair: target trained in {house['train']['seconds']} s, held-out perplexity "
        f"{house['train']['heldout_perplexity']}")
    head_cfg = TrainConfig(target=str(work / "target"), corpus=[str(work / "target" / "corpus" / "train.jsonl")],
                           out=str(work / "eagle3"), kind="eagle3", **{**(SMOKE_HEAD if smoke else HEAD),
                                                                        **head_overrides})
    head = train_draft(head_cfg, chat_renderer(work / "target"))  # chat records rendered as the router does
    log(f"tiny-pair: head trained in {head['seconds']} s, accept length {head['evals'][-1]['accept_length']}")
    prompt_len = 16 if smoke else 64
    cpu = cpu_acceptance(work / "target", work / "eagle3", cpu_prompts, prompt_len, cpu_new_tokens)
    log("tiny-pair: CPU accept length " + ", ".join(f"{n} {cpu[n]['accept_length']}" for n, *_ in CPU_CONFIGS))
    shown = demo(work / "target", work / "eagle3", cpu_new_tokens)
    log(f"tiny-pair: demo {shown['prompt']!r} -> {shown['completion']!r}")
    record = {
        "command": [sys.executable, "-m", "bench.house.tiny_pair", *sys.argv[1:]],
        "device": torch.cuda.get_device_name() if house_cfg.device.startswith("cuda") else "cpu",
        "python": sys.version.split()[0], "torch": torch.__version__,
        "corpus": {"packages": house["packages"], "missing_packages": house["missing_packages"],
                   "tokenizer": house["tokenizer"]},
        "target": {"model": house["model"], "parameters": house["parameters"],
                   "train": {**{k: v for k, v in house["train"].items() if k != "loss_curve"},
                             "loss_curve": abridged(house["train"]["loss_curve"])},
                   "samples": house["samples"], "settings": asdict(house_cfg)},
        "head": {k: head[k] for k in ("steps", "seconds", "draft_vocab_size", "train_tokens", "heldout_tokens",
                                      "evals", "settings")},
        "cpu_acceptance": cpu, "demo": shown,
    }
    record["files"] = {f"{sub}/{name}": (work / sub / name).stat().st_size
                       for sub, names in PAIR_FILES.items() for name in names}
    record["seconds"] = round(time.perf_counter() - t0, 1)
    out.mkdir(parents=True, exist_ok=True)
    pack(out, work, record)
    (out / "tiny_pair.json").write_text(json.dumps(record, indent=1))
    return record


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, type=Path, help="where tiny-pair.tar and tiny_pair.json go")
    p.add_argument("--work", type=Path, help="scratch directory (default: a new temporary one)")
    p.add_argument("--smoke", action="store_true", help="the CPU form: tiny shapes, seconds")
    p.add_argument("--target-seconds", type=float, help="the target's training time budget (GPU default 90)")
    p.add_argument("--head-steps", type=int, help="the head's training steps (GPU default 1500)")
    p.add_argument("--device", help="cuda (default) or cpu")
    p.add_argument("--cpu-prompts", type=int, default=16)
    p.add_argument("--cpu-new-tokens", type=int, default=48)
    args = p.parse_args(argv)
    target, head = {}, {}
    if args.target_seconds is not None:
        target["time_budget_s"] = args.target_seconds
    if args.head_steps is not None:
        head["steps"] = args.head_steps
    if args.device is not None:
        target["device"] = head["device"] = args.device
    work = args.work or Path(tempfile.mkdtemp(prefix="tiny-pair-"))
    record = build_pair(args.out, work, args.smoke, target, head, args.cpu_prompts, args.cpu_new_tokens)
    print(json.dumps({"out": str(args.out), "seconds": record["seconds"], "device": record["device"],
                      "heldout_perplexity": record["target"]["train"]["heldout_perplexity"],
                      "cpu_acceptance": record["cpu_acceptance"], "demo": record["demo"], "files": record["files"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
