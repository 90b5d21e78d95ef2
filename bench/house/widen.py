"""Widen a trained pair (target + EAGLE-3 head) to Llama-3.1-8B's shape, keeping what it computes.

    python -m bench.house.widen --target /tmp/house --draft /tmp/house-eagle3 --out /tmp/house-8b

Writes ``OUT/target`` (config.json, model.safetensors, the tokenizer files) and ``OUT/eagle3``;
``--layers --hidden --intermediate --heads --kv-heads`` pick another shape. The method is in
``shared/training/widen.py``; ``--check N`` then decodes N held-out prompts greedily with both pairs
on ``--device`` and reports whether the outputs and accept lengths are equal.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from shared.model.factory import write_checkpoint
from shared.model.loader import read_state_dict
from shared.training.widen import LLAMA31_8B, Shape, widen_eagle3, widen_target

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def widen_pair(target: Path, draft: Path | None, out: Path, shape: Shape) -> dict:
    tcfg = json.loads((target / "config.json").read_text())
    state, wcfg, plan = widen_target(read_state_dict(target), tcfg, shape)
    write_checkpoint(out / "target", wcfg, state)
    del state
    for name in TOKENIZER_FILES:
        if (target / name).exists():
            shutil.copy(target / name, out / "target" / name)
    record = {"target": str(out / "target"), "shape": vars(shape), "layer_of": list(plan.layer_of),
              "rms_norm_eps": wcfg["rms_norm_eps"]}
    if draft is not None:
        dcfg = json.loads((draft / "config.json").read_text())
        dstate, dwcfg = widen_eagle3(read_state_dict(draft), dcfg, tcfg, shape)
        write_checkpoint(out / "eagle3", dwcfg, dstate)
        record.update(draft=str(out / "eagle3"),
                      aux_layer_ids=dwcfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
    return record


def check(small: tuple[Path, Path], wide: tuple[Path, Path], prompts: list[list[int]], steps: int, new_tokens: int,
          device: str, dtype: str) -> dict:
    """Greedy outputs and accept lengths of both pairs on the same prompts."""
    from shared.config import EngineConfig, SpecConfig
    from shared.engine import Engine
    from shared.sampling import SamplingParams

    config = EngineConfig(device=device, dtype=dtype, max_running=len(prompts),
                          max_context=max(map(len, prompts)) + new_tokens + 1, chunk_size=None,
                          spec=SpecConfig(topk=1, steps=steps, num_draft_tokens=steps + 1), spec_policy="fixed")
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    out = {}
    for name, (target, draft) in (("small", small), ("wide", wide)):
        engine = Engine(target, draft=draft, config=config)
        tokens = [r.token_ids for r in engine.generate(prompts, params)]
        out[name] = {"tokens": tokens, "accept_length": engine.spec_stats.totals.accept_length}
        del engine
    return {"outputs_equal": out["small"]["tokens"] == out["wide"]["tokens"],
            "accept_length_small": out["small"]["accept_length"], "accept_length_wide": out["wide"]["accept_length"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True, type=Path)
    p.add_argument("--draft", type=Path, help="the target's EAGLE-3 head")
    p.add_argument("--out", required=True, type=Path)
    for name, field in (("layers", "num_hidden_layers"), ("hidden", "hidden_size"),
                        ("intermediate", "intermediate_size"), ("heads", "num_attention_heads"),
                        ("kv-heads", "num_key_value_heads")):
        p.add_argument("--" + name, type=int, default=getattr(LLAMA31_8B, field), dest=field)
    p.add_argument("--check", type=int, default=0, help="held-out prompts to compare the pairs on")
    p.add_argument("--heldout", type=Path, help="JSONL of held-out documents (default TARGET/corpus/heldout.jsonl)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    args = p.parse_args(argv)
    shape = Shape(args.num_hidden_layers, args.hidden_size, args.intermediate_size, args.num_attention_heads,
                  args.num_key_value_heads)
    record = widen_pair(args.target, args.draft, args.out, shape)
    if args.check and args.draft is not None:
        from shared.model.tokenizer import Tokenizer

        heldout = args.heldout or args.target / "corpus" / "heldout.jsonl"
        tok = Tokenizer(args.target)
        texts = [json.loads(line)["text"] for line in heldout.read_text().splitlines()[:args.check]]
        prompts = [tok.encode(t)[:64] for t in texts]
        record["check"] = check((args.target, args.draft), (args.out / "target", args.out / "eagle3"), prompts,
                                steps=5, new_tokens=64, device=args.device, dtype=args.dtype)
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
