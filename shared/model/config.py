"""Model configuration read from a Hugging Face ``config.json``: the Llama family and its relatives.

One decoder covers every supported target architecture; what differs between them is a field here:
Qwen2's q/k/v bias, Llama's ``attention_bias`` / ``mlp_bias``, Qwen3's per-head q/k RMSNorm,
Mistral's (and Qwen's ``layer_types``) sliding window, and Gemma's embedding scale, ``1 + w`` norm
weights and GeGLU. An architecture outside ``TARGET_ARCHITECTURES`` is refused at load.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict


class CheckpointError(ValueError):
    """A checkpoint Eyrie cannot load: one line naming what is wrong (the CLI exits 2 with it)."""


# Target architectures (config.json ``architectures[0]``) and their family (HF ``model_type``).
TARGET_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "GemmaForCausalLM": "gemma",
}


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
    mlp_bias: bool = False  # bias on gate/up/down (Llama's mlp_bias)
    qk_norm: bool = False  # Qwen3: RMSNorm over each head's q and k (head_dim weights) before RoPE
    # Keys a query at position p sees: (p - sliding_window, p], on the layers in sliding_layers
    # (None: every layer). None: full causal attention.
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] | None = None
    hidden_act: str = "silu"  # the gated MLP's activation: "silu" (SwiGLU) or "gelu_tanh" (Gemma's GeGLU)
    embed_scale: float = 1.0  # Gemma multiplies the embeddings by sqrt(hidden_size)
    norm_weight_offset: float = 0.0  # Gemma's RMSNorm scales by (1 + w): folded into the weights at load
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
        family = TARGET_ARCHITECTURES.get(archs[0])
        qwen2 = family == "qwen2" or cfg.get("model_type") == "qwen2"
        # Qwen2's q/k/v always carry a bias (HF hard-codes it, whatever attention_bias says).
        bias = True if family == "qwen2" else cfg.get("attention_bias", qwen2)
        gemma = family == "gemma"
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
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=family == "qwen3",
            sliding_window=_sliding_window(cfg),
            sliding_layers=_sliding_layers(cfg),
            hidden_act=_activation(cfg, gemma),
            embed_scale=hidden ** 0.5 if gemma else 1.0,
            norm_weight_offset=1.0 if gemma else 0.0,
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
            draft_vocab_size=cfg.get("draft_vocab_size"),
            fc_bias=cfg.get("bias", cfg.get("fc_bias", False)),
            target_hidden_size=cfg.get("target_hidden_size"),
        )

    def window_of(self, layer: int) -> int:
        """The sliding window of target layer ``layer`` (0: full attention)."""
        if self.sliding_window is None:
            return 0
        if self.sliding_layers is not None and layer not in self.sliding_layers:
            return 0
        return self.sliding_window

    def check_tree_depth(self, steps: int) -> None:
        """A verify tree node at depth d sees its ancestors d positions back: they must lie in the window
        (the attention kernels apply the window to the prefix and take the tree from its mask)."""
        if self.sliding_window is not None and steps >= self.sliding_window:
            raise CheckpointError(f"speculative steps ({steps}) must be fewer than the target's sliding_window "
                                  f"({self.sliding_window})")

    def check_target(self, where: str | Path) -> None:
        """Refuse, in one line, a target whose architecture Eyrie does not implement."""
        if self.architecture not in TARGET_ARCHITECTURES:
            raise CheckpointError(f"{where}: architecture {self.architecture!r} is not supported "
                                  f"(supported: {', '.join(TARGET_ARCHITECTURES)})")

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
        raise CheckpointError(f"config.json: rope type {rope_type!r} is not supported (default, llama3)")
    fields = {k: merged[k] for k in ("factor", "low_freq_factor", "high_freq_factor",
                                      "original_max_position_embeddings") if k in merged}
    return RopeConfig(theta=theta, rope_type=rope_type, **fields)


def _sliding_window(cfg: dict) -> int | None:
    """Mistral's ``sliding_window``; Qwen's only when ``use_sliding_window`` (its configs carry a stale one)."""
    window = cfg.get("sliding_window")
    if window is None or not cfg.get("use_sliding_window", True):
        return None
    if not isinstance(window, int) or window < 1:
        raise CheckpointError(f"config.json: sliding_window must be a positive integer, got {window!r}")
    if window >= cfg.get("max_position_embeddings", 2048):
        return None  # never reached: full attention, no masking cost
    return window


def _sliding_layers(cfg: dict) -> tuple[int, ...] | None:
    """The layers ``layer_types`` marks "sliding_attention" (Qwen2 / Qwen3 above max_window_layers); None: all."""
    types = cfg.get("layer_types")
    if types is None:
        return None
    return tuple(i for i, t in enumerate(types) if t == "sliding_attention")


def _activation(cfg: dict, gemma: bool) -> str:
    act = cfg.get("hidden_act", cfg.get("hidden_activation")) or ("gelu_pytorch_tanh" if gemma else "silu")
    if gemma and act == "gelu":  # Gemma's released configs say "gelu" and mean the tanh approximation
        act = "gelu_pytorch_tanh"
    names = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
    if act not in names:
        raise CheckpointError(f"config.json: hidden_act {act!r} is not supported ({', '.join(names)})")
    return names[act]
