"""Function-preserving widening of a Llama target and its EAGLE-3 head to a larger shape.

The wide model computes what the small one does, so a trained small pair gives a pair at (say)
Llama-3.1-8B's shape whose greedy output and acceptance are the small pair's, while its timing is the
wide shape's:

* channels: the residual stream keeps the small model's channels first and zeros after; every weight
  reading it gets zero columns there, every weight writing it zero rows (embedding, o_proj, down_proj,
  LM head, the head's fc); the MLP's extra intermediate channels are zero in and out.
* heads: head_dim is unchanged; small KV head j is wide KV head j, small query head i (of KV group
  j = i // g) is wide query head j * G + i % g (g, G the small and wide group sizes), so each query
  head still reads its own keys; every other head has zero projections (its output is multiplied by
  zero columns of o_proj).
* layers: small layer i is wide layer ``layer_of[i]`` (spread evenly); the others are identity
  layers (zero o_proj and down_proj: they add nothing to the residual stream).
* RMSNorm: the mean of squares over the wide stream is r = h_small / h_wide times the small one, so
  every norm's weight is scaled by sqrt(r) and ``rms_norm_eps`` by r:
  w sqrt(r) x / sqrt(r mean + r eps) = w x / sqrt(mean + eps) on the small channels.
* EAGLE-3: the head is widened alike (its attention reads [embedding | hidden] halves, its fc the
  three features' blocks), and its auxiliary layer ids follow the layers: the residual stream
  entering small layer p is the one entering wide layer ``layer_of[p]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from shared.model.drafts import capture_points
from shared.model.llama import default_aux_layers


@dataclass(frozen=True)
class Shape:
    num_hidden_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int


LLAMA31_8B = Shape(num_hidden_layers=32, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                   num_key_value_heads=8)


class WidenError(ValueError):
    pass


@dataclass(frozen=True)
class HeadMap:
    """Where each small attention head goes in the wide layer."""

    head_dim: int
    q: tuple[int, ...]  # wide query head of each small query head
    kv: tuple[int, ...]  # wide KV head of each small KV head
    wide_q: int
    wide_kv: int


def head_map(small_q: int, small_kv: int, wide_q: int, wide_kv: int, head_dim: int) -> HeadMap:
    g, G = small_q // small_kv, wide_q // wide_kv
    if small_kv > wide_kv or g > G or wide_q % wide_kv:
        raise WidenError(f"heads: {small_q}/{small_kv} (query/KV) do not fit in {wide_q}/{wide_kv}: the wide model "
                         f"needs at least as many KV heads and query heads per KV head")
    return HeadMap(head_dim, tuple((i // g) * G + i % g for i in range(small_q)), tuple(range(small_kv)), wide_q,
                   wide_kv)


@dataclass(frozen=True)
class Plan:
    h: int  # small hidden
    H: int  # wide hidden
    layer_of: tuple[int, ...]  # wide layer of each small layer
    shape: Shape

    @property
    def ratio(self) -> float:
        return self.h / self.H

    @property
    def norm_scale(self) -> float:
        return math.sqrt(self.ratio)


def plan(small_cfg: dict, shape: Shape) -> Plan:
    L, h = small_cfg["num_hidden_layers"], small_cfg["hidden_size"]
    for name, small, wide in (("num_hidden_layers", L, shape.num_hidden_layers), ("hidden_size", h, shape.hidden_size),
                              ("intermediate_size", small_cfg["intermediate_size"], shape.intermediate_size)):
        if wide < small:
            raise WidenError(f"{name}: the wide shape's {wide} is smaller than the model's {small}")
    hd = small_cfg.get("head_dim") or h // small_cfg["num_attention_heads"]
    if shape.hidden_size % shape.num_attention_heads or shape.hidden_size // shape.num_attention_heads != hd:
        raise WidenError(f"head_dim: the model's {hd} != the wide shape's "
                         f"{shape.hidden_size / shape.num_attention_heads:g} (head_dim is kept: RoPE and the "
                         f"attention scale depend on it)")
    return Plan(h=h, H=shape.hidden_size, layer_of=tuple(i * shape.num_hidden_layers // L for i in range(L)),
                shape=shape)


# ---- tensors --------------------------------------------------------------------------------------
def pad(t: torch.Tensor, rows: int | None = None, cols: int | None = None) -> torch.Tensor:
    """``t`` in the top-left corner of zeros [rows, cols] (or [rows] for a vector)."""
    out = torch.zeros((rows or t.shape[0],) + ((cols or t.shape[1],) if t.dim() == 2 else ()), dtype=t.dtype)
    out[tuple(slice(0, n) for n in t.shape)] = t
    return out


def place_heads(t: torch.Tensor, slots: tuple[int, ...], n_wide: int, head_dim: int, dim: int) -> torch.Tensor:
    """Move head blocks of ``head_dim`` along ``dim`` to ``slots`` among ``n_wide`` heads (zeros elsewhere)."""
    t = t.movedim(dim, 0)
    out = torch.zeros((n_wide * head_dim,) + t.shape[1:], dtype=t.dtype)
    for i, s in enumerate(slots):
        out[s * head_dim:(s + 1) * head_dim] = t[i * head_dim:(i + 1) * head_dim]
    return out.movedim(0, dim)


def spread_cols(t: torch.Tensor, small: int, wide: int, blocks: int) -> torch.Tensor:
    """Columns in ``blocks`` blocks of ``small`` -> the same blocks of ``wide`` (zeros after each)."""
    out = torch.zeros(t.shape[0], blocks * wide, dtype=t.dtype)
    for b in range(blocks):
        out[:, b * wide:b * wide + small] = t[:, b * small:(b + 1) * small]
    return out


def widen_attention(state: dict, prefix: str, p: Plan, heads: HeadMap, in_blocks: int) -> dict:
    """q/k/v/o of one attention block; its input is ``in_blocks`` halves of the stream (2 for EAGLE-3)."""
    out = {}
    projections = (("q", heads.q, heads.wide_q), ("k", heads.kv, heads.wide_kv), ("v", heads.kv, heads.wide_kv))
    for name, slots, n in projections:
        w = spread_cols(state[f"{prefix}.{name}_proj.weight"], p.h, p.H, in_blocks)
        out[f"{prefix}.{name}_proj.weight"] = place_heads(w, slots, n, heads.head_dim, 0)
        if f"{prefix}.{name}_proj.bias" in state:
            out[f"{prefix}.{name}_proj.bias"] = place_heads(state[f"{prefix}.{name}_proj.bias"], slots, n,
                                                            heads.head_dim, 0)
    o = place_heads(state[f"{prefix}.o_proj.weight"], heads.q, heads.wide_q, heads.head_dim, 1)
    out[f"{prefix}.o_proj.weight"] = pad(o, rows=p.H)
    if f"{prefix}.o_proj.bias" in state:
        out[f"{prefix}.o_proj.bias"] = pad(state[f"{prefix}.o_proj.bias"], rows=p.H)
    return out


def widen_mlp(state: dict, prefix: str, p: Plan) -> dict:
    inter = p.shape.intermediate_size
    return {f"{prefix}.gate_proj.weight": pad(state[f"{prefix}.gate_proj.weight"], inter, p.H),
            f"{prefix}.up_proj.weight": pad(state[f"{prefix}.up_proj.weight"], inter, p.H),
            f"{prefix}.down_proj.weight": pad(state[f"{prefix}.down_proj.weight"], p.H, inter)}


def widen_norm(w: torch.Tensor, p: Plan) -> torch.Tensor:
    return pad((w.float() * p.norm_scale).to(w.dtype), rows=p.H)


def identity_layer(prefix: str, p: Plan, heads: HeadMap, dtype: torch.dtype) -> dict:
    """A layer that adds nothing: every projection zero (o_proj and down_proj are what matter)."""
    q, kv, inter = heads.wide_q * heads.head_dim, heads.wide_kv * heads.head_dim, p.shape.intermediate_size
    shapes = {"self_attn.q_proj.weight": (q, p.H), "self_attn.k_proj.weight": (kv, p.H),
              "self_attn.v_proj.weight": (kv, p.H), "self_attn.o_proj.weight": (p.H, q),
              "mlp.gate_proj.weight": (inter, p.H), "mlp.up_proj.weight": (inter, p.H),
              "mlp.down_proj.weight": (p.H, inter)}
    out = {f"{prefix}.{k}": torch.zeros(s, dtype=dtype) for k, s in shapes.items()}
    for norm in ("input_layernorm", "post_attention_layernorm"):
        out[f"{prefix}.{norm}.weight"] = torch.full((p.H,), p.norm_scale, dtype=dtype)
    return out


# ---- models ---------------------------------------------------------------------------------------
def wide_config(cfg: dict, p: Plan, heads: HeadMap, num_layers: int) -> dict:
    return {**cfg, "hidden_size": p.H, "intermediate_size": p.shape.intermediate_size,
            "num_hidden_layers": num_layers, "num_attention_heads": heads.wide_q,
            "num_key_value_heads": heads.wide_kv, "head_dim": heads.head_dim,
            "rms_norm_eps": cfg.get("rms_norm_eps", 1e-6) * p.ratio}


def target_heads(cfg: dict, shape: Shape) -> HeadMap:
    hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return head_map(cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
                    shape.num_attention_heads, shape.num_key_value_heads, hd)


def widen_target(state: dict[str, torch.Tensor], cfg: dict, shape: Shape) -> tuple[dict, dict, Plan]:
    """(wide state dict, wide config.json, the plan) of a Llama target checkpoint."""
    p = plan(cfg, shape)
    heads = target_heads(cfg, shape)
    dtype = state["model.embed_tokens.weight"].dtype
    out = {"model.embed_tokens.weight": pad(state["model.embed_tokens.weight"], cols=p.H),
           "model.norm.weight": widen_norm(state["model.norm.weight"], p)}
    if "lm_head.weight" in state:
        out["lm_head.weight"] = pad(state["lm_head.weight"], cols=p.H)
    placed = dict(zip(p.layer_of, range(len(p.layer_of))))
    for wide in range(shape.num_hidden_layers):
        prefix = f"model.layers.{wide}"
        if wide not in placed:
            out.update(identity_layer(prefix, p, heads, dtype))
            continue
        small = f"model.layers.{placed[wide]}"
        renamed = {prefix + k[len(small):]: v for k, v in state.items() if k.startswith(small + ".")}
        out.update(widen_attention(renamed, f"{prefix}.self_attn", p, heads, 1))
        out.update(widen_mlp(renamed, f"{prefix}.mlp", p))
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out[f"{prefix}.{norm}.weight"] = widen_norm(renamed[f"{prefix}.{norm}.weight"], p)
    return out, wide_config(cfg, p, heads, shape.num_hidden_layers), p


def widen_eagle3(state: dict[str, torch.Tensor], cfg: dict, target_cfg: dict, shape: Shape) -> tuple[dict, dict]:
    """(wide state dict, wide config.json) of an EAGLE-3 head of the target ``target_cfg`` (small)."""
    p = plan(target_cfg, shape)
    hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    heads = head_map(cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
                     shape.num_attention_heads, shape.num_key_value_heads, hd)
    if cfg["hidden_size"] != p.h:
        raise WidenError(f"the EAGLE-3 head's hidden_size {cfg['hidden_size']} != its target's {p.h}")
    n_feat = state["fc.weight"].shape[1] // p.h
    out = {"fc.weight": pad(spread_cols(state["fc.weight"], p.h, p.H, n_feat), rows=p.H),
           "norm.weight": widen_norm(state["norm.weight"], p),
           "lm_head.weight": pad(state["lm_head.weight"], cols=p.H)}
    if "fc.bias" in state:
        out["fc.bias"] = pad(state["fc.bias"], rows=p.H)
    out.update(widen_attention(state, "midlayer.self_attn", p, heads, 2))
    out.update(widen_mlp(state, "midlayer.mlp", p))
    for norm in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        out[f"midlayer.{norm}.weight"] = widen_norm(state[f"midlayer.{norm}.weight"], p)
    for k in ("d2t", "t2d"):
        if k in state:
            out[k] = state[k].clone()
    wide = wide_config(cfg, p, heads, cfg.get("num_hidden_layers", 1))
    wide["target_hidden_size"] = p.H
    ids = wide_aux_ids(cfg, target_cfg["num_hidden_layers"], p)
    wide["eagle_config"] = {**(cfg.get("eagle_config") or {}), "eagle_aux_hidden_state_layer_ids": ids}
    return out, wide


def wide_aux_ids(cfg: dict, small_layers: int, p: Plan) -> list[int]:
    """SGLang ids (id k = output of layer k) of the wide capture points: the input of wide layer
    ``layer_of[q]`` is the input of small layer q."""
    ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    points = default_aux_layers(small_layers) if ids is None else capture_points(ids, small_layers)
    wide = [p.layer_of[q] - 1 for q in points]
    if min(wide) < 0:
        raise WidenError(f"EAGLE-3 capture points {list(points)} include the embedding (layer 0's input), which "
                         f"SGLang's layer ids cannot name")
    return wide


# ---- vocabulary ------------------------------------------------------------------------------------
def pad_vocab_target(state: dict[str, torch.Tensor], cfg: dict, vocab_size: int,
                     filler: int) -> tuple[dict, dict]:
    """The target with ``vocab_size`` ids: the new ids' embedding rows zero, their LM-head rows copies of
    real id ``filler``'s.

    A copy ties each new id's logit with ``filler``'s, and argmax takes the first of equal maxima
    (``torch.argmax``), so a new id never wins over the real ids: greedy decoding is exactly the small
    vocabulary's. Under sampling the new ids share ``filler``'s probability, so ``filler`` should be an
    id the model never expects (``bench/house/widen_tiny.py`` picks the one least likely on held-out
    text). A zero row would give logit 0, which wins wherever every real logit is negative."""
    v = state["model.embed_tokens.weight"].shape[0]
    if vocab_size < v or not 0 <= filler < v:
        raise WidenError(f"vocabulary: cannot pad {v} ids to {vocab_size} with filler id {filler}")
    if cfg.get("tie_word_embeddings"):
        raise WidenError("vocabulary: a tied LM head shares the embedding's zero rows; untie it first")
    out = dict(state)
    out["model.embed_tokens.weight"] = pad(state["model.embed_tokens.weight"], rows=vocab_size)
    head = state["lm_head.weight"]
    out["lm_head.weight"] = torch.cat([head, head[filler].expand(vocab_size - v, -1)])
    return out, {**cfg, "vocab_size": vocab_size}


def pad_vocab_eagle3(state: dict[str, torch.Tensor], cfg: dict, vocab_size: int) -> tuple[dict, dict]:
    """The EAGLE-3 head of a target padded to ``vocab_size`` ids: its draft vocabulary is unchanged (``d2t``
    still maps it into the first ids) and the new target ids are outside it (``t2d`` false)."""
    out = dict(state)
    if "t2d" in state:
        out["t2d"] = torch.cat([state["t2d"], torch.zeros(vocab_size - state["t2d"].numel(), dtype=torch.bool)])
    if "embed_tokens.weight" in state:
        out["embed_tokens.weight"] = pad(state["embed_tokens.weight"], rows=vocab_size)
    draft_vocab = cfg.get("draft_vocab_size") or state["lm_head.weight"].shape[0]
    return out, {**cfg, "vocab_size": vocab_size, "draft_vocab_size": draft_vocab}
