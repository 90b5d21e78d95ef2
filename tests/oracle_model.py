"""A tiny target and drafts that agree with it most of the time (tests only: acceptance well above zero)."""

from __future__ import annotations

from pathlib import Path

import torch

from shared.model.factory import (
    DRAFT_MTP_LAYERS,
    PRESETS,
    draft_config,
    eagle3_layer_config,
    llama_hf_config,
    random_llama_state,
    write_checkpoint,
)
from shared.model.tokenizer import build_tiny_tokenizer


def make_oracle_model(out_dir: str | Path, seed: int = 0, alpha: float = 0.2, **overrides) -> Path:
    """A target whose next token depends mostly on the current token, and drafts that know it.

    The target keeps every mechanism live (attention in every layer, all layers contributing), but
    attention outputs and layers 1.. are scaled by ``alpha``, so layer 0's MLP on the current token
    dominates. Each draft reproduces that map exactly from the token it is fed (EAGLE and MTP through
    their input projection, EAGLE-3 through a self-attending head), so drafts are accepted often,
    while the target's logits still depend on the whole context (KV mistakes change them).
    """
    out = Path(out_dir)
    tcfg = llama_hf_config(**{**PRESETS["tiny"], **overrides})
    gen = torch.Generator().manual_seed(seed)
    state = random_llama_state(tcfg, gen)
    h = tcfg["hidden_size"]
    emb = state["model.embed_tokens.weight"]
    state["model.embed_tokens.weight"] = emb / emb.pow(2).mean(-1, keepdim=True).sqrt()  # RMS 1: norm = id
    state["model.norm.weight"] = torch.ones(h)
    state["model.layers.0.input_layernorm.weight"] = torch.ones(h)
    for i in range(tcfg["num_hidden_layers"]):
        state[f"model.layers.{i}.self_attn.o_proj.weight"] *= alpha
        if i > 0:
            state[f"model.layers.{i}.mlp.down_proj.weight"] *= alpha
    write_checkpoint(out / "target", tcfg, state)
    build_tiny_tokenizer(out / "target", tcfg["vocab_size"])
    layer0 = {k.removeprefix("model.layers.0."): v for k, v in state.items() if k.startswith("model.layers.0.")}

    eye_fc = torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1)  # keep the token, drop the feature
    cfg = draft_config(tcfg, "LlamaForCausalLMEagle", 1, bias=True)
    eagle = {"fc.weight": eye_fc, "fc.bias": torch.zeros(h)}
    eagle.update({f"layers.0.{k}": v for k, v in layer0.items() if not k.startswith("input_layernorm")})
    write_checkpoint(out / "eagle", cfg, eagle)

    cfg = draft_config(tcfg, "EyrieMultiLayerDraft", DRAFT_MTP_LAYERS)
    mtp = {}
    for i in range(DRAFT_MTP_LAYERS):
        mtp.update({f"layers.{i}.{k}": v for k, v in layer0.items()})
        mtp.update({f"layers.{i}.enorm.weight": torch.ones(h), f"layers.{i}.hnorm.weight": torch.ones(h),
                    f"layers.{i}.eh_proj.weight": eye_fc, f"layers.{i}.norm.weight": torch.ones(h)})
    write_checkpoint(out / "mtp", cfg, mtp)

    # EAGLE-3: the residual stream starts from fc(features) = 0; one attention head per dimension
    # group that attends (almost) only to the current position copies the token's embedding in.
    heads = tcfg["num_attention_heads"]
    cfg = draft_config(tcfg, "LlamaForCausalLMEagle3", 1, num_key_value_heads=heads,
                       draft_vocab_size=tcfg["vocab_size"], target_hidden_size=h,
                       **eagle3_layer_config(tcfg["num_hidden_layers"]))
    big = 8.0
    qk = torch.cat([big * torch.eye(h), torch.zeros(h, h)], dim=1)
    e3 = {"fc.weight": torch.zeros(h, 3 * h), "norm.weight": torch.ones(h),
          "lm_head.weight": state["lm_head.weight"], "d2t": torch.zeros(tcfg["vocab_size"], dtype=torch.int64),
          "t2d": torch.ones(tcfg["vocab_size"], dtype=torch.bool),
          "midlayer.input_layernorm.weight": torch.ones(h), "midlayer.hidden_norm.weight": torch.ones(h),
          "midlayer.self_attn.q_proj.weight": qk, "midlayer.self_attn.k_proj.weight": qk,
          "midlayer.self_attn.v_proj.weight": torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1),
          "midlayer.self_attn.o_proj.weight": torch.eye(h),
          "midlayer.post_attention_layernorm.weight": layer0["post_attention_layernorm.weight"],
          "midlayer.mlp.gate_proj.weight": layer0["mlp.gate_proj.weight"],
          "midlayer.mlp.up_proj.weight": layer0["mlp.up_proj.weight"],
          "midlayer.mlp.down_proj.weight": layer0["mlp.down_proj.weight"]}
    write_checkpoint(out / "eagle3", cfg, e3)
    return out
