"""EAGLE draft heads: EAGLE (-1/-2), EAGLE-3 and the multi-layer (MTP-style) chain.

All three share one calling convention: ``forward(batch, cache, layer, features, from_target)``
runs draft position t on (feature at t, token at t+1) and returns the logits of token t+2 and the
recurrent hidden state (the feature the next draft step consumes).

Widths are declared once, here (seed 003): ``feature_width(from_target)`` is the input width of
the draft (target hidden, or 3x target hidden for EAGLE-3's draft extend) and ``hidden_width`` the
recurrent width (the draft's own hidden size). Buffers, the wire schema and empty batches all ask
these two methods.

Checkpoint formats:
* ``eagle``  (SafeAILab EAGLE / SGLang ``LlamaForCausalLMEagle``): ``fc.{weight,bias}`` over
  concat(embedding, feature), ``layers.N.*`` Llama layers (layer 0 without input_layernorm); the
  target's LM head applied to the un-normalised output.
  SafeAILab's own configs name the plain ``LlamaForCausalLM`` architecture and keep ``embed_tokens``
  in ``pytorch_model.bin``; such a directory is recognised by its weights (``fc`` + ``layers.N``),
  and the ``fc`` bias follows the weights (SafeAILab's default is a bias, ``"bias": false`` drops it).
* ``eagle3`` (SGLang ``LlamaForCausalLMEagle3`` / SpecForge): ``fc.weight`` [H, 3H] fusing the low,
  mid and high target features; ``midlayer.*`` with ``hidden_norm`` and attention over
  concat(norm(embedding), norm(hidden)); ``norm``; ``lm_head`` over a reduced draft vocabulary with
  ``d2t`` (target id = draft id + d2t[draft id]) and ``t2d``. Without ``lm_head.weight`` (SGLang:
  no ``draft_vocab_size``) the head reads the target's LM head, as SGLang does.
  The three target features are named by ``eagle_config.eagle_aux_hidden_state_layer_ids`` in
  SGLang's and SpecForge's convention: id ``k`` is the OUTPUT of target layer ``k`` (the residual
  stream entering layer ``k + 1``; SGLang's ``set_eagle3_layers_to_capture`` adds 1; SpecForge writes
  [1, 15, 28] for 32 layers). Without ids, the capture points are SGLang's default: the inputs of
  layers 2, L//2 and L-3 (``default_aux_layers``). ``aux_layers`` below are always capture points
  (inputs of layers), what the target's forward takes.
* ``mtp`` (Eyrie's multi-layer chain, DeepSeek-MTP-like modules): ``layers.N.{enorm,hnorm,eh_proj}``
  then a Llama layer and a per-layer ``norm`` before the target's LM head. Layer i serves draft step
  i and owns its own KV cache.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from kernels.gemv import linear
from shared.forward_batch import ForwardBatch
from shared.model.config import ModelConfig
from shared.model.layers import MLP, Attention, DecoderLayer, RMSNorm, fuse_projections
from shared.model.llama import LlamaForCausalLM, default_aux_layers
from shared.model.loader import CheckpointError, build_module, load_weights, log_loaded, parse_dtype, read_state_dict

DRAFT_ARCHITECTURES = {
    "LlamaForCausalLMEagle": "eagle", "EagleLlamaForCausalLM": "eagle",
    "LlamaForCausalLMEagle3": "eagle3", "Eagle3LlamaForCausalLM": "eagle3",
    "EyrieMultiLayerDraft": "mtp",
}


@dataclass
class DraftOutput:
    logits: torch.Tensor  # [R, Vd] float32 over the draft vocabulary, rows = batch.logits_rows
    hidden: torch.Tensor  # [T, hidden_width] recurrent feature for the next draft step


class DraftHead(nn.Module):
    kind: str

    def __init__(self, config: ModelConfig, target: LlamaForCausalLM):
        super().__init__()
        self.config = config
        self.target_hidden = target.config.hidden_size
        # The target's embedding and LM head are shared, not owned (not in this state dict).
        self._target = (target,)
        self.embed_tokens: nn.Embedding | None = None

    @property
    def hidden_width(self) -> int:
        return self.config.hidden_size

    def feature_width(self, from_target: bool) -> int:
        return self.target_hidden if from_target else self.hidden_width

    @property
    def num_caches(self) -> int:
        return 1

    @property
    def layers_per_cache(self) -> int:
        return 1

    def cache_for_step(self, step: int) -> int:
        """Index of the cache (and layer) that draft step ``step`` runs with."""
        return 0

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        table = self.embed_tokens if self.embed_tokens is not None else self._target[0].model.embed_tokens
        return table(ids)

    def target_lm_head(self, x: torch.Tensor) -> torch.Tensor:
        return self._target[0].lm_logits(x)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids

    @staticmethod
    def rows(x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return x if batch.logits_rows is None else x[batch.logits_rows]


class EagleDraft(DraftHead):
    kind = "eagle"

    def __init__(self, config: ModelConfig, target: LlamaForCausalLM):
        super().__init__(config, target)
        h = config.hidden_size
        self.fc = nn.Linear(h + self.target_hidden, h, bias=config.fc_bias)
        self.layers = nn.ModuleList(DecoderLayer(config, i, input_norm=i != 0)
                                    for i in range(config.num_hidden_layers))

    @property
    def layers_per_cache(self) -> int:
        return len(self.layers)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, cache, step: int, features: torch.Tensor,
                from_target: bool) -> DraftOutput:
        x = self.fc(torch.cat([self.embed(batch.input_ids), features.to(self.fc.weight.dtype)], dim=-1))
        for layer in self.layers:
            x = layer(x, batch, cache)
        return DraftOutput(logits=self.target_lm_head(self.rows(x, batch)), hidden=x)


class Eagle3Layer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        h = config.hidden_size
        self.input_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps)
        self.self_attn = Attention(config, cache_layer=0, in_dim=2 * h)
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.mlp = MLP(h, config.intermediate_size)


class Eagle3Draft(DraftHead):
    kind = "eagle3"

    def __init__(self, config: ModelConfig, target: LlamaForCausalLM, aux_layers: tuple[int, ...]):
        super().__init__(config, target)
        h = config.hidden_size
        self.aux_layers = aux_layers  # capture points: the target's residual stream entering these layers
        self.fc = nn.Linear(len(aux_layers) * self.target_hidden, h, bias=config.fc_bias)
        self.midlayer = Eagle3Layer(config)
        self.norm = RMSNorm(h, config.rms_norm_eps)
        vd = config.draft_vocab_size or config.vocab_size
        self.lm_head = nn.Linear(h, vd, bias=False)
        self.register_buffer("d2t", torch.zeros(vd, dtype=torch.int64))

    def feature_width(self, from_target: bool) -> int:
        return len(self.aux_layers) * self.target_hidden if from_target else self.hidden_width

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, cache, step: int, features: torch.Tensor,
                from_target: bool) -> DraftOutput:
        m = self.midlayer
        h = features.to(self.fc.weight.dtype)
        h = self.fc(h) if from_target else h
        a = torch.cat([m.input_layernorm(self.embed(batch.input_ids)), m.hidden_norm(h)], dim=-1)
        x = h + m.self_attn(a, batch, cache)
        x = x + m.mlp(m.post_attention_layernorm(x))
        return DraftOutput(logits=linear(self.norm(self.rows(x, batch)), self.lm_head.weight).float(), hidden=x)


class MTPLayer(DecoderLayer):
    def __init__(self, config: ModelConfig, target_hidden: int):
        super().__init__(config, cache_layer=0)
        h = config.hidden_size
        self.enorm = RMSNorm(h, config.rms_norm_eps)
        self.hnorm = RMSNorm(target_hidden, config.rms_norm_eps)
        self.eh_proj = nn.Linear(h + target_hidden, h, bias=False)
        self.norm = RMSNorm(h, config.rms_norm_eps)


class MultiLayerDraft(DraftHead):
    kind = "mtp"

    def __init__(self, config: ModelConfig, target: LlamaForCausalLM):
        super().__init__(config, target)
        if config.hidden_size != self.target_hidden:
            raise CheckpointError("mtp draft: hidden_size must equal the target's (layers feed each other)")
        self.layers = nn.ModuleList(MTPLayer(config, self.target_hidden) for _ in range(config.num_hidden_layers))

    @property
    def num_caches(self) -> int:
        return len(self.layers)

    def cache_for_step(self, step: int) -> int:
        return step

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, cache, step: int, features: torch.Tensor,
                from_target: bool) -> DraftOutput:
        layer = self.layers[step]
        e = layer.enorm(self.embed(batch.input_ids))
        x = layer.eh_proj(torch.cat([e, layer.hnorm(features.to(e.dtype))], dim=-1))
        x = DecoderLayer.forward(layer, x, batch, cache)
        return DraftOutput(logits=self.target_lm_head(layer.norm(self.rows(x, batch))), hidden=x)


def draft_kind(path: str | Path, state: dict[str, torch.Tensor] | None = None) -> str:
    """The head's kind from ``architectures``; a plain ``LlamaForCausalLM`` config (SafeAILab writes
    its EAGLE heads that way) is told by its weights: ``fc`` + ``midlayer.*`` (EAGLE-3) or ``fc`` +
    ``layers.N.*`` (EAGLE). A target checkpoint has neither ``fc`` nor top-level ``layers``."""
    with open(Path(path) / "config.json") as f:
        archs = json.load(f).get("architectures") or []
    for arch in archs:
        if arch in DRAFT_ARCHITECTURES:
            return DRAFT_ARCHITECTURES[arch]
    if state is not None and "fc.weight" in state:
        if any(k.startswith("midlayer.") for k in state):
            return "eagle3"
        if any(k.startswith("layers.") for k in state):
            return "eagle"
    raise CheckpointError(f"{path}: architectures {archs} name no known draft head "
                          f"({sorted(DRAFT_ARCHITECTURES)}) and the weights are not an EAGLE head's "
                          f"(fc.weight with layers.N.* or midlayer.*)")


def capture_points(layer_ids, num_layers: int, where: str = "eagle_aux_hidden_state_layer_ids") -> tuple[int, ...]:
    """SGLang / SpecForge layer ids -> Eyrie capture points (the target layers whose input is taken).

    Id ``k`` names the output of target layer ``k``, i.e. the residual stream entering layer ``k + 1``
    (SGLang: ``layers_to_capture = [val + 1 for val in layer_ids]``; transformers:
    ``hidden_states[k + 1]``). Ids run from 0 to L - 2: the output of the last layer is not a layer's
    input (neither SGLang nor Eyrie's target captures it), and a negative id is no layer at all.
    """
    if not isinstance(layer_ids, (list, tuple)) or not layer_ids or not all(
            isinstance(k, int) and not isinstance(k, bool) for k in layer_ids):
        raise CheckpointError(f"{where}: expected a non-empty list of layer ids, got {layer_ids!r}")
    bad = [k for k in layer_ids if not 0 <= k <= num_layers - 2]
    if bad:
        raise CheckpointError(
            f"{where}: layer id {bad[0]} of {list(layer_ids)} is outside [0, {num_layers - 2}] for a target of "
            f"{num_layers} layers (id k is the output of layer k, captured entering layer k + 1)")
    return tuple(k + 1 for k in layer_ids)


def aux_layers_of(path: str | Path, target: LlamaForCausalLM) -> tuple[int, ...]:
    """Capture points of an EAGLE-3 head: from ``eagle_config.eagle_aux_hidden_state_layer_ids``
    (SGLang's convention, see ``capture_points``), else SGLang's default (inputs of 2, L//2, L-3)."""
    with open(Path(path) / "config.json") as f:
        cfg = json.load(f)
    n = target.config.num_hidden_layers
    ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if ids is None and "eagle_aux_hidden_state_layer_ids" in cfg:
        # vLLM's speculators configs put the ids at the top level, as layer INPUTS (no shift), while
        # SGLang shifts them: the two conventions disagree, so a top-level list is not guessed at.
        top = cfg["eagle_aux_hidden_state_layer_ids"]
        raise CheckpointError(
            f"{path}: config.json has a top-level eagle_aux_hidden_state_layer_ids {top}; Eyrie reads "
            f"eagle_config.eagle_aux_hidden_state_layer_ids in SGLang's convention (id k = output of layer k): "
            f"move the ids there, shifted as that convention needs")
    if ids is None:
        return default_aux_layers(n)
    return capture_points(ids, n, f"{path}: eagle_config.eagle_aux_hidden_state_layer_ids")


def check_matches_target(path: Path, config: ModelConfig, target: LlamaForCausalLM,
                         d2t: torch.Tensor | None) -> None:
    """A draft made for another target is refused at load, with both sides in the message."""
    t = target.config
    if config.vocab_size != t.vocab_size:
        raise CheckpointError(f"{path}: draft vocab_size {config.vocab_size} != target vocab_size {t.vocab_size}")
    # Every head embeds tokens with the target's table (and EAGLE / multi-layer use its LM head).
    if config.hidden_size != t.hidden_size:
        raise CheckpointError(f"{path}: draft hidden_size {config.hidden_size} != target hidden_size {t.hidden_size}")
    if config.target_hidden_size is not None and config.target_hidden_size != t.hidden_size:
        raise CheckpointError(f"{path}: draft target_hidden_size {config.target_hidden_size} != target "
                              f"hidden_size {t.hidden_size}")
    if d2t is not None:
        vd = config.draft_vocab_size or config.vocab_size
        if d2t.numel() != vd:
            raise CheckpointError(f"{path}: d2t has {d2t.numel()} entries != draft_vocab_size {vd}")
        ids = torch.arange(vd) + d2t.to(torch.int64)
        if vd and not (0 <= int(ids.min()) and int(ids.max()) < t.vocab_size):
            raise CheckpointError(f"{path}: d2t maps draft ids to target ids in [{int(ids.min())}, {int(ids.max())}], "
                                  f"outside the target vocabulary [0, {t.vocab_size})")


def whole_lm_head(target: LlamaForCausalLM, read: Callable[[], torch.Tensor] | None) -> torch.Tensor:
    """The whole target's LM head weight [V, H]: ``read()`` when given, else the target's own (not split)."""
    if read is not None:
        return read()
    if target.tp is not None:
        raise ValueError("the target is split over tensor-parallel ranks: the draft needs a reader of its whole "
                         "LM head (target_lm_head)")
    return target.lm_head.weight.detach()


def load_draft(path: str | Path, target: LlamaForCausalLM, dtype="float32", device="cpu",
               target_lm_head: Callable[[], torch.Tensor] | None = None) -> DraftHead:
    """The draft head at ``path`` for ``target``. ``target_lm_head``: reads the whole target's LM head weight
    [V, H], which an EAGLE-3 head without its own copies; needed when ``target`` is already split over
    tensor-parallel ranks (each holds only its vocabulary rows), else the target's own is copied."""
    t0 = time.perf_counter()
    path = Path(path)
    dtype, device = parse_dtype(dtype), torch.device(device)
    state = {k.removeprefix("model."): v for k, v in read_state_dict(path).items()}
    kind = draft_kind(path, state)
    # The fc bias is what the weights hold: SafeAILab's EAGLE defaults to one (no "bias" key in its
    # configs), "bias": false drops it; SGLang's EAGLE-3 reads config "bias" (default none).
    # A draft head attends over the whole context, even under a windowed target: it only proposes
    # tokens (the target's verify decides, lossless either way), and EAGLE heads are trained so.
    config = ModelConfig.from_dir(path).model_copy(update={"fc_bias": "fc.bias" in state, "sliding_window": None})
    check_matches_target(path, config, target, state.get("d2t") if kind == "eagle3" else None)
    if kind == "eagle":
        head = build_module(EagleDraft, config, dtype, device, target)
    elif kind == "eagle3":
        aux = aux_layers_of(path, target)
        fc = state.get("fc.weight")
        if fc is not None and fc.shape[-1] != len(aux) * target.config.hidden_size:
            raise CheckpointError(f"{path}: fc.weight takes {fc.shape[-1]} inputs but the target features are "
                                  f"{len(aux)} layers x hidden_size {target.config.hidden_size} "
                                  f"(capture points {list(aux)})")
        head = build_module(Eagle3Draft, config, dtype, device, target, aux)
        state.pop("t2d", None)  # derivable from d2t; the target->draft direction is never needed
        vd = head.lm_head.out_features
        if "d2t" in state:
            with torch.no_grad():
                head.d2t.copy_(state.pop("d2t").to(torch.int64))
        elif vd != target.config.vocab_size:
            raise CheckpointError(f"{path}: no d2t map for a draft vocabulary of {vd} (target vocabulary "
                                  f"{target.config.vocab_size})")
        if "lm_head.weight" not in state:
            # SGLang: a head without its own LM head (no draft_vocab_size) loads the target's.
            if vd != target.config.vocab_size:
                raise CheckpointError(f"{path}: no lm_head.weight for a draft vocabulary of {vd}")
            state["lm_head.weight"] = whole_lm_head(target, target_lm_head)
    else:
        head = build_module(MultiLayerDraft, config, dtype, device, target)
    if "embed_tokens.weight" in state:
        head.embed_tokens = nn.Embedding(*state["embed_tokens.weight"].shape, device=device, dtype=dtype)
    state.pop("lm_head.weight", None) if kind != "eagle3" else None
    load_weights(head, state)
    head = fuse_projections(head).eval()
    log_loaded(path, f"draft ({kind})", head, t0)
    return head
