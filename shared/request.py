"""A request's life in an engine: its tokens, its cache claims and its statistics."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, fields
from enum import Enum

import torch

from shared.memory.kv_cache import KVHandle
from shared.sampling import SamplingParams


class RequestError(ValueError):
    """A request the engine refuses; ``field`` names the input at fault."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


class Phase(Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    HANDOFF = "handoff"  # prefill role: prompt done, waiting to be sent to a decode instance
    RECEIVING = "receiving"  # decode role: pages reserved, K/V arriving
    FINISHED = "finished"


@dataclass
class SpecStats:
    """Speculative statistics (a request's, or an engine's summed over requests).

    Accept length is committed tokens per verify: the accepted drafts plus the bonus token, cut where
    EOS, a stop token or max_new_tokens ended the request inside the accepted run (the discarded rest
    is not counted). Accept rate is the drafts verification accepted (discarded ones included: it
    measures the draft, not where the request ended) over the drafts it could accept (``steps`` per
    verify). Without a cut, accept length = (accepted_drafts + verify_steps) / verify_steps.
    """

    verify_steps: int = 0
    accepted_drafts: int = 0  # draft tokens verification accepted (bonus tokens not counted)
    proposed_drafts: int = 0  # draft tokens on the verified path's depth budget (steps per verify)
    committed_tokens: int = 0  # tokens the verifies committed to the output (bonus included)
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0

    @property
    def accept_length(self) -> float:
        """Committed tokens per verify."""
        return self.committed_tokens / self.verify_steps if self.verify_steps else 0.0

    @property
    def accept_rate(self) -> float:
        return self.accepted_drafts / self.proposed_drafts if self.proposed_drafts else 0.0

    def add(self, other: SpecStats) -> None:
        """Sum ``other`` into these statistics (a verify step into a request's, or into the engine's)."""
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def as_dict(self) -> dict:
        return {"verify_steps": self.verify_steps, "accepted_drafts": self.accepted_drafts,
                "committed_tokens": self.committed_tokens,
                "accept_length": round(self.accept_length, 4), "accept_rate": round(self.accept_rate, 4),
                "draft_time_s": round(self.draft_time_s, 6), "verify_time_s": round(self.verify_time_s, 6)}


@dataclass
class Request:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    eos_ids: tuple[int, ...] = ()
    generator: torch.Generator | None = None
    seed: int = 0  # the seed its speculative draws hash with the committed length (set at admission)
    phase: Phase = Phase.WAITING
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)  # target log p of each output token
    handles: list[KVHandle] = field(default_factory=list)  # one per cache, target first
    kv_len: int = 0  # committed tokens whose target K/V is cached
    finish_reason: str | None = None
    draft_state: object | None = None  # shared.spec.state.DraftState while decoding with a draft
    stats: SpecStats = field(default_factory=SpecStats)
    t_arrival: float = field(default_factory=time.perf_counter)
    t_first_token: float | None = None
    t_finish: float | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def prefill_done(self) -> bool:
        return self.kv_len >= self.prompt_len

    def commit(self, tokens: list[int], logprobs: list[float]) -> list[int]:
        """Append sampled tokens up to the first stop condition; returns those appended."""
        taken = []
        for tok, lp in zip(tokens, logprobs):
            if self.finish_reason is not None:
                break
            self.output_ids.append(tok)
            self.output_logprobs.append(lp)
            taken.append(tok)
            if self.t_first_token is None:
                self.t_first_token = time.perf_counter()
            self.finish_reason = self._stop_reason(tok)
        return taken

    def _stop_reason(self, tok: int) -> str | None:
        if tok in self.params.stop_token_ids:
            return "stop"
        if not self.params.ignore_eos and tok in self.eos_ids:
            return "stop"
        if len(self.output_ids) >= self.params.max_new_tokens:
            return "length"
        return None
