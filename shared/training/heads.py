"""Draft heads to train, and their checkpoints in the public formats the engine (and SGLang) load.

A head is built from the engine's own modules (``shared.model.drafts``), unfused, in float32, on the
target it serves; it is written as ``config.json`` + ``model.safetensors``:

* ``eagle3``: ``LlamaForCausalLMEagle3`` with ``draft_vocab_size``, ``target_hidden_size``,
  ``eagle_config.eagle_aux_hidden_state_layer_ids`` (SGLang's convention) and ``d2t``/``t2d``; no
  embedding (the target's is shared).
* ``eagle``: ``LlamaForCausalLMEagle`` (``fc`` with a bias, ``layers.N``); the target's embedding and
  LM head are shared.
* ``mtp``: ``EyrieMultiLayerDraft``, one layer per draft step.
"""

from __future__ import annotations

from pathlib import Path

import torch

from shared.model.config import ModelConfig
from shared.model.drafts import DraftHead, Eagle3Draft, EagleDraft, MultiLayerDraft, capture_points
from shared.model.factory import draft_config, eagle3_layer_config, write_checkpoint
from shared.model.llama import LlamaForCausalLM, default_aux_layers
from shared.model.loader import build_module

ARCHITECTURES = {"eagle3": "LlamaForCausalLMEagle3", "eagle": "LlamaForCausalLMEagle", "mtp": "EyrieMultiLayerDraft"}
# What a head takes from its target's config.json beyond the shape draft_config copies.
INHERITED = ("rope_theta", "rope_scaling", "rope_parameters", "rms_norm_eps", "head_dim", "bos_token_id",
             "eos_token_id", "max_position_embeddings")


def head_config(kind: str, target_cfg: dict, num_layers: int, draft_vocab_size: int | None = None) -> dict:
    """The head's ``config.json``: the target's width, attention and rotary shape, ``num_layers``."""
    cfg = draft_config(target_cfg, ARCHITECTURES[kind], num_layers)
    cfg.update({k: target_cfg[k] for k in INHERITED if k in target_cfg})
    if kind == "eagle3":
        cfg.update(draft_vocab_size=draft_vocab_size or target_cfg["vocab_size"],
                   target_hidden_size=target_cfg["hidden_size"],
                   **eagle3_layer_config(target_cfg["num_hidden_layers"]))
    elif kind == "eagle":
        cfg["bias"] = True  # SafeAILab's default: the fc has a bias
    return cfg


def new_head(kind: str, cfg: dict, target: LlamaForCausalLM, device: torch.device) -> DraftHead:
    """An untrained head (the modules' own initialisation; norms at one), float32, unfused."""
    config = ModelConfig.from_hf_dict(cfg)
    if kind == "eagle3":
        aux = aux_layers_from(cfg, target)
        return build_module(Eagle3Draft, config, torch.float32, device, target, aux)
    cls = {"eagle": EagleDraft, "mtp": MultiLayerDraft}[kind]
    return build_module(cls, config, torch.float32, device, target)


def aux_layers_from(cfg: dict, target: LlamaForCausalLM) -> tuple[int, ...]:
    """The capture points the engine derives from this config (``capture_points``, or the default)."""
    n = target.config.num_hidden_layers
    ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return default_aux_layers(n) if ids is None else capture_points(ids, n)


def head_state(head: DraftHead, t2d: torch.Tensor | None, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The tensors of the head's checkpoint: its own parameters (the target's are shared, not saved),
    ``d2t`` and ``t2d`` for EAGLE-3."""
    state = {k: (v.to(dtype) if v.is_floating_point() else v).detach().cpu() for k, v in head.state_dict().items()}
    if isinstance(head, Eagle3Draft):
        state["t2d"] = t2d.cpu()
    return state


def write_head(out: Path, cfg: dict, head: DraftHead, t2d: torch.Tensor | None, dtype: torch.dtype) -> None:
    names = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
    write_checkpoint(out, {**cfg, "torch_dtype": names[dtype]}, head_state(head, t2d, dtype))
