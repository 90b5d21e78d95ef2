"""Does receiving hand-offs slow the decode engine's steps? (issue 28: two GPUs over grpc-stream gave 461 tok/s
at c32 where colocated gave 2300+, inter-token latency p50 31-37 ms.)

In one process, as the decode service runs them: an engine proxy on its own thread (each step: ``--step-ms`` of
device work queued on the default stream, then the host waits for it, as ``Engine.step`` does at its
``.tolist()``) and a gRPC server receiving hand-offs with ``GrpcStreamTransport.receive`` into a KV cache on the
same device (``PageSink``: checksums, checks, the scatter into reserved pages). A second process sends hand-offs
of ``--tokens`` tokens (target + draft layers at the 8B shape by default) back to back for ``--seconds``.

Printed and written (``--json``): the proxy's step period (p50 / p99 / max) quiet and while hand-offs arrive, and
the hand-offs' count and median seconds. ``--legacy`` runs the scatter as it was before issue 28 (pageable
host -> device copies on the default stream) beside the current one, in the same run.

Usage: ``python bench/bench_receive.py [--device cuda:0] [--tokens 512] [--seconds 10] [--legacy] [--json out]``
(on the CPU: the same with ``--device cpu`` and a matmul step: what the receiver's GIL share costs the steps).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import shared.handoff.wire as wire  # noqa: E402
from proto.eyrie.v1 import eyrie_pb2 as pb  # noqa: E402
from proto.eyrie.v1 import eyrie_pb2_grpc as pb_grpc  # noqa: E402
from shared.handoff import GrpcStreamTransport, PageSink, PageSource  # noqa: E402
from shared.handoff.transport import add_decode_servicer  # noqa: E402
from shared.memory.kv_cache import CacheLayout, KVCache  # noqa: E402


def make_cache(args, layers: int, device: str) -> KVCache:
    pages = -(-args.tokens // args.page_size)
    return KVCache(CacheLayout(num_layers=layers, num_kv_heads=args.kv_heads, head_dim=args.head_dim,
                               dtype=torch.bfloat16, device=torch.device(device), page_size=args.page_size,
                               num_pages=pages + 1, max_reqs=1, max_context=args.tokens + 16))


def page_lists(args) -> tuple[list[int], list[int]]:
    """Source pages in order; destination pages reversed (fragmented, as a busy pool's are)."""
    n = -(-args.tokens // args.page_size)
    return list(range(1, n + 1)), list(range(n, 0, -1))


def legacy_scatter(layer: torch.Tensor, page_ids: list[int], data: torch.Tensor, page_size: int) -> None:
    """The GPU scatter before issue 28: pageable copies on the calling thread's default stream."""
    runs = wire.coalesce(page_ids)
    if len(runs) == 1:
        first = runs[0].page * page_size
        layer[first:first + len(page_ids) * page_size].copy_(data)
        return
    pages = layer.view(-1, page_size, *layer.shape[1:])
    index = torch.tensor(page_ids, dtype=torch.int64, device=layer.device)
    pages.index_copy_(0, index, data.to(layer.device).view(-1, page_size, *layer.shape[1:]))


class Receiver(pb_grpc.DecodeServicer):
    def __init__(self, caches: list[KVCache], dst_pages: list[int]):
        self.caches, self.pages, self.transport = caches, dst_pages, GrpcStreamTransport()
        self.seconds: list[float] = []

    def Transfer(self, request_iterator, context):  # noqa: N802
        t0 = time.perf_counter()
        got = self.transport.receive(request_iterator,
                                     lambda rid: PageSink(rid, self.caches, [self.pages] * len(self.caches)))
        self.seconds.append(time.perf_counter() - t0)
        return pb.TransferAck(bytes=got.bytes, chunks=got.chunks)


def send_loop(args, port: int, ready, go, stop) -> None:
    """The sending process: hand-offs back to back from a cache of its own (on the CPU: the sender's GPU work
    is not what is measured), between ``go`` and ``stop``; ``ready`` once one warm-up hand-off went through."""
    src_pages = page_lists(args)[0]
    caches = [make_cache(args, args.layers, "cpu"), make_cache(args, args.draft_layers, "cpu")]
    transport = GrpcStreamTransport(chunk_bytes=args.chunk_mb << 20, streams=args.streams)
    transport.send(f"127.0.0.1:{port}", PageSource("warm", caches, [src_pages] * 2, b""), timeout=120)
    ready.set()
    i = 0
    while not stop.is_set():
        go.wait()
        if stop.is_set():
            break
        transport.send(f"127.0.0.1:{port}", PageSource(f"r{i}", caches, [src_pages] * 2, b""), timeout=120)
        i += 1
    transport.close()


class EngineProxy:
    """A decode engine's step cadence: ``step_ms`` of device work on the default stream, then a host wait."""

    def __init__(self, device: torch.device, step_ms: float):
        self.device = device
        n = 4096 if device.type == "cuda" else 256
        self.a = torch.randn(n, n, device=device, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
        self.reps = self._calibrate(step_ms)
        self.periods: list[float] = []
        self.stop = threading.Event()

    def _step(self, reps: int) -> None:
        x = self.a
        for _ in range(reps):
            x = self.a @ x
            x = x / x.norm()
        float(x[0, 0])  # the host waits for the step's results

    def _calibrate(self, step_ms: float) -> int:
        """Repetitions of the work that take ``step_ms`` (the best of a few timings of 20)."""
        with torch.cuda.device(self.device) if self.device.type == "cuda" else _null():
            self._step(5)
            times = []
            for _ in range(5):
                t0 = time.perf_counter()
                self._step(20)
                times.append((time.perf_counter() - t0) / 20)
        return max(1, round(step_ms / 1e3 / min(times)))

    def run(self) -> None:
        with torch.cuda.device(self.device) if self.device.type == "cuda" else _null():
            last = time.perf_counter()
            while not self.stop.is_set():
                self._step(self.reps)
                now = time.perf_counter()
                self.periods.append(now - last)
                last = now


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def stats(periods: list[float]) -> dict:
    ms = sorted(p * 1e3 for p in periods)
    if not ms:
        return {"steps": 0}
    return {"steps": len(ms), "p50_ms": statistics.median(ms), "p99_ms": ms[int(0.99 * (len(ms) - 1))],
            "max_ms": ms[-1]}


def measure(args, receiver: Receiver, go, seconds: float) -> dict:
    """The proxy's steps for ``seconds`` quiet, then for ``seconds`` with hand-offs arriving."""
    proxy = EngineProxy(torch.device(args.device), args.step_ms)
    thread = threading.Thread(target=proxy.run, daemon=True)
    thread.start()
    time.sleep(seconds)
    quiet, proxy.periods = proxy.periods, []
    receiver.seconds.clear()
    go.set()
    time.sleep(seconds)
    go.clear()
    busy = proxy.periods
    proxy.stop.set()
    thread.join(30)
    handoffs = list(receiver.seconds)
    return {"quiet": stats(quiet), "receiving": stats(busy), "handoffs": len(handoffs),
            "handoff_p50_s": statistics.median(handoffs) if handoffs else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--draft-layers", type=int, default=1)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--chunk-mb", type=int, default=4)
    ap.add_argument("--streams", type=int, default=1)
    ap.add_argument("--step-ms", type=float, default=15.0)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--legacy", action="store_true", help="also: the scatter as it was before issue 28")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dst_pages = page_lists(args)[1]
    caches = [make_cache(args, args.layers, args.device), make_cache(args, args.draft_layers, args.device)]
    receiver = Receiver(caches, dst_pages)
    server = grpc.server(futures.ThreadPoolExecutor(8), options=[("grpc.max_receive_message_length", 256 << 20)])
    add_decode_servicer(receiver, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    ctx = mp.get_context("spawn")
    ready, go, stop = ctx.Event(), ctx.Event(), ctx.Event()
    sender = ctx.Process(target=send_loop, args=(args, port, ready, go, stop), daemon=True)
    sender.start()
    results = {}
    try:
        if not ready.wait(300):
            raise RuntimeError("the sending process sent no warm-up hand-off within 300 s")
        results["current"] = measure(args, receiver, go, args.seconds)
        if args.legacy and args.device != "cpu":
            current, wire._scatter_on_device = wire._scatter_on_device, legacy_scatter
            try:
                results["legacy"] = measure(args, receiver, go, args.seconds)
            finally:
                wire._scatter_on_device = current
    finally:
        stop.set()
        go.set()
        sender.join(60)
        server.stop(0)
    settings = {k: v for k, v in vars(args).items() if k != "json"}
    print(f"engine-proxy steps while hand-offs arrive, {settings}")
    for name, r in results.items():
        q, b = r["quiet"], r["receiving"]
        print(f"  {name:8s} step p50 {q.get('p50_ms', 0):7.2f} -> {b.get('p50_ms', 0):7.2f} ms, p99 "
              f"{q.get('p99_ms', 0):7.2f} -> {b.get('p99_ms', 0):7.2f} ms, max {b.get('max_ms', 0):7.2f} ms; "
              f"{r['handoffs']} hand-offs, median {r['handoff_p50_s'] or 0:.3f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"settings": settings, "results": results}, indent=2))


if __name__ == "__main__":
    main()
