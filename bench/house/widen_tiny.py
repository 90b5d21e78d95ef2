"""The tiny trained pair (``models/tiny-pair``) widened to Llama-3.1-8B's shape, vocabulary included.

    python -m bench.house.widen_tiny --out /tmp/tiny-8b --device cuda     # on the GPU host, ~30 s
    python -m bench.house.widen_tiny --out /tmp/w --hidden 512 --layers 6 --intermediate 1024 \\
        --heads 4 --kv-heads 2 --vocab 4096 --dtype float32 --check 4     # a small widening on the CPU

The tiny pair (vocabulary 2048, 4 layers of 256) gives an 8B-shaped pair whose timing is the 8B shape's
and whose acceptance is a trained pair's. Two steps, both keeping what the pair computes:

1. vocabulary 2048 -> 128256 (``shared/training/widen.py``: ``pad_vocab_target``, ``pad_vocab_eagle3``):
   the new ids' embedding rows zero, their LM-head rows copies of the real id least likely on held-out
   text (``filler``). Greedy decoding is exact (a copy ties with the filler, and argmax takes the first
   maximum); the record says what zero rows would have cost (the share of held-out positions where every
   real logit is negative, where a new id would win) and how much probability the new ids take under
   sampling with either choice;
2. the shape (``widen_target``, ``widen_eagle3``): channels, heads and identity layers.

``OUT`` gets ``target/`` (config, sharded safetensors, the tokenizer padded to the vocabulary with
``<|pad_N|>`` tokens), ``eagle3/``, ``heldout.jsonl`` (the held-out packages' sources, what
``bench_serving.py --prompts-file`` draws real prompts from) and ``widen.json`` (the record). ``--check N``
then decodes N held-out prompts greedily with the small and the wide pair and compares tokens and accept
length (run it at a small shape: the engine at 8B shape on the CPU is slow).
"""

from __future__ import annotations

import argparse
import json
import shutil
import struct
import sys
import time
from pathlib import Path

import torch

from bench.house.tiny_pair import HELDOUT_PACKAGES
from bench.house.train_target import read_package
from bench.serving_model import pad_tokenizer, plan_shards
from shared.model.config import ModelConfig
from shared.model.llama import LlamaForCausalLM
from shared.model.loader import build_module, load_weights, read_state_dict
from shared.model.tokenizer import Tokenizer
from shared.training.dense import hidden_states
from shared.training.widen import (
    LLAMA31_8B,
    Shape,
    pad_vocab_eagle3,
    pad_vocab_target,
    widen_eagle3,
    widen_target,
)

ROOT = Path(__file__).resolve().parents[2]
LLAMA3_VOCAB = 128256
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
SAFETENSORS_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.int64: "I64",
                      torch.int32: "I32", torch.bool: "BOOL"}


def log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


# ---- held-out text -------------------------------------------------------------------------------
def heldout_texts(cap_bytes: int = 400_000) -> list[str]:
    """The sources of the tiny pair's held-out packages (standard library: the same on every machine of
    one Python version), up to ``cap_bytes`` each."""
    texts = []
    for name in HELDOUT_PACKAGES:
        texts += read_package(name, "heldout", cap_bytes)[1]
    if not texts:
        raise SystemExit(f"widen_tiny: none of the held-out packages {HELDOUT_PACKAGES} is importable")
    return texts


def heldout_windows(tok: Tokenizer, texts: list[str], count: int, length: int) -> torch.Tensor:
    """[count, length] token windows spread evenly over the held-out documents joined."""
    ids = [i for t in texts for i in tok.encode(t)]
    stream = torch.tensor(ids[:count * length * 4], dtype=torch.int64)
    starts = torch.linspace(0, stream.numel() - length, count).long()
    return torch.stack([stream[s:s + length] for s in starts])


# ---- the padded ids ------------------------------------------------------------------------------
def small_logits(target_dir: Path, windows: torch.Tensor) -> torch.Tensor:
    """[positions, vocab] float32 logits of the small target on ``windows`` (the dense forward, CPU)."""
    cfg = json.loads((target_dir / "config.json").read_text())
    model = build_module(LlamaForCausalLM, ModelConfig.from_hf_dict(cfg), torch.float32, torch.device("cpu"))
    load_weights(model, {k: v.float() for k, v in read_state_dict(target_dir).items()})
    with torch.no_grad():
        return model.lm_head(hidden_states(model, windows)).reshape(-1, cfg["vocab_size"]).float()


def pick_filler(logits: torch.Tensor) -> int:
    """The real id whose highest probability over the positions is lowest."""
    return int(torch.log_softmax(logits, dim=-1).max(dim=0).values.argmin())


def padding_exactness(logits: torch.Tensor, vocab_size: int, filler: int, temperatures=(1.0, 0.8)) -> dict:
    """What the new ids do at each position, with zero LM-head rows (logit 0) and with copies of ``filler``:
    how often one wins the argmax, and the probability they take together when sampling."""
    n_pad = vocab_size - logits.shape[1]
    top = logits.max(dim=1).values
    padded = torch.cat([logits[:64], logits[:64, filler:filler + 1].expand(-1, n_pad)], dim=1)
    out = {"positions": logits.shape[0], "new_ids": n_pad, "filler": filler,
           "zero_rows_greedy_wins": round(float((top < 0).float().mean()), 6),
           "copy_rows_greedy_wins": round(float((padded.argmax(dim=1) >= logits.shape[1]).float().mean()), 6),
           "copy_rows_checked_positions": padded.shape[0]}
    for t in temperatures:
        lse = torch.logsumexp(logits / t, dim=1)
        for name, pad_logit in (("zero_rows", torch.zeros_like(top)), ("copy_rows", logits[:, filler])):
            mass = torch.sigmoid(pad_logit / t + torch.log(torch.tensor(float(n_pad))) - lse)
            out[f"{name}_sampled_mass_t{t:g}"] = {"mean": float(mass.mean()), "max": float(mass.max())}
    return out


# ---- writing -------------------------------------------------------------------------------------
def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """A safetensors file whose all-zero tensors are holes: most of a widened model is zeros (identity
    layers, padding), and a sparse file skips writing them while reading them back as zeros."""
    header: dict = {"__metadata__": metadata}
    offset = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        header[name] = {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset,
                                                                                                       offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        base = f.tell()
        for name, t in tensors.items():
            if t.numel() and bool(t.any()):
                f.seek(base + header[name]["data_offsets"][0])
                f.write(t.contiguous().reshape(-1).view(torch.uint8).numpy().data)
        f.truncate(base + offset)


def write_sharded(out: Path, cfg: dict, state: dict[str, torch.Tensor], dtype: torch.dtype,
                  shard_bytes: int) -> int:
    """``model-0000k-of-0000n.safetensors`` and their index, as the public checkpoints; returns bytes written."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps({**cfg, "torch_dtype": str(dtype).removeprefix("torch.")},
                                                indent=1))
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    shards = plan_shards(shapes, torch.empty((), dtype=dtype).element_size(), shard_bytes)
    weight_map, total = {}, 0
    for k, names in enumerate(shards, 1):
        file = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        tensors = {n: state[n].contiguous() for n in names}
        write_safetensors(out / file, tensors, {"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update(dict.fromkeys(names, file))
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": weight_map}, indent=1))
    return total


def as_dtype(state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Floating tensors in the written dtype before widening (the norms' rescaling rounds in it)."""
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}


def widen_tiny(pair: Path, out: Path, shape: Shape, vocab_size: int, dtype: torch.dtype, shard_bytes: int,
               texts: list[str], windows: int = 32, window_len: int = 256) -> dict:
    t0 = time.perf_counter()
    small_t, small_h = pair / "target", pair / "eagle3"
    tcfg = json.loads((small_t / "config.json").read_text())
    hcfg = json.loads((small_h / "config.json").read_text())
    logits = small_logits(small_t, heldout_windows(Tokenizer(small_t), texts, windows, window_len))
    filler = pick_filler(logits)
    record = {"pair": str(pair), "shape": vars(shape), "vocab_size": vocab_size, "dtype": str(dtype),
              "padding": padding_exactness(logits, vocab_size, filler)}
    log(f"widen_tiny: filler id {filler}; zero rows would win {record['padding']['zero_rows_greedy_wins']:.2%} "
        f"of {logits.shape[0]} held-out argmaxes")
    t1 = time.perf_counter()
    state, cfg = pad_vocab_target(as_dtype(read_state_dict(small_t), dtype), tcfg, vocab_size, filler)
    wide, wcfg, plan = widen_target(state, cfg, shape)
    del state
    t2 = time.perf_counter()
    record["target_bytes"] = write_sharded(out / "target", wcfg, wide, dtype, shard_bytes)
    del wide
    t3 = time.perf_counter()
    record["phase_s"] = {"padding_check": round(t1 - t0, 2), "widen": round(t2 - t1, 2), "write": round(t3 - t2, 2)}
    log(f"widen_tiny: target widened in {t2 - t1:.1f} s, {record['target_bytes'] / 1e9:.1f} GB written in "
        f"{t3 - t2:.1f} s")
    for name in TOKENIZER_FILES:
        shutil.copy(small_t / name, out / "target" / name)
    pad_tokenizer(out / "target" / "tokenizer.json", vocab_size)
    hstate, hcfg2 = pad_vocab_eagle3(as_dtype(read_state_dict(small_h), dtype), hcfg, vocab_size)
    dstate, dcfg = widen_eagle3(hstate, hcfg2, tcfg, shape)
    write_sharded(out / "eagle3", dcfg, dstate, dtype, shard_bytes)
    with open(out / "heldout.jsonl", "w") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")
    record.update(target=str(out / "target"), draft=str(out / "eagle3"), prompts_file=str(out / "heldout.jsonl"),
                  layer_of=list(plan.layer_of), rms_norm_eps=wcfg["rms_norm_eps"],
                  aux_layer_ids=dcfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"],
                  seconds=round(time.perf_counter() - t0, 2))
    return record


def check_prompts(target_dir: Path, texts: list[str], count: int, length: int) -> list[list[int]]:
    return heldout_windows(Tokenizer(target_dir), texts, count, length).tolist()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pair", type=Path, default=ROOT / "models" / "tiny-pair", help="target/ and eagle3/")
    p.add_argument("--out", required=True, type=Path)
    for name, field in (("layers", "num_hidden_layers"), ("hidden", "hidden_size"),
                        ("intermediate", "intermediate_size"), ("heads", "num_attention_heads"),
                        ("kv-heads", "num_key_value_heads")):
        p.add_argument("--" + name, type=int, default=getattr(LLAMA31_8B, field), dest=field)
    p.add_argument("--vocab", type=int, default=LLAMA3_VOCAB)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--shard-gb", type=float, default=4.0)
    p.add_argument("--heldout-bytes", type=int, default=400_000, help="held-out text read per package")
    p.add_argument("--check", type=int, default=0, help="held-out prompts to compare the small and wide pair on")
    p.add_argument("--check-tokens", type=int, default=32, help="new tokens per prompt of --check")
    p.add_argument("--check-device", default="cpu")
    p.add_argument("--record", type=Path, help="also write the record here (default OUT/widen.json)")
    args = p.parse_args(argv)
    shape = Shape(args.num_hidden_layers, args.hidden_size, args.intermediate_size, args.num_attention_heads,
                  args.num_key_value_heads)
    texts = heldout_texts(args.heldout_bytes)
    record = widen_tiny(args.pair, args.out, shape, args.vocab, getattr(torch, args.dtype),
                        int(args.shard_gb * (1 << 30)), texts)
    if args.check:
        from bench.house.widen import check

        prompts = check_prompts(args.pair / "target", texts, args.check, 64)
        small, wide = (args.pair / "target", args.pair / "eagle3"), (args.out / "target", args.out / "eagle3")
        record["check"] = check(small, wide, prompts, steps=3, new_tokens=args.check_tokens, device=args.check_device,
                                dtype="float32")
    text = json.dumps(record, indent=1)
    (args.record or args.out / "widen.json").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
