"""Hand-off bandwidth on loopback: one request's target KV pages through each transport's data path.

- grpc-stream: ``iter_chunks`` -> a real gRPC server on 127.0.0.1 -> ``GrpcStreamTransport.receive`` ->
  ``PageSink`` (checksums, checks, the copy into the reserved pages), as the services run it.
- ipc: ``write_in_place`` into the decode pools mapped through ``shared.handoff.ipc`` (on the CPU the
  pools are mapped in this process, so this is the copy's speed, not a second process's).

Usage: ``python bench/bench_handoff.py [--tokens 4096] [--layers 8] [--device cpu] [--json out.json]``.
Prints the settings with the figures; the floor for grpc-stream is 1.5 GB/s (issue 14).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent import futures
from pathlib import Path

import grpc
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from proto.eyrie.v1 import eyrie_pb2 as pb  # noqa: E402
from proto.eyrie.v1 import eyrie_pb2_grpc as pb_grpc  # noqa: E402
from shared.handoff import GrpcStreamTransport, PageSink, PageSource  # noqa: E402
from shared.handoff.ipc import export_pools, open_pools, write_in_place  # noqa: E402
from shared.memory.kv_cache import CacheLayout, KVCache  # noqa: E402

GRPC_FLOOR_GBPS = 1.5


def make_cache(args, shareable: bool) -> KVCache:
    pages = -(-args.tokens // args.page_size)
    return KVCache(CacheLayout(num_layers=args.layers, num_kv_heads=args.kv_heads, head_dim=args.head_dim,
                             dtype=getattr(torch, args.dtype), device=torch.device(args.device),
                             page_size=args.page_size, num_pages=pages + 1, max_reqs=1, max_context=args.tokens + 16,
                             shareable=shareable))


class Receiver(pb_grpc.DecodeServicer):
    def __init__(self, dst: KVCache, pages: list[int]):
        self.dst, self.pages, self.transport = dst, pages, GrpcStreamTransport()

    def Transfer(self, request_iterator, context):  # noqa: N802
        got = self.transport.receive(request_iterator, lambda rid: PageSink(rid, [self.dst], [self.pages]))
        return pb.TransferAck(bytes=got.bytes, chunks=got.chunks)


def bench_grpc(args, src: KVCache, dst: KVCache, src_pages: list[int], dst_pages: list[int]) -> dict:
    server = grpc.server(futures.ThreadPoolExecutor(4), options=[("grpc.max_receive_message_length", 256 << 20)])
    pb_grpc.add_DecodeServicer_to_server(Receiver(dst, dst_pages), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    transport = GrpcStreamTransport(chunk_bytes=args.chunk_mb << 20)
    try:
        times, nbytes = [], 0
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            ack = transport.send(f"127.0.0.1:{port}", PageSource("r", [src], [src_pages], b""), timeout=120)
            times.append(time.perf_counter() - t0)
            nbytes = ack.bytes
    finally:
        transport.close()
        server.stop(0)
    assert torch.equal(dst.pool[:, :, dst_pages[0] * args.page_size], src.pool[:, :, src_pages[0] * args.page_size])
    best = min(times)
    return {"transport": "grpc-stream", "bytes": nbytes, "seconds": best, "gbps": nbytes / best / 1e9,
            "chunk_mb": args.chunk_mb}


def bench_ipc(args, src: KVCache, dst: KVCache, src_pages: list[int], dst_pages: list[int]) -> dict:
    pools = open_pools(export_pools([dst.pool]))
    times, nbytes = [], 0
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        nbytes = write_in_place(PageSource("r", [src], [src_pages], b""), pools, [dst_pages], time.monotonic() + 60)
        times.append(time.perf_counter() - t0)
    best = min(times)
    return {"transport": "ipc", "bytes": nbytes, "seconds": best, "gbps": nbytes / best / 1e9}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--chunk-mb", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    src, dst = make_cache(args, False), make_cache(args, True)
    src.pool.normal_()
    n = -(-args.tokens // args.page_size)
    src_pages, dst_pages = list(range(1, n + 1)), list(range(n, 0, -1))  # no run coalesces on the receiving side
    results = [bench_grpc(args, src, dst, src_pages, dst_pages), bench_ipc(args, src, dst, src_pages, dst_pages)]
    settings = {k: v for k, v in vars(args).items() if k != "json"}
    print(f"hand-off of {args.tokens} tokens, {settings}")
    for r in results:
        floor = f" (floor {GRPC_FLOOR_GBPS} GB/s)" if r["transport"] == "grpc-stream" else ""
        print(f"  {r['transport']:12s} {r['bytes'] / 1e6:9.1f} MB in {r['seconds'] * 1e3:8.2f} ms: "
              f"{r['gbps']:6.2f} GB/s{floor}")
    if args.json:
        Path(args.json).write_text(json.dumps({"settings": settings, "results": results}, indent=2))


if __name__ == "__main__":
    main()
