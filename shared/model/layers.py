"""Llama building blocks: RMSNorm, rotary embedding (incl. llama3 scaling), paged attention, SwiGLU."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from shared.batch import ForwardBatch
from shared.model.config import ModelConfig, RopeConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.rope_type != "llama3":
        return inv_freq
    old_ctx = rope.original_max_position_embeddings
    low_wavelen = old_ctx / rope.low_freq_factor
    high_wavelen = old_ctx / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_ctx / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Half-split (rotate_half) rotary embedding, as Hugging Face Llama checkpoints expect."""

    def __init__(self, rope: RopeConfig, head_dim: int):
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(rope, head_dim), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        freqs = positions.float().unsqueeze(-1) * self.inv_freq.float().unsqueeze(0)  # [T, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)
        cos = emb.cos().to(q.dtype).unsqueeze(1)
        sin = emb.sin().to(q.dtype).unsqueeze(1)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def attention_fn():
    """The paged attention entry point: Triton on CUDA, the torch reference elsewhere."""
    try:
        from kernels.attention import paged_attention
    except ImportError:  # kernels not built yet: the reference shares the contract
        from kernels.attention_ref import paged_attention_ref as paged_attention
    return paged_attention


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, cache_layer: int, in_dim: int | None = None):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.cache_layer = cache_layer  # index of this layer's K/V in the runner's cache
        in_dim = in_dim or config.hidden_size
        bias = config.attention_bias
        self.q_proj = nn.Linear(in_dim, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(in_dim, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(in_dim, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        self.rotary = RotaryEmbedding(config.rope, self.head_dim)
        self.scale = self.head_dim ** -0.5
        self._attend = attention_fn()

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache) -> torch.Tensor:
        T = x.shape[0]
        q = self.q_proj(x).view(T, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(T, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(batch.positions, q, k)
        k_cache, v_cache = cache.k[self.cache_layer], cache.v[self.cache_layer]
        k_cache[batch.out_cache_loc] = k.to(k_cache.dtype)
        v_cache[batch.out_cache_loc] = v.to(v_cache.dtype)
        o = self._attend(q, k_cache, v_cache, batch.attn, self.scale)
        return self.o_proj(o.reshape(T, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm Llama layer. ``input_norm=False`` is EAGLE-1's first draft layer."""

    def __init__(self, config: ModelConfig, cache_layer: int, input_norm: bool = True):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps) if input_norm else None
        self.self_attn = Attention(config, cache_layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache) -> torch.Tensor:
        h = self.input_layernorm(x) if self.input_layernorm is not None else x
        x = x + self.self_attn(h, batch, cache)
        return x + self.mlp(self.post_attention_layernorm(x))
