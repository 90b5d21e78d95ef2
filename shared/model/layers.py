"""Llama-family building blocks: RMSNorm, rotary embedding (incl. llama3 scaling), paged attention (with
Qwen3's q/k norm and Mistral's sliding window), the gated MLP (SwiGLU, or Gemma's GeGLU)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from kernels.extend_attention import extend_attention
from kernels.fused import rope_store, silu_mul
from kernels.mixed_attention import mixed_attention
from kernels.norm_rope import apply_rope, rms_norm
from shared.forward_batch import ForwardBatch
from shared.model.config import ModelConfig, RopeConfig
from shared.model.fp8 import cat_weights, linear  # dense weights: kernels/gemv.py; FP8 ones: their scales


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)[0]

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual) in one pass."""
        return rms_norm(x, self.weight, self.eps, residual)


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

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float().unsqueeze(-1) * self.inv_freq.float().unsqueeze(0)  # [T, D/2]
        return freqs.cos(), freqs.sin()

    def forward(self, batch: ForwardBatch, q: torch.Tensor, k: torch.Tensor):
        if batch.cos_sin is None:  # computed once per forward, shared by every layer
            batch.cos_sin = self.cos_sin(batch.positions)
        return apply_rope(q, k, *batch.cos_sin)


# Causal batches whose longest request has at least this many queries (prefill chunks) run the
# extend kernel on CUDA; decode, verify and draft steps keep the paged kernel.
EXTEND_MIN_Q = 64


def _long_extend(q: torch.Tensor, batch: ForwardBatch) -> bool:
    meta = batch.attn
    return (q.is_cuda and meta.custom_mask is None and meta.max_q_len is not None
            and meta.max_q_len >= EXTEND_MIN_Q)


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
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=config.o_proj_bias)
        # Qwen3: each head's q and k RMS-normalised (weights over head_dim) before RoPE.
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.window = config.window_of(cache_layer)  # 0: full causal attention
        self.rotary = RotaryEmbedding(config.rope, self.head_dim)
        self.scale = self.head_dim ** -0.5
        self._attend = attention_fn()
        self.qkv_weight: torch.Tensor | None = None  # set by fuse(): one GEMM instead of three
        self.qkv_bias: torch.Tensor | None = None
        self.tp = None  # a TPGroup when split by heads (shared/parallel.py): the output is a partial sum

    @torch.no_grad()
    def fuse(self) -> None:
        """Concatenate q/k/v projections after loading (checkpoints name them separately)."""
        projs = (self.q_proj, self.k_proj, self.v_proj)
        self.qkv_weight = cat_weights([p.weight for p in projs])
        self.qkv_bias = torch.cat([p.bias for p in projs]) if self.q_proj.bias is not None else None
        del self.q_proj, self.k_proj, self.v_proj

    def _qkv(self, x: torch.Tensor):
        if self.qkv_weight is None:
            return self.q_proj(x), self.k_proj(x), self.v_proj(x)
        qd, kd = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return linear(x, self.qkv_weight, self.qkv_bias).split([qd, kd, kd], dim=-1)

    def _extend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch,
                kv_new: tuple[torch.Tensor, torch.Tensor] | None = None, out: torch.Tensor | None = None
                ) -> torch.Tensor:
        """A batch with prefill chunks: the extend kernel, except for its decode rows (and chunks as short) in a
        mixed step, which take the decode launch (``kernels.mixed_attention``): the bits a decode step gives them.
        ``kv_new``: this step's keys (rotated) and values as stored, row-aligned with ``q``; None: gathered back
        from the cache's slots (two launches a layer). ``out``: where the output goes (contiguous, q's shape)."""
        loc = batch.out_cache_loc
        split = batch.mixed_split(q.shape[1] // k_cache.shape[1])
        if split is not None:
            return mixed_attention(q, k_cache, v_cache, loc, split, self.scale, self.window,
                                   batch.positions if self.window else None, kv_new=kv_new, out=out)
        k_new, v_new = kv_new if kv_new is not None else (k_cache[loc], v_cache[loc])
        return extend_attention(q, k_new, v_new, k_cache, v_cache, batch.attn, self.scale, self.window, out=out)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache) -> torch.Tensor:
        T = x.shape[0]
        k_cache, v_cache = cache.k[self.cache_layer], cache.v[self.cache_layer]
        # Prefill chunks: this step's K/V read densely (TMA) from where they were computed, not by slot
        long = _long_extend(x, batch)
        kv_new = None
        if self.qkv_weight is not None and self.q_norm is None:  # one GEMM, then RoPE + the K/V store in one launch
            if batch.cos_sin is None:
                batch.cos_sin = self.rotary.cos_sin(batch.positions)
            qkv = linear(x, self.qkv_weight, self.qkv_bias)
            keep = long and qkv.dtype == k_cache.dtype == v_cache.dtype
            q = rope_store(qkv, *batch.cos_sin, k_cache, v_cache, batch.out_cache_loc, self.num_heads,
                           self.num_kv_heads, keep_kv=keep)
            if keep:
                q, *kv_new = q
        else:
            q, k, v = self._qkv(x)
            q = q.reshape(T, self.num_heads, self.head_dim)
            k = k.reshape(T, self.num_kv_heads, self.head_dim)
            v = v.reshape(T, self.num_kv_heads, self.head_dim)
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = self.rotary(batch, q, k)
            k_cache[batch.out_cache_loc] = k.to(k_cache.dtype)
            v_cache[batch.out_cache_loc] = v.to(v_cache.dtype)
            if long and k.dtype == k_cache.dtype and v.dtype == v_cache.dtype:
                kv_new = (k, v)
        if long:
            o = self._extend(q, k_cache, v_cache, batch, kv_new)
        else:
            o = self._attend(q, k_cache, v_cache, batch.attn, self.scale, self.window,
                             batch.positions if self.window else None)
        out = linear(o.reshape(T, self.num_heads * self.head_dim), self.o_proj.weight, self.o_proj.bias)
        return out if self.tp is None else self.tp.all_reduce(out)


def _act(gate: torch.Tensor, act: str) -> torch.Tensor:
    return F.silu(gate) if act == "silu" else F.gelu(gate, approximate="tanh")


class MLP(nn.Module):
    """down(act(gate(x)) * up(x)): SwiGLU (``act="silu"``) or Gemma's GeGLU (``"gelu_tanh"``)."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False, act: str = "silu"):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.act = act
        self.gate_up_weight: torch.Tensor | None = None
        self.gate_up_bias: torch.Tensor | None = None
        self.tp = None  # a TPGroup when split by columns (shared/parallel.py): the output is a partial sum

    @torch.no_grad()
    def fuse(self) -> None:
        self.gate_up_weight = cat_weights([self.gate_proj.weight, self.up_proj.weight])
        if self.gate_proj.bias is not None:
            self.gate_up_bias = torch.cat([self.gate_proj.bias, self.up_proj.bias])
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_weight is None:
            return self.down_proj(_act(self.gate_proj(x), self.act) * self.up_proj(x))
        gate_up = linear(x, self.gate_up_weight, self.gate_up_bias)
        if self.act == "silu":
            h = silu_mul(gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            h = _act(gate, self.act) * up
        out = linear(h, self.down_proj.weight, self.down_proj.bias)
        return out if self.tp is None else self.tp.all_reduce(out)


class DecoderLayer(nn.Module):
    """Pre-norm Llama layer. ``input_norm=False`` is EAGLE-1's first draft layer."""

    def __init__(self, config: ModelConfig, cache_layer: int, input_norm: bool = True):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps) if input_norm else None
        self.self_attn = Attention(config, cache_layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config.hidden_size, config.intermediate_size, config.mlp_bias, config.hidden_act)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache) -> torch.Tensor:
        h = self.input_layernorm(x) if self.input_layernorm is not None else x
        h, x = self.post_attention_layernorm.add_forward(self.self_attn(h, batch, cache), x)
        return x + self.mlp(h)

    def forward_deferred(self, out: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch,
                         cache) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The same layer with the residual add deferred into the next RMSNorm (one launch fewer).

        The layer's input is ``out + residual`` (``residual`` None: ``out`` itself, the first layer);
        returns ``(mlp_out, residual, layer_input)`` where the next layer's input is
        ``mlp_out + residual``. Same arithmetic as ``forward``: the sum is rounded to the activation
        dtype before the norm, exactly as ``x + mlp`` was.
        """
        if residual is None:
            x = out
            h = self.input_layernorm(x) if self.input_layernorm is not None else x
        else:
            h, x = self.input_layernorm.add_forward(out, residual)
        layer_input = x
        h, x = self.post_attention_layernorm.add_forward(self.self_attn(h, batch, cache), x)
        return self.mlp(h), x, layer_input


def fuse_projections(module: nn.Module) -> nn.Module:
    """Merge q/k/v and gate/up GEMMs of every layer (after the checkpoint is loaded). Only the blocks are listed
    first, not their projections: each block's separate weights are freed as it fuses, so the model's memory
    grows by one block's projections at most, not by all of them."""
    blocks = [m for m in module.modules() if isinstance(m, (Attention, MLP))]
    for m in blocks:
        if getattr(m, "qkv_weight", None) is None and getattr(m, "gate_up_weight", None) is None:
            m.fuse()
    return module
