"""``eyrie make-model``: random-weight checkpoints in standard Hugging Face formats.

Layout of OUT_DIR: ``target/`` (a Llama checkpoint ``transformers`` can load), and the draft heads
beside it (``eagle/``, ``eagle3/``, ``mtp/``), each a directory with ``config.json`` and
``model.safetensors``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from shared.model.llama import default_aux_layers
from shared.model.tokenizer import build_tiny_tokenizer

PRESETS = {
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096),
    "llama3-8b-shape": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                            num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                            max_position_embeddings=131072),
}


def llama_hf_config(vocab_size: int, hidden_size: int, intermediate_size: int, num_hidden_layers: int,
                    num_attention_heads: int, num_key_value_heads: int, max_position_embeddings: int,
                    tie_word_embeddings: bool = False, rope_theta: float = 10000.0,
                    rope_scaling: dict | None = None, architecture: str = "LlamaForCausalLM",
                    **extra) -> dict:
    rope = {"rope_type": "default", "rope_theta": rope_theta, **(rope_scaling or {})}
    return {
        "architectures": [architecture], "model_type": "llama",
        "vocab_size": vocab_size, "hidden_size": hidden_size, "intermediate_size": intermediate_size,
        "num_hidden_layers": num_hidden_layers, "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads, "head_dim": hidden_size // num_attention_heads,
        "hidden_act": "silu", "rms_norm_eps": 1e-6, "max_position_embeddings": max_position_embeddings,
        "rope_theta": rope_theta, "rope_parameters": rope, "tie_word_embeddings": tie_word_embeddings,
        "attention_bias": False, "mlp_bias": False, "bos_token_id": 0, "eos_token_id": 1,
        "torch_dtype": "float32", **extra,
    }


def decoder_layer_weights(cfg: dict, prefix: str, gen: torch.Generator, qkv_in: int | None = None,
                          input_norm: bool = True) -> dict[str, torch.Tensor]:
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    hd = cfg["head_dim"]
    q_out, kv_out = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    qkv_in = qkv_in or h
    w = {
        f"{prefix}.self_attn.q_proj.weight": _rand(gen, q_out, qkv_in),
        f"{prefix}.self_attn.k_proj.weight": _rand(gen, kv_out, qkv_in),
        f"{prefix}.self_attn.v_proj.weight": _rand(gen, kv_out, qkv_in),
        f"{prefix}.self_attn.o_proj.weight": _rand(gen, h, q_out),
        f"{prefix}.mlp.gate_proj.weight": _rand(gen, inter, h),
        f"{prefix}.mlp.up_proj.weight": _rand(gen, inter, h),
        f"{prefix}.mlp.down_proj.weight": _rand(gen, h, inter),
        f"{prefix}.post_attention_layernorm.weight": _norm_weight(gen, h),
    }
    if input_norm:
        w[f"{prefix}.input_layernorm.weight"] = _norm_weight(gen, h)
    return w


def random_llama_state(cfg: dict, gen: torch.Generator) -> dict[str, torch.Tensor]:
    state = {"model.embed_tokens.weight": torch.randn(cfg["vocab_size"], cfg["hidden_size"], generator=gen),
             "model.norm.weight": _norm_weight(gen, cfg["hidden_size"])}
    for i in range(cfg["num_hidden_layers"]):
        state.update(decoder_layer_weights(cfg, f"model.layers.{i}", gen))
    if not cfg["tie_word_embeddings"]:
        state["lm_head.weight"] = _rand(gen, cfg["vocab_size"], cfg["hidden_size"])
    return state


def write_checkpoint(out: Path, config: dict, state: dict[str, torch.Tensor]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "config.json", "w") as f:
        json.dump(config, f, indent=1)
    save_file({k: v.clone().contiguous() for k, v in state.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})


def make_tiny_target(out_dir: str | Path, seed: int = 0, **overrides) -> Path:
    out = Path(out_dir) / "target"
    cfg = llama_hf_config(**{**PRESETS["tiny"], **overrides})
    gen = torch.Generator().manual_seed(seed)
    write_checkpoint(out, cfg, random_llama_state(cfg, gen))
    build_tiny_tokenizer(out, cfg["vocab_size"])
    return out


def make_model(preset: str, out_dir: str | Path, seed: int = 0, fp8: str | None = None) -> Path:
    """Write the preset's target (and, where defined, its draft heads) under out_dir; ``fp8`` ("channel" or
    "block"): the target as an FP8 checkpoint of that format (``quantize_checkpoint``), the heads as they are."""
    if preset != "tiny":
        raise ValueError(f"preset: {preset!r} cannot be written to disk here (known: tiny)")
    target = make_tiny_target(out_dir, seed)
    write_random_drafts(target, Path(out_dir), seed)
    if fp8 is not None:
        quantize_checkpoint(target, fp8)
    return Path(out_dir)


FP8_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FP8_BLOCK = [128, 128]  # Qwen3's and DeepSeek-V3's weight_block_size


def fp8_quantization_config(kind: str, block: list[int] = FP8_BLOCK) -> dict:
    """``quantization_config`` as the FP8 checkpoints write it: compressed-tensors' (llm-compressor's
    FP8_DYNAMIC scheme, RedHatAI's ``*-FP8-dynamic``) or the block-wise ``fp8`` one (Qwen3-FP8, DeepSeek-V3)."""
    if kind == "block":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": block}
    if kind != "channel":
        raise ValueError(f"fp8: {kind!r} is not one of channel, block")
    weights = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False,
               "group_size": None, "block_structure": None, "observer": "minmax"}
    acts = {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True, "dynamic": True,
            "group_size": None, "block_structure": None, "observer": None}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts,
                                          "output_activations": None}},
            "ignore": ["lm_head"], "kv_cache_scheme": None}


def fp8_state(state: dict[str, torch.Tensor], kind: str, block: list[int] = FP8_BLOCK) -> dict[str, torch.Tensor]:
    """``state`` with every decoder-layer projection weight in FP8 beside its scale (``weight_scale`` [N, 1]
    for per-channel, ``weight_scale_inv`` [N/bn, K/bk] for blocks); everything else as it was."""
    from shared.model.fp8 import quantize

    out = {}
    for name, tensor in state.items():
        parts = name.split(".")
        if name.startswith("model.layers.") and parts[-2] in FP8_PROJECTIONS and parts[-1] == "weight":
            q, scale = quantize(tensor, kind, tuple(block))
            module = name.removesuffix(".weight")
            out[name] = q
            out[f"{module}.weight_scale" if kind == "channel" else f"{module}.weight_scale_inv"] = scale
        else:
            out[name] = tensor
    return out


def quantize_checkpoint(target_dir: Path, kind: str, block: list[int] = FP8_BLOCK) -> Path:
    """Rewrite the checkpoint in ``target_dir`` as an FP8 one of ``kind`` (its config gains the format's
    ``quantization_config``)."""
    from safetensors.torch import load_file

    with open(target_dir / "config.json") as f:
        cfg = json.load(f)
    cfg["quantization_config"] = fp8_quantization_config(kind, block)
    state = fp8_state(load_file(str(target_dir / "model.safetensors")), kind, block)
    write_checkpoint(target_dir, cfg, state)
    return target_dir


def _rand(gen: torch.Generator, rows: int, cols: int) -> torch.Tensor:
    # Scaled so that activations neither vanish nor saturate: random models then produce varied,
    # non-degenerate greedy continuations, which the losslessness tests need.
    return torch.randn(rows, cols, generator=gen) / cols ** 0.5


def _norm_weight(gen: torch.Generator, dim: int) -> torch.Tensor:
    return 1.0 + 0.1 * torch.randn(dim, generator=gen)


# ---- draft heads ---------------------------------------------------------------------------------
DRAFT_MTP_LAYERS = 5  # enough for steps <= 5


def draft_config(target_cfg: dict, architecture: str, num_layers: int, **extra) -> dict:
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
            "max_position_embeddings")
    cfg = llama_hf_config(**{k: target_cfg[k] for k in keys}, num_hidden_layers=num_layers,
                          architecture=architecture)
    cfg.update(extra)
    return cfg


def eagle3_layer_config(num_target_layers: int) -> dict:
    """``eagle_config`` of an EAGLE-3 head, as SpecForge writes it and SGLang reads it.

    SGLang's ids name the target layer whose OUTPUT is captured (it captures the input of layer
    id + 1), so the ids of Eyrie's (and SGLang's) default capture points, the inputs of layers
    2, L//2 and L-3, are one less: [1, 15, 28] for 32 layers. Targets too shallow for the default to
    be written this way (fewer than 3 layers) get no ids, and readers fall back to the same default.
    """
    ids = [p - 1 for p in default_aux_layers(num_target_layers)]
    if min(ids) < 0:
        return {}
    return {"eagle_config": {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True}}


def eagle_state(cfg: dict, gen: torch.Generator) -> dict[str, torch.Tensor]:
    h = cfg["hidden_size"]
    state = {"fc.weight": _rand(gen, h, 2 * h), "fc.bias": torch.zeros(h)}
    for i in range(cfg["num_hidden_layers"]):
        state.update(decoder_layer_weights(cfg, f"layers.{i}", gen, input_norm=i != 0))
    return state


def eagle3_state(cfg: dict, gen: torch.Generator, target_hidden: int) -> dict[str, torch.Tensor]:
    h, vd, v = cfg["hidden_size"], cfg["draft_vocab_size"], cfg["vocab_size"]
    state = decoder_layer_weights(cfg, "midlayer", gen, qkv_in=2 * h)
    state["midlayer.hidden_norm.weight"] = _norm_weight(gen, h)
    state.update({"fc.weight": _rand(gen, h, 3 * target_hidden), "norm.weight": _norm_weight(gen, h),
                  "lm_head.weight": _rand(gen, vd, h)})
    # The draft vocabulary: every other target token (a real head keeps the most frequent ones).
    hot = torch.arange(0, v, v // vd)[:vd]
    state["d2t"] = hot - torch.arange(vd)
    t2d = torch.zeros(v, dtype=torch.bool)
    t2d[hot] = True
    state["t2d"] = t2d
    return state


def mtp_state(cfg: dict, gen: torch.Generator) -> dict[str, torch.Tensor]:
    h = cfg["hidden_size"]
    state = {}
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}"
        state.update(decoder_layer_weights(cfg, p, gen))
        state.update({f"{p}.enorm.weight": _norm_weight(gen, h), f"{p}.hnorm.weight": _norm_weight(gen, h),
                      f"{p}.eh_proj.weight": _rand(gen, h, 2 * h), f"{p}.norm.weight": _norm_weight(gen, h)})
    return state


def write_random_drafts(target_dir: Path, out_dir: Path, seed: int = 0) -> None:
    with open(target_dir / "config.json") as f:
        tcfg = json.load(f)
    gen = torch.Generator().manual_seed(seed + 1)
    cfg = draft_config(tcfg, "LlamaForCausalLMEagle", 1, bias=True)
    write_checkpoint(out_dir / "eagle", cfg, eagle_state(cfg, gen))
    cfg = draft_config(tcfg, "LlamaForCausalLMEagle3", 1, draft_vocab_size=tcfg["vocab_size"] // 2,
                       target_hidden_size=tcfg["hidden_size"], **eagle3_layer_config(tcfg["num_hidden_layers"]))
    write_checkpoint(out_dir / "eagle3", cfg, eagle3_state(cfg, gen, tcfg["hidden_size"]))
    cfg = draft_config(tcfg, "EyrieMultiLayerDraft", DRAFT_MTP_LAYERS)
    write_checkpoint(out_dir / "mtp", cfg, mtp_state(cfg, gen))
