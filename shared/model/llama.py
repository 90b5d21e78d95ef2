"""The Llama-family target model over the paged KV cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from shared.forward_batch import ForwardBatch
from shared.model.config import ModelConfig
from shared.model.fp8 import linear  # dense: kernels/gemv.py; an FP8 model's LM head: same_rows
from shared.model.layers import DecoderLayer, RMSNorm


@dataclass
class TargetOutput:
    logits: torch.Tensor  # [R, V] float32, rows = batch.logits_rows
    hidden: torch.Tensor | None = None  # [T, H] final-norm hidden state (EAGLE feature)
    aux_hidden: torch.Tensor | None = None  # [T, 3H] residual stream at the EAGLE-3 layers

    def features(self) -> torch.Tensor | None:
        """What the draft is fed: the EAGLE-3 layers' states when captured, else the last hidden state."""
        return self.aux_hidden if self.aux_hidden is not None else self.hidden


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's low/mid/high capture points: the input of layers 2, L//2 and L-3."""
    return (min(2, num_layers - 1), num_layers // 2, max(num_layers - 3, 0))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.tp = None  # a TPGroup when split over ranks (shared/parallel.py shard_target)

    def lm_logits(self, x: torch.Tensor) -> torch.Tensor:
        """[R, V] float32 logits of the final-norm states ``x`` [R, H] over the whole vocabulary (under
        tensor parallelism each rank computes its vocabulary range and the ranks gather them)."""
        logits = linear(x, self.lm_head.weight)
        if self.tp is not None:
            logits = self.tp.all_gather(logits)[..., :self.config.vocab_size]
        return logits.float()

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, cache, capture: str = "none",
                aux_layers: tuple[int, ...] = ()) -> TargetOutput:
        """``capture``: "none", "last" (EAGLE feature) or "aux" (EAGLE-3 features at aux_layers)."""
        out, residual = self.model.embed_tokens(batch.input_ids), None
        if self.config.embed_scale != 1.0:  # Gemma: sqrt(hidden), rounded to the activation dtype as in HF
            out = out * torch.tensor(self.config.embed_scale, dtype=out.dtype).item()
        layer_inputs = {}
        for i, layer in enumerate(self.model.layers):
            out, residual, x = layer.forward_deferred(out, residual, batch, cache)
            if capture == "aux" and i in aux_layers:
                layer_inputs[i] = x
        h, _ = self.model.norm.add_forward(out, residual)
        rows = h if batch.logits_rows is None else h[batch.logits_rows]
        return TargetOutput(
            logits=self.lm_logits(rows),
            hidden=h if capture == "last" else None,
            aux_hidden=torch.cat([layer_inputs[i] for i in aux_layers], dim=-1) if capture == "aux" else None,
        )
