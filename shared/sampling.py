"""Sampling parameters, the target distribution they define, and seeded per-request draws (each a
function of the request's seed and the drawn token's position).

The distribution a request samples from is defined once, by ``kernels.spec_sampling.target_weights``
(temperature, then top-k and top-p as one threshold on integer weights); ``target_probs`` normalises
it for target-only sampling, and speculative verification draws from the same weights, which is
what makes verification lossless.
"""

from __future__ import annotations

import math
import secrets

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kernels.spec_sampling import (
    TARGET_ONLY_DRAW,
    SamplingRows,
    draw_limbs,
    kept_weights,
    request_key,
    target_weights,
)


class SamplingParams(BaseModel):
    model_config = ConfigDict(frozen=True)
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: int | None = None
    max_new_tokens: int = 16
    stop_token_ids: tuple[int, ...] = Field(default_factory=tuple)
    ignore_eos: bool = False
    stop: tuple[str, ...] = Field(default_factory=tuple)  # stop strings, matched on the output text
    include_stop_str_in_output: bool = False
    # Penalties and filters (shared/logits_process.py), vLLM's meanings; the defaults are neutral.
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=10.0)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    min_tokens: int = Field(default=0, ge=0)
    logit_bias: tuple[tuple[int, float], ...] = Field(default_factory=tuple)  # (token id, bias in [-100, 100])
    allowed_token_ids: tuple[int, ...] = Field(default_factory=tuple)  # empty = every token
    # The most likely tokens returned with each output token, with their log-probabilities (OpenAI's limit).
    top_logprobs: int = Field(default=0, ge=0, le=20)
    # Structured output (shared/grammar.py): the JSON schema the output matches, as JSON text; response_format
    # {"type": "json_object"} is {"type": "object"}. None: free text.
    json_schema: str | None = None
    # The prompt's last tokens that are output of an earlier call (a client continuing a structured value it
    # re-sends as prompt): the grammar consumes them first. 0 for a new request. (The router's failover hands
    # the streamed tokens over as output instead, which the grammar also consumes.)
    resumed_tokens: int = Field(default=0, ge=0)

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: tuple[tuple[int, float], ...]) -> tuple[tuple[int, float], ...]:
        if any(not (math.isfinite(b) and -100 <= b <= 100) for _, b in v):
            raise ValueError("logit_bias values must be in [-100, 100]")
        return v

    @model_validator(mode="after")
    def _min_tokens(self) -> SamplingParams:
        if self.min_tokens > self.max_new_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) exceeds max_new_tokens ({self.max_new_tokens})")
        return self

    def token_ids_used(self) -> list[int]:
        """Every token id the parameters name (the engine and the router check them against the vocabulary)."""
        return [*self.stop_token_ids, *(t for t, _ in self.logit_bias), *self.allowed_token_ids]

    @field_validator("json_schema")
    @classmethod
    def _json_schema(cls, v: str | None) -> str | None:
        if v is not None:
            from shared.grammar import check_schema

            check_schema(v)  # a ValueError names the problem
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if any(not s for s in v):
            raise ValueError("stop strings must not be empty")
        return v

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


def request_seed(params: SamplingParams) -> int:
    """The seed a request draws with: its own, or a random one chosen at admission."""
    return params.seed if params.seed is not None else secrets.randbits(64)


def sampling_rows(params: list[SamplingParams], seeds: list[int], device: torch.device | str) -> SamplingRows:
    """The batch's sampling parameters as device tensors (two host-to-device copies)."""
    ints = torch.tensor(sampling_ints(params, seeds), dtype=torch.int64).view(2, len(params)).to(device)
    return sampling_rows_from(params, ints[0], ints[1], device)


def sampling_ints(params: list[SamplingParams], seeds: list[int]) -> list[list[int]]:
    """The integer rows of the batch's sampling parameters: top-k, and each seed as a signed int64."""
    return [[p.top_k for p in params], [s - (1 << 64) if s >= 1 << 63 else s for s in seeds]]


def sampling_rows_from(params: list[SamplingParams], top_k: torch.Tensor, seed: torch.Tensor,
                       device: torch.device | str) -> SamplingRows:
    """``SamplingRows`` from integer rows already on the device and the float rows of ``params``."""
    floats = to_device(torch.tensor([[p.temperature for p in params], [p.top_p for p in params]],
                                    dtype=torch.float32).view(2, len(params)), device)
    return SamplingRows(temperature=floats[0], top_k=top_k, top_p=floats[1], seed=seed)


def to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor's copy on ``device``, without waiting for the device: on a GPU through pinned memory (a
    copy from pageable memory waits for every kernel queued before it, leaving the GPU idle behind the host's
    work that follows it)."""
    device = torch.device(device)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def target_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """[R, V] float32 probabilities after temperature, top-k and top-p, row r under params[r].

    Greedy rows get a one-hot on the argmax, so greedy is the temperature -> 0 limit of sampling.
    """
    rows = sampling_rows(params, [0] * len(params), logits.device)
    tw = target_weights(logits.unsqueeze(1), rows)
    probs = (kept_weights(tw).squeeze(1).double() / tw.total.double().clamp(min=1)).float()
    onehot = torch.zeros_like(probs).scatter_(1, logits.argmax(dim=1, keepdim=True), 1.0)
    return torch.where((rows.temperature == 0).unsqueeze(1), onehot, probs)


def draw_from(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw per row: the token whose cumulative mass first exceeds u."""
    cdf = probs.double().cumsum(dim=1)
    u = uniforms.to(probs.device, torch.float64).unsqueeze(1) * cdf[:, -1:]
    idx = torch.searchsorted(cdf, u, right=True).squeeze(1)
    return idx.clamp_(max=probs.shape[1] - 1)


def top_logprobs(logprobs: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``n`` largest of [..., V] log-probabilities: values [..., n] float32 and token ids [..., n] int64,
    most likely first."""
    values, ids = logprobs.float().topk(n, dim=-1)
    return values, ids


def top_pairs(values: list[list[float]], ids: list[list[int]], n: int) -> list[list[tuple[int, float]]]:
    """Host rows of ``top_logprobs`` as (token id, logprob) pairs, the first ``n`` of each row."""
    return [list(zip(i[:n], v[:n])) for v, i in zip(values, ids)]


def uniforms(seeds: list[int], positions: list[int]) -> torch.Tensor:
    """[R] float64 U[0,1): request r's draw for its token at ``positions[r]`` (the tokens before it).

    Counter-based, as speculative verification's draws (``kernels.spec_sampling``): a hash of the seed and
    the position, under a draw index no tree node uses. So a request draws the same numbers whatever ran
    before on this instance or another one: a failover that resumes it at the same position draws what
    the lost instance would have drawn. Host integers (no device op); 53 bits of the 60-bit draw, so
    u < 1 exactly."""
    out = []
    for seed, pos in zip(seeds, positions):
        hi, lo = draw_limbs(request_key(seed, pos), TARGET_ONLY_DRAW)
        out.append(((hi << 23) | (lo >> 7)) / (1 << 53))
    return torch.tensor(out, dtype=torch.float64)


def sample(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int], positions: list[int]
           ) -> torch.Tensor:
    """[R] int64 next tokens, row r at ``positions[r]`` of a request seeded ``seeds[r]``; greedy rows take
    the argmax and draw no random number."""
    if all(p.greedy for p in params):
        return logits.argmax(dim=1)
    probs = target_probs(logits, params)
    draws = uniforms(*zip(*[(s, t) for s, t, p in zip(seeds, positions, params) if not p.greedy]))
    out = logits.argmax(dim=1)
    sampled = torch.tensor([not p.greedy for p in params], device=logits.device)
    out[sampled] = draw_from(probs[sampled], draws)
    return out
