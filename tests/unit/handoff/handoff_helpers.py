"""Helpers of the hand-off tests: models whose drafts depend on the transferred state, and an in-process
hand-off between two engines through the real wire format or ipc's in-place copies (no sockets), after
the prefill or during it."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from shared.config import EngineConfig, SpecConfig
from shared.engine import Engine
from shared.handoff import PageSink, PageSource, Prefilled, decode_draft_state, encode_draft_state, iter_chunks
from shared.handoff.ipc import write_in_place
from shared.handoff.wire import page_bytes
from shared.model.drafts import DraftHead, load_draft
from shared.model.llama import LlamaForCausalLM
from shared.model.loader import load_target
from shared.request import Request, Stage
from shared.sampling import SamplingParams

KINDS = ("eagle", "eagle3", "mtp")
SHORT = [5, 17, 33, 2, 9]  # shorter than the chunk (8)
LONG = [(i * 37 + 11) % 500 for i in range(30)]  # several chunks
PROMPTS = [SHORT, LONG]
GREEDY = SamplingParams(max_new_tokens=16, ignore_eos=True)


@dataclass
class Models:
    root: Path
    target: LlamaForCausalLM
    drafts: dict[str, DraftHead]


def load_models(root: Path, feature_scale: float = 0.25, seed: int = 5, device: str = "cpu") -> Models:
    """The oracle checkpoints, with a small random read of the target features added to each draft's
    input projection (in memory): the factory's oracle drafts ignore the features, so a draft state
    or draft K/V that went wrong in transit would go unnoticed; with this path the draft's hidden
    states and K/V depend on them, and drafts are still accepted often."""
    target = load_target(root / "target", device=device)
    drafts = {k: load_draft(root / k, target, device=device) for k in KINDS}
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for kind, draft in drafts.items():
            for proj in [layer.eh_proj for layer in draft.layers] if kind == "mtp" else [draft.fc]:
                w = proj.weight
                h = w.shape[1] - draft.feature_width(from_target=True)  # the token part stays
                extra = torch.randn(w.shape[0], w.shape[1] - h, generator=g) / (w.shape[1] - h) ** .5
                w[:, h:] = feature_scale * extra.to(w.device)
    return Models(root, target, drafts)


def spec_config(topk: int, steps: int = 3) -> SpecConfig:
    return SpecConfig(topk=topk, steps=steps, num_draft_tokens=steps + 1 if topk == 1 else 8)


def engine_config(draft: str | None, topk: int = 1, page_size: int = 16, **kw) -> EngineConfig:
    """The hand-off tests' engines. Fixed policy unless named: they compare the verify steps and acceptance of a
    hand-off with one engine's, which the adaptive policy's timed choices would make differ
    (test_handoff_policy.py hands off under both policies)."""
    return EngineConfig(page_size=page_size, chunk_size=kw.pop("chunk_size", 8),
                        spec=spec_config(topk) if draft else None, **{"spec_policy": "fixed", **kw})


def make_engine(models: Models, draft: str | None, config: EngineConfig, role: str = "both") -> Engine:
    return Engine(models.target, models.drafts[draft] if draft else None, config, role=role)


def prefill_until_handoff(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> list[Request]:
    """Admit every prompt at once (their chunks interleave, so their pages do too) and step until each
    is parked for its hand-off."""
    reqs = [engine.add_request(p, params) for p in prompts]
    while any(r.stage is not Stage.HANDOFF and r.finish_reason is None for r in reqs):
        engine.step()
    return reqs


def positions_kv(engine: Engine, req: Request, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per cache and layer, K and V of the request's positions [0, length) (wherever its pages are)."""
    out = []
    for cache, h in zip(engine.scheduler.caches, req.handles):
        slots = cache.req_to_token.host[h.row, :length]
        out += [(cache.k[layer][slots].clone(), cache.v[layer][slots].clone()) for layer in range(len(cache.k))]
    return out


def smallest_chunk_bytes(engine: Engine) -> int:
    """The smallest legal chunk size: one page of one layer of the widest cache (the others get
    several pages per chunk), so runs are cut into many chunks."""
    return max(page_bytes(c) for c in engine.scheduler.caches)


def hand_off(prefill: Engine, req: Request, decode: Engine, chunk_bytes: int | None = None,
             state_bytes: bytes | None = None, moved: Request | None = None) -> Request:
    """Move ``req`` from ``prefill`` to ``decode`` through the wire format, as the services do: reserve
    on the decode side (or take ``moved``, reserved there already), stream the chunks into the reserved pages,
    check, activate. Returns the decode side's request (the prefill side's is left for the caller to release)."""
    source = PageSource(req.rid, prefill.scheduler.caches, prefill.scheduler.page_ids(req),
                        encode_draft_state(req) if state_bytes is None else state_bytes)
    moved = moved or decode.reserve_handoff(req.rid, req.prompt_ids, req.output_ids, req.output_logprobs,
                                            req.params, req.kv_len)
    assert moved is not None, "the decode engine refused the request"
    sink = PageSink(req.rid, decode.scheduler.caches, decode.scheduler.page_ids(moved))
    last = None
    for chunk in iter_chunks(source, chunk_bytes or smallest_chunk_bytes(prefill)):
        sink.write(chunk)
        last = chunk
    received = sink.finish(last)
    state = decode_draft_state(received.draft_state, decode.handoff_schema(), req.kv_len, decode.device)
    decode.activate_handoff(moved, req.kv_len, state)
    return moved


@dataclass
class Sending:
    """One request's hand-off while its prefill runs: the decode side's request, and the sender's thread."""

    source: PageSource
    moved: Request
    thread: threading.Thread
    result: dict  # the sender's outcome: "state" (Prefilled) or "error"
    arrived_early: bool | None = None  # its first pages reached the decode side before its next chunk ran


def _send(source: PageSource, decode: Engine, moved: Request, transport: str, chunk_bytes: int, result: dict) -> None:
    try:
        if transport == "ipc":  # the pools are this process's own: the copies are what another process does
            written = write_in_place(source, decode.kv_pools(), decode.scheduler.page_ids(moved), time.monotonic() + 60)
            result["state"] = written.last
            return
        sink, last = PageSink(source.rid, decode.scheduler.caches, decode.scheduler.page_ids(moved)), None
        for chunk in iter_chunks(source, chunk_bytes):
            sink.write(chunk)
            last = chunk
        received = sink.finish(last)
        result["state"] = Prefilled(received.draft_state, tuple(received.output_ids), tuple(received.output_logprobs))
    except Exception as e:  # reported to the test
        result["error"] = e


def hand_off_during_prefill(prefill: Engine, decode: Engine, prompts: list[list[int]], params: SamplingParams,
                            transport: str, chunk_bytes: int | None = None,
                            arrived: list[bool] | None = None) -> list[Request]:
    """Prefill ``prompts`` (admitted at once, their chunks interleaved) while their pages go to ``decode``
    as the services send them: reserved at the first chunk, each step's increment sent by a thread of its
    own (the wire format into a PageSink, or ipc's in-place copies) while the next step computes. Before
    each step, the pages an earlier increment named must have reached the decode side (waited for, up to
    20 s: ``arrived`` gets, per request with pages done before its last chunk, whether they did). Returns
    the decode side's requests, activated."""
    chunk_bytes = chunk_bytes or smallest_chunk_bytes(prefill)
    reqs = [prefill.add_request(p, params) for p in prompts]
    sending: dict[str, Sending] = {}
    while any(r.stage is not Stage.HANDOFF for r in reqs):
        for s in sending.values():
            if s.arrived_early is None and s.source.feed is not None and s.result.get("first") is not None:
                s.arrived_early = _wait_until(lambda s=s: _arrived(prefill, decode, s), 20)
        prefill.step()
        for req in prefill.prefilled():
            _feed(prefill, decode, req, sending, transport, chunk_bytes)
    moved = []
    for req in reqs:
        s = sending[req.rid]
        s.thread.join(60)
        assert "error" not in s.result, s.result.get("error")
        last = s.result["state"]
        state = decode_draft_state(last.draft_state, decode.handoff_schema(), req.kv_len, decode.device)
        assert decode.activate_handoff(s.moved, req.kv_len, state, list(last.output_ids), list(last.output_logprobs))
        assert prefill.release(req)
        moved.append(s.moved)
        if arrived is not None and s.arrived_early is not None:
            arrived.append(s.arrived_early)
    return moved


def _feed(prefill, decode, req, sending, transport, chunk_bytes) -> None:
    s = sending.get(req.rid)
    if s is None:  # its first chunk ran: reserve, start sending
        moved = decode.reserve_handoff(req.rid, req.prompt_ids, [], [], req.params, req.prompt_len)
        assert moved is not None, "the decode engine refused the request"
        source, result = prefill.page_source(req, fed=True), {}
        thread = threading.Thread(target=_send, args=(source, decode, moved, transport, chunk_bytes, result))
        s = sending[req.rid] = Sending(source, moved, thread, result)
        thread.start()
    if s.result.get("fed") == req.kv_len:
        return
    inc = prefill.handoff_increment(req)
    s.source.feed.put(inc)
    s.result["fed"] = req.kv_len
    if inc.last is None and inc.done[0] > 0 and "first" not in s.result:
        s.result["first"] = inc.done[0] * prefill.config.page_size  # positions the decode side must have next


def _arrived(prefill: Engine, decode: Engine, s: Sending) -> bool:
    n = s.result["first"]
    req = prefill.requests[s.source.rid]
    return all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
               for a, b in zip(positions_kv(prefill, req, n), positions_kv(decode, s.moved, n)))


def _wait_until(condition, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True
