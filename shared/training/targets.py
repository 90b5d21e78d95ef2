"""The target's side of training: features and labels for windows of tokens, computed online.

The target runs through the engine's own forward (``LlamaForCausalLM.forward`` over a paged KV cache,
as a prefill does), so the features a head is trained on are exactly those it is fed when serving:
the final-norm hidden state for EAGLE and the multi-layer draft, the residual stream entering the
head's capture points for EAGLE-3.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.forward_batch import build_forward_batch
from shared.memory.kv_cache import CacheLayout, KVCache
from shared.model.llama import LlamaForCausalLM

PAGE = 16


@dataclass
class TargetBatch:
    """Windows of tokens and what the target computed on them. Row t of a window is position t."""

    ids: torch.Tensor  # [B, T] int64 tokens
    features: torch.Tensor  # [B, T, W] target dtype: the draft's input feature at position t
    label_logp: torch.Tensor  # [B, T, Vd] float32 target log-probs of token t+1 over the draft vocabulary
    label_ok: torch.Tensor  # [B, T] bool: the target's most likely token t+1 is in the draft vocabulary
    target_next: torch.Tensor  # [B, T] int64 the target's most likely token t+1 (target ids)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.ids.shape)


class TargetRunner:
    """Runs the target over up to ``rows`` windows of ``seq_len`` tokens in a KV cache of its own."""

    def __init__(self, target: LlamaForCausalLM, capture: str, aux_layers: tuple[int, ...], rows: int,
                 seq_len: int, hot: torch.Tensor | None):
        self.target, self.capture, self.aux_layers = target, capture, aux_layers
        cfg = target.config
        weight = target.lm_head.weight
        self.cache = KVCache(CacheLayout(
            num_layers=cfg.num_hidden_layers, num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
            dtype=weight.dtype, device=weight.device, page_size=PAGE, num_pages=rows * -(-seq_len // PAGE),
            max_reqs=rows, max_context=seq_len))
        self.kv_handles = [self.cache.open() for _ in range(rows)]
        for h in self.kv_handles:
            self.cache.reserve(h, seq_len)
        self.hot = None if hot is None else hot.to(weight.device)
        in_draft = torch.ones(cfg.vocab_size, dtype=torch.bool) if hot is None else torch.zeros(
            cfg.vocab_size, dtype=torch.bool).index_fill_(0, hot, True)
        self.in_draft = in_draft.to(weight.device)

    def __call__(self, ids: torch.Tensor) -> TargetBatch:
        B, T = ids.shape
        dev = self.target.lm_head.weight.device
        pos = torch.arange(T).repeat(B)
        batch = build_forward_batch(self.cache, [h.row for h in self.kv_handles[:B]], [0] * B, [T] * B,
                                    ids.reshape(-1), pos, pos)
        out = self.target(batch, self.cache, capture=self.capture, aux_layers=self.aux_layers)
        feats = out.features()
        logits = out.logits if self.hot is None else out.logits[:, self.hot]
        target_next = out.logits.argmax(-1)
        # Outside inference mode from here: clones are ordinary tensors autograd may save.
        return TargetBatch(ids=ids.to(dev), features=feats.view(B, T, -1).clone(),
                           label_logp=torch.log_softmax(logits.float(), -1).view(B, T, -1).clone(),
                           label_ok=self.in_draft[target_next].view(B, T).clone(),
                           target_next=target_next.view(B, T).clone())
