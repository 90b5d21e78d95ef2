"""The shared-prefix serving benchmark (issue 33): the prefix cache on and off, colocated and disaggregated,
with and without a draft, through the stack as users run it.

A run is a layout (``bench/serving_layouts.py``: colo1, pd1, pd2, ...: separate ``eyrie serve`` processes,
one Redis, the router's OpenAI API in front) x the prefix cache on or off (the engines' ``prefix_cache``,
EYRIE_PREFIX_CACHE) x a draft (none, or a head's directory): started, warmed, measured, stopped. Its
workloads send token-id prompts (windows of ``--prompts-file``'s text, else random ids in the tokenizer's
trained vocabulary), greedy, ``ignore_eos``, streamed over ``/v1/completions`` with
``stream_options.include_usage`` (so each response's ``usage.prompt_tokens_details.cached_tokens`` comes
back):

* shared prefixes: ``--prefixes`` P distinct prefixes of ``--prefix-tokens`` tokens, each followed by
  ``--questions`` Q different questions of ``--question-tokens`` tokens, ``--output-tokens`` out each, sent
  closed-loop at ``--concurrency`` in an interleaved order (every prefix's first question, then every
  prefix's second, ...): a prefix's first request is cold, its later ones warm. A warm request is not sent
  before its prefix's cold one has its first token (its prompt is in the cache by then; with P at least the
  concurrency this never waits);
* multi-turn chat: ``--chat`` CxT, C conversations at once, T turns each: the first turn's prompt is
  ``--chat-tokens``' FIRST tokens, a later turn's the previous prompt + the previous answer's tokens + NEW
  tokens; OUTPUT tokens out. The first turn is cold, the later ones warm;
* the TTFT probe: ``--probe`` N new prefixes at concurrency 1, each a cold request then a warm one (another
  question), ``--probe-output`` tokens out: a cached prompt's TTFT against an uncached one, no queue.

Every run sends the same prompts (planned once from ``--seed``), each prefix and conversation starting unlike
every other, after a warm-up of its own prefixes (cold and warm, several at once). With a draft, a warm request
finds its prefix less the last page (a cached page's key holds the token after it: here a question's first).

Per run and workload: output tok/s, requests/s, TTFT p50/p99 of the cold and of the warm requests, the cached
tokens the responses report (summed per kind, and per request in ``requests_detail``), failed requests (a
request is complete when every token and its usage came back), the hand-off bytes the prefill services count
(``eyrie_handoff_bytes_total``; pd layouts) and the engines' prefix-cache counters. Per layout and draft, cache
on against off (``comparisons``): the probe's uncached / cached TTFT p50 (the issue's target: >= 5), the
loaded warm TTFT p50 off / on, the shared workload's output tok/s on / off (target: >= 2), the chat's, and the
hand-off bytes on / off. Writes the JSON (``--out``, rewritten after every workload) and a markdown table
beside it (``.md``). ``--deadline-s`` bounds the whole: each run gets an even share of what is left (the first,
which starts cold, half a share more), and a workload that no longer fits its run's share is listed under the
run's ``skipped``.

    python -m bench.house.widen_tiny --out /tmp/wide        # the trained tiny pair at the 8B shape
    python bench/bench_prefix.py --model /tmp/wide/target --draft /tmp/wide/eagle3 \
        --prompts-file /tmp/wide/heldout.jsonl --layouts colo1,pd1 --out out/prefix.json   # one H100
    python bench/bench_prefix.py --smoke --out /tmp/prefix.json     # tiny model on the CPU, its figures mean nothing
"""

from __future__ import annotations

import argparse
import random
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from bench.serving_layouts import LAYOUTS, LayoutRun, parse_layouts  # noqa: E402
from bench.serving_load import (  # noqa: E402
    HttpDriver,
    Point,
    RequestRecord,
    RequestSpec,
    percentile,
    run_closed_loop,
    summarize,
)
from bench.serving_stack import handoff_delta, handoff_totals  # noqa: E402
from bench.timing import write_json  # noqa: E402

GPU_DEFAULTS = dict(preset="llama3-8b-shape", device="cuda", dtype="bfloat16", cuda_graph="on", prefixes=64,
                    prefix_tokens=2048, questions=10, question_tokens=128, output_tokens=256, concurrency=32,
                    chat="16x4", chat_tokens="512:64:128", probe=4, probe_output=8, num_pages=0, max_running=64,
                    max_context=8192, chunk_size=512, deadline_s=3000.0, start_timeout_s=300.0,
                    request_timeout_s=300.0, min_phase_s=20.0)
SMOKE_DEFAULTS = dict(preset="tiny", device="cpu", dtype="float32", cuda_graph="off", prefixes=3, prefix_tokens=64,
                      questions=3, question_tokens=16, output_tokens=4, concurrency=2, chat="2x3",
                      chat_tokens="32:16:4", probe=2, probe_output=2, num_pages=None, max_running=4, max_context=512,
                      chunk_size=64, deadline_s=300.0, start_timeout_s=120.0, request_timeout_s=60.0,
                      min_phase_s=5.0)
# The smoke run's services use one CPU thread each (bench_serving's SMOKE_ENV: a tiny model's step on a small
# shared machine is ten times slower with a spinning thread per core).
SMOKE_ENV = {"OMP_NUM_THREADS": "1"}
WORKLOADS = ("shared", "chat", "probe")
FIRST_SHARE = 1.5  # the first run's share of the deadline, the others' being 1 (``main``)
HEAD_KEY = 8  # a run's prompts differ in their first this many tokens: a cold prompt finds no page cached


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny model on the CPU: checks the script only")
    ap.add_argument("--out", default="out/prefix/bench_prefix.json")
    ap.add_argument("--model", help="target checkpoint directory (default: write one under --workdir)")
    ap.add_argument("--draft", default="none", help="comma-separated, one run each: none | DIR | eagle3 (a random "
                                                    "head written beside the written model)")
    ap.add_argument("--layouts", default="colo1,pd1", help=f"comma-separated: {', '.join(LAYOUTS)}")
    ap.add_argument("--cache", default="on,off", help="the prefix cache in each run: on, off, or both (on,off)")
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help="any of shared, chat, probe")
    ap.add_argument("--workdir", help="where a written checkpoint and the services' logs go (default: a temp dir)")
    ap.add_argument("--prompts-file", help="text (or JSONL of {\"text\"}) the prompts are windows of, tokenized by "
                                           "the model's tokenizer (default: random token ids)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prefixes", type=int, help="distinct prefixes of the shared workload (64)")
    ap.add_argument("--prefix-tokens", type=int, help="tokens of each prefix (2048)")
    ap.add_argument("--questions", type=int, help="questions per prefix, the first cold (10)")
    ap.add_argument("--question-tokens", type=int, help="tokens of each question (128)")
    ap.add_argument("--output-tokens", type=int, help="output tokens of each shared-prefix request (256)")
    ap.add_argument("--concurrency", type=int, help="closed-loop requests in flight (32)")
    ap.add_argument("--chat", help="CONVERSATIONSxTURNS of the chat replay (16x4; 0x0: none)")
    ap.add_argument("--chat-tokens", help="FIRST:NEW:OUTPUT tokens of the chat replay's turns (512:64:128)")
    ap.add_argument("--probe", type=int, help="prefixes of the concurrency-1 TTFT probe (4; 0: none)")
    ap.add_argument("--probe-output", type=int, help="output tokens of each probe request (8)")
    ap.add_argument("--preset", help="shape of a written checkpoint (llama3-8b-shape, tiny)")
    ap.add_argument("--device")
    ap.add_argument("--dtype")
    ap.add_argument("--cuda-graph", choices=["on", "off"])
    ap.add_argument("--num-pages", type=int, help="KV pages per pool (0: sized by the memory fraction)")
    ap.add_argument("--max-running", type=int)
    ap.add_argument("--max-context", type=int)
    ap.add_argument("--chunk-size", type=int)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--spec-topk", type=int, help="with a draft (default: the services' own)")
    ap.add_argument("--spec-steps", type=int)
    ap.add_argument("--spec-draft-tokens", type=int)
    ap.add_argument("--spec-policy", choices=["fixed", "adaptive"])
    ap.add_argument("--spec-candidates")
    ap.add_argument("--local-prefill", type=int, default=0, help="disaggregated layouts: prompts with at most this "
                    "many tokens to compute on their decode instance (past the prefix it holds) are prefilled there "
                    "(the router's local_prefill_max_tokens; 0: every prompt to a prefill instance)")
    ap.add_argument("--transports", default="auto", help="every run's EYRIE_HANDOFF_TRANSPORT (auto, ipc, "
                                                         "grpc-stream)")
    ap.add_argument("--deadline-s", type=float, help="the whole benchmark's budget")
    ap.add_argument("--start-timeout-s", type=float, help="a stack's start-up deadline")
    ap.add_argument("--request-timeout-s", type=float)
    ap.add_argument("--min-phase-s", type=float, help="a workload starts only with this much of its run's share left")
    args = ap.parse_args(argv)
    for k, v in (SMOKE_DEFAULTS if args.smoke else GPU_DEFAULTS).items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    args.cuda_graph = args.cuda_graph == "on"
    check_args(ap, args)
    return args


def check_args(ap: argparse.ArgumentParser, args) -> None:
    """Exit 2 with one line naming what is wrong."""
    caches = [c.strip() for c in args.cache.split(",")]
    if not caches or any(c not in ("on", "off") for c in caches):
        ap.error(f"--cache {args.cache!r}: expected on, off or on,off")
    workloads = [w.strip() for w in args.workloads.split(",")]
    if any(w not in WORKLOADS for w in workloads):
        ap.error(f"--workloads {args.workloads!r}: expected any of {', '.join(WORKLOADS)}")
    for name in ("prefixes", "prefix_tokens", "question_tokens", "output_tokens", "concurrency", "probe_output"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.questions < 2:
        ap.error(f"--questions must be at least 2 (the first of a prefix is cold), got {args.questions}")
    try:
        args.chat_shape = tuple(int(x) for x in args.chat.lower().split("x"))
        args.chat_lengths = tuple(int(x) for x in args.chat_tokens.split(":"))
    except ValueError:
        ap.error(f"--chat {args.chat!r} / --chat-tokens {args.chat_tokens!r}: expected CxT and FIRST:NEW:OUTPUT")
    if len(args.chat_shape) != 2 or len(args.chat_lengths) != 3 or min(args.chat_lengths) < 1:
        ap.error(f"--chat {args.chat!r} / --chat-tokens {args.chat_tokens!r}: expected CxT and FIRST:NEW:OUTPUT "
                 "(each length at least 1)")
    unknown = [n for n in args.layouts.split(",") if n.strip() and n.strip() not in LAYOUTS]
    if unknown:
        ap.error(f"--layouts: unknown layout {unknown[0]!r} (known: {', '.join(LAYOUTS)})")
    drafts = [d.strip() for d in args.draft.split(",") if d.strip()]
    for d in drafts:
        if d == "eagle3" and args.model:
            ap.error("--draft eagle3 writes a random head beside a written model; with --model give the head's "
                     "directory")
        if d not in ("none", "eagle3") and not (Path(d) / "config.json").exists():
            ap.error(f"--draft {d}: not a checkpoint directory (no config.json)")
    if args.model and not (Path(args.model) / "config.json").exists():
        ap.error(f"--model {args.model}: not a checkpoint directory (no config.json)")
    args.cache_list, args.workload_list, args.draft_list = caches, workloads, drafts or ["none"]


# ---- requests and their records ------------------------------------------------------------------
@dataclass(frozen=True)
class PrefixSpec(RequestSpec):
    group: int = 0  # its prefix (the chat: its conversation)
    turn: int = 0  # its place in the group: 0 is the group's first request (cold)


@dataclass
class PrefixRecord(RequestRecord):
    """A request as its client saw it, with its tokens and the usage its response reported."""

    group: int = -1
    turn: int = 0
    token_ids: list[int] = field(default_factory=list)
    prompt_tokens: int | None = None
    cached_tokens: int | None = None  # None: no usage came back
    first: threading.Event | None = None  # set when its first tokens arrive (a cold request's: its warm ones wait)

    @property
    def kind(self) -> str:
        return "cold" if self.turn == 0 else "warm"

    @property
    def ok(self) -> bool:
        return super().ok and self.cached_tokens is not None


class UsageDriver(HttpDriver):
    """``HttpDriver`` with ``stream_options.include_usage``: keeps each response's tokens and its usage."""

    def payload(self, spec: RequestSpec) -> dict:
        return {**super().payload(spec), "stream_options": {"include_usage": True}}

    def on_event(self, event: dict, record: PrefixRecord) -> None:
        ids = [t for c in event.get("choices", []) for t in c.get("token_ids") or []]
        if ids:
            record.arrivals.append((time.perf_counter(), len(ids)))
            record.token_ids += ids
            if record.first is not None:
                record.first.set()
        usage = event.get("usage")
        if usage:
            record.prompt_tokens = usage.get("prompt_tokens")
            record.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)


def draw(rng: random.Random, n: int, vocab: tuple[int, int], text_ids: list[int] | None) -> list[int]:
    """``n`` prompt ids: a window of the text at a random start, else random ids in ``vocab``."""
    if text_ids:
        start = rng.randrange(max(1, len(text_ids) - n))
        return (text_ids * (n // len(text_ids) + 2))[start:start + n]
    return [rng.randrange(*vocab) for _ in range(n)]


def fresh(rng: random.Random, n: int, vocab: tuple[int, int], text_ids: list[int] | None, taken: set) -> list[int]:
    """``draw``, again while its first ``HEAD_KEY`` tokens start an earlier prompt (a text repeats itself: two
    windows could share a first page, and a cold request would find it cached); its start is then taken."""
    for _ in range(100):
        ids = draw(rng, n, vocab, text_ids)
        if tuple(ids[:HEAD_KEY]) not in taken:
            break
    taken.add(tuple(ids[:HEAD_KEY]))
    return ids


def shared_prefix_specs(prefixes: int, prefix_tokens: int, questions: int, question_tokens: int, output: int,
                        vocab: tuple[int, int], text_ids: list[int] | None, seed: str,
                        taken: set | None = None) -> list[PrefixSpec]:
    """Every prefix's first question, then every prefix's second, ... (a pure function of its arguments; each
    prefix starts unlike the others and those in ``taken``, which gains theirs)."""
    rng, taken = random.Random(f"prefix/{seed}"), set() if taken is None else taken
    heads = [fresh(rng, prefix_tokens, vocab, text_ids, taken) for _ in range(prefixes)]
    asks = [[draw(rng, question_tokens, vocab, text_ids) for _ in range(questions)] for _ in range(prefixes)]
    return [PrefixSpec(heads[p] + asks[p][q], output, group=p, turn=q) for q in range(questions)
            for p in range(prefixes)]


def gated(driver: UsageDriver, specs: list[PrefixSpec], wait_s: float):
    """``run_closed_loop``'s ``send``: a warm request waits for its group's cold one's first token (or end)."""
    firsts = {s.group: threading.Event() for s in specs if s.turn == 0}

    def send(spec: PrefixSpec, record: PrefixRecord) -> None:
        record.group, record.turn = spec.group, spec.turn
        gate = firsts.get(spec.group)
        if spec.turn == 0:
            record.first = gate
            try:
                driver(spec, record)
            finally:
                gate.set()
            return
        if gate is not None:
            gate.wait(wait_s)
            record.sent = time.perf_counter()  # its TTFT counts from here, not from its wait
        driver(spec, record)

    return send


def run_shared(driver: UsageDriver, specs: list[PrefixSpec], concurrency: int, issue_s: float,
               wait_s: float) -> list[PrefixRecord]:
    return run_closed_loop(gated(driver, specs, wait_s), specs, concurrency, issue_s, PrefixRecord)


def run_chat(driver: UsageDriver, openings: list[list[int]], turns: int, new: int, output: int,
             vocab: tuple[int, int], text_ids: list[int] | None, seed: int, issue_s: float) -> list[PrefixRecord]:
    """Every conversation (its first prompt in ``openings``) at once, its turns one after the other; the records
    in order of sending."""
    deadline = time.perf_counter() + issue_s
    per: list[list[PrefixRecord]] = [[] for _ in openings]
    rngs = [random.Random(f"chat/{seed}/{c}") for c in range(len(openings))]

    def conversation(c: int) -> None:
        rng, prompt = rngs[c], openings[c]
        for t in range(turns):
            if t:
                prompt = prompt + per[c][-1].token_ids + draw(rng, new, vocab, text_ids)
            if time.perf_counter() > deadline:
                return
            record = PrefixRecord(time.perf_counter(), output, group=c, turn=t)
            per[c].append(record)
            driver(PrefixSpec(prompt, output, group=c, turn=t), record)
            if not record.ok:
                return

    threads = [threading.Thread(target=conversation, args=(c,), daemon=True) for c in range(len(openings))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sorted((r for rs in per for r in rs), key=lambda r: r.sent)


# ---- figures -----------------------------------------------------------------------------------------
def workload_summary(name: str, records: list[PrefixRecord], concurrency: int, output: int) -> dict:
    """``summarize``'s figures, requests/s, and per kind (cold, warm): TTFT p50/p99 and the cached tokens."""
    lengths = [r.prompt_tokens for r in records if r.prompt_tokens is not None] or [0]
    point = Point(name, concurrency, len(records), (min(lengths), max(lengths)), (output, output))
    s = summarize(point, records)
    s["requests_s"] = s["completed"] / s["duration_s"] if s["duration_s"] > 0 else None
    for kind in ("cold", "warm"):
        rs = [r for r in records if r.kind == kind]
        ttfts = [r.ttft for r in rs if r.arrivals]
        prompt, cached = sum(r.prompt_tokens or 0 for r in rs), sum(r.cached_tokens or 0 for r in rs)
        s[kind] = {"requests": len(rs), "completed": sum(r.ok for r in rs), "ttft_p50_s": percentile(ttfts, 50),
                   "ttft_p99_s": percentile(ttfts, 99), "prompt_tokens": prompt, "cached_tokens": cached,
                   "cached_share": cached / prompt if prompt else None,
                   "hits": sum(1 for r in rs if (r.cached_tokens or 0) > 0)}
    s["cached_tokens"] = s["cold"]["cached_tokens"] + s["warm"]["cached_tokens"]
    start = min((r.sent for r in records), default=0.0)
    # per request, in order of sending: [group, turn, sent (s after the first), TTFT (s), output tokens,
    # prompt tokens, cached tokens]
    s["requests_detail"] = [[r.group, r.turn, round(r.sent - start, 4), None if not r.arrivals else round(r.ttft, 4),
                             r.tokens, r.prompt_tokens, r.cached_tokens] for r in records]
    return s


def prefix_counters(metrics_text: str) -> dict[str, float]:
    """An engine service's prefix-cache counters: prompt tokens looked up, and found (vLLM's names)."""
    names = {"eyrie_prefix_cache_queries_total": "queries", "eyrie_prefix_cache_hits_total": "hits"}
    out = {"queries": 0.0, "hits": 0.0}
    for family in text_string_to_metric_families(metrics_text):
        for s in family.samples:
            if s.name in names:
                out[names[s.name]] += s.value
    return out


class PrefixRun(LayoutRun):
    """One run: a layout with the cache on or off and a draft; ``LayoutRun`` starts it as users deploy it."""

    def __init__(self, bench: Bench, layout: str, cache: str, draft_name: str, model: str, draft: str | None,
                 workdir: Path):
        self.run, self.name, self.model, self.draft, self.args = bench, layout, model, draft, bench.args
        local = bench.args.local_prefill if LAYOUTS[layout][0] else 0
        label = f"{layout}-cache-{cache}-draft-{Path(draft_name).name}" + (f"-local{local}" if local else "")
        self.out: dict = {"layout": layout, "cache": cache, "draft": draft_name, "label": label, "local_prefill": local,
                          "instances": [],
                          "log_dir": str(workdir / f"logs-{label}")}
        bench.report["runs"].append(self.out)
        self.stack = None

    def snapshot(self) -> dict[str, dict]:
        """Per engine service: its hand-off totals and prefix-cache counters now."""
        out = {}
        for name in self.stack.ready:
            if name != "router":
                text = self.stack.metrics(name)
                out[name] = {"handoff": handoff_totals(text), "prefix": prefix_counters(text)}
        return out

    def delta(self, before: dict[str, dict]) -> dict:
        """What the engine services counted since ``before``: hand-offs (the prefill services' sent bytes: None
        in a colocated layout) and prefix-cache lookups and hits, per service."""
        after = self.snapshot()
        handoff = {n: handoff_delta(before[n]["handoff"], a["handoff"]) for n, a in after.items()
                   if n.startswith("prefill")}
        prefix = {n: {k: a["prefix"][k] - before[n]["prefix"][k] for k in a["prefix"]} for n, a in after.items()}
        sent = sum(t["bytes"] for h in handoff.values() for t in h.values()) if handoff else None
        return {"handoff": handoff, "handoff_bytes": sent, "prefix_cache": prefix}


# ---- the benchmark ------------------------------------------------------------------------------------
class Bench:
    """The clock and the report, rewritten after every workload."""

    def __init__(self, args):
        self.t0, self.args = time.monotonic(), args
        derived = ("chat_shape", "chat_lengths", "cache_list", "workload_list", "draft_list", "layout_list")
        settings = {k: v for k, v in vars(args).items() if k not in derived}
        self.report: dict = {"settings": settings, "runs": [], "comparisons": [], "skipped": []}

    def child_env(self) -> dict:
        return SMOKE_ENV if self.args.smoke else {}

    def left(self) -> float:
        return self.args.deadline_s - (time.monotonic() - self.t0)

    def save(self) -> None:
        self.report["comparisons"] = comparisons(self.report["runs"])
        self.report["wall_s"] = round(time.monotonic() - self.t0, 1)
        write_json(self.args.out, self.report)


@dataclass(frozen=True)
class Plan:
    """A run's prompts, the same in every run (a pure function of the settings), each prefix and conversation
    starting unlike every other (``fresh``)."""

    warmup: list[PrefixSpec]
    shared: list[PrefixSpec]
    probe: list[PrefixSpec]
    chat: list[list[int]]  # each conversation's first prompt


def plan_prompts(args, vocab: tuple[int, int], text_ids: list[int] | None) -> Plan:
    taken: set = set()
    # The warm-up: prefixes of their own, cold and warm, several at once (kernels compiled, pools touched).
    warmup = shared_prefix_specs(min(8, args.prefixes), args.prefix_tokens, 2, args.question_tokens,
                                 min(8, args.output_tokens), vocab, text_ids, f"warmup/{args.seed}", taken)
    shared = shared_prefix_specs(args.prefixes, args.prefix_tokens, args.questions, args.question_tokens,
                                 args.output_tokens, vocab, text_ids, str(args.seed), taken)
    probe = shared_prefix_specs(args.probe, args.prefix_tokens, 2, args.question_tokens, args.probe_output, vocab,
                                text_ids, f"probe/{args.seed}", taken)
    probe.sort(key=lambda s: (s.group, s.turn))  # each prefix cold, then warm, one request at a time
    rng = random.Random(f"chat-opening/{args.seed}")
    chat = [fresh(rng, args.chat_lengths[0], vocab, text_ids, taken) for _ in range(args.chat_shape[0])]
    return Plan(warmup, shared, probe, chat)


def run_one(bench: Bench, pr: PrefixRun, flags: dict, budget_s: float, plan: Plan, vocab: tuple[int, int],
            text_ids: list[int] | None) -> None:
    """Start the run's stack, warm it, run each workload that fits ``budget_s``, stop it."""
    args, t0 = bench.args, time.monotonic()
    left = lambda: budget_s - (time.monotonic() - t0)  # noqa: E731
    try:
        pr.start(flags, budget_s)
        driver = UsageDriver(pr.stack.openai_address, args.request_timeout_s)
        warm = run_shared(driver, plan.warmup, min(16, args.concurrency), left(), args.request_timeout_s)
        pr.out["warmup_failed"] = sum(not r.ok for r in warm)
        for name in args.workload_list:
            if name == "chat" and not all(args.chat_shape) or name == "probe" and not args.probe:
                continue
            if left() < args.min_phase_s:
                pr.out.setdefault("skipped", []).append(name)
                continue
            before = pr.snapshot()
            pr.out[name] = {**run_workload(name, args, driver, plan, vocab, text_ids, left()), **pr.delta(before)}
            bench.save()
            print(format_line(pr.out["label"], name, pr.out[name]), flush=True)
        pr.services()
    except (RuntimeError, TimeoutError, OSError) as e:
        pr.out["error"] = f"{type(e).__name__}: {e}"
        print(f"{pr.out['label']}: {pr.out['error']}", flush=True)
    finally:
        if pr.stack is not None:
            pr.out["exit_codes"] = pr.stack.stop()
        bench.save()


def run_workload(name: str, args, driver: UsageDriver, plan: Plan, vocab, text_ids, issue_s: float) -> dict:
    if name == "shared":
        records = run_shared(driver, plan.shared, args.concurrency, issue_s, args.request_timeout_s)
        return workload_summary(name, records, args.concurrency, args.output_tokens)
    if name == "chat":
        _, new, output = args.chat_lengths
        records = run_chat(driver, plan.chat, args.chat_shape[1], new, output, vocab, text_ids, args.seed, issue_s)
        return workload_summary(name, records, len(plan.chat), output)
    records = run_shared(driver, plan.probe, 1, issue_s, args.request_timeout_s)
    return workload_summary(name, records, 1, args.probe_output)


def plan_runs(args) -> list[tuple[str, str, str]]:
    """(layout, draft name, cache) in run order: a layout's cache on and off next to each other."""
    return [(layout, d, c) for layout in args.layout_list for d in args.draft_list for c in args.cache_list]


def prepare(bench: Bench, workdir: Path) -> tuple[str, dict[str, str | None]]:
    """The target checkpoint (``--model``, else one written under ``workdir``) and each draft name's directory
    (None: no draft; ``eagle3``: a random head written with the checkpoint)."""
    args = bench.args
    model, written = args.model, {}
    if model is None:
        import torch

        from bench.serving_model import write_serving_model

        shard = {"shard_bytes": 200_000} if args.smoke else {}
        written = write_serving_model(workdir / "model", args.preset, args.device, getattr(torch, args.dtype),
                                      "eagle3" in args.draft_list, **shard)
        bench.report["model"] = written
        model = written["target"]
    return model, {n: None if n == "none" else written["draft"] if n == "eagle3" else n for n in args.draft_list}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `timeout`: stop the services, keep the JSON
    from bench.bench_serving import engine_flags, prompt_text_ids, prompt_vocab

    gpus = None
    if args.device.startswith("cuda"):
        import torch

        gpus = torch.cuda.device_count()
    args.layout_list, left_out = parse_layouts(args.layouts, gpus)
    bench = Bench(args)
    bench.report.update(left_out=left_out, device=f"{gpus} x {torch.cuda.get_device_name(0)}" if gpus else "cpu")
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="eyrie-prefix-"))
    workdir.mkdir(parents=True, exist_ok=True)
    model, drafts = prepare(bench, workdir)
    vocab, text_ids = prompt_vocab(model), prompt_text_ids(model, args.prompts_file)
    # The engines' flags as bench_serving's layouts set them: device and memory fraction each instance its own.
    flags = {**engine_flags(argparse.Namespace(**vars(args), gpu_memory_fraction=None)), "device": None}
    runs, plan = plan_runs(args), plan_prompts(args, vocab, text_ids)
    # The first run starts cold (its stack compiles the kernels the later ones find cached): half a share more.
    shares = [FIRST_SHARE] + [1.0] * (len(runs) - 1)
    for i, (layout, draft_name, cache) in enumerate(runs):
        budget = (bench.left() - 5) * shares[i] / sum(shares[i:])
        if budget < args.min_phase_s:
            bench.report["skipped"].append(f"{layout} cache {cache} draft {draft_name}")
            continue
        pr = PrefixRun(bench, layout, cache, draft_name, model, drafts[draft_name], workdir)
        run_one(bench, pr, {**flags, "prefix_cache": cache == "on"}, budget, plan, vocab, text_ids)
    bench.save()
    markdown = tables(bench.report)
    Path(args.out).with_suffix(".md").write_text(f"{heading(bench.report)} (raw JSON: {Path(args.out).name})\n\n"
                                                 f"{markdown}\n")
    print("\n" + markdown)
    for line in left_out + [f"skipped (deadline): {s}" for s in bench.report["skipped"]]:
        print(line)
    return 0


# ---- the report ----------------------------------------------------------------------------------------
def div(a, b):
    return a / b if a is not None and b else None


def comparisons(runs: list[dict]) -> list[dict]:
    """Per layout and draft with both a cache-on and a cache-off run: the issue's ratios."""
    by = {(r["layout"], r["draft"], r["cache"]): r for r in runs}
    out = []
    for (layout, draft, cache), on in by.items():
        off = by.get((layout, draft, "off"))
        if cache != "on" or off is None:
            continue

        def get(run: dict, workload: str, *keys):
            v = run.get(workload)
            for k in keys:
                v = None if v is None else v.get(k)
            return v

        probe = div(get(on, "probe", "cold", "ttft_p50_s"), get(on, "probe", "warm", "ttft_p50_s"))
        tput = div(get(on, "shared", "output_tok_s"), get(off, "shared", "output_tok_s"))
        out.append({
            "layout": layout, "draft": draft,
            "probe_ttft_uncached_over_cached": probe,  # cache on: a new prefix's TTFT p50 / a cached one's
            "probe_ttft_off_over_on": div(get(off, "probe", "warm", "ttft_p50_s"), get(on, "probe", "warm",
                                                                                       "ttft_p50_s")),
            "warm_ttft_off_over_on": div(get(off, "shared", "warm", "ttft_p50_s"), get(on, "shared", "warm",
                                                                                       "ttft_p50_s")),
            "warm_cached_share": get(on, "shared", "warm", "cached_share"),
            "throughput_on_over_off": tput,
            "requests_s_on_over_off": div(get(on, "shared", "requests_s"), get(off, "shared", "requests_s")),
            "chat_throughput_on_over_off": div(get(on, "chat", "output_tok_s"), get(off, "chat", "output_tok_s")),
            "chat_warm_ttft_off_over_on": div(get(off, "chat", "warm", "ttft_p50_s"), get(on, "chat", "warm",
                                                                                          "ttft_p50_s")),
            "handoff_bytes_on": get(on, "shared", "handoff_bytes"), "handoff_bytes_off": get(off, "shared",
                                                                                             "handoff_bytes"),
            "handoff_bytes_on_over_off": div(get(on, "shared", "handoff_bytes"), get(off, "shared", "handoff_bytes")),
            "targets": {"ttft_5x": None if probe is None else probe >= 5,
                        "throughput_2x": None if tput is None else tput >= 2},
        })
    return out


def fmt(x, scale: float = 1.0, digits: int = 0) -> str:
    return "-" if x is None else f"{x * scale:.{digits}f}"


def format_line(label: str, name: str, w: dict) -> str:
    cold, warm = w["cold"], w["warm"]
    mb = "" if w["handoff_bytes"] is None else f"  hand-off {w['handoff_bytes'] / 1e6:.1f} MB"
    return (f"{label} {name:6s} done {w['completed']}/{w['issued']}  tok/s {fmt(w['output_tok_s'], 1, 1)}  req/s "
            f"{fmt(w['requests_s'], 1, 2)}  TTFT p50 cold/warm {fmt(cold['ttft_p50_s'], 1, 3)}/"
            f"{fmt(warm['ttft_p50_s'], 1, 3)} s  cached cold/warm {cold['cached_tokens']}/{warm['cached_tokens']}{mb}")


def heading(report: dict) -> str:
    s = report["settings"]
    return (f"Shared-prefix serving on {report['device']}: {s['prefixes']} prefixes x {s['prefix_tokens']} tokens, "
            f"{s['questions']} questions x {s['question_tokens']} tokens, {s['output_tokens']} out, concurrency "
            f"{s['concurrency']}; chat {s['chat']} ({s['chat_tokens']} first:new:out); probe {s['probe']} prefixes "
            f"at concurrency 1")


def tables(report: dict) -> str:
    head = ["layout", "cache", "draft", "tok/s", "req/s", "cold TTFT p50 / p99 (s)", "warm TTFT p50 / p99 (s)",
            "warm cached tokens (share)", "hand-off MB", "chat tok/s", "chat warm TTFT p50 (s)",
            "probe TTFT cold / warm (ms)", "failed"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in report["runs"]:
        sh, chat, probe = r.get("shared") or {}, r.get("chat") or {}, r.get("probe") or {}
        warm = sh.get("warm") or {}

        def p(w: dict, kind: str, q: int, scale: float = 1.0, digits: int = 3) -> str:
            return fmt((w.get(kind) or {}).get(f"ttft_p{q}_s"), scale, digits)

        failed = sum(r.get(w, {}).get("failed", 0) for w in WORKLOADS) + (r.get("warmup_failed") or 0)
        rows.append("| " + " | ".join([
            r["layout"], r["cache"], Path(r["draft"]).name, fmt(sh.get("output_tok_s"), 1, 1),
            fmt(sh.get("requests_s"), 1, 2), f"{p(sh, 'cold', 50)} / {p(sh, 'cold', 99)}",
            f"{p(sh, 'warm', 50)} / {p(sh, 'warm', 99)}",
            f"{warm.get('cached_tokens', '-')} ({fmt(warm.get('cached_share'), 100, 1)}%)",
            fmt(sh.get("handoff_bytes"), 1e-6, 1), fmt(chat.get("output_tok_s"), 1, 1), p(chat, "warm", 50),
            f"{p(probe, 'cold', 50, 1e3, 1)} / {p(probe, 'warm', 50, 1e3, 1)}",
            str(failed) + (" (error)" if "error" in r else "") + (f" (skipped {','.join(r['skipped'])})"
                                                                  if r.get("skipped") else "")]) + " |")
    head2 = ["layout", "draft", "probe TTFT uncached / cached (>= 5)", "warm TTFT loaded, off / on",
             "tok/s on / off (>= 2)", "chat tok/s on / off", "hand-off bytes on / off"]
    rows += ["", "| " + " | ".join(head2) + " |", "|" + "---|" * len(head2)]
    for c in report["comparisons"]:
        rows.append("| " + " | ".join([
            c["layout"], Path(c["draft"]).name, fmt(c["probe_ttft_uncached_over_cached"], 1, 2),
            fmt(c["warm_ttft_off_over_on"], 1, 2), fmt(c["throughput_on_over_off"], 1, 2),
            fmt(c["chat_throughput_on_over_off"], 1, 2), fmt(c["handoff_bytes_on_over_off"], 1, 3)]) + " |")
    return "\n".join(rows)


if __name__ == "__main__":
    sys.exit(main())
