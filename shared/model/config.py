"""Model configuration read from a Hugging Face ``config.json`` (Llama family)."""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict


class RopeConfig(BaseModel):
    model_config = ConfigDict(frozen=True)
    theta: float = 10000.0
    rope_type: str = "default"  # "default" or "llama3"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


class ModelConfig(BaseModel):
    """The shape of a Llama-family decoder, target or draft."""

    model_config = ConfigDict(frozen=True)
    architecture: str = "LlamaForCausalLM"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v (Qwen2 and Llama's attention_bias)
    o_proj_bias: bool = False  # Llama's attention_bias also puts one on o_proj; Qwen2 does not
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    # Draft-only fields (EAGLE / EAGLE-3 / multi-layer heads).
    draft_vocab_size: int | None = None
    fc_bias: bool = False
    target_hidden_size: int | None = None

    @classmethod
    def from_hf_dict(cls, cfg: dict) -> ModelConfig:
        heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        archs = cfg.get("architectures") or ["LlamaForCausalLM"]
        qwen2 = cfg.get("model_type") == "qwen2"
        bias = cfg.get("attention_bias", qwen2)
        return cls(
            architecture=archs[0],
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope=_rope_from_hf(cfg),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=bool(bias),
            o_proj_bias=bool(bias) and not qwen2,
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
            draft_vocab_size=cfg.get("draft_vocab_size"),
            fc_bias=cfg.get("bias", cfg.get("fc_bias", False)),
            target_hidden_size=cfg.get("target_hidden_size"),
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        with open(Path(path) / "config.json") as f:
            return cls.from_hf_dict(json.load(f))


def _rope_from_hf(cfg: dict) -> RopeConfig:
    # transformers >= 5 writes `rope_parameters`; older configs use rope_theta + rope_scaling.
    params = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or {}
    merged = {**scaling, **params}
    theta = merged.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise ValueError(f"config.json: rope type {rope_type!r} is not supported (default, llama3)")
    fields = {k: merged[k] for k in ("factor", "low_freq_factor", "high_freq_factor",
                                      "original_max_position_embeddings") if k in merged}
    return RopeConfig(theta=theta, rope_type=rope_type, **fields)
