"""Draft heads in their public checkpoint formats, written by hand, and their forwards in plain torch.

Nothing here uses Eyrie's writer (shared/model/factory.py) or its modules: the files follow the
public formats and the forwards are written again from the public model definitions.

* SafeAILab EAGLE (-1/-2), ``eagle/model/cnets1.py`` (``Model``) + ``ea_model.py``: the directory has
  ``config.json`` (architectures ``["LlamaForCausalLM"]``, the head's Llama shape, ``"bias"`` for
  the fc, absent = a bias) and ``pytorch_model.bin``, the ``Model`` state dict loaded strictly:
  ``embed_tokens.weight``, ``fc.weight`` [H, 2H] (+ ``fc.bias``), ``layers.N.self_attn.{q,k,v,o}_proj``,
  ``layers.N.mlp.{gate,up,down}_proj``, ``layers.N.post_attention_layernorm`` and, for N > 0 only,
  ``layers.N.input_layernorm``. Forward: ``x = fc(cat(embed(token t+1), feature t))``, then the
  layers (layer 0 without its input norm); ``ea_model`` applies the TARGET's ``lm_head`` to ``x``
  with no norm. The feature is the target's last hidden state after its final norm.
* EAGLE-3 as SpecForge saves it and SGLang's ``llama_eagle3.py`` (``LlamaForCausalLMEagle3``) loads
  it: ``config.json`` (architectures ``["LlamaForCausalLMEagle3"]``, ``draft_vocab_size``,
  ``target_hidden_size``, ``eagle_config.eagle_aux_hidden_state_layer_ids``) and
  ``model.safetensors`` with ``fc.weight`` [H, 3T], ``midlayer.{input_layernorm,hidden_norm,
  post_attention_layernorm}.weight``, ``midlayer.self_attn.{q,k,v}_proj`` over 2H inputs,
  ``midlayer.self_attn.o_proj``, ``midlayer.mlp.*``, ``norm.weight``, ``lm_head.weight`` [Vd, H],
  ``d2t`` (int64 [Vd], target id = draft id + d2t) and ``t2d`` (bool [V]). Forward: ``h = fc(cat of
  the three target features)`` (a draft step feeds its own previous ``h`` instead);
  ``a = attn(cat(input_layernorm(embed), hidden_norm(h)))``, ``x = h + a``,
  ``x = x + mlp(post_attention_layernorm(x))``; the next step's ``h`` is ``x`` (before the norm),
  logits ``lm_head(norm(x))`` over the draft vocabulary. The embedding is the target's (SGLang
  shares it: ``set_embed``). SGLang's ids name the layer whose OUTPUT is captured: feature k is
  ``hidden_states[id_k + 1]`` of ``transformers``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

LLAMA_SHAPE = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
               "rms_norm_eps", "rope_theta", "max_position_embeddings")


# ---- writing -----------------------------------------------------------------------------------
def _w(gen: torch.Generator, rows: int, cols: int, gain: float = 1.5) -> torch.Tensor:
    return gain * torch.randn(rows, cols, generator=gen) / math.sqrt(cols)


def _norm(gen: torch.Generator, n: int) -> torch.Tensor:
    return 1.0 + 0.2 * torch.randn(n, generator=gen)


def _attn_mlp(gen: torch.Generator, cfg: dict, prefix: str, qkv_in: int) -> dict[str, torch.Tensor]:
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    hd = h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    return {f"{prefix}.self_attn.q_proj.weight": _w(gen, q, qkv_in, 3.0),
            f"{prefix}.self_attn.k_proj.weight": _w(gen, kv, qkv_in, 3.0),
            f"{prefix}.self_attn.v_proj.weight": _w(gen, kv, qkv_in),
            f"{prefix}.self_attn.o_proj.weight": _w(gen, h, q),
            f"{prefix}.mlp.gate_proj.weight": _w(gen, inter, h),
            f"{prefix}.mlp.up_proj.weight": _w(gen, inter, h),
            f"{prefix}.mlp.down_proj.weight": _w(gen, h, inter),
            f"{prefix}.post_attention_layernorm.weight": _norm(gen, h)}


def head_config(target_cfg: dict, architecture: str, **shape) -> dict:
    """A head's config.json: the target's vocabulary and width, its own attention/MLP shape."""
    cfg = {"architectures": [architecture], "model_type": "llama", "hidden_act": "silu", "num_hidden_layers": 1,
           "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 0, "tie_word_embeddings": False,
           "torch_dtype": "float32", "rope_scaling": None,
           **{k: target_cfg[k] for k in LLAMA_SHAPE if k in target_cfg}}
    cfg.update(shape)
    return cfg


def write_safeailab_eagle(out: Path, target_cfg: dict, embed: torch.Tensor, seed: int, num_layers: int = 2,
                          bias: bool | None = None, architecture: str = "LlamaForCausalLM", **shape) -> Path:
    """A SafeAILab EAGLE head: ``pytorch_model.bin`` (+ ``embed_tokens``), config ``"bias"`` as given
    (None: no key, SafeAILab's default, which is an fc bias)."""
    gen = torch.Generator().manual_seed(seed)
    cfg = head_config(target_cfg, architecture, num_hidden_layers=num_layers, **shape)
    if bias is not None:
        cfg["bias"] = bias
    h = cfg["hidden_size"]
    state = {"embed_tokens.weight": embed.clone(), "fc.weight": _w(gen, h, 2 * h)}
    if bias is None or bias:
        state["fc.bias"] = 0.3 * torch.randn(h, generator=gen)
    for i in range(num_layers):
        state.update(_attn_mlp(gen, cfg, f"layers.{i}", h))
        if i > 0:
            state[f"layers.{i}.input_layernorm.weight"] = _norm(gen, h)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    torch.save(state, out / "pytorch_model.bin")
    return out


def write_specforge_eagle3(out: Path, target_cfg: dict, seed: int, draft_vocab_size: int,
                           layer_ids: list[int] | None, **shape) -> Path:
    """An EAGLE-3 head as SpecForge saves it (no embedding: SGLang shares the target's)."""
    gen = torch.Generator().manual_seed(seed)
    cfg = head_config(target_cfg, "LlamaForCausalLMEagle3", draft_vocab_size=draft_vocab_size,
                      target_hidden_size=target_cfg["hidden_size"], **shape)
    if layer_ids is not None:
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(layer_ids), "use_aux_hidden_state": True}
    h, t, v = cfg["hidden_size"], target_cfg["hidden_size"], target_cfg["vocab_size"]
    state = {"fc.weight": _w(gen, h, 3 * t), "norm.weight": _norm(gen, h),
             "lm_head.weight": _w(gen, draft_vocab_size, h), "midlayer.input_layernorm.weight": _norm(gen, h),
             "midlayer.hidden_norm.weight": _norm(gen, h)}
    state.update(_attn_mlp(gen, cfg, "midlayer", 2 * h))
    hot = torch.randperm(v, generator=gen)[:draft_vocab_size].sort().values  # the draft vocabulary
    state["d2t"] = hot - torch.arange(draft_vocab_size)
    t2d = torch.zeros(v, dtype=torch.bool)
    t2d[hot] = True
    state["t2d"] = t2d
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


# ---- plain-torch forwards ------------------------------------------------------------------------
def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


def attention(x: torch.Tensor, sd: dict, prefix: str, cfg: dict) -> torch.Tensor:
    """Causal self-attention over one sequence (positions 0..T-1), RoPE, GQA by repeating K/V heads."""
    T = x.shape[0]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg["hidden_size"] // nh
    q = (x @ sd[f"{prefix}.q_proj.weight"].T).view(T, nh, hd).transpose(0, 1)
    k = (x @ sd[f"{prefix}.k_proj.weight"].T).view(T, nkv, hd).transpose(0, 1)
    v = (x @ sd[f"{prefix}.v_proj.weight"].T).view(T, nkv, hd).transpose(0, 1)
    inv_freq = 1.0 / (cfg.get("rope_theta", 10000.0) ** (torch.arange(0, hd, 2).float() / hd))
    freqs = torch.outer(torch.arange(T).float(), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos(), emb.sin()
    q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    k, v = k.repeat_interleave(nh // nkv, dim=0), v.repeat_interleave(nh // nkv, dim=0)
    scores = q @ k.transpose(1, 2) / math.sqrt(hd)
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.softmax(scores, dim=-1) @ v
    return o.transpose(0, 1).reshape(T, nh * hd) @ sd[f"{prefix}.o_proj.weight"].T


def mlp(x: torch.Tensor, sd: dict, prefix: str) -> torch.Tensor:
    g = x @ sd[f"{prefix}.gate_proj.weight"].T
    u = x @ sd[f"{prefix}.up_proj.weight"].T
    return (torch.nn.functional.silu(g) * u) @ sd[f"{prefix}.down_proj.weight"].T


def safeailab_eagle_forward(sd: dict, cfg: dict, ids: torch.Tensor, features: torch.Tensor,
                            lm_head: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """SafeAILab ``Model.forward`` over one sequence: row t takes (token ids[t], feature t); a draft
    step's feature is the head's own previous output. Returns (logits over the target vocabulary
    through the target's lm_head, un-normalised output hidden states)."""
    eps = cfg["rms_norm_eps"]
    x = torch.cat([sd["embed_tokens.weight"][ids], features], dim=-1) @ sd["fc.weight"].T
    if "fc.bias" in sd:
        x = x + sd["fc.bias"]
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}"
        h = rms_norm(x, sd[f"{p}.input_layernorm.weight"], eps) if i > 0 else x
        x = x + attention(h, sd, f"{p}.self_attn", cfg)
        x = x + mlp(rms_norm(x, sd[f"{p}.post_attention_layernorm.weight"], eps), sd, f"{p}.mlp")
    return x @ lm_head.T, x


def sglang_eagle3_forward(sd: dict, cfg: dict, ids: torch.Tensor, hidden_in: torch.Tensor,
                          embed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """SGLang ``LlamaForCausalLMEagle3`` over one sequence. ``hidden_in`` rows are already H wide:
    ``fc(target features)`` for the extend, the head's previous hidden for a draft step. Returns
    (logits over the draft vocabulary, the pre-norm hidden states fed to the next step)."""
    eps = cfg["rms_norm_eps"]
    m = "midlayer"
    a_in = torch.cat([rms_norm(embed[ids], sd[f"{m}.input_layernorm.weight"], eps),
                      rms_norm(hidden_in, sd[f"{m}.hidden_norm.weight"], eps)], dim=-1)
    x = hidden_in + attention(a_in, sd, f"{m}.self_attn", cfg)
    x = x + mlp(rms_norm(x, sd[f"{m}.post_attention_layernorm.weight"], eps), sd, f"{m}.mlp")
    return rms_norm(x, sd["norm.weight"], eps) @ sd["lm_head.weight"].T, x


def sglang_eagle3_fc(sd: dict, features: torch.Tensor) -> torch.Tensor:
    return features @ sd["fc.weight"].T


# ---- the target: a Llama checkpoint written by transformers ---------------------------------------
TARGET = dict(vocab_size=256, hidden_size=64, intermediate_size=112, num_hidden_layers=8, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=10000.0,
              bos_token_id=0, eos_token_id=1, initializer_range=0.1, tie_word_embeddings=False)


def write_hf_target(path: Path, seed: int = 0):
    """A random 8-layer Llama saved by ``transformers``; returns (config dict, the transformers model)."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**TARGET)).eval()
    with torch.no_grad():  # norms at 1 would hide a missing or misplaced norm
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.add_(0.2 * torch.randn_like(p))
    model.save_pretrained(path, safe_serialization=True)
    return json.loads((path / "config.json").read_text()), model


@torch.no_grad()
def hf_hidden_states(model, ids: list[int]) -> tuple[torch.Tensor, ...]:
    """``transformers``' hidden_states for one sequence: [i] enters layer i, [L] is after the final norm."""
    return tuple(h[0] for h in model(torch.tensor([ids]), output_hidden_states=True).hidden_states)
