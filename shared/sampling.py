"""Sampling parameters, the target distribution they define, and seeded per-request draws.

``target_probs`` is the one definition of "the distribution a request samples from"; target-only
sampling and speculative verification both use it, which is what makes verification lossless.
"""

from __future__ import annotations

import math

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator


class SamplingParams(BaseModel):
    model_config = ConfigDict(frozen=True)
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: int | None = None
    max_new_tokens: int = 16
    stop_token_ids: tuple[int, ...] = Field(default_factory=tuple)
    ignore_eos: bool = False

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, v: float) -> float:
        if not (math.isfinite(v) and v >= 0):
            raise ValueError("temperature must be a finite number >= 0")
        return v

    @field_validator("top_p")
    @classmethod
    def _top_p(cls, v: float) -> float:
        if not 0 < v <= 1:
            raise ValueError("top_p must be in (0, 1]")
        return v

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int) -> int:
        if v < 0:
            raise ValueError("top_k must be >= 0 (0 disables it)")
        return v

    @field_validator("max_new_tokens")
    @classmethod
    def _max_new(cls, v: int) -> int:
        if v < 1:
            raise ValueError("max_new_tokens must be >= 1")
        return v

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def target_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """[R, V] float32 probabilities after temperature, top-k and top-p, row r under params[r].

    Greedy rows get a one-hot on the argmax, so greedy is the temperature -> 0 limit of sampling.
    """
    logits = logits.float()
    device = logits.device
    temps = torch.tensor([p.temperature for p in params], device=device)
    greedy = temps == 0
    scaled = logits / torch.where(greedy, torch.ones_like(temps), temps).unsqueeze(1)
    top_ks = torch.tensor([p.top_k if p.top_k > 0 else logits.shape[1] for p in params], device=device)
    top_ps = torch.tensor([p.top_p for p in params], device=device)
    sorted_logits, order = scaled.sort(dim=1, descending=True)
    rank = torch.arange(logits.shape[1], device=device).unsqueeze(0)
    drop = rank >= top_ks.unsqueeze(1)
    sorted_probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=1)
    # top-p keeps the smallest prefix whose mass reaches p (the first token always stays).
    mass_before = sorted_probs.cumsum(dim=1) - sorted_probs
    drop |= mass_before >= top_ps.unsqueeze(1)
    drop[:, 0] = False
    sorted_probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=1)
    probs = torch.zeros_like(sorted_probs).scatter_(1, order, sorted_probs)
    if greedy.any():
        onehot = torch.zeros_like(probs).scatter_(1, logits.argmax(dim=1, keepdim=True), 1.0)
        probs = torch.where(greedy.unsqueeze(1), onehot, probs)
    return probs


def draw_from(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw per row: the token whose cumulative mass first exceeds u."""
    cdf = probs.double().cumsum(dim=1)
    u = uniforms.to(probs.device, torch.float64).unsqueeze(1) * cdf[:, -1:]
    idx = torch.searchsorted(cdf, u, right=True).squeeze(1)
    return idx.clamp_(max=probs.shape[1] - 1)


def make_generator(seed: int | None) -> torch.Generator:
    gen = torch.Generator()
    gen.manual_seed(seed if seed is not None else torch.seed())
    return gen


def uniforms(generators: list[torch.Generator]) -> torch.Tensor:
    """One U[0,1) draw per request, from that request's own host generator (device independent)."""
    return torch.cat([torch.rand(1, generator=g, dtype=torch.float64) for g in generators])


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]) -> torch.Tensor:
    """[R] int64 next tokens; greedy rows take the argmax and draw no random number."""
    if all(p.greedy for p in params):
        return logits.argmax(dim=1)
    probs = target_probs(logits, params)
    draws = uniforms([g for g, p in zip(generators, params) if not p.greedy])
    out = logits.argmax(dim=1)
    sampled = torch.tensor([not p.greedy for p in params], device=logits.device)
    out[sampled] = draw_from(probs[sampled], draws)
    return out
