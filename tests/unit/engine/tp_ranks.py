"""What each rank of the tensor-parallel tests runs (a module of its own: spawned ranks import it by name).

Each function takes the rank's ``TPGroup`` first (None: TP 1, called in the test's own process), runs on
tiny models and returns what the test compares; ``run_group`` runs one on every rank of a group. Rank 0 drives
its engines; the other ranks build ``Follower``s of them (``built``), which run rank 0's calls (``follow``), and
read what their own runner and book hold: the requests rank 0's calls made there, their tokens, their K/V.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import torch

from shared.config import EngineConfig, SpecConfig
from shared.engine import Engine
from shared.follower import Follower
from shared.forward_batch import build_forward_batch
from shared.memory.sizing import make_cache
from shared.model.loader import load_target
from shared.parallel import TPGroup, free_address, join_ranks, local_config, rank_device, shard_target, start_ranks
from shared.sampling import SamplingParams
from tests.unit.spec.spec_helpers import CountingModel, add_feature_path, load_models

RANK_TIMEOUT_S = 240  # one group's whole run, start-up included


def run_group(size: int, fn, *args, device: str = "cpu") -> list:
    """``fn(tp, *args)`` on each of ``size`` spawned ranks (gloo on the CPU, NCCL on ``cuda``); what each
    rank's call returned."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="eyrie-tp-") as out:
        procs = start_ranks(range(size), size, free_address(), device, _saved, (out, fn, *args))
        codes = join_ranks(procs, time.monotonic() + RANK_TIMEOUT_S)
        assert codes == [0] * size, f"ranks exited with {codes} (their stderr says why)"
        return [torch.load(Path(out) / f"rank{r}.pt", weights_only=False) for r in range(size)]


def _saved(tp: TPGroup, out: str, fn, *args) -> None:
    torch.set_num_threads(1)  # two ranks on a small CI machine: one thread each
    torch.save(fn(tp, *args), Path(out) / f"rank{tp.rank}.pt")


# ---- the model alone -------------------------------------------------------------------------------
def forward_logits(tp: TPGroup | None, target: str, prompts: list[list[int]]) -> dict:
    """The target's logits at every position of ``prompts`` (one prefill batch, page size 1), and the KV
    heads this rank's pool holds."""
    model = load_target(target)
    if tp is not None:
        shard_target(model, tp, torch.device("cpu"))
    config = EngineConfig(page_size=1, max_running=len(prompts), max_context=64, dtype="float32")
    cache = make_cache(local_config(model.config, tp), model.config.num_hidden_layers, config, 64)
    handles = [cache.open() for _ in prompts]
    for h, p in zip(handles, prompts):
        cache.reserve(h, len(p))
    ids = torch.tensor([t for p in prompts for t in p])
    pos = torch.tensor([i for p in prompts for i in range(len(p))])
    batch = build_forward_batch(cache, [h.row for h in handles], [0] * len(prompts), [len(p) for p in prompts],
                                ids, pos, pos, logits_rows=torch.arange(len(ids)))
    logits = model(batch, cache).logits
    return {"logits": logits, "kv_heads": cache.layout.num_kv_heads}


def leads(tp: TPGroup | None) -> bool:
    """Whether this rank drives its engines: rank 0, or the only one."""
    return tp is None or tp.rank == 0


def built(tp: TPGroup | None, *args, **kwargs) -> Engine | Follower:
    """Rank 0's engine (or the only rank's), or on another rank the ``Follower`` of it, built alike."""
    return (Engine if leads(tp) else Follower)(*args, tp=tp, **kwargs)


def generated(engine: Engine | Follower, tp: TPGroup | None, prompts, params) -> list:
    """``engine.generate(prompts, params)`` on rank 0 (or the only rank); on the others the results of the
    requests rank 0's generate made there, followed until rank 0 let them go."""
    if not leads(tp):
        return [engine.result(r) for r in engine.follow()]
    got = engine.generate(prompts, params)
    engine.release_followers()
    return got


# ---- the engine ------------------------------------------------------------------------------------
SHAPES = {"chain": SpecConfig(topk=1, steps=3, num_draft_tokens=4), "tree": SpecConfig(topk=2, steps=3,
                                                                                       num_draft_tokens=6)}


def engine_outputs(tp: TPGroup | None, root: str, cases: list[tuple], prompts: list[list[int]],
                   params: list[SamplingParams], device: str = "cpu", cuda_graph: bool = False,
                   spec_policy: str = "fixed") -> dict:
    """For each (draft kind or None, tree shape, page size, chunk size) of ``cases``: every prompt's tokens,
    logprobs and finish reason, the accept lengths, whether the pools were all free again and how many
    KV heads the target's pool holds. The oracle drafts get their feature path (``add_feature_path``)."""
    models = add_feature_path(load_models(Path(root), device=rank_device(device, tp.rank if tp else 0)))
    results = {}
    for kind, shape, page_size, chunk in cases:
        config = EngineConfig(page_size=page_size, chunk_size=chunk, max_running=8, max_context=160,
                              spec=SHAPES[shape] if kind else None, tensor_parallel=tp.size if tp else 1,
                              device=device, cuda_graph=cuda_graph, spec_policy=spec_policy)
        engine = built(tp, models.target, models.drafts[kind] if kind else None, config)
        got = generated(engine, tp, prompts, params)
        results[(kind, shape, page_size, chunk)] = {
            "tokens": [r.token_ids for r in got], "logprobs": [r.logprobs for r in got],
            "finish": [r.finish_reason for r in got], "clean": engine.is_idle_and_clean(),
            "accept_length": [r.spec_stats["accept_length"] for r in got] if kind else None,
            "kv_heads": engine.cache.layout.num_kv_heads,
            "graphs": sum(len(g.captured_sizes) for g in engine.phase_graphs()),
            "graph_failures": [f.as_dict() for f in engine.graph_failures]}
    return results


def path_outputs(tp: TPGroup | None, target: str, drafts: dict[str, str], prompts: list[list[int]],
                 params: SamplingParams) -> dict:
    """Engines built from checkpoint directories (under TP each rank reads its share of the target), one per
    draft of ``drafts`` (name -> directory), EAGLE chain, page size 16, chunks of 8: the tokens, accept lengths,
    whether the pools were free again, whether the target was split, and the draft's LM head (None: it borrows
    the target's at run time)."""
    results = {}
    for name, draft in drafts.items():
        config = EngineConfig(page_size=16, chunk_size=8, max_running=8, max_context=160, spec=SHAPES["chain"],
                              tensor_parallel=tp.size if tp else 1)
        engine = built(tp, target, draft, config)
        got = generated(engine, tp, prompts, params)
        head = getattr(engine.speculator.draft, "lm_head", None)
        results[name] = {"tokens": [r.token_ids for r in got], "clean": engine.is_idle_and_clean(),
                         "accept_length": [r.spec_stats["accept_length"] for r in got],
                         "split": engine.model.tp is not None, "lm_head": None if head is None else head.weight}
    return results


class DearSpec:
    """Step costs under which speculation never pays: an adaptive policy runs plain steps only."""

    def decode_s(self, batch: int) -> float:
        return 0.01

    def spec_s(self, batch: int, shape: str) -> float:
        return 1.0


def folded_prefills(tp: TPGroup, root: str, prompts: list[list[int]], params: SamplingParams) -> dict:
    """An adaptive EAGLE engine (tree, chunks of 8) whose rank 0 finds speculation dear: the prompts' later chunks
    run in the plain decode steps' target forwards (``ModelRunner.run``); the other ranks, with policies of their
    own, must follow rank 0's choice. The tokens, target forwards per step, and which steps were mixed."""
    models = add_feature_path(load_models(Path(root)))
    config = EngineConfig(page_size=16, chunk_size=8, max_running=8, max_context=160, spec=SHAPES["tree"],
                          tensor_parallel=tp.size, spec_policy="adaptive", spec_candidates=())
    engine = built(tp, models.target, models.drafts["eagle"], config)
    policy = engine.spec_policy if tp.rank == 0 else None  # rank 0's alone: a follower has none
    if policy is not None:
        policy.cost, policy.probe_every = DearSpec(), 10 ** 6
        policy.candidates[0].acceptance.observe([2])
    plans, model, forwards = [], CountingModel(engine.model), []
    engine.runner.model = model
    if tp.rank == 0:
        schedule = engine.scheduler.schedule
        engine.scheduler.schedule = lambda: plans.append(schedule()) or plans[-1]
        reqs = [engine.add_request(p, params) for p in prompts]
        while engine.scheduler.has_work():
            before = model.calls
            engine.step()
            forwards.append(model.calls - before)
        engine.release_followers()
    else:  # each step of rank 0's replayed here: its plan applied, run, committed
        book, before = engine.scheduler, []
        replay, commit = book.replay, book.commit
        book.replay = lambda *plan: before.append(model.calls) or plans.append(replay(*plan)) or plans[-1]
        book.commit = lambda plan, events: forwards.append(model.calls - before[-1]) or commit(plan, events)
        reqs = engine.follow()
    return {"tokens": [engine.result(r).token_ids for r in reqs], "forwards": forwards,
            "clean": engine.is_idle_and_clean(), "choices": dict(policy.choices) if policy else {},
            "mixed": [i for i, p in enumerate(plans) if p.prefill and p.decode]}


def graphed_collectives(tp: TPGroup, device: str, replays: int) -> dict:
    """The device collectives captured in a CUDA graph (``PhaseGraphs``, as the engine captures its phases)
    and replayed on new inputs: whether every replay gave what the same collectives give eagerly."""
    from shared.cuda_graphs import PhaseGraphs

    gpu = torch.device(rank_device(device, tp.rank))

    def fn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = x * (tp.rank + 1)
        return tp.all_reduce(y.clone()), tp.all_gather(y, dim=-1)

    graphs = PhaseGraphs("collectives", fn, True, 4)
    same = []
    with torch.cuda.device(gpu) if gpu.type == "cuda" else contextlib.nullcontext():
        for i in range(replays):
            x = torch.arange(4 * 3, dtype=torch.float32, device=gpu).view(4, 3) + 100 * i  # the same on every rank
            summed, gathered = graphs(x)
            want_sum = x * sum(r + 1 for r in range(tp.size))
            want_gathered = torch.cat([x * (r + 1) for r in range(tp.size)], dim=-1)
            same.append(torch.equal(summed, want_sum) and torch.equal(gathered, want_gathered))
    return {"same": same, "captured": graphs.captured_sizes, "failures": [f.as_dict() for f in graphs.failures]}


# ---- sampling --------------------------------------------------------------------------------------
def sampled_outputs(tp: TPGroup | None, root: str, shape: str, setting: str, n: int, batch: int) -> dict:
    """``n`` seeded requests (seeds 0 .. n - 1) of sampling ``setting`` on the 16-token oracle pair of
    test_sampling_lossless: their first DEPTH tokens and accepted drafts; and four unseeded requests'
    tokens (each rank would draw its own seed for them if rank 0 did not choose it)."""
    from tests.unit.spec.test_sampling_lossless import DEPTH, PROMPT, SETTINGS, SPECS

    kind, spec = SPECS[shape]
    root = Path(root)
    config = EngineConfig(page_size=4, max_running=batch, max_context=32, chunk_size=None, spec=spec,
                          tensor_parallel=tp.size if tp else 1)
    engine = built(tp, root / "target", root / kind, config)
    params = [SamplingParams(**SETTINGS[setting], seed=i, max_new_tokens=DEPTH, ignore_eos=True) for i in range(n)]
    rows = []
    for start in range(0, n, batch):
        rows += generated(engine, tp, [PROMPT] * len(params[start:start + batch]), params[start:start + batch])
    unseeded = generated(engine, tp, [PROMPT] * 4,
                         SamplingParams(temperature=1.0, max_new_tokens=DEPTH, ignore_eos=True))
    return {"tokens": [r.token_ids for r in rows], "accepted": [r.spec_stats["accepted_drafts"] for r in rows],
            "unseeded": [r.token_ids for r in unseeded], "clean": engine.is_idle_and_clean()}


# ---- everything at once (one group start-up for the whole test module) ---------------------------
def suite(tp: TPGroup, jobs: dict[str, tuple]) -> dict:
    """Each job ``name -> (function name, args)`` of this module run in turn; and the error a rank
    gets when its digest differs from rank 0's (``TPGroup.agree`` with each rank's own value)."""
    out, seconds = {}, {}
    for name, (fn, args) in jobs.items():
        t0 = time.perf_counter()
        out[name] = globals()[fn](tp, *args)
        seconds[name] = round(time.perf_counter() - t0, 2)
    out["seconds"] = seconds  # printed by the tests (-s): where a slow run spent its time
    try:
        tp.agree(1000 + tp.rank, "a value every rank computes differently")
        out["diverged"] = None
    except RuntimeError as e:
        out["diverged"] = str(e)
    return out


# ---- hand-off between groups of different sizes --------------------------------------------------
def handoff_to_one_rank(tp: TPGroup, root: str, kind: str, page_size: int, prompts: list[list[int]],
                        params: SamplingParams) -> dict | None:
    """A TP-2 prefill engine (rank 1 following rank 0's) parks ``prompts`` for their hand-off; rank 0 sends each,
    its KV heads gathered from both ranks (``Engine.page_source``), through the wire format to a TP-1 decode
    engine of its own (the models loaded again, whole), which generates the rest. Rank 0 returns the decode
    side's outputs and whether both engines' pools are free again; rank 1 None."""
    from shared.handoff import PageSink, decode_draft_state, iter_chunks
    from shared.handoff.wire import page_bytes
    from tests.unit.handoff.handoff_helpers import prefill_until_handoff

    def config(role_tp: int) -> EngineConfig:
        return EngineConfig(page_size=page_size, chunk_size=8, max_running=8, max_context=160, spec=SHAPES["chain"],
                            tensor_parallel=role_tp)

    split = add_feature_path(load_models(Path(root)))
    prefill = built(tp, split.target, split.drafts[kind], config(tp.size), role="prefill")
    if tp.rank != 0:
        prefill.follow()
        return None
    whole = add_feature_path(load_models(Path(root)))
    decode = Engine(whole.target, whole.drafts[kind], config(1), role="decode")
    decode.handoff_schema().check(prefill.handoff_schema())  # the handshake: every KV head arrives
    moved = []
    for req in prefill_until_handoff(prefill, prompts, params):
        source = prefill.page_source(req)  # a collective: rank 1 replays it
        there = decode.reserve_handoff(req.rid, req.prompt_ids, req.output_ids, req.output_logprobs, req.params,
                                       req.kv_len)
        sink, last = PageSink(req.rid, decode.scheduler.caches, decode.scheduler.page_ids(there)), None
        for chunk in iter_chunks(source, max(page_bytes(c) for c in decode.scheduler.caches)):  # many chunks
            sink.write(chunk)
            last = chunk
        state = decode_draft_state(sink.finish(last).draft_state, decode.handoff_schema(), req.kv_len)
        assert decode.activate_handoff(there, req.kv_len, state)
        moved.append(there)
        prefill.release(req)
    prefill.release_followers()
    decode.run_until_done()
    return {"tokens": [decode.result(r).token_ids for r in moved], "clean": decode.is_idle_and_clean()
            and prefill.is_idle_and_clean()}


def handoff_from_one_rank(tp: TPGroup, root: str, kind: str, page_size: int, prompts: list[list[int]],
                          params: SamplingParams) -> dict:
    """The way back: rank 0's TP-1 prefill engine (the models whole) parks ``prompts`` and sends each through
    the wire format to a TP-2 decode engine (rank 0 receives every KV head, each rank keeps its own,
    ``Engine.activate_handoff``: rank 1 follows rank 0's engine), which generates the rest. Each rank returns the
    outputs and whether its pools are free again."""
    from shared.handoff import PageGuard, decode_draft_state, iter_chunks
    from shared.handoff.wire import page_bytes
    from tests.unit.handoff.handoff_helpers import positions_kv, prefill_until_handoff

    def config(role_tp: int) -> EngineConfig:
        return EngineConfig(page_size=page_size, chunk_size=8, max_running=8, max_context=160, spec=SHAPES["tree"],
                            tensor_parallel=role_tp)

    split = add_feature_path(load_models(Path(root)))
    decode = built(tp, split.target, split.drafts[kind], config(tp.size), role="decode")
    parked, prefill = [], None
    if tp.rank == 0:
        whole = add_feature_path(load_models(Path(root)))
        prefill = Engine(whole.target, whole.drafts[kind], config(1), role="prefill")
        decode.handoff_schema().check(prefill.handoff_schema())
        parked = prefill_until_handoff(prefill, prompts, params)
    moved, same_kv = [], []
    for i in range(tp.broadcast(len(parked))):
        sent = None
        if tp.rank == 0:  # rank 0 reserves, receives and activates; rank 1 replays its calls (until let go)
            req = parked[i]
            there = decode.reserve_handoff(req.rid, req.prompt_ids, req.output_ids, req.output_logprobs, req.params,
                                           req.kv_len)
            sink, last = decode.page_sink(there, PageGuard()), None
            for chunk in iter_chunks(prefill.page_source(req), max(page_bytes(c) for c in prefill.scheduler.caches)):
                sink.write(chunk)
                last = chunk
            state = decode_draft_state(sink.finish(last).draft_state, decode.handoff_schema(), req.kv_len)
            sent = positions_kv(prefill, req, req.kv_len)
            prefill.release(req)
            assert decode.activate_handoff(there, req.kv_len, state)
            decode.release_followers()
        else:
            (there,) = decode.follow()
        same_kv.append(kept_its_heads(decode, there, tp.broadcast(sent), tp))
        moved.append(there)
    run_until_done(decode, tp)
    return {"tokens": [decode.result(r).token_ids for r in moved], "same_kv": same_kv,
            "clean": decode.is_idle_and_clean() and (prefill is None or prefill.is_idle_and_clean())}


def run_until_done(engine: Engine, tp: TPGroup | None) -> None:
    """``engine.run_until_done()`` on rank 0 (or the only rank), followed by the others."""
    if not leads(tp):
        engine.follow()
        return
    engine.run_until_done()
    engine.release_followers()


def kept_its_heads(decode: Engine, req, sent: list, tp: TPGroup | None) -> bool:
    """Whether ``req``'s K/V on this rank is exactly ``sent`` (the whole engine's, per cache and layer): this
    rank's heads of the target's layers, every head of the draft's (``tp`` None: every head of every cache)."""
    from tests.unit.handoff.handoff_helpers import positions_kv

    layers, heads = len(decode.cache.k), decode.cache.layout.num_kv_heads
    mine = slice(tp.rank * heads, (tp.rank + 1) * heads) if tp is not None else slice(None)
    got = positions_kv(decode, req, req.kv_len)
    return len(got) == len(sent) and all(
        torch.equal(g.cpu(), s[:, mine].cpu() if i < layers else s.cpu()) for i, (gkv, skv) in enumerate(zip(got, sent))
        for g, s in zip(gkv, skv))


def handoff_cached_from_one_rank(tp: TPGroup | None, root: str, kind: str, topk: int, transport: str, page_size: int,
                                 prompts: list[list[int]], params: SamplingParams, device: str = "cpu") -> dict:
    """A TP-1 prefill engine (rank 0's) hands ``prompts`` one after the other to a TP-2 decode engine with its
    prefix cache on (issue 33): each reservation asks to skip the cached pages (``cached=True``), the sender skips
    what rank 0's sink says every rank holds (``wire``: the wire format; ``ipc``: written in place into rank 0's
    landing cache), each rank takes its heads of the rest, and the prompt pages join every rank's cache at
    activation; each request decodes to its end before the next arrives. Each rank returns, per prompt, its tokens,
    the cached pages its reservation took here (and rank 0's sink's count), the K/V bytes sent and whether its K/V
    at every position is the prefill's (its heads); then the cached page ids, whether a request still holds one,
    and whether every pool is full after the cache's flush. ``tp`` None: the same into a TP-1 decode engine."""
    from shared.handoff import PageGuard, PageSource, decode_draft_state, encode_draft_state, iter_chunks
    from shared.handoff.ipc import write_in_place
    from shared.handoff.wire import page_bytes
    from tests.unit.handoff.handoff_helpers import positions_kv, prefill_until_handoff, spec_config

    def config(role_tp: int, cache: bool) -> EngineConfig:
        return EngineConfig(page_size=page_size, chunk_size=8, max_running=8, max_context=160, spec=spec_config(topk),
                            tensor_parallel=role_tp, prefix_cache=cache, device=device, num_pages=512,
                            cuda_graph=device.startswith("cuda"))  # pools not sized by a GPU's memory (two engines)

    rank = tp.rank if tp is not None else 0
    share = tp.broadcast if tp is not None else (lambda x: x)
    lead = leads(tp)
    split = add_feature_path(load_models(Path(root), device=rank_device(device, rank)))
    decode = built(tp, split.target, split.drafts[kind], config(tp.size if tp else 1, True), role="decode")
    prefill = None
    if rank == 0:
        whole = add_feature_path(load_models(Path(root), device=rank_device(device, 0)))
        prefill = Engine(whole.target, whole.drafts[kind], config(1, False), role="prefill")
        decode.handoff_schema().check(prefill.handoff_schema())
    out = []
    for prompt in prompts:
        sink_held, sent, kv = None, None, None
        # Rank 0 reserves, receives and activates; the others replay its calls (until let go).
        if lead:
            req = prefill_until_handoff(prefill, [prompt], params)[0]
            there = decode.reserve_handoff(req.rid, req.prompt_ids, req.output_ids, req.output_logprobs, req.params,
                                           req.kv_len, cached=True)
            decode.release_followers()
        else:
            (there,) = decode.follow()
        held = len(there.prefix_pages)  # the cached pages its reservation took here
        if lead:
            sink = decode.page_sink(there, PageGuard(), in_place=transport == "ipc")
            source = PageSource(req.rid, prefill.scheduler.caches, prefill.scheduler.page_ids(req),
                                encode_draft_state(req), held=sink.held)
            if transport == "ipc":
                sent, blob = write_in_place(source, decode.kv_pools(), sink.page_ids, time.monotonic() + 60).bytes, \
                    source.draft_state
            else:
                last = None
                for chunk in iter_chunks(source, max(page_bytes(c) for c in prefill.scheduler.caches)):
                    sink.write(chunk)
                    last = chunk
                received = sink.finish(last)
                sent, blob = received.bytes - len(received.draft_state), received.draft_state
            state = decode_draft_state(blob, decode.handoff_schema(), req.kv_len, decode.device)
            sink_held = sink.held
            kv = [(k.cpu(), v.cpu()) for k, v in positions_kv(prefill, req, req.kv_len)]  # to every rank's device
            prefill.release(req)
            assert decode.activate_handoff(there, req.kv_len, state)
            decode.release_followers()
        else:
            decode.follow()
        same_kv = kept_its_heads(decode, there, share(kv), tp)
        run_until_done(decode, tp)
        out.append({"tokens": decode.result(there).token_ids, "held": held, "sink_held": sink_held, "sent": sent,
                    "same_kv": same_kv})
    pc = decode.prefix_cache
    cached, referenced = sorted(pc.cached_pages()), pc.referenced()
    if lead:
        decode.flush_prefix_cache()
        decode.release_followers()
    else:
        decode.follow()
    return {"requests": out, "cached": cached, "referenced": referenced, "flushed": len(pc),
            "clean": decode.is_idle_and_clean() and (prefill is None or prefill.is_idle_and_clean())}
