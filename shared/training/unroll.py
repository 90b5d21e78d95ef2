"""The unrolled multi-step objective (EAGLE-3's training-time test), on the engine's draft modules.

A window of T tokens gives T anchors. Step 0 at anchor t is the draft extend: position t, fed the
target's feature at t and token t+1, predicting token t+2. Step j > 0 at anchor t is the j-th draft
forward of a decode step that committed tokens up to t+1: position t+j, fed the head's own hidden
state from step j-1 of the same anchor and token t+1+j, predicting token t+2+j. It attends to what
the serving loop lets it see: the step-0 keys of positions 0..t (the committed prefix the extend
wrote), and the keys its own anchor's steps 1..j wrote (its ancestors in the draft tree, and
itself). A multi-layer draft runs step j on its layer j, whose prefix keys are that layer's extend
over the target features, as the engine keeps them (``SpecWorker.draft_extend``).

The label of step j at anchor t is the target's distribution of token t+2+j (soft cross-entropy,
restricted to the draft vocabulary for EAGLE-3, where rows whose most likely token lies outside it
are not counted); step j's loss is weighted by ``STEP_DECAY ** j``. EAGLE-1 adds its feature
regression (smooth L1 of the head's hidden state against the target's next feature).

The forwards are written for training (dense attention, autograd) over the very modules the engine
loads (``shared.model.drafts``): weights, norms and rotary frequencies are theirs, so a head written
from them and loaded by the engine computes what was trained. ``tests/unit/training`` holds the two
against each other.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.norm_rope import apply_rope_ref, rms_norm_ref
from shared.model.drafts import DraftHead, Eagle3Draft, EagleDraft, MultiLayerDraft
from shared.model.layers import Attention, DecoderLayer, RMSNorm
from shared.training.targets import TargetBatch

STEP_DECAY = 0.8
EAGLE_CE_WEIGHT = 0.1  # EAGLE-1's recipe: the feature regression leads, the token loss guides


@dataclass
class StepKV:
    """The rotated keys and the values one unrolled step wrote, at every anchor."""

    k: torch.Tensor  # [B, Hkv, T, D]
    v: torch.Tensor  # [B, Hkv, T, D]


@dataclass
class StepOut:
    logits: torch.Tensor  # [B, T, Vd] float32 draft logits of step j at each anchor
    hidden: torch.Tensor  # [B, T, H] the recurrent hidden state step j + 1 is fed


@dataclass
class StepMetrics:
    loss: torch.Tensor  # scalar: this step's token loss (the objective's term before its weight)
    correct: torch.Tensor  # [B, T] bool: the draft's top token is the target's, where counted
    counted: torch.Tensor  # [B, T] bool: anchors this step is scored on


@dataclass
class Objective:
    loss: torch.Tensor  # scalar the optimiser minimises
    steps: list[StepMetrics]

    def accuracy(self) -> list[float]:
        return [float(s.correct.sum() / s.counted.sum().clamp(min=1)) for s in self.steps]


def shift(x: torch.Tensor, n: int) -> torch.Tensor:
    """Row t of the result is row t + n of ``x`` along dim 1; rows past the end are zeros."""
    if n == 0:
        return x
    pad = torch.zeros_like(x[:, :n])
    return torch.cat([x[:, n:], pad], dim=1)


def norm(module: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    return rms_norm_ref(x, module.weight, module.eps)[0]


def project_kv(attn: Attention, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, StepKV]:
    """Queries [B, H, T, D] and this step's keys/values, rotated at ``positions`` [T]."""
    B, T, _ = x.shape
    q = attn.q_proj(x).view(B * T, attn.num_heads, attn.head_dim)
    k = attn.k_proj(x).view(B * T, attn.num_kv_heads, attn.head_dim)
    v = attn.v_proj(x).view(B, T, attn.num_kv_heads, attn.head_dim)
    cos, sin = attn.rotary.cos_sin(positions.repeat(B))
    q, k = apply_rope_ref(q, k, cos, sin)
    q = q.view(B, T, attn.num_heads, attn.head_dim).transpose(1, 2)
    k = k.view(B, T, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
    return q, StepKV(k=k, v=v.transpose(1, 2))


def attend(attn: Attention, q: torch.Tensor, prefix: StepKV, own: list[StepKV]) -> torch.Tensor:
    """Anchor t's query sees ``prefix`` at anchors s <= t and each of ``own`` at anchor t only.
    Returns the attention output after ``o_proj``: [B, T, hidden]."""
    B, H, T, D = q.shape
    rep = H // attn.num_kv_heads
    pk, pv = prefix.k.repeat_interleave(rep, 1), prefix.v.repeat_interleave(rep, 1)
    scores = (q @ pk.transpose(2, 3)).float() * attn.scale  # [B, H, T, T]
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    diag = [(q * kv.k.repeat_interleave(rep, 1)).sum(-1, keepdim=True).float() * attn.scale for kv in own]
    p = torch.softmax(torch.cat([scores, *diag], dim=-1), dim=-1).to(q.dtype)
    o = p[..., :T] @ pv
    for i, kv in enumerate(own):
        o = o + p[..., T + i:T + i + 1] * kv.v.repeat_interleave(rep, 1)
    return attn.o_proj(o.transpose(1, 2).reshape(B, T, H * D))


def mlp_block(layer, x: torch.Tensor) -> torch.Tensor:
    """``x + mlp(post_attention_layernorm(x))`` (the MLP's unfused projections)."""
    return x + layer.mlp(norm(layer.post_attention_layernorm, x))


# ---- the three heads, one unrolled step at a time -------------------------------------------------
class Unroll:
    """Runs a head's unrolled steps over a batch of windows; keeps the keys earlier steps wrote."""

    def __init__(self, head: DraftHead, batch: TargetBatch):
        self.head, self.batch = head, batch
        B, T = batch.shape
        self.positions = torch.arange(T, device=batch.ids.device)
        self.kv: dict[int, list[StepKV]] = {}  # attention layer -> its keys of steps 0..j-1
        self.prefix: dict[int, StepKV] = {}  # multi-layer draft: layer -> keys of its extend

    def embed(self, j: int) -> torch.Tensor:
        """Embeddings of the tokens step j is fed: token t+1+j at anchor t."""
        table = self.head.embed_tokens if self.head.embed_tokens is not None else \
            self.head._target[0].model.embed_tokens
        return F.embedding(shift(self.batch.ids, 1 + j), table.weight.detach()).float()

    def step(self, j: int, fed: torch.Tensor | None) -> StepOut:
        """Step j; ``fed`` is step j-1's hidden state (None at step 0: the target's features)."""
        head = self.head
        if isinstance(head, Eagle3Draft):
            return self._eagle3(j, fed)
        if isinstance(head, EagleDraft):
            return self._eagle(j, fed)
        if isinstance(head, MultiLayerDraft):
            return self._mtp(j, fed)
        raise TypeError(f"no unrolled objective for {type(head).__name__}")

    def _attention(self, key: int, attn: Attention, x: torch.Tensor, j: int, prefix: StepKV | None = None):
        """Attention of step j at layer ``key``: prefix = step 0's keys (or the given ones)."""
        q, kv = project_kv(attn, x, self.positions + j)
        own = self.kv.setdefault(key, [])
        own.append(kv)
        if prefix is None:
            prefix, diagonal = own[0], own[1:]
        else:
            diagonal = [kv]
        return attend(attn, q, prefix, diagonal)

    def _features(self) -> torch.Tensor:
        return self.batch.features.float()

    def _eagle3(self, j: int, fed: torch.Tensor | None) -> StepOut:
        head: Eagle3Draft = self.head
        m = head.midlayer
        h = head.fc(self._features()) if fed is None else fed
        a = torch.cat([norm(m.input_layernorm, self.embed(j)), norm(m.hidden_norm, h)], dim=-1)
        x = h + self._attention(0, m.self_attn, a, j)
        x = mlp_block(m, x)
        return StepOut(logits=head.lm_head(norm(head.norm, x)).float(), hidden=x)

    def _eagle(self, j: int, fed: torch.Tensor | None) -> StepOut:
        head: EagleDraft = self.head
        x = head.fc(torch.cat([self.embed(j), self._features() if fed is None else fed], dim=-1))
        for i, layer in enumerate(head.layers):
            h = norm(layer.input_layernorm, x) if layer.input_layernorm is not None else x
            x = mlp_block(layer, x + self._attention(i, layer.self_attn, h, j))
        return StepOut(logits=self._target_logits(x), hidden=x)

    def _mtp(self, j: int, fed: torch.Tensor | None) -> StepOut:
        head: MultiLayerDraft = self.head
        layer = head.layers[j]
        x = self._mtp_input(layer, j, self._features() if fed is None else fed)
        prefix = None
        if fed is not None:  # layer j's extend over the target features wrote the prefix keys
            ext = self._mtp_input(layer, 0, self._features())
            prefix = project_kv(layer.self_attn, norm(layer.input_layernorm, ext), self.positions)[1]
        x = mlp_block(layer, x + self._attention(j, layer.self_attn, norm(layer.input_layernorm, x), j, prefix))
        return StepOut(logits=self._target_logits(norm(layer.norm, x)), hidden=x)

    def _mtp_input(self, layer: DecoderLayer, j: int, feature: torch.Tensor) -> torch.Tensor:
        return layer.eh_proj(torch.cat([norm(layer.enorm, self.embed(j)), norm(layer.hnorm, feature)], dim=-1))

    def _target_logits(self, x: torch.Tensor) -> torch.Tensor:
        w = self.head._target[0].lm_head.weight.detach()
        return F.linear(x.to(w.dtype), w).float()


def draft_to_target(head: DraftHead, draft_ids: torch.Tensor) -> torch.Tensor:
    return draft_ids + head.d2t[draft_ids] if isinstance(head, Eagle3Draft) else draft_ids


def step_metrics(head: DraftHead, batch: TargetBatch, j: int, out: StepOut) -> StepMetrics:
    """Soft cross-entropy of step j against the target's token t+2+j, on the anchors that have one
    (token t+1+j, the one step j is fed, is still in the window)."""
    B, T = batch.shape
    valid = (torch.arange(T, device=batch.ids.device) + 1 + j < T).unsqueeze(0).expand(B, T)
    counted = valid & shift(batch.label_ok, 1 + j)
    label = shift(batch.label_logp, 1 + j)
    ce = -(label.exp() * torch.log_softmax(out.logits, dim=-1)).sum(-1)
    loss = (ce * counted).sum() / counted.sum().clamp(min=1)
    correct = (draft_to_target(head, out.logits.argmax(-1)) == shift(batch.target_next, 1 + j)) & counted
    return StepMetrics(loss=loss, correct=correct, counted=counted)


def unrolled_objective(head: DraftHead, batch: TargetBatch, steps: int) -> Objective:
    """The weighted loss of ``steps`` unrolled steps over ``batch``."""
    unroll = Unroll(head, batch)
    fed, total, metrics = None, 0.0, []
    eagle1 = isinstance(head, EagleDraft)
    for j in range(steps):
        out = unroll.step(j, fed)
        m = step_metrics(head, batch, j, out)
        term = m.loss
        if eagle1:  # the head's hidden state at anchor t stands for the target's feature at t+1+j
            want = shift(batch.features, 1 + j).float()
            reg = F.smooth_l1_loss(out.hidden, want, reduction="none").mean(-1)
            term = EAGLE_CE_WEIGHT * m.loss + (reg * m.counted).sum() / m.counted.sum().clamp(min=1)
        total = total + STEP_DECAY ** j * term
        metrics.append(m)
        fed = out.hidden
    return Objective(loss=total, steps=metrics)


def chain_estimate(accuracy: list[float]) -> float:
    """Accept length of a chain of ``len(accuracy)`` steps if step j's drafts were right with
    probability accuracy[j] given the earlier ones were: 1 + sum_j prod_{i<=j} accuracy[i]. An
    offline indication only; ``shared.training.evaluate`` measures the real one."""
    total, run = 1.0, 1.0
    for a in accuracy:
        run *= a
        total += run
    return total
