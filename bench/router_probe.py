"""Where the router's added latency comes from: ``bench_router.py`` with probes inside the router process.

    python bench/router_probe.py --streams 512 --instance-tok-s 5000 --duration-s 10 --probe-out probe.json
    python bench/router_probe.py --streams 64 --duration-s 4 --warmup-s 1 --garbage   # what the cyclic GC frees

Every ``bench_router.py`` option is taken as is. The router process additionally records (``--probe-out``):
- the cyclic GC's collections (``gc.callbacks``): when, which generation, how long, how many objects freed;
- loop lag: a task that sleeps 1 ms records how late it woke (the loop busy, waiting for the GIL, or its thread
  off the CPU);
- loop callbacks over ``--slow-ms`` (wall time and the loop thread's CPU time: wall >> CPU is the thread losing
  the CPU or the GIL inside the callback);
- the loop thread's scheduler figures once a second (``/proc/self/task/TID/schedstat``: time run, time runnable
  but waiting for a CPU), and every thread's CPU time by name (the I/O pool, gRPC's poller, ...);
- per relayed message (10% sampled), when the relay's reader hands it on and when the client's handler yields
  it, less the synthetic instance's stamp: the part of the added latency before the router reads a relay batch,
  and the part inside the router (both relative to the smallest reader delay seen, the clocks' offset).
``--garbage``: at the end, the objects the cyclic GC would free (``gc.DEBUG_SAVEALL``), by type, and the
reference cycles through the router's per-request objects. ``--phases``: each synthetic instance's steps
offset by i/N of a step (the bench's instances otherwise step together: one burst of every stream's message).
``--full-probes`` off (the default is on): only the GC is recorded (the other probes cost a few % of CPU).
The summary of the measurement window is printed at the end.
"""

from __future__ import annotations

import asyncio
import collections
import gc
import json
import os
import random
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import bench_router  # noqa: E402

ENV = "EYRIE_ROUTER_PROBE"  # the options, as JSON, for the spawned router and synthetic instances


def _opts() -> dict:
    return json.loads(os.environ.get(ENV, "{}"))


def probed_router_main(args, model_dir: str, conn) -> None:
    from services.router import grpc_api, relay
    from services.router import server as srv
    from services.settings import RouterSettings

    opts = _opts()
    full = opts.get("full", True)
    st: dict = {"gc": [], "lag": [], "slow": [], "recv": [], "yield": [], "sched": []}
    t_start = time.monotonic()
    st["t_start"] = t_start
    gc_t0 = [0.0]

    def on_gc(phase, info):
        if phase == "start":
            gc_t0[0] = time.perf_counter()
        else:
            st["gc"].append((time.monotonic() - t_start, info["generation"], time.perf_counter() - gc_t0[0],
                             info["collected"]))

    gc.callbacks.append(on_gc)
    if full:
        slow_s = opts.get("slow_ms", 3.0) / 1000
        handle_run = asyncio.events.Handle._run

        def run(self):
            t0, c0 = time.perf_counter(), time.thread_time()
            handle_run(self)
            dt = time.perf_counter() - t0
            if dt > slow_s:
                st["slow"].append((time.monotonic() - t_start, dt, time.thread_time() - c0,
                                   repr(getattr(self, "_callback", None))[:80]))

        asyncio.events.Handle._run = run
        push = relay.Inbox.push

        def probed_push(self, msg):
            if msg.logprobs and random.random() < 0.1:
                st["recv"].append((time.monotonic(), msg.logprobs[0]))
            return push(self, msg)

        relay.Inbox.push = probed_push
        generate = grpc_api.AioGeneration.generate

        async def probed_generate(self, raw, context):
            async for msg in generate(self, raw, context):
                if msg.logprobs and random.random() < 0.1:
                    st["yield"].append((time.monotonic(), msg.logprobs[0]))
                yield msg

        grpc_api.AioGeneration.generate = probed_generate
    settings = RouterSettings(model=model_dir, redis_url=args.redis_url, local_prefill_max_tokens=1 << 20,
                              max_concurrent_requests=0, log_level="WARNING", heartbeat_s=1.0,
                              decode_relay=not args.no_relay, openai_port=0 if args.api == "openai" else None)
    handle = srv.start_router(settings)
    loop = handle.extra["core"].loop

    async def lag_probe():
        while True:
            t = time.monotonic()
            await asyncio.sleep(0.001)
            st["lag"].append((t - t_start, time.monotonic() - t - 0.001))

    async def sched_probe():
        path = f"/proc/self/task/{threading.get_native_id()}/schedstat"
        while os.path.exists(path):
            with open(path) as f:
                ran, waited, slices = (int(x) for x in f.read().split())
            st["sched"].append((time.monotonic() - t_start, ran / 1e9, waited / 1e9, slices))
            threads = collections.Counter()  # every thread's CPU seconds so far, by name (Python's, else the OS')
            names = {t.native_id: t.name.rstrip("0123456789_") for t in threading.enumerate()}
            names[threading.get_native_id()] = "loop"
            for task in os.listdir("/proc/self/task"):
                try:
                    with open(f"/proc/self/task/{task}/comm") as f:
                        name = names.get(int(task)) or f"os:{f.read().strip()}"
                    with open(f"/proc/self/task/{task}/schedstat") as f:
                        threads[name] += int(f.read().split()[0]) / 1e9
                except OSError:
                    pass  # ended meanwhile
            st.setdefault("threads", []).append((time.monotonic() - t_start, dict(threads)))
            await asyncio.sleep(1.0)

    if full:
        loop.call_soon_threadsafe(lambda: (loop.create_task(lag_probe()), loop.create_task(sched_probe())))
    conn.send((os.getpid(), handle.extra["openai_address"] if args.api == "openai" else handle.grpc_address))
    conn.recv()  # stop
    if opts.get("garbage"):
        st["garbage"], st["cycles"] = _garbage()
    handle.stop(0.5)
    st["gc_threshold"] = gc.get_threshold()
    Path(opts["out"]).write_text(json.dumps(st))


def _name(o) -> str:
    n = type(o).__qualname__
    if n == "frame":
        return f"frame:{o.f_code.co_qualname}"
    if n in ("function", "coroutine", "async_generator"):
        return f"{n}:{o.__qualname__}"
    if n == "partial":
        return f"partial:{getattr(o.func, '__qualname__', '?')}"
    return n


def _garbage() -> tuple[list, list]:
    """What the cyclic GC would free now, by type; and for a few objects of each per-request type, the reference
    cycle through it (or that it is only held by one)."""
    gc.set_debug(gc.DEBUG_SAVEALL)
    gc.collect()
    found = list(gc.garbage)
    gc.set_debug(0)
    gc.garbage.clear()
    by_type = collections.Counter(f"{type(o).__module__}.{type(o).__qualname__}" for o in found)
    ids = {id(o) for o in found}
    cycles, seen = collections.Counter(), collections.Counter()
    for o in found:
        t = type(o).__qualname__
        if t in ("list", "tuple", "dict", "cell", "frame", "deque", "method", "function") or seen[t] >= 3:
            continue
        seen[t] += 1
        prev, frontier, last = {id(o): None}, [o], None
        while frontier and last is None:  # breadth first, through the garbage only, back to o
            nxt = []
            for x in frontier:
                for r in gc.get_referents(x):
                    if r is o:
                        last = x
                        break
                    if id(r) in ids and id(r) not in prev:
                        prev[id(r)] = x
                        nxt.append(r)
                if last is not None:
                    break
            frontier = nxt
        if last is None:
            cycles[f"{t}: held by a cycle, not in one"] += 1
            continue
        path = [last]
        while prev[id(path[-1])] is not None:
            path.append(prev[id(path[-1])])
        cycles[" -> ".join(_name(x) for x in reversed(path)) + " -> " + _name(o)] += 1
    return by_type.most_common(30), cycles.most_common(20)


def _phased(step_loop):
    async def run(self):
        i = int(self.instance_id.rsplit("-", 1)[1])
        await asyncio.sleep(i / self.args.instances * self.args.step_ms / 1000)
        await step_loop(self)

    return run


# The spawned processes import this module as their main: the probes and options reach them from here.
bench_router.router_main = probed_router_main
if _opts().get("phases"):
    bench_router.Synth.step_loop = _phased(bench_router.Synth.step_loop)


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def summary(st: dict, t0: float, t1: float) -> dict:
    """The probes over [t0, t1) (seconds since the router process started)."""
    out: dict = {"window_s": [round(t0, 1), round(t1, 1)]}
    gcs = [g for g in st["gc"] if t0 <= g[0] < t1]
    out["gc"] = {f"gen{k}": {"n": len(d), "total_ms": round(1e3 * sum(d), 1), "max_ms": round(1e3 * max(d), 1)}
                 for k in (0, 1, 2) if (d := [g[2] for g in gcs if g[1] == k])}
    lag = [v for t, v in st["lag"] if t0 <= t < t1]
    if lag:
        out["loop_lag_ms"] = {q: round(1e3 * _pct(lag, p), 2) for q, p in (("p50", .5), ("p90", .9), ("p99", .99),
                                                                         ("max", 1.0))}
    slow = [s for s in st["slow"] if t0 <= s[0] < t1]
    out["slow_callbacks"] = {"n": len(slow), "wall_ms": round(1e3 * sum(s[1] for s in slow), 1),
                             "cpu_ms": round(1e3 * sum(s[2] for s in slow), 1),
                             "max_ms": round(1e3 * max([s[1] for s in slow] or [0]), 1)}
    sched = [s for s in st["sched"] if t0 <= s[0] < t1 + 1]
    if len(sched) >= 2:
        a, b = sched[0], sched[-1]
        out["loop_thread"] = {"over_s": round(b[0] - a[0], 1), "ran_s": round(b[1] - a[1], 2),
                              "runnable_waiting_s": round(b[2] - a[2], 2)}
    threads = [x for x in st.get("threads", []) if t0 <= x[0] < t1 + 1]
    if len(threads) >= 2:  # CPU seconds per thread over the window (threads that ended meanwhile are missed)
        a, b = threads[0][1], threads[-1][1]
        out["threads_cpu_s"] = {k: round(v - a.get(k, 0.0), 2) for k, v in b.items() if v - a.get(k, 0.0) >= 0.01}
    base = st["t_start"]
    recv = [t - lp for t, lp in st["recv"] if t0 <= t - base < t1]
    yielded = [t - lp for t, lp in st["yield"] if t0 <= t - base < t1]
    if recv:
        off = min(recv)
        out["reader_ms"] = {"p50": round(1e3 * (_pct(recv, .5) - off), 2),
                            "p99": round(1e3 * (_pct(recv, .99) - off), 2)}
        out["handler_ms"] = {"p50": round(1e3 * (_pct(yielded, .5) - off), 2),
                             "p99": round(1e3 * (_pct(yielded, .99) - off), 2)}
    return out


def main() -> int:
    argv, opts = [], {"out": "router_probe.json"}
    it = iter(sys.argv[1:])
    for a in it:
        if a == "--probe-out":
            opts["out"] = next(it)
        elif a == "--garbage":
            opts["garbage"] = True
        elif a == "--phases":
            opts["phases"] = True
        elif a == "--gc-only":
            opts["full"] = False
        elif a == "--slow-ms":
            opts["slow_ms"] = float(next(it))
        else:
            argv.append(a)
    opts["out"] = str(Path(opts["out"]).resolve())
    os.environ[ENV] = json.dumps(opts)
    if opts.get("phases"):
        bench_router.Synth.step_loop = _phased(bench_router.Synth.step_loop)
    sys.argv = ["bench_router.py", *argv]
    windows, run_point = [], bench_router.run_point

    def timed_point(args, routers, streams, base, synth_pid):
        start_at = time.monotonic() + 3.0  # as run_point's: its clients start then and warm up
        windows.append((streams, start_at + args.warmup_s, start_at + args.warmup_s + args.duration_s))
        return run_point(args, routers, streams, base, synth_pid)

    bench_router.run_point = timed_point
    rc = bench_router.main()
    st = json.loads(Path(opts["out"]).read_text())  # the last router process's (use --routers 1)
    st["summary"] = [{"streams": n, **summary(st, w0 - st["t_start"], w1 - st["t_start"])} for n, w0, w1 in windows]
    Path(opts["out"]).write_text(json.dumps(st))
    for point in st["summary"]:
        print(json.dumps(point))
    if st.get("garbage"):
        print(json.dumps({"garbage": st["garbage"], "cycles": st["cycles"]}, indent=1))
    return rc


if __name__ == "__main__":
    sys.exit(main())
