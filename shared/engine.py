"""The single-process engine: continuous batching, chunked prefill, optional EAGLE speculation.

``Engine.generate`` is the Python API; the services drive the same engine through ``add_request``
/ ``step`` (prefill) or ``admit_handoff`` / ``step`` (decode).
"""

from __future__ import annotations

import contextlib
import itertools
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from shared.batch import build_forward_batch, build_uniform_batch
from shared.config import EngineConfig
from shared.memory.kv_cache import CacheSpec, KVCache
from shared.model.config import ModelConfig
from shared.model.llama import LlamaForCausalLM, TargetOutput
from shared.model.loader import load_target, parse_dtype
from shared.model.tokenizer import Tokenizer
from shared.request import Phase, Request, RequestError
from shared.runner import PhaseGraphs, pad_rows
from shared.sampling import SamplingParams, make_generator, request_seed, sample
from shared.scheduler import Scheduler, StepPlan


@dataclass
class GenerationResult:
    rid: str
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    text: str | None
    finish_reason: str
    ttft_s: float
    latency_s: float
    spec: dict | None

    def as_json(self) -> dict:
        return {"request_id": self.rid, "token_ids": self.token_ids, "text": self.text,
                "finish_reason": self.finish_reason, "prompt_tokens": len(self.prompt_ids),
                "timing": {"ttft_s": round(self.ttft_s, 6), "latency_s": round(self.latency_s, 6)},
                **({"spec": self.spec} if self.spec is not None else {})}


def make_cache(config: ModelConfig, num_layers: int, engine: EngineConfig, max_context: int) -> KVCache:
    max_context += engine.headroom  # a decode step near the end of the context writes past it
    num_pages = engine.num_pages or engine.max_running * -(-max_context // engine.page_size)
    return KVCache(CacheSpec(
        num_layers=num_layers, num_kv_heads=config.num_key_value_heads, head_dim=config.head_dim,
        dtype=parse_dtype(engine.dtype), device=torch.device(engine.device), page_size=engine.page_size,
        num_pages=num_pages, max_reqs=engine.max_running, max_context=max_context,
    ))


class Engine:
    def __init__(self, model: str | Path | LlamaForCausalLM, draft: str | Path | None = None,
                 config: EngineConfig | None = None, tokenizer: Tokenizer | None = None,
                 role: str = "both"):
        if role not in ("both", "prefill", "decode"):
            raise ValueError(f"role must be both, prefill or decode, got {role!r}")
        self.role = role
        config = config or EngineConfig()
        self.config = config
        self.device = torch.device(config.device)
        if config.device.startswith("cuda") and not torch.cuda.is_available():
            raise RequestError("device", "cuda was asked for but no CUDA device is available")
        if isinstance(model, LlamaForCausalLM):
            self.model = model
        else:
            self.model = load_target(model, config.dtype, config.device)
            if tokenizer is None and (Path(model) / "tokenizer.json").exists():
                tokenizer = Tokenizer(model)
        self.tokenizer = tokenizer
        mc = self.model.config
        self.max_context = min(config.max_context or mc.max_position_embeddings, mc.max_position_embeddings)
        self.cache = make_cache(mc, mc.num_hidden_layers, config, self.max_context)
        self.spec = None
        if draft is not None:
            from shared.spec.worker import SpecWorker  # the draft machinery is optional

            self.spec = SpecWorker.load(draft, self, config)
        caches = [self.cache] + (self.spec.caches if self.spec else [])
        self.scheduler = Scheduler(caches, config.max_running, config.chunk_size, config.headroom,
                                   prefill_only=role == "prefill")
        graphs_on = set(config.cuda_graph_phases) if config.cuda_graph else set()
        self.decode_graphs = PhaseGraphs("decode", self._decode_phase, "decode" in graphs_on, config.cuda_graph_max_bs)
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()

    # ---- requests --------------------------------------------------------------------------------
    def validate_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("prompt", "text prompts need a tokenizer.json beside the model")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise RequestError("prompt", "the prompt is empty")
        vocab = self.model.config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise RequestError("prompt", f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
        if len(ids) >= self.max_context:
            raise RequestError("prompt", f"{len(ids)} tokens do not fit the context of {self.max_context}")
        return ids

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    rid: str | None = None) -> Request:
        params = params or SamplingParams()
        ids = self.validate_prompt(prompt)
        if len(ids) + params.max_new_tokens > self.max_context:
            raise RequestError("max_new_tokens", f"prompt ({len(ids)}) + max_new_tokens "
                               f"({params.max_new_tokens}) exceeds the context of {self.max_context}")
        rid = rid or f"req-{next(self._ids)}"
        if rid in self.requests:
            raise RequestError("request_id", f"{rid!r} is already running")
        seed = request_seed(params)
        req = Request(rid=rid, prompt_ids=ids, params=params, eos_ids=self.model.config.eos_token_ids,
                      generator=make_generator(seed), seed=seed)
        self.scheduler.submit(req)
        self.requests[rid] = req
        return req

    def abort(self, rid: str) -> bool:
        req = self.requests.pop(rid, None)
        if req is None:
            return False
        req.finish_reason = req.finish_reason or "abort"
        req.phase = Phase.FINISHED
        self.scheduler.release(req)
        return True

    # ---- stepping --------------------------------------------------------------------------------
    def on_device(self) -> contextlib.AbstractContextManager:
        """This engine's GPU as the calling thread's current CUDA device (a no-op off CUDA). Triton
        launches, CUDA events, streams and graph capture all use the current device, not the device of
        the tensors they touch: an engine on ``cuda:1`` run from a thread whose current device is 0
        (every new thread's) would launch its kernels and record its events on the wrong GPU."""
        return torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()

    def step(self) -> list[tuple[Request, list[int]]]:
        """Run one scheduling step; returns (request, tokens it committed) for each request touched."""
        with self.on_device():
            return self._step()

    def _step(self) -> list[tuple[Request, list[int]]]:
        plan = self.scheduler.schedule()
        if self.spec is not None and not plan.decode:
            self.spec.drop_ahead()  # no decode step now: a draft launched ahead would wait in vain
        events: list[tuple[Request, list[int]]] = []
        if plan.empty:
            return events
        if self.spec is None and not plan.prefill and self.decode_graphs.enabled:
            events += self._run_decode_step(plan.decode)
        elif self.spec is None:
            events += self._run_target_step(plan)
        else:
            if plan.prefill:
                events += self._run_target_step(StepPlan(prefill=plan.prefill))
            if plan.decode:
                events += self.spec.decode_step(plan.decode)
        for req, _ in events:
            if req.finish_reason is not None and req.phase is not Phase.FINISHED:
                self._finish(req)
        return events

    def _finish(self, req: Request) -> None:
        req.phase = Phase.FINISHED
        req.t_finish = time.perf_counter()
        self.scheduler.release(req)
        self.requests.pop(req.rid, None)

    def _run_target_step(self, plan: StepPlan) -> list[tuple[Request, list[int]]]:
        """One target forward over the decode tokens and prefill chunks of ``plan``."""
        rows, prefix, q_lens, ids, pos, sample_rows, sampled_reqs = [], [], [], [], [], [], []
        for req in plan.decode:
            self.cache.reserve(req.handles[0], req.kv_len + 1)
            rows.append(req.handles[0].row), prefix.append(req.kv_len), q_lens.append(1)
            ids.append(req.all_ids[req.kv_len]), pos.append(req.kv_len)
            sample_rows.append(len(ids) - 1), sampled_reqs.append(req)
        for ch in plan.prefill:
            rows.append(ch.req.handles[0].row), prefix.append(ch.start), q_lens.append(ch.end - ch.start)
            ids.extend(ch.req.prompt_ids[ch.start:ch.end]), pos.extend(range(ch.start, ch.end))
            if ch.completes_prompt:
                sample_rows.append(len(ids) - 1), sampled_reqs.append(ch.req)
        positions = torch.tensor(pos, dtype=torch.int64)
        batch = build_forward_batch(self.cache, rows, prefix, q_lens, torch.tensor(ids), positions, positions,
                                    logits_rows=torch.tensor(sample_rows, dtype=torch.int64))
        capture = self.spec.capture_mode if self.spec is not None else "none"
        out = self.model(batch, self.cache, capture=capture, aux_layers=self.spec.aux_layers if self.spec else ())
        for req in plan.decode:
            req.kv_len += 1
        for ch in plan.prefill:
            ch.req.kv_len = ch.end
        events = self._sample_and_commit(out, sampled_reqs)
        if self.spec is not None:
            self.spec.draft_extend_prefill(plan.prefill, out)
        for ch in plan.prefill:
            if ch.completes_prompt:
                ch.req.phase = Phase.HANDOFF if self.role == "prefill" else Phase.DECODING
            elif not any(r is ch.req for r, _ in events):
                events.append((ch.req, []))
        return events

    def _decode_phase(self, rows: torch.Tensor, lengths: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Pure tensor decode forward (graph-capturable): one token per request at its length."""
        batch = build_uniform_batch(self.cache, rows, lengths, 1, 1, tokens, lengths, lengths.unsqueeze(1))
        return self.model(batch, self.cache).logits

    def _run_decode_step(self, reqs: list[Request]) -> list[tuple[Request, list[int]]]:
        n = len(reqs)
        bs = self.decode_graphs.bucket(n) or n
        for req in reqs:
            self.cache.reserve(req.handles[0], req.kv_len + 1)
        dev = self.device
        rows = pad_rows(torch.tensor([r.handles[0].row for r in reqs], dtype=torch.int64, device=dev), bs)
        lengths = pad_rows(torch.tensor([r.kv_len for r in reqs], dtype=torch.int64, device=dev), bs)
        tokens = pad_rows(torch.tensor([r.all_ids[r.kv_len] for r in reqs], dtype=torch.int64, device=dev), bs)
        logits = self.decode_graphs(rows, lengths, tokens)[:n]
        for req in reqs:
            req.kv_len += 1
        return self._sample_and_commit(TargetOutput(logits=logits), reqs)

    def _sample_and_commit(self, out: TargetOutput, reqs: list[Request]) -> list[tuple[Request, list[int]]]:
        if not reqs:
            return []
        tokens = sample(out.logits, [r.params for r in reqs], [r.generator for r in reqs])
        logprobs = torch.log_softmax(out.logits, dim=-1).gather(1, tokens.unsqueeze(1)).squeeze(1)
        return [(r, r.commit([t], [lp])) for r, t, lp in zip(reqs, tokens.tolist(), logprobs.tolist())]

    # ---- disaggregation: prefill hands requests to a decode instance ------------------------------
    def take_handoffs(self) -> list[Request]:
        """Requests whose prefill completed (prefill role); they keep their pages until released."""
        return [r for r in self.scheduler.running if r.phase is Phase.HANDOFF and r.finish_reason is None]

    def page_ids(self, req: Request) -> list[list[int]]:
        """Per cache (target first), the request's page ids in position order."""
        return [cache.pages_of(h, 0, cache.pages_for(h.reserved))
                for cache, h in zip(self.scheduler.caches, req.handles)]

    def release(self, req: Request, reason: str = "handed_off") -> None:
        """Drop a request and return its pages (after the decode side acknowledged, or on failure)."""
        req.finish_reason = req.finish_reason or reason
        self._finish(req)

    def reserve_handoff(self, rid: str, prompt_ids: list[int], output_ids: list[int],
                        output_logprobs: list[float], params: SamplingParams, committed_len: int) -> Request | None:
        """Decode role: claim pages for a request about to arrive; None when it cannot be held now."""
        if rid in self.requests:
            raise RequestError("request_id", f"{rid!r} is already here")
        seed = request_seed(params)
        req = Request(rid=rid, prompt_ids=list(prompt_ids), params=params,
                      eos_ids=self.model.config.eos_token_ids, generator=make_generator(seed), seed=seed)
        req.output_ids, req.output_logprobs = list(output_ids), list(output_logprobs)
        self.scheduler.check_fits(req)
        if not self.scheduler.can_admit(req):
            return None
        req.handles = [cache.open() for cache in self.scheduler.caches]
        for cache, h in zip(self.scheduler.caches, req.handles):
            cache.reserve(h, committed_len)
        req.phase = Phase.RECEIVING
        self.scheduler.running.append(req)
        self.requests[rid] = req
        return req

    def activate_handoff(self, req: Request, committed_len: int, draft_state=None) -> None:
        """The K/V has arrived: the request resumes straight into the decode loop."""
        req.kv_len = committed_len
        req.draft_state = draft_state
        if draft_state is not None and draft_state.rng_state is not None:
            req.generator.set_state(draft_state.rng_state)
        if draft_state is not None and draft_state.seed is not None:
            req.seed = draft_state.seed  # the prefill side's: an unseeded request keeps its random one
        req.t_first_token = req.t_first_token or time.perf_counter()
        req.phase = Phase.DECODING

    # ---- the Python API --------------------------------------------------------------------------
    def run_until_done(self, max_steps: int | None = None) -> None:
        for _ in range(max_steps) if max_steps else itertools.count():
            if not self.scheduler.has_work():
                return
            self.step()

    def generate(self, prompts: list[str | list[int]] | str | list[int],
                 params: SamplingParams | list[SamplingParams] | None = None) -> list[GenerationResult]:
        single = isinstance(prompts, str) or (prompts and isinstance(prompts[0], int))
        prompts = [prompts] if single else list(prompts)
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        reqs = []
        try:
            for p, sp in zip(prompts, plist):
                reqs.append(self.add_request(p, sp))
        except RequestError:
            for r in reqs:
                self.abort(r.rid)
            raise
        self.run_until_done()
        return [self.result(r) for r in reqs]

    def result(self, req: Request) -> GenerationResult:
        text = self.tokenizer.decode(req.output_ids) if self.tokenizer else None
        end = req.t_finish or time.perf_counter()
        return GenerationResult(
            rid=req.rid, prompt_ids=req.prompt_ids, token_ids=list(req.output_ids),
            logprobs=list(req.output_logprobs), text=text, finish_reason=req.finish_reason or "abort",
            ttft_s=(req.t_first_token or end) - req.t_arrival, latency_s=end - req.t_arrival,
            spec=req.stats.as_dict() if self.spec is not None else None,
        )

    def capture_graphs(self) -> int:
        """Capture every enabled CUDA graph of every batch-size bucket now, so serving starts without
        capture pauses (the services do this while /health says ``capturing``). Runs on padding rows
        only (request row 0, length 0: the sink page), as capture always does. Returns how many graphs
        exist afterwards; nothing happens off CUDA."""
        if self.device.type != "cuda":
            return 0
        with self.on_device():
            return self._capture_graphs()

    def _capture_graphs(self) -> int:
        if self.spec is not None:
            return self.spec.capture_graphs()
        g = self.decode_graphs
        if g.capture:
            for bs in g.buckets:
                zeros = torch.zeros(bs, dtype=torch.int64, device=self.device)
                g(zeros, zeros.clone(), zeros.clone())
        return len(g.captured_sizes)

    def is_idle_and_clean(self) -> bool:
        """True when no request runs and every cache is full again (the no-leak invariant)."""
        return not self.scheduler.has_work() and all(c.is_full() for c in self.scheduler.caches)
