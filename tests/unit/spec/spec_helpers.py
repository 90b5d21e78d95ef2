"""Helpers for the speculative-decoding tests: loaded models (shared by many engines), target-only
references computed once per prompt set, and comparisons.

Engines here are small (``max_context`` 160, 8 rows) so that each costs little to build; the
target and draft modules are loaded once per session and shared, since an engine only adds caches.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from shared.config import EngineConfig, SpecConfig
from shared.engine import Engine, GenerationResult
from shared.model.drafts import DraftHead, load_draft
from shared.model.llama import LlamaForCausalLM
from shared.model.loader import load_target
from shared.sampling import SamplingParams

KINDS = ("eagle", "eagle3", "mtp")
SMALL = dict(max_running=8, max_context=160)

# Five prompts of mixed lengths (3 .. 53 tokens), so that chunks of 4 and 64 cut them differently.
PROMPTS = [
    [7, 8, 9],
    [100 + (i * 37) % 300 for i in range(53)],
    [5, 6, 7, 8, 9, 10, 11],
    list(range(3, 40)),
    [60 + (i * 11) % 97 for i in range(18)],
]
GREEDY = SamplingParams(max_new_tokens=16, ignore_eos=True)


@dataclass
class Models:
    """One checkpoint directory's target and draft heads, loaded once."""

    root: Path
    target: LlamaForCausalLM
    drafts: dict[str, DraftHead] = field(default_factory=dict)
    device: str = "cpu"
    _refs: dict = field(default_factory=dict)

    def engine(self, kind: str | None = None, topk: int = 1, steps: int = 3, ndt: int | None = None,
               **cfg) -> Engine:
        """An engine on the shared modules; ``kind=None``: target only."""
        spec = None
        if kind is not None:
            spec = SpecConfig(topk=topk, steps=steps, num_draft_tokens=ndt or steps + 1)
        config = EngineConfig(**{**SMALL, "device": self.device, **cfg, "spec": spec})
        return Engine(self.target, self.drafts[kind] if kind else None, config)

    def fixed(self, kind: str | None = None, topk: int = 1, steps: int = 3, ndt: int | None = None,
              **cfg) -> Engine:
        """``engine`` under the fixed policy: every decode step speculates with the configured shape, for the
        tests that count verify steps, drafts launched ahead or per-step trees (the default, adaptive, may run
        other shapes or plain steps by its measured costs)."""
        return self.engine(kind, topk, steps, ndt, **{"spec_policy": "fixed", **cfg})

    def reference(self, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[GenerationResult]:
        """Greedy target-only results (page size 1, whole prompts, one batch), cached per prompts."""
        key = (tuple(map(tuple, prompts)), params)
        if key not in self._refs:
            engine = self.engine(page_size=1, chunk_size=None)
            self._refs[key] = engine.generate(prompts, params)
            assert engine.is_idle_and_clean()
        return self._refs[key]


def load_models(root: Path, device: str = "cpu") -> Models:
    target = load_target(root / "target", device=device)
    drafts = {k: load_draft(root / k, target, device=device) for k in KINDS}
    return Models(root=root, target=target, drafts=drafts, device=device)


def add_feature_path(models: Models, scale: float = 0.25, seed: int = 5) -> Models:
    """Give the oracle heads a small random read of the target features (in memory).

    The factory's oracle heads ignore the features entirely (their input projection keeps only the
    token), so a feature gathered from the wrong tree node or chunk would go unnoticed. With this
    path every draft K/V and hidden state depends on the features, and drafts are still accepted
    often (accept length about 1.6-1.9 instead of 1.9-2.3).
    """
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for kind, draft in models.drafts.items():
            projections = [layer.eh_proj for layer in draft.layers] if kind == "mtp" else [draft.fc]
            for proj in projections:
                w = proj.weight
                h = w.shape[1] - draft.feature_width(from_target=True)  # the token part, kept as is
                w[:, h:] = scale * torch.randn(w.shape[0], w.shape[1] - h, generator=g) / (w.shape[1] - h) ** 0.5
    return models


def assert_same_greedy(got: list[GenerationResult], want: list[GenerationResult], what: str = "") -> None:
    """Token for token, logprobs to float32 noise (tree verify reduces in another order)."""
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.token_ids == w.token_ids, f"{what} prompt {i}: {g.token_ids} != {w.token_ids}"
        assert torch.allclose(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=1e-4), \
            f"{what} prompt {i}: logprobs {g.logprobs} != {w.logprobs}"
        assert g.finish_reason == w.finish_reason


class CountingModel:
    """A target as an engine calls it (``engine.model``), counting its forwards."""

    def __init__(self, model):
        self.model, self.calls = model, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.model(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.model, name)


def run_steps(engine: Engine) -> list[list[tuple[str, list[int]]]]:
    """Step the engine until done; per step, the (request id, tokens committed) events."""
    steps = []
    while engine.scheduler.has_work():
        steps.append([(r.rid, toks) for r, toks in engine.step()])
    return steps
