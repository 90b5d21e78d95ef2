"""Acceptance of a written head, measured by the engine's own speculative decoding.

``measure_acceptance`` loads the head from its directory onto the already loaded target (the path
``Engine(draft=...)`` takes when serving), decodes held-out prompts greedily with a chain of
``steps`` drafts, and reports what the engine counted: accept length (tokens committed per verify)
and accept rate. ``heldout_prompts`` picks the prompts from the held-out token stream.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from shared.config import EngineConfig, SpecConfig
from shared.engine import Engine
from shared.model.llama import LlamaForCausalLM
from shared.sampling import SamplingParams


@dataclass
class Acceptance:
    accept_length: float  # committed tokens per verify
    accept_rate: float  # accepted drafts over proposed drafts
    verify_steps: int
    tokens: list[list[int]]  # the greedy outputs (equal to the target's own: verification is lossless)

    def as_dict(self) -> dict:
        return {"accept_length": round(self.accept_length, 4), "accept_rate": round(self.accept_rate, 4),
                "verify_steps": self.verify_steps}


def heldout_prompts(heldout: torch.Tensor, count: int, length: int) -> list[list[int]]:
    """``count`` prompts of ``length`` tokens (fewer when the held-out stream is short), evenly spread."""
    length = min(length, heldout.numel())
    last = heldout.numel() - length
    starts = sorted({round(i * last / max(count - 1, 1)) for i in range(count)})
    return [heldout[s:s + length].tolist() for s in starts]


def measure_acceptance(target: LlamaForCausalLM, head_dir: str | Path, prompts: list[list[int]], steps: int,
                       new_tokens: int, dtype: str, device: str) -> Acceptance:
    longest = max(len(p) for p in prompts) + new_tokens
    config = EngineConfig(device=device, dtype=dtype, max_running=len(prompts), max_context=longest + 1,
                          chunk_size=None, spec=SpecConfig(topk=1, steps=steps, num_draft_tokens=steps + 1),
                          spec_policy="fixed")  # the chain's own acceptance, every step
    engine = Engine(target, draft=head_dir, config=config)
    results = engine.generate(prompts, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
    totals = engine.spec_stats.totals
    return Acceptance(accept_length=totals.accept_length, accept_rate=totals.accept_rate,
                      verify_steps=totals.verify_steps, tokens=[r.token_ids for r in results])
