"""What an engine gives back: a finished request's result (the Python API's) and the load snapshot (the
services': what the engine holds after each step, read by health, metrics, placement and refusals)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from shared.cuda_graphs import CaptureFailure
from shared.model.tokenizer import Tokenizer
from shared.request import Request
from shared.spec.token_counts import SpecTokenCounts


@dataclass
class GenerationResult:
    rid: str
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]  # with params.top_logprobs: each token's alternatives
    text: str | None
    finish_reason: str
    stop_str: str | None  # the stop string that ended the generation, if one did
    ttft_s: float
    latency_s: float
    spec_stats: dict | None  # the request's speculative statistics (SpecStats.as_dict), None without a draft
    cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache (not computed)

    @classmethod
    def of(cls, req: Request, tokenizer: Tokenizer | None, speculative: bool) -> GenerationResult:
        """``req``'s result so far (its text cut at its stop string; the spec statistics with a draft)."""
        text = tokenizer.decode(req.output_ids) if tokenizer else None
        if req.text is not None:  # cut at its stop string
            req.text.push([], final=True)
            text = req.text.text
        end = req.t_finish or time.perf_counter()
        return cls(rid=req.rid, prompt_ids=req.prompt_ids, token_ids=list(req.output_ids),
                   logprobs=list(req.output_logprobs), top_logprobs=list(req.output_top_logprobs),
                   text=text, finish_reason=req.finish_reason or "abort", stop_str=req.stop_str,
                   ttft_s=(req.t_first_token or end) - req.t_arrival, latency_s=end - req.t_arrival,
                   spec_stats=req.stats.as_dict() if speculative else None, cached_tokens=req.cached_tokens)

    def as_json(self) -> dict:
        return {"request_id": self.rid, "token_ids": self.token_ids, "text": self.text,
                "finish_reason": self.finish_reason, "stop_str": self.stop_str, "prompt_tokens": len(self.prompt_ids),
                "cached_tokens": self.cached_tokens,
                "timing": {"ttft_s": round(self.ttft_s, 6), "latency_s": round(self.latency_s, 6)},
                **({"spec": self.spec_stats} if self.spec_stats is not None else {})}


@dataclass(frozen=True)
class EngineLoad:
    """What an engine holds: the snapshot its loop publishes after each step and call, read from any
    thread by health, metrics, the registry's placement figures and the decode service's refusals."""

    running: int  # requests holding pages
    queued: int  # requests waiting for admission
    prefill_tokens: int  # prompt tokens still to prefill, running and queued requests
    decode_tokens: int  # tokens the running requests may still generate (max_new_tokens left)
    free_pages: tuple[int, ...]  # per cache, target first
    total_pages: tuple[int, ...]  # per cache, target first
    draft_ahead: dict[str, int] = field(default_factory=dict)  # drafts launched ahead, by outcome
    draft_catch_up: dict[str, int] = field(default_factory=dict)  # the draft's catch-ups: extends, positions
    graph_failures: tuple[CaptureFailure, ...] = ()  # CUDA graphs that failed to capture (phase eager)
    spec_tokens: SpecTokenCounts | None = None  # token-level speculation counts so far (None without a draft)
    spec_shape_tokens: dict[str, SpecTokenCounts] = field(default_factory=dict)  # the same per tree shape
    spec_steps: dict[str, int] = field(default_factory=dict)  # decode steps per shape and "plain" (with a draft)
    # With a prefix cache: prompt tokens looked up and found so far, and the pages it holds now (per cache)
    prefix_queries: int = 0
    prefix_hits: int = 0
    prefix_pages: int = 0
    prefix_version: int = 0  # changes whenever a page is cached or evicted (the heartbeat then republishes)

    @classmethod
    def of(cls, scheduler, speculator, policy, prefix_cache, graph_failures) -> EngineLoad:
        """An engine's load: its scheduler's queues and caches, its speculator's and policy's counts (None
        without a draft), its prefix cache's (None without one)."""
        s, w, pc = scheduler, speculator, prefix_cache
        return cls(
            running=len(s.running), queued=len(s.waiting),
            prefill_tokens=sum(r.prompt_len - r.kv_len for r in [*s.running, *s.waiting]),
            decode_tokens=sum(max(0, r.params.max_new_tokens - len(r.output_ids)) for r in s.running),
            free_pages=tuple(c.num_free_pages for c in s.caches),
            total_pages=tuple(c.layout.num_pages for c in s.caches),
            draft_ahead=w.ahead.counts() if w is not None else {}, graph_failures=tuple(graph_failures),
            draft_catch_up=dict(w.stats.catch_up) if w is not None else {},
            spec_tokens=w.stats.tokens.copy() if w is not None else None,
            spec_shape_tokens={n: c.copy() for n, c in w.stats.by_shape.items()} if w is not None else {},
            spec_steps=policy.steps_by_kind() if policy is not None else {},
            **({} if pc is None else dict(prefix_queries=pc.lookups, prefix_hits=pc.hits, prefix_pages=len(pc),
                                          prefix_version=pc.version)))
