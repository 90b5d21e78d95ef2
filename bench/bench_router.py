"""The router alone: its sustained tokens/s, CPU per token and the latency it adds, in front of synthetic
decode instances (no GPU, no model weights, real gRPC, real Redis).

    python bench/bench_router.py --streams 64,256,512,1024 --routers 1,2 --out docs/bench/router_cpu.json
    python bench/bench_router.py --api openai --streams 256,512      # the clients on the OpenAI API (SSE)

Each synthetic decode instance (``Synth``, all in one process) implements ``Decode.Admit``, ``Stream`` and
``Abort`` and registers itself in Redis with heartbeats like an engine: the router takes every request as a
local prefill (``local_prefill_max_tokens`` large), so no prefill service is involved. An instance steps every
``--step-ms`` and gives each of its streams ``--tokens-per-step`` tokens per step, stretching its steps so that
it never emits more than ``--instance-tok-s`` (a fixed engine throughput). Each token's logprob is the time it
left the instance (``time.monotonic`` less the run's base, one clock for every process of the host), so the
client measures what the router adds to each message: arrival time less the oldest token's departure (a
sample of the messages: ``added``), and to each request's first message (all of them: ``first``, the part of
TTFT the router adds).

Clients (``--clients`` processes, grpc.aio) run a closed loop of ``--streams`` streams spread over the routers,
each asking for ``--max-tokens`` tokens at a time. Reported per point: the tokens/s the clients received in
the window, the routers' CPU seconds per token (``psutil``, user + system, all routers together), the added
latency per message (p50 / p99) and the clients' inter-token gap (p50 / p99). On a shared machine every
figure includes the other processes' contention: say so where the figures are recorded.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CONFIG = {"architectures": ["LlamaForCausalLM"], "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
          "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
          "max_position_embeddings": 8192, "eos_token_id": 2}


# ---- synthetic decode instances -------------------------------------------------------------------
class Synth:
    """One synthetic decode instance: a step loop that wakes every attached stream once per step."""

    def __init__(self, instance_id: str, args, base: float):
        self.instance_id, self.args, self.base = instance_id, args, base
        self.admitted: dict[str, int] = {}  # request id -> tokens to generate
        self.aborted: set[str] = set()
        self.tick = asyncio.Event()
        self.waiting = 0  # streams waiting for the next step
        self.relayed = 0  # streams on relays

    async def step_loop(self) -> None:
        a = self.args
        while True:
            n = max(1, self.waiting + self.relayed)
            await asyncio.sleep(max(a.step_ms / 1000, n * a.tokens_per_step / a.instance_tok_s))
            old, self.tick = self.tick, asyncio.Event()
            old.set()

    async def Admit(self, request, context):  # noqa: N802
        from proto.eyrie.v1 import eyrie_pb2 as pb

        if len(self.admitted) >= self.args.max_running:
            return pb.ReserveResponse(accepted=False, reason="no room now (synthetic max_running)")
        self.admitted[request.request_id] = request.sampling.max_new_tokens or 16
        return pb.ReserveResponse(accepted=True)

    async def Stream(self, request, context):  # noqa: N802
        import grpc

        from proto.eyrie.v1 import eyrie_pb2 as pb

        rid = request.request_id
        total = self.admitted.get(rid)
        if total is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"{rid} is not here")
        k, sent = self.args.tokens_per_step, 0
        try:
            while sent < total:
                if rid in self.aborted:
                    await context.abort(grpc.StatusCode.ABORTED, f"{rid} aborted")
                n = 1 if sent == 0 else min(k, total - sent)  # the prompt's first token comes alone
                if sent:
                    self.waiting += 1
                    try:
                        await self.tick.wait()
                    finally:
                        self.waiting -= 1
                now = time.monotonic() - self.base
                msg = pb.GenerateResponse(request_id=rid, token_ids=[(sent + i) % 1000 + 3 for i in range(n)],
                                          logprobs=[now] * n)
                sent += n
                if sent >= total:
                    msg.finish.reason = "length"
                    msg.finish.usage.completion_tokens = total
                yield msg
        finally:
            self.admitted.pop(rid, None)
            self.aborted.discard(rid)

    async def Relay(self, request_iterator, context):  # noqa: N802
        """Every attached request's tokens, one RelayBatch per step (as the decode service's relay)."""
        from proto.eyrie.v1 import eyrie_pb2 as pb

        streams: dict[str, int] = {}  # request id -> tokens sent
        errors: list = []

        async def attach() -> None:
            async for req in request_iterator:
                if req.request_id in self.admitted:
                    streams[req.request_id] = 0
                    self.relayed += 1
                else:
                    errors.append(pb.RelayError(request_id=req.request_id, code=5, details="not here"))

        reader = asyncio.get_running_loop().create_task(attach())
        try:
            while True:
                await self.tick.wait()
                batch, now = pb.RelayBatch(errors=errors), time.monotonic() - self.base
                errors.clear()
                for rid, sent in list(streams.items()):
                    total = self.admitted.get(rid, 0)
                    n = 1 if sent == 0 else min(self.args.tokens_per_step, total - sent)
                    msg = batch.messages.add(request_id=rid, token_ids=[(sent + i) % 1000 + 3 for i in range(n)],
                                             logprobs=[now] * n)
                    streams[rid] = sent = sent + n
                    if sent >= total or rid in self.aborted:
                        msg.finish.reason = "length"
                        msg.finish.usage.completion_tokens = sent
                        del streams[rid]
                        self.relayed -= 1
                        self.admitted.pop(rid, None)
                        self.aborted.discard(rid)
                if batch.messages or batch.errors:
                    yield batch
        finally:
            reader.cancel()
            self.relayed -= len(streams)

    async def Abort(self, request, context):  # noqa: N802
        from proto.eyrie.v1 import eyrie_pb2 as pb

        found = request.request_id in self.admitted
        if found:
            self.aborted.add(request.request_id)
        return pb.AbortResponse(found=found)

    def load(self) -> dict:
        return {"outstanding_tokens": sum(self.admitted.values()), "running": len(self.admitted)}


async def _serve_synth(args, base: float, ready) -> None:
    import grpc

    from proto.eyrie.v1 import eyrie_pb2 as pb
    from services.metadata import Heartbeat, InstanceInfo, Registry, connect

    registry = Registry(connect(args.redis_url), 5.0)
    beats, synths = [], []
    for i in range(args.instances):
        synth = Synth(f"synth-decode-{i}", args, base)
        server = grpc.aio.server()
        handlers = {
            "Admit": grpc.unary_unary_rpc_method_handler(synth.Admit, pb.AdmitRequest.FromString,
                                                          pb.ReserveResponse.SerializeToString),
            "Stream": grpc.unary_stream_rpc_method_handler(synth.Stream, pb.StreamRequest.FromString,
                                                            pb.GenerateResponse.SerializeToString),
            "Abort": grpc.unary_unary_rpc_method_handler(synth.Abort, pb.AbortRequest.FromString,
                                                          pb.AbortResponse.SerializeToString),
            "Relay": grpc.stream_stream_rpc_method_handler(synth.Relay, pb.StreamRequest.FromString,
                                                            pb.RelayBatch.SerializeToString)}
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("eyrie.v1.Decode", handlers),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        synths.append((synth, server))
        asyncio.get_running_loop().create_task(synth.step_loop())
        info = InstanceInfo(synth.instance_id, "decode", f"127.0.0.1:{port}")
        beats.append(Heartbeat(registry, info, 0.2, synth.load).start())
    registry.register(InstanceInfo("synth-prefill", "prefill", "127.0.0.1:1"))  # /health is ready
    ready.set()
    await asyncio.Event().wait()


def synth_main(args, base: float, ready) -> None:
    asyncio.run(_serve_synth(args, base, ready))


# ---- routers --------------------------------------------------------------------------------------
def router_main(args, model_dir: str, conn) -> None:  # noqa: D103
    from services.router.server import start_router
    from services.settings import RouterSettings

    settings = RouterSettings(model=model_dir, redis_url=args.redis_url, local_prefill_max_tokens=1 << 20,
                              max_concurrent_requests=0, log_level="WARNING", heartbeat_s=1.0,
                              decode_relay=not args.no_relay, openai_port=0 if args.api == "openai" else None)
    handle = start_router(settings)
    conn.send((os.getpid(), handle.extra["openai_address"] if args.api == "openai" else handle.grpc_address))
    conn.recv()  # stop
    handle.stop(0.5)


# ---- clients --------------------------------------------------------------------------------------
async def _stream_slot(stub, args, base: float, stats: dict, stop_at: float, measure_from: float) -> None:
    from proto.eyrie.v1 import eyrie_pb2 as pb

    prompt = [random.randrange(3, 30000) for _ in range(args.prompt_tokens)]
    while time.monotonic() < stop_at:
        req = pb.GenerateRequest(return_logprobs=True, sampling=pb.SamplingParams(max_new_tokens=args.max_tokens))
        req.token_ids.ids.extend(prompt)
        last = None
        async for msg in stub.Generate(req):
            now = time.monotonic()
            if now >= measure_from and now < stop_at:
                n = len(msg.token_ids)
                stats["tokens"] += n
                stats["messages"] += 1
                if msg.logprobs and last is None:  # a request's first message (its first token)
                    stats["first"].append(now - base - msg.logprobs[0])
                if msg.logprobs and random.random() < 0.2:
                    stats["added"].append(now - base - msg.logprobs[0])
                if last is not None and random.random() < 0.2:
                    stats["itl"].append((now - last) / n)
            last = now
        if time.monotonic() >= measure_from:
            stats["requests"] += 1


async def _sse_slot(address: str, args, base: float, stats: dict, stop_at: float, measure_from: float) -> None:
    """One stream over the OpenAI API (``/v1/completions``, ``stream``), on one kept-alive HTTP/1.1 connection.
    A minimal client (chunked transfer, SSE lines, one ``json.loads`` per event) so that the clients' own parsing
    takes as little of the machine as it can; each event's first ``token_logprobs`` is its oldest token's stamp."""
    host, port = address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port), limit=1 << 20)
    prompt = [random.randrange(3, 30000) for _ in range(args.prompt_tokens)]
    body = json.dumps({"prompt": prompt, "max_tokens": args.max_tokens, "stream": True,
                       "logprobs": 0, "return_token_ids": True, "ignore_eos": True}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {address}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    try:
        while time.monotonic() < stop_at:
            writer.write(head + body)
            status = await reader.readline()
            if b" 200 " not in status:
                raise RuntimeError(f"HTTP {status!r}")
            while (await reader.readline()) not in (b"\r\n", b""):
                pass  # headers (the body is chunked: uvicorn streams a response of no stated length)
            last, pending, done = None, b"", False
            while True:  # to the last chunk (after [DONE]): the connection then takes the next request
                size = int((await reader.readline()).strip() or b"0", 16)
                if size == 0:
                    await reader.readline()
                    break
                pending += (await reader.readexactly(size + 2))[:-2]  # the chunk's data, less its CRLF
                *events, pending = pending.split(b"\n\n")
                for ev in events:
                    data = ev[6:].rstrip(b"\r\n") if ev.startswith(b"data: ") else b""
                    if not data:
                        continue
                    if data == b"[DONE]":
                        done = True
                        continue
                    choice = json.loads(data)["choices"][0]
                    ids, lps = choice.get("token_ids") or [], (choice.get("logprobs") or {}).get("token_logprobs")
                    now = time.monotonic()
                    if ids and measure_from <= now < stop_at:
                        stats["tokens"] += len(ids)
                        stats["messages"] += 1
                        if lps and last is None:  # a request's first event (its first token)
                            stats["first"].append(now - base - lps[0])
                        if lps and random.random() < 0.2:
                            stats["added"].append(now - base - lps[0])
                        if last is not None and random.random() < 0.2:
                            stats["itl"].append((now - last) / len(ids))
                    if ids:
                        last = now
            if done and time.monotonic() >= measure_from:
                stats["requests"] += 1
    finally:
        writer.close()


async def _client(args, routers: list[str], streams: int, base: float, start_at: float) -> dict:
    import grpc

    from proto.eyrie.v1 import eyrie_pb2_grpc as pb_grpc

    stats = {"tokens": 0, "messages": 0, "requests": 0, "added": [], "first": [], "itl": []}
    measure_from = start_at + args.warmup_s
    stop_at = measure_from + args.duration_s
    while time.monotonic() < start_at:
        await asyncio.sleep(0.01)
    if args.api == "openai":
        await asyncio.gather(*(_sse_slot(routers[i % len(routers)], args, base, stats, stop_at, measure_from)
                               for i in range(streams)))
        return stats
    channels = [grpc.aio.insecure_channel(a) for a in routers]
    stubs = [pb_grpc.GenerationStub(c) for c in channels]
    await asyncio.gather(*(_stream_slot(stubs[i % len(stubs)], args, base, stats, stop_at, measure_from)
                           for i in range(streams)))
    for c in channels:
        await c.close()
    return stats


def client_main(args, routers: list[str], streams: int, base: float, start_at: float, conn) -> None:
    conn.send(asyncio.run(_client(args, routers, streams, base, start_at)))


# ---- the sweep ------------------------------------------------------------------------------------
def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def run_point(args, routers: list[tuple[int, str]], streams: int, base: float, synth_pid: int) -> dict:
    import psutil

    ctx = mp.get_context("spawn")
    procs = [psutil.Process(pid) for pid, _ in routers]
    addresses = [a for _, a in routers]
    start_at = time.monotonic() + 3.0  # the clients' imports
    pipes, clients = [], []
    per = [streams // args.clients + (i < streams % args.clients) for i in range(args.clients)]
    for i, n in enumerate(per):
        parent, child = ctx.Pipe()
        order = addresses[i % len(addresses):] + addresses[:i % len(addresses)]
        p = ctx.Process(target=client_main, args=(args, order, n, base, start_at, child), daemon=True)
        p.start()
        pipes.append(parent)
        clients.append(p)
    others = {"synth": [psutil.Process(synth_pid)], "clients": [psutil.Process(p.pid) for p in clients]}
    while time.monotonic() < start_at + args.warmup_s:
        time.sleep(0.02)
    other0 = {k: sum(sum(p.cpu_times()[:2]) for p in v) for k, v in others.items()}
    cpu0 = sum(sum(p.cpu_times()[:2]) for p in procs)
    t0 = time.monotonic()
    while time.monotonic() < start_at + args.warmup_s + args.duration_s:
        time.sleep(0.02)
    cpu = sum(sum(p.cpu_times()[:2]) for p in procs) - cpu0
    wall = time.monotonic() - t0
    other = {f"{k}_cpu_cores": round((sum(sum(p.cpu_times()[:2]) for p in v) - other0[k]) / wall, 2)
             for k, v in others.items()}
    results = [c.recv() for c in pipes]
    for p in clients:
        p.join(60)
    tokens = sum(r["tokens"] for r in results)
    added = [x for r in results for x in r["added"]]
    first = [x for r in results for x in r["first"]]
    itl = [x for r in results for x in r["itl"]]
    return {"routers": len(routers), "streams": streams, "tok_s": round(tokens / args.duration_s, 1),
            "msgs_s": round(sum(r["messages"] for r in results) / args.duration_s, 1),
            "requests": sum(r["requests"] for r in results),
            "router_cpu_us_per_token": round(1e6 * cpu / max(1, tokens), 2),
            "router_cpu_cores": round(cpu / wall, 2),
            "added_ms_p50": round(1e3 * _pct(added, 0.5), 3), "added_ms_p99": round(1e3 * _pct(added, 0.99), 3),
            "first_ms_p50": round(1e3 * _pct(first, 0.5), 3), "first_ms_p99": round(1e3 * _pct(first, 0.99), 3),
            "itl_ms_p50": round(1e3 * _pct(itl, 0.5), 3), "itl_ms_p99": round(1e3 * _pct(itl, 0.99), 3),
            **other, "load_avg_1m": round(os.getloadavg()[0], 2)}


def start_routers(args, n: int, model_dir: str) -> list:
    ctx = mp.get_context("spawn")
    out = []
    for _ in range(n):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=router_main, args=(args, model_dir, child), daemon=True)
        p.start()
        pid, address = parent.recv()
        out.append((p, parent, pid, address))
    return out


def stop_routers(routers) -> None:
    for _, conn, _, _ in routers:
        conn.send("stop")
    for p, *_ in routers:
        p.join(15)
        if p.is_alive():
            p.terminate()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", default="64,256,512,1024")
    ap.add_argument("--routers", default="1,2", help="router process counts to compare")
    ap.add_argument("--instances", type=int, default=4, help="synthetic decode instances")
    ap.add_argument("--instance-tok-s", type=float, default=10000, help="each instance's fixed throughput ceiling")
    ap.add_argument("--step-ms", type=float, default=20.0, help="an instance's shortest step")
    ap.add_argument("--tokens-per-step", type=int, default=2, help="tokens per stream per step (speculative: > 1)")
    ap.add_argument("--max-running", type=int, default=100000, help="streams an instance holds at most")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--clients", type=int, default=2, help="client processes")
    ap.add_argument("--warmup-s", type=float, default=3.0)
    ap.add_argument("--duration-s", type=float, default=10.0)
    ap.add_argument("--no-relay", action="store_true", help="a Stream call per request (the relay off)")
    ap.add_argument("--api", choices=("grpc", "openai"), default="grpc",
                    help="the clients' API: the router's gRPC Generate, or the OpenAI API's streamed completions")
    ap.add_argument("--redis-url", default=None, help="default: an embedded Redis")
    ap.add_argument("--out", default=None, help="write the JSON here too")
    args = ap.parse_args()
    from services.metadata import EmbeddedRedis

    redis = None
    if args.redis_url is None:
        redis = EmbeddedRedis()
        args.redis_url = redis.start()
    model_dir = tempfile.mkdtemp(prefix="bench-router-model-")
    Path(model_dir, "config.json").write_text(json.dumps(CONFIG))
    ctx = mp.get_context("spawn")
    base = time.monotonic()
    ready = ctx.Event()
    synth = ctx.Process(target=synth_main, args=(args, base, ready), daemon=True)
    synth.start()
    ready.wait(60)
    settings = {k: v for k, v in vars(args).items() if k not in ("out",)}
    print(json.dumps({"settings": settings, "cpus": os.cpu_count(), "load_avg": os.getloadavg()}), flush=True)
    points = []
    try:
        for n_routers in [int(x) for x in args.routers.split(",")]:
            routers = start_routers(args, n_routers, model_dir)
            print(json.dumps({"router_pids": [pid for _, _, pid, _ in routers]}), flush=True)
            try:
                for streams in [int(x) for x in args.streams.split(",")]:
                    point = run_point(args, [(pid, a) for _, _, pid, a in routers], streams, base, synth.pid)
                    print(json.dumps(point), flush=True)
                    points.append(point)
            finally:
                stop_routers(routers)
    finally:
        synth.terminate()
        synth.join(5)
        if redis is not None:
            redis.stop()
    if args.out:
        Path(args.out).write_text(json.dumps({"settings": settings, "points": points}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
