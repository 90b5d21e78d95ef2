"""A dense, differentiable forward of the engine's Llama module, for training a target from scratch.

The parameters are those of ``shared.model.llama.LlamaForCausalLM`` built unfused (their names are
Hugging Face's, so the state dict is the checkpoint); the forward is causal attention over whole
windows (``scaled_dot_product_attention``) instead of the paged cache. A model trained here and
written with ``write_checkpoint`` is loaded by the engine like any Llama checkpoint; the tests hold
the engine's logits to this forward's.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kernels.norm_rope import apply_rope_ref, rms_norm_ref
from shared.model.config import ModelConfig
from shared.model.layers import Attention, DecoderLayer
from shared.model.llama import LlamaForCausalLM
from shared.model.loader import build_module


def new_llama(config: ModelConfig, device: torch.device, std: float = 0.02) -> LlamaForCausalLM:
    """A float32, unfused Llama with GPT-2-style initialisation: N(0, std), the projections into the
    residual stream scaled by 1/sqrt(2 * layers), norms at one."""
    model = build_module(LlamaForCausalLM, config, torch.float32, device)
    out_std = std / math.sqrt(2 * config.num_hidden_layers)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, out_std if name.endswith(("o_proj.weight", "down_proj.weight")) else std)
    return model


def attention(attn: Attention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    B, T, _ = x.shape
    q = attn.q_proj(x).view(B * T, attn.num_heads, attn.head_dim)
    k = attn.k_proj(x).view(B * T, attn.num_kv_heads, attn.head_dim)
    v = attn.v_proj(x).view(B, T, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
    q, k = apply_rope_ref(q, k, cos, sin)
    q = q.view(B, T, attn.num_heads, attn.head_dim).transpose(1, 2)
    k = k.view(B, T, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=attn.scale,
                                       enable_gqa=attn.num_heads != attn.num_kv_heads)
    return attn.o_proj(o.transpose(1, 2).reshape(B, T, attn.num_heads * attn.head_dim))


def layer_forward(layer: DecoderLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    n = layer.input_layernorm
    x = x + attention(layer.self_attn, rms_norm_ref(x, n.weight, n.eps)[0], cos, sin)
    n = layer.post_attention_layernorm
    return x + layer.mlp(rms_norm_ref(x, n.weight, n.eps)[0])


def hidden_states(model: LlamaForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    """[B, T, H] final-norm hidden states of windows ``ids`` [B, T] (positions 0..T-1)."""
    B, T = ids.shape
    x = model.model.embed_tokens(ids)
    rotary = model.model.layers[0].self_attn.rotary
    cos, sin = rotary.cos_sin(torch.arange(T, device=ids.device).repeat(B))
    for layer in model.model.layers:
        x = layer_forward(layer, x, cos, sin)
    n = model.model.norm
    return rms_norm_ref(x, n.weight, n.eps)[0]


def causal_lm_loss(model: LlamaForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of windows ``ids`` [B, T] (in nats, float32)."""
    logits = model.lm_head(hidden_states(model, ids[:, :-1]))
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
