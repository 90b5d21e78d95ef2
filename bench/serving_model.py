"""A random-weight checkpoint on disk, as a new user's would be: sharded safetensors, ``config.json``, and a
byte-level BPE tokenizer padded to the model's vocabulary (Llama-3's 128256 ids for the 8B shape).

The padding ids are ordinary added tokens (``<|pad_N|>``), not special ones, so every id a random model
emits decodes to visible text: a streamed OpenAI chunk carries every token, and a load generator that counts
tokens by re-tokenising text sees each one.

    write_serving_model(out, "llama3-8b-shape", device="cuda", dtype=torch.bfloat16)  # ~16 GB, ~25 s on a GPU
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer

from shared.model.factory import (
    PRESETS,
    draft_config,
    eagle3_layer_config,
    eagle3_state,
    llama_hf_config,
    write_checkpoint,
)
from shared.model.tokenizer import build_tiny_tokenizer

SHARD_BYTES = 4 << 30  # as the public 8B checkpoints: a handful of ~4-5 GB shards
BPE_VOCAB = 8192  # trained ids before the padding (training a larger BPE on the offline text adds nothing)


def weight_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of a Llama checkpoint of ``cfg``, by its Hugging Face name, in file order."""
    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        shapes.update({f"{p}.input_layernorm.weight": (h,), f"{p}.self_attn.q_proj.weight": (q, h),
                       f"{p}.self_attn.k_proj.weight": (kv, h), f"{p}.self_attn.v_proj.weight": (kv, h),
                       f"{p}.self_attn.o_proj.weight": (h, q), f"{p}.post_attention_layernorm.weight": (h,),
                       f"{p}.mlp.gate_proj.weight": (inter, h), f"{p}.mlp.up_proj.weight": (inter, h),
                       f"{p}.mlp.down_proj.weight": (h, inter)})
    shapes["model.norm.weight"] = (h,)
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (v, h)
    return shapes


def random_tensor(shape: tuple[int, ...], device: str, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Norm weights near 1, matrices scaled by 1/sqrt(fan-in) (activations neither vanish nor saturate)."""
    if len(shape) == 1:
        return (1.0 + 0.1 * torch.randn(shape, device=device, generator=gen)).to(dtype)
    return (torch.randn(shape, device=device, generator=gen, dtype=dtype) / shape[1] ** 0.5).to(dtype)


def plan_shards(shapes: dict[str, tuple[int, ...]], element_size: int, shard_bytes: int) -> list[list[str]]:
    """Tensor names per shard, in order, each shard at most ``shard_bytes`` (or one tensor larger than that)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        nbytes = math.prod(shape) * element_size
        if size and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def write_sharded(out: Path, cfg: dict, device: str, dtype: torch.dtype, shard_bytes: int, seed: int) -> int:
    """Random weights of ``cfg`` made on ``device``, written shard by shard as
    ``model-0000k-of-0000n.safetensors`` plus ``model.safetensors.index.json``; returns the bytes written."""
    gen = torch.Generator(device=device).manual_seed(seed)
    shapes = weight_shapes(cfg)
    shards = plan_shards(shapes, torch.empty((), dtype=dtype).element_size(), shard_bytes)
    weight_map, total = {}, 0
    for k, names in enumerate(shards, 1):
        file = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        tensors = {name: random_tensor(shapes[name], device, dtype, gen).cpu() for name in names}
        save_file(tensors, str(out / file), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update(dict.fromkeys(names, file))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    return total


def write_padded_tokenizer(out: Path, vocab_size: int) -> None:
    """A BPE of up to ``BPE_VOCAB`` ids trained on offline text, padded with ordinary added tokens."""
    build_tiny_tokenizer(out, min(vocab_size, BPE_VOCAB))
    pad_tokenizer(out / "tokenizer.json", vocab_size)


def pad_tokenizer(path: Path, vocab_size: int) -> None:
    """Pad the tokenizer file at ``path`` to ``vocab_size`` ids with ordinary added tokens ``<|pad_N|>``."""
    tok = HFTokenizer.from_file(str(path))
    pad = vocab_size - tok.get_vocab_size()
    if pad > 0:
        tok.add_tokens([AddedToken(f"<|pad_{i}|>", special=False, normalized=False) for i in range(pad)])
        tok.save(str(path))
    assert tok.get_vocab_size() == vocab_size, (tok.get_vocab_size(), vocab_size)


def write_eagle3_head(out: Path, target_cfg: dict, dtype: torch.dtype, seed: int) -> None:
    """A random one-layer EAGLE-3 head for the target (draft vocabulary 32000 at most), in SpecForge's format."""
    cfg = draft_config(target_cfg, "LlamaForCausalLMEagle3", 1,
                       draft_vocab_size=min(32000, target_cfg["vocab_size"] // 2),
                       target_hidden_size=target_cfg["hidden_size"],
                       **eagle3_layer_config(target_cfg["num_hidden_layers"]))
    state = eagle3_state(cfg, torch.Generator().manual_seed(seed + 1), target_cfg["hidden_size"])
    write_checkpoint(out, cfg, {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()})


def write_serving_model(out_dir: str | Path, preset: str = "llama3-8b-shape", device: str = "cpu",
                        dtype: torch.dtype = torch.bfloat16, draft: bool = False, shard_bytes: int = SHARD_BYTES,
                        seed: int = 0, max_position_embeddings: int | None = None) -> dict:
    """``out_dir/target`` (and with ``draft``, ``out_dir/eagle3``); returns what was written and how long it took."""
    t0 = time.perf_counter()
    shape = dict(PRESETS[preset])
    if max_position_embeddings:
        shape["max_position_embeddings"] = max_position_embeddings
    cfg = llama_hf_config(**shape, rope_theta=500000.0, torch_dtype=str(dtype).removeprefix("torch."))
    target = Path(out_dir) / "target"
    target.mkdir(parents=True, exist_ok=True)
    (target / "config.json").write_text(json.dumps(cfg, indent=1))
    nbytes = write_sharded(target, cfg, device, dtype, shard_bytes, seed)
    if device.startswith("cuda"):
        torch.cuda.empty_cache()  # the services and the engine that follow need the device's memory
    write_padded_tokenizer(target, cfg["vocab_size"])
    written = {"target": str(target), "bytes": nbytes, "shards": len(list(target.glob("model-*.safetensors")))}
    if draft:
        write_eagle3_head(Path(out_dir) / "eagle3", cfg, dtype, seed)
        written["draft"] = str(Path(out_dir) / "eagle3")
    written["seconds"] = round(time.perf_counter() - t0, 2)
    return written
