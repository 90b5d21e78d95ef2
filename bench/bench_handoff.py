"""Hand-off bandwidth on loopback: one request's target KV pages through each transport's data path.

- grpc-stream: ``GrpcStreamTransport.send`` -> a real gRPC server on 127.0.0.1 in another process (as the
  decode service is) -> ``GrpcStreamTransport.receive`` -> ``PageSink`` (checksums, checks, the copy into the
  reserved pages), as the services run it; every page is checked afterwards.
- ipc: ``write_in_place`` into the decode pools mapped through ``shared.handoff.ipc`` (on the CPU the
  pools are mapped in this process, so this is the copy's speed, not a second process's).
- ipc-cross-process (``--cross-process``): the pools live in a second process, as the decode service's
  do, exported by handle and mapped here; the same copies, plus the device's own copy of the same bytes
  (one ``copy_`` of a contiguous tensor) as the reference (issue 14: IPC >= 80% of it).
- peer (``--peer``, two GPUs): the pools in a second process on another GPU (``--peer-device``), target +
  draft (``--draft-layers``) at the 8B shape, every candidate in one run: each peer copy mode
  (``kernels.page_copy.PeerSettings``: staged per ``--peer-chunks-mb``, pull, push, runs, runs-strided) per page
  layout (``--peer-layouts``), every page checked bit for bit, against ``cudaMemcpyPeer`` of the same bytes
  measured before and after in the same run (issue 28: >= 80% of it); also the local gather alone and the
  hand-off as the services run it (``write_in_place``, the default mode).

Usage: ``python bench/bench_handoff.py [--tokens 4096] [--layers 8] [--device cpu] [--chunk-mb 4]
[--repeat 5] [--streams 1,4] [--transports grpc-stream,ipc] [--cross-process] [--contiguous] [--json out.json]``;
two GPUs: ``python bench/bench_handoff.py --peer --json peer.json`` (4096 tokens, 32 + 1 layers, bf16).
Prints the settings with the figures (the median of the repeats, and the best); the floor for
grpc-stream is 1.5 GB/s (issue 14).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import select
import statistics
import sys
import threading
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
from shared.handoff.transport import add_decode_servicer  # noqa: E402
from shared.memory.kv_cache import CacheLayout, KVCache  # noqa: E402

GRPC_FLOOR_GBPS = 1.5


def make_cache(args, shareable: bool) -> KVCache:
    pages = -(-args.tokens // args.page_size)
    return KVCache(CacheLayout(num_layers=args.layers, num_kv_heads=args.kv_heads, head_dim=args.head_dim,
                             dtype=getattr(torch, args.dtype), device=torch.device(args.device),
                             page_size=args.page_size, num_pages=pages + 1, max_reqs=1, max_context=args.tokens + 16,
                             shareable=shareable))


def pages(args) -> tuple[list[int], list[int]]:
    """The source's pages, and the destination's."""
    n = -(-args.tokens // args.page_size)
    src = list(range(1, n + 1))
    # Reversed: no run coalesces on the receiving side (the worst case, one copy per page), unless --contiguous.
    return src, list(src) if args.contiguous else list(range(n, 0, -1))


def filled_source(args) -> KVCache:
    src = make_cache(args, False)
    src.pool.copy_(torch.randn(src.pool.shape, generator=torch.Generator().manual_seed(0)).to(src.pool.dtype))
    return src


class Receiver(pb_grpc.DecodeServicer):
    def __init__(self, dst: KVCache, pages: list[int]):
        self.dst, self.pages, self.transport = dst, pages, GrpcStreamTransport()
        self.sinks: dict[str, PageSink] = {}  # one per hand-off, shared by its parallel streams
        self.lock = threading.Lock()

    def sink(self, rid: str) -> PageSink:
        with self.lock:
            return self.sinks.setdefault(rid, PageSink(rid, [self.dst], [self.pages]))

    def Transfer(self, request_iterator, context):  # noqa: N802
        got = self.transport.receive(request_iterator, self.sink)
        return pb.TransferAck(bytes=got.bytes, chunks=got.chunks)


def serve_receiver(args, conn) -> None:
    """The receiving side in a process of its own (as the decode service is): serves Decode.Transfer into
    a cache of its own, sends its port, then its CPU seconds for each hand-off it is told to time ("start",
    "stop"), and at "done" whether every page arrived intact."""
    src_pages, dst_pages = pages(args)
    dst = make_cache(args, True)
    server = grpc.server(futures.ThreadPoolExecutor(2 * max(stream_counts(args)) + 2),
                         options=[("grpc.max_receive_message_length", 256 << 20)])
    add_decode_servicer(Receiver(dst, dst_pages), server)  # as the decode service registers it
    conn.send(server.add_insecure_port("127.0.0.1:0"))
    server.start()
    while (msg := conn.recv()) != "done":
        if msg == "start":
            cpu = time.process_time()
        else:
            conn.send(time.process_time() - cpu)
    src, ps = filled_source(args), args.page_size
    conn.send(all(torch.equal(dst.pool[:, :, d * ps:(d + 1) * ps], src.pool[:, :, s * ps:(s + 1) * ps])
                  for s, d in zip(src_pages, dst_pages)))
    server.stop(0)


def stream_counts(args) -> list[int]:
    return [int(k) for k in str(args.streams).split(",")]


def bench_grpc(args, src: KVCache, src_pages: list[int]) -> list[dict]:
    """One result per stream count, the counts run in turn in every round (a shared machine's load moves
    them alike)."""
    conn, child_conn = mp.Pipe()
    receiver = mp.get_context("spawn").Process(target=serve_receiver, args=(args, child_conn), daemon=True)
    receiver.start()
    port = conn.recv()
    counts = stream_counts(args)
    transports = {k: GrpcStreamTransport(chunk_bytes=args.chunk_mb << 20, streams=k) for k in counts}
    times = {k: [] for k in counts}
    cpu = {k: [0.0, 0.0] for k in counts}  # sender, receiver CPU seconds
    nbytes = 0
    try:
        for i in range(args.repeat + 1):  # the first round opens the connections and warms
            for k in counts:
                conn.send("start")
                c0, t0 = time.process_time(), time.perf_counter()
                ack = transports[k].send(f"127.0.0.1:{port}", PageSource(f"r{i}-{k}", [src], [src_pages], b""),
                                         timeout=120)
                dt, dc = time.perf_counter() - t0, time.process_time() - c0
                conn.send("stop")
                received_cpu = conn.recv()
                nbytes = ack.bytes
                if i:
                    times[k].append(dt)
                    cpu[k][0] += dc
                    cpu[k][1] += received_cpu
    finally:
        for t in transports.values():
            t.close()
        conn.send("done")
    assert conn.recv(), "the pages did not arrive intact"
    join_exited(receiver, 30)
    # CPU seconds per GB on each side (every thread of the process): the figure a loaded machine moves least.
    gb = nbytes * args.repeat / 1e9
    return [{"transport": "grpc-stream", **figures(nbytes, times[k]), "chunk_mb": args.chunk_mb, "streams": k,
             "sender_cpu_s_per_gb": cpu[k][0] / gb, "receiver_cpu_s_per_gb": cpu[k][1] / gb} for k in counts]


def figures(nbytes: int, times: list[float]) -> dict:
    """Bytes, the median and best times of the repeats, and the median's bandwidth."""
    median = statistics.median(times)
    return {"bytes": nbytes, "seconds": median, "best_seconds": min(times), "gbps": nbytes / median / 1e9,
            "best_gbps": nbytes / min(times) / 1e9, "repeats": len(times)}


def bench_ipc(args, src: KVCache, src_pages: list[int]) -> dict:
    dst_pages = pages(args)[1]
    dst = make_cache(args, True)
    pools = open_pools(export_pools([dst.pool]))
    times, nbytes = [], 0
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        nbytes = write_in_place(PageSource("r", [src], [src_pages], b""), pools, [dst_pages],
                                time.monotonic() + 60).bytes
        times.append(time.perf_counter() - t0)
    return [{"transport": "ipc", **figures(nbytes, times)}]


def join_exited(proc, timeout: float) -> None:
    """``proc.join(timeout)`` that returns once ``proc`` itself has exited. ``join`` waits on the process's
    sentinel, a pipe every process it starts inherits: the first CPU tensor it shares by name starts torch's
    shared-memory manager, which holds the pipe open after ``proc`` is gone, so ``join`` sat out its whole
    timeout (30 s of a 40 s ``bench_tp --smoke``). Here the wait is on the process (a pidfd, Linux 5.3+)."""
    if proc.exitcode is not None:  # (reaps it when it has exited)
        return
    try:
        fd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):  # no pidfd here: the sentinel, as before
        proc.join(timeout)
        return
    try:
        select.select([fd], [], [], timeout)  # readable once the process has exited
    finally:
        os.close(fd)
    proc.exitcode  # noqa: B018 (reaps it)


def _hold_pools(args, conn) -> None:
    """The child: a decode-like process that allocates the pools, exports them, and waits to be told to go."""
    dst = make_cache(args, True)
    conn.send(export_pools([dst.pool]))
    conn.recv()
    conn.send(float(dst.pool.float().abs().sum()))  # proof the writes landed in this process's memory


def d2d_copy(args, nbytes: int) -> dict:
    """The device's own copy bandwidth for the same bytes (bytes written per second)."""
    device = torch.device(args.device)
    a = torch.empty(nbytes // 2, dtype=torch.float16, device=device).normal_()
    b = torch.empty_like(a)
    times = []
    for _ in range(args.repeat + 1):
        sync(device)
        t0 = time.perf_counter()
        b.copy_(a)
        sync(device)
        times.append(time.perf_counter() - t0)
    return {"transport": "device-copy", **figures(nbytes, times[1:])}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_writes(pools: list[torch.Tensor], src: KVCache, src_pages: list[int], dst_pages: list[int],
                 repeat: int) -> tuple[int, list[float]]:
    """``repeat`` + 1 in-place writes of ``src``'s pages into ``pools`` (the first maps and warms, and is not
    kept): the bytes of one, and the seconds of each of the others."""
    times, nbytes = [], 0
    for _ in range(repeat + 1):
        t0 = time.perf_counter()
        nbytes = write_in_place(PageSource("r", [src], [src_pages], b""), pools, [dst_pages],
                                time.monotonic() + 60).bytes
        times.append(time.perf_counter() - t0)
    return nbytes, times[1:]


def writes_into_another_process(dst_args, src: KVCache, src_pages: list[int], dst_pages: list[int],
                                repeat: int) -> tuple[int, list[float], float]:
    """``timed_writes`` into pools a spawned process holds (``_hold_pools`` with ``dst_args``): bytes, seconds,
    and that process's sum of its pools afterwards (> 0: the writes landed in its memory)."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_hold_pools, args=(dst_args, child), daemon=True)
    proc.start()
    try:
        if not parent.poll(120):
            raise RuntimeError("the process holding the pools did not export them within 120 s")
        nbytes, times = timed_writes(open_pools(parent.recv()), src, src_pages, dst_pages, repeat)
        parent.send("done")
        return nbytes, times, parent.recv()
    finally:
        join_exited(proc, 30)
        if proc.is_alive():
            proc.kill()


def bench_cross_process(args, src: KVCache, src_pages: list[int]) -> dict:
    nbytes, times, landed = writes_into_another_process(args, src, src_pages, pages(args)[1], args.repeat)
    assert landed > 0, "the writes did not reach the other process's pools"
    return {"transport": "ipc-cross-process", **figures(nbytes, times), "runs": len(src_pages)}


def _hold_peer_pools(cache_args: list, conn) -> None:
    """The child of ``--peer``: a decode-like process holding one pool per cache on its GPU (zeroed); exports
    them and holds them until told "done" (the parent checks the pages through its own mapping of them)."""
    caches = [make_cache(a, True) for a in cache_args]
    for c in caches:
        c.pool.zero_()
    torch.cuda.synchronize(caches[0].pool.device)
    conn.send(export_pools([c.pool for c in caches]))
    conn.recv()


def pages_bit_equal(pools: list[torch.Tensor], srcs: list[KVCache], src_pages: list[int],
                    dst_pages: list[int]) -> bool:
    """Every destination page holds its source page's bytes (every plane, compared as int16 words), and every
    other page of the pools is still zero."""
    for pool, src in zip(pools, srcs):
        planes, ps = pool.shape[0] * pool.shape[1], src.page_size
        got = pool.view(torch.int16).view(planes, pool.shape[2] // ps, -1)
        want = src.pool.view(torch.int16).view(planes, src.pool.shape[2] // ps, -1).to(pool.device)
        d_idx = torch.tensor(dst_pages, device=pool.device)
        if not torch.equal(got[:, d_idx], want[:, torch.tensor(src_pages, device=pool.device)]):
            return False
        rest = [p for p in range(got.shape[1]) if p not in set(dst_pages)]
        if rest and got[:, torch.tensor(rest, device=pool.device)].any():
            return False
    return True


def peer_candidate(pools: list[torch.Tensor], srcs: list[KVCache], src_pages: list[int], dst_pages: list[int],
                   mode: str, chunk_mb: int | None, repeat: int) -> dict:
    """``repeat`` + 1 calls of ``copy_pages_peer`` in ``mode`` for every cache (on a side stream of the source GPU,
    as the hand-off runs it; the first warms and is not kept), each timed from both GPUs idle to both idle; then
    the pages checked bit for bit."""
    from kernels.page_copy import copy_pages_peer

    src_dev, dst_dev = srcs[0].pool.device, pools[0].device
    for p in pools:
        p.zero_()
    stream, times = torch.cuda.Stream(src_dev), []
    chunk = chunk_mb << 20 if chunk_mb else None
    try:
        for _ in range(repeat + 1):
            sync(src_dev)
            sync(dst_dev)
            t0 = time.perf_counter()
            with torch.cuda.stream(stream):
                for pool, src in zip(pools, srcs):
                    copy_pages_peer(pool, src.pool, src_pages, dst_pages, src.page_size, mode, chunk)
            stream.synchronize()
            sync(src_dev)
            sync(dst_dev)
            times.append(time.perf_counter() - t0)
    except Exception as e:  # a mode the driver refuses: its row says why, the others still run
        return {"error": f"{type(e).__name__}: {e}"[:300]}
    nbytes = sum(s.pool[:, :, :s.page_size].numel() * s.pool.element_size() * len(src_pages) for s in srcs)
    return {**figures(nbytes, times[1:]), "intact": pages_bit_equal(pools, srcs, src_pages, dst_pages)}


def local_gather(srcs: list[KVCache], src_pages: list[int], repeat: int) -> dict:
    """The copy kernel on the source GPU alone (the staged mode's gather: pages into a contiguous buffer), the
    bytes it moves per second: the local half of ``staged``."""
    from kernels.page_copy import copy_pages

    dev, times = srcs[0].pool.device, []
    bufs = [torch.empty((*s.pool.shape[:2], len(src_pages) * s.page_size, *s.pool.shape[3:]), dtype=s.pool.dtype,
                        device=dev) for s in srcs]
    for _ in range(repeat + 1):
        sync(dev)
        t0 = time.perf_counter()
        for buf, src in zip(bufs, srcs):
            copy_pages(buf, src.pool, src_pages, list(range(len(src_pages))), src.page_size)
        sync(dev)
        times.append(time.perf_counter() - t0)
    return {"transport": "local-gather", **figures(sum(b.numel() * b.element_size() for b in bufs), times[1:])}


def peer_layouts(args) -> dict[str, tuple[list[int], list[int]]]:
    """The page lists per layout: scattered (the destination's reversed: no run on both sides, the worst case),
    contiguous (one run), runs8 (runs of 8 pages, the runs' order reversed: a pool with some churn)."""
    n = -(-args.tokens // args.page_size)
    src = list(range(1, n + 1))
    runs8 = [p for lo in reversed(range(0, n, 8)) for p in range(lo + 1, min(lo + 9, n + 1))]
    return {"scattered": (src, list(range(n, 0, -1))), "contiguous": (src, list(src)), "runs8": (src, runs8)}


def bench_peer(args) -> list[dict]:
    """``--peer``: one request's target + draft pages from ``--device`` into pools a second process holds on
    ``--peer-device`` (CUDA IPC, peer access: ``shared.handoff.peer``): every candidate (each mode of
    ``kernels.page_copy.PeerSettings``, staged per chunk size) per page layout, each checked bit for bit, against
    the device's own peer memcpy (``cudaMemcpyPeer``: ``copy_`` of one contiguous tensor between the two GPUs) of
    the same bytes, measured before and after in the same run (the better of the two is the reference)."""
    from kernels import page_copy
    from shared.handoff.peer import ready

    src_dev, dst_dev = torch.device(args.device), torch.device(args.peer_device)
    why = ready(src_dev, dst_dev)
    if why is not None:
        raise SystemExit(f"no peer copy between {src_dev} and {dst_dev}: {why}")
    cache_args = [argparse.Namespace(**{**vars(args), "layers": n}) for n in (args.layers, args.draft_layers) if n]
    srcs = [filled_source(a) for a in cache_args]
    layouts = peer_layouts(args)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    held = [argparse.Namespace(**{**vars(a), "device": args.peer_device}) for a in cache_args]
    proc = ctx.Process(target=_hold_peer_pools, args=(held, child), daemon=True)
    proc.start()
    per_page = sum(s.pool[:, :, :s.page_size].numel() * s.pool.element_size() for s in srcs)
    nbytes = per_page * len(layouts["scattered"][0])
    results = [peer_memcpy(src_dev, dst_dev, nbytes, args.repeat),
               local_gather(srcs, layouts["scattered"][0], args.repeat)]
    try:
        if not parent.poll(120):
            raise RuntimeError("the process holding the pools did not export them within 120 s")
        pools = open_pools(parent.recv())
        for layout in args.peer_layouts.split(","):
            src_pages, dst_pages = layouts[layout]
            for mode, (chunk_mb, buffers), kernel in peer_candidates(args):
                page_copy.PEER.kernel, default_buffers = kernel, page_copy.PEER.buffers
                page_copy.PEER.buffers = buffers or default_buffers
                r = peer_candidate(pools, srcs, src_pages, dst_pages, mode, chunk_mb, args.repeat)
                page_copy.PEER.kernel, page_copy.PEER.buffers = None, default_buffers
                results.append({"transport": f"peer-{mode}", "layout": layout, "chunk_mb": chunk_mb,
                                "buffers": buffers,
                                "kernel": kernel and f"{kernel.block_bytes}:{kernel.num_warps}",
                                "runs": len(page_copy.page_runs(src_pages, dst_pages)), **r})
                print(peer_line(results[-1]), flush=True)
        results.append(guarded("write_in_place", lambda: production_row(pools, srcs, *layouts["scattered"],
                                                                        args.repeat)))
        parent.send("done")
    finally:
        join_exited(proc, 30)
        if proc.is_alive():
            proc.kill()
    results.append(guarded("memcpy-peer", lambda: peer_memcpy(src_dev, dst_dev, nbytes, args.repeat)))
    ref = max(r["gbps"] for r in results if r["transport"] == "memcpy-peer" and "gbps" in r)
    for r in results:
        if "gbps" in r and r["transport"] != "memcpy-peer":
            r["of_memcpy_peer"] = r["gbps"] / ref
    return results


def guarded(name: str, measure) -> dict:
    """``measure()``, or a row naming why it failed (a CUDA error left by a candidate: the figures so far are kept)."""
    try:
        return measure()
    except Exception as e:
        return {"transport": name, "layout": "-", "error": f"{type(e).__name__}: {e}"[:300]}


def peer_candidates(args) -> list[tuple]:
    """(mode, (staged chunk MB, staging buffers) or Nones, the crossing kernel's launch or None) of every
    candidate: staged once per ``--peer-chunks-mb`` and ``--peer-buffers``, push and pull once per
    ``--peer-kernels`` (block bytes:warps), the others once."""
    from kernels.page_copy import KERNEL, KernelSettings

    out = []
    for mode in args.peer_modes.split(","):
        if mode == "staged":
            out += [(mode, (int(c), int(b)), None) for b in args.peer_buffers.split(",")
                    for c in args.peer_chunks_mb.split(",")]
        elif mode in ("push", "pull"):
            for k in args.peer_kernels.split(","):
                block, warps = (int(x) for x in k.split(":"))
                out.append((mode, (None, None),
                            KernelSettings(**{**vars(KERNEL), "block_bytes": block, "num_warps": warps})))
        else:
            out.append((mode, (None, None), None))
    return out


def production_row(pools, srcs, src_pages, dst_pages, repeat: int) -> dict:
    """The hand-off as the services run it (``write_in_place``, the default mode: ``EYRIE_PEER_COPY``)."""
    from kernels import page_copy

    for p in pools:
        p.zero_()
    times, nbytes = [], 0
    for _ in range(repeat + 1):
        t0 = time.perf_counter()
        nbytes = write_in_place(PageSource("r", srcs, [src_pages] * len(srcs), b""), pools,
                                [dst_pages] * len(srcs), time.monotonic() + 60).bytes
        times.append(time.perf_counter() - t0)
    return {"transport": "write_in_place", "layout": "scattered", "mode_used": page_copy.PEER.mode,
            "chunk_mb": page_copy.PEER.chunk_bytes >> 20, "push_refused": page_copy.PEER.push_refused,
            **figures(nbytes, times[1:]), "intact": pages_bit_equal(pools, srcs, src_pages, dst_pages)}


def peer_line(r: dict) -> str:
    """One candidate's row: mode, layout, chunk, median GB/s (and the ratio to memcpy-peer once known)."""
    name = f"{r['transport']}" + (f" {r['chunk_mb']} MB x {r.get('buffers')}" if r.get("chunk_mb")
                                  and "staged" in r["transport"] else "") + (f" {r['kernel']}" if r.get("kernel")
                                                                             else "")
    if r.get("mode_used"):  # the services' path: which mode the default (EYRIE_PEER_COPY) gave
        name += f" ({r['mode_used']})"
    if "error" in r:
        return f"  {name:28s} {r['layout']:10s} failed: {r['error']}"
    ratio = f" {r['of_memcpy_peer']:.2f} of memcpy-peer" if "of_memcpy_peer" in r else ""
    intact = f" bit-equal: {r['intact']}" if "intact" in r else ""
    return (f"  {name:28s} {r.get('layout', ''):10s} {r['bytes'] / 1e6:7.1f} MB {r['seconds'] * 1e3:7.2f} ms "
            f"{r['gbps']:7.1f} GB/s (best {r['best_gbps']:6.1f}){ratio}{intact}")


def peer_memcpy(src: torch.device, dst: torch.device, nbytes: int, repeat: int) -> dict:
    """``cudaMemcpyPeer`` of ``nbytes``: one contiguous ``copy_`` from ``src`` to ``dst`` (peer access enabled)."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=src).random_()
    b = torch.empty(nbytes, dtype=torch.uint8, device=dst)
    times = []
    for _ in range(repeat + 1):
        sync(src)
        sync(dst)
        t0 = time.perf_counter()
        b.copy_(a)
        sync(src)
        sync(dst)
        times.append(time.perf_counter() - t0)
    assert torch.equal(a.cpu(), b.cpu())
    return {"transport": "memcpy-peer", **figures(nbytes, times[1:])}


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
    ap.add_argument("--streams", default="1,4", help="grpc-stream: parallel streams per hand-off (a list: each "
                    "count in turn, every round)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--transports", default="grpc-stream,ipc")
    ap.add_argument("--cross-process", action="store_true", help="also: the pools in a second process (ipc)")
    ap.add_argument("--contiguous", action="store_true", help="pages contiguous on both sides (one run)")
    ap.add_argument("--peer", action="store_true", help="only: ipc into a peer GPU (--device into --peer-device), "
                    "each peer copy mode against cudaMemcpyPeer of the same bytes; the 8B shape by default")
    ap.add_argument("--peer-device", default="cuda:1")
    ap.add_argument("--peer-modes", default="staged,pull,runs", help="--peer: the candidates "
                    "(kernels.page_copy.PEER_MODES; push and runs-strided store into the peer's IPC mapping from a "
                    "kernel on this GPU: run them in a process of their own, as bench/gpu_session.sh peer does)")
    ap.add_argument("--peer-chunks-mb", default="8,16,32,64,128", help="--peer: the staged mode's chunk sizes")
    ap.add_argument("--peer-buffers", default="2,3", help="--peer: the staged mode's buffers per GPU")
    ap.add_argument("--peer-kernels", default="32768:8,32768:16,8192:4,4096:4", help="--peer: push and pull's "
                    "launches, block bytes per program:warps (a page-plane of the 8B shape is 32768 bytes)")
    ap.add_argument("--peer-layouts", default="scattered,runs8,contiguous", help="--peer: page layouts "
                    "(scattered: no run on both sides; runs8: runs of 8 pages; contiguous: one run)")
    ap.add_argument("--draft-layers", type=int, default=None, help="a draft cache's layers beside the target's "
                    "(--peer: default 1, an EAGLE-3 draft's)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.peer:
        args.device = "cuda:0" if args.device == "cpu" else args.device
        args.layers = 32 if args.layers == 8 else args.layers  # the 8B shape unless told otherwise
        args.dtype = "bfloat16" if args.dtype == "float16" else args.dtype
        args.draft_layers = 1 if args.draft_layers is None else args.draft_layers
        results = bench_peer(args)
    else:
        src, src_pages = filled_source(args), pages(args)[0]
        benches = {"grpc-stream": bench_grpc, "ipc": bench_ipc}
        results = [r for t in args.transports.split(",") for r in benches[t](args, src, src_pages)]
    if args.cross_process and not args.peer:
        results.append(bench_cross_process(args, src, src_pages))
        results.append(d2d_copy(args, results[-1]["bytes"]))
        results[-2]["of_device_copy"] = results[-2]["gbps"] / results[-1]["gbps"]
    settings = {k: v for k, v in vars(args).items() if k != "json"}
    print(f"hand-off of {args.tokens} tokens, {settings}")
    if args.peer:
        print("median GB/s per candidate; ratio to the better of two cudaMemcpyPeer runs (target 0.8):")
        for r in results:
            print(peer_line(r) if "layout" in r else f"  {r['transport']:39s} {r['bytes'] / 1e6:7.1f} MB "
                  f"{r['seconds'] * 1e3:7.2f} ms {r['gbps']:7.1f} GB/s (best {r['best_gbps']:6.1f})")
        for layout in args.peer_layouts.split(","):
            best = max((r for r in results if r.get("intact") and r.get("layout") == layout and "gbps" in r),
                       key=lambda r: r["gbps"], default=None)
            print(f"best on {layout} pages: {peer_line(best).strip() if best else 'none bit-equal'}")
    for r in results if not args.peer else []:
        floor = f" ({r['streams']} streams; floor {GRPC_FLOOR_GBPS} GB/s)" if r["transport"] == "grpc-stream" else ""
        if "of_device_copy" in r:
            floor = f" ({r['of_device_copy']:.2f} of the device copy; target 0.8)"
        print(f"  {r['transport']:12s} {r['bytes'] / 1e6:9.1f} MB in {r['seconds'] * 1e3:8.2f} ms (median of "
              f"{r['repeats']}): {r['gbps']:6.2f} GB/s, best {r['best_gbps']:6.2f} GB/s{floor}")
        if "sender_cpu_s_per_gb" in r:
            print(f"  {'':12s} CPU seconds per GB: sender {r['sender_cpu_s_per_gb']:.2f}, "
                  f"receiver {r['receiver_cpu_s_per_gb']:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"settings": settings, "results": results}, indent=2))


if __name__ == "__main__":
    main()
