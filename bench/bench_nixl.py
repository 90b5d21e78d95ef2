"""NIXL (UCX backend) bandwidth between two processes of one host, per UCX configuration.

Issue 14 asks whether NIXL, the KV-transfer library under vLLM's NixlConnector, SGLang's nixl backend and
Dynamo, is worth a transport of Eyrie's: keep it only if it beats the gRPC stream. With its default UCX
settings it moved VRAM -> VRAM at 0.3 GB/s in this VM. This script tries the settings that decide that
figure, one fresh pair of processes per configuration (UCX reads its environment once, at start):

- ``UCX_TLS``: which UCX transports may carry the bytes (cuda_ipc: GPU to GPU through CUDA IPC; cuda_copy
  staging through host memory; tcp; shm for host memory; ``default``: UCX's own choice);
- how many descriptors a transfer has (one per KV page run: a request's pages are scattered in the pool;
  ``--descs 1`` is one contiguous region, the best case);
- the memory: VRAM -> VRAM (the hand-off) and DRAM -> DRAM (for reference).

The writer (the prefill side) posts a NIXL WRITE into the reader's registered region and polls it to
DONE; the figure is bytes over the best of ``--repeat`` transfers, checked by the reader's checksum.
Needs ``nixl-cu13`` (``pip install nixl-cu13``; ~57 MiB) and, for VRAM, a GPU.

Usage: ``python bench/bench_nixl.py [--mb 512] [--descs 1,256] [--tls default,cuda_ipc,...] [--json out]``
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
import traceback
from pathlib import Path

import torch

TLS_DEFAULT = "default;cuda_ipc,cuda_copy,tcp;cuda_ipc,cuda_copy;cuda_copy,tcp;shm,cuda_ipc,cuda_copy,tcp"


def nixl_module():
    for name in ("nixl_cu13", "nixl_cu12", "nixl._api"):
        try:
            mod = __import__(name, fromlist=["nixl_agent"])
            return mod
        except ImportError:
            continue
    raise SystemExit("bench_nixl: no NIXL package (pip install nixl-cu13)")


def split(tensor: torch.Tensor, n: int) -> list[tuple[int, int, int]]:
    """``n`` descriptors (address, bytes, device id) tiling ``tensor`` in order (the reader lists its own
    reversed, so no two neighbours stay neighbours: pages scattered as a pool's are; n == 1: one region)."""
    nbytes = tensor.numel() * tensor.element_size()
    step = nbytes // n
    dev = (tensor.device.index or 0) if tensor.device.type == "cuda" else 0
    return [(tensor.data_ptr() + i * step, step, dev) for i in range(n)]


def reader(conn, mem: str, nbytes: int, ndesc: int) -> None:
    try:
        nixl = nixl_module()
        gpu = int(os.environ.get("BENCH_NIXL_READER_GPU", "0"))
        device = f"cuda:{gpu}" if mem == "VRAM" else "cpu"
        dst = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        agent = nixl.nixl_agent("reader", nixl.nixl_agent_config(backends=["UCX"]))
        agent.register_memory([(dst.data_ptr(), nbytes, gpu if mem == "VRAM" else 0, "")], mem)
        remote = agent.get_xfer_descs(list(reversed(split(dst, ndesc))), mem)
        conn.send((agent.get_agent_metadata(), agent.get_serialized_descs(remote)))
        conn.recv()  # the writer is done
        conn.send(int(dst.sum(dtype=torch.int64)))
    except Exception:
        conn.send(("error", traceback.format_exc()))


def writer(conn, mem: str, nbytes: int, ndesc: int, repeat: int) -> dict:
    nixl = nixl_module()
    device = "cuda" if mem == "VRAM" else "cpu"
    src = torch.full((nbytes,), 3, dtype=torch.uint8, device=device)
    agent = nixl.nixl_agent("writer", nixl.nixl_agent_config(backends=["UCX"]))
    agent.register_memory([(src.data_ptr(), nbytes, 0, "")], mem)
    got = conn.recv()
    if got[0] == "error":
        raise RuntimeError(got[1])
    meta, serialized = got
    name = agent.add_remote_agent(meta)
    remote = agent.deserialize_descs(serialized)
    local = agent.get_xfer_descs(split(src, ndesc), mem)
    t_init = time.perf_counter()
    handle = agent.initialize_xfer("WRITE", local, remote, name, b"done")
    init_s = time.perf_counter() - t_init
    times = []
    for _ in range(repeat + 1):  # the first one connects and warms
        t0 = time.perf_counter()
        state = agent.transfer(handle)
        while state == "PROC":
            state = agent.check_xfer_state(handle)
        if state != "DONE":
            raise RuntimeError(f"transfer ended {state}")
        times.append(time.perf_counter() - t0)
    backend = agent.query_xfer_backend(handle)
    handle.release()
    conn.send("done")
    checksum = conn.recv()
    if isinstance(checksum, tuple):
        raise RuntimeError(checksum[1])
    best = min(times[1:])
    return {"bytes": nbytes, "seconds": best, "gbps": nbytes / best / 1e9, "first_s": times[0],
            "init_xfer_s": init_s, "backend": backend, "landed": checksum == 3 * nbytes}


def one(tls: str, mem: str, nbytes: int, ndesc: int, repeat: int, out) -> None:
    """A fresh pair of processes with ``UCX_TLS`` set (or not): the child reads, this process writes."""
    if tls != "default":
        os.environ["UCX_TLS"] = tls
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=reader, args=(child, mem, nbytes, ndesc), daemon=True)
    proc.start()
    try:
        result = writer(parent, mem, nbytes, ndesc, repeat)
    except Exception as e:
        result = {"error": f"{type(e).__name__}: {e}"[:400]}
    finally:
        proc.join(20)
        if proc.is_alive():
            proc.kill()
    out.put({"tls": tls, "mem": mem, "descs": ndesc, **result})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=512, help="bytes per transfer (a 4096-token 8B hand-off: 512)")
    ap.add_argument("--descs", default="1,256", help="descriptor counts to try")
    ap.add_argument("--tls", default=TLS_DEFAULT, help="UCX_TLS values, ';'-separated ('default': unset)")
    ap.add_argument("--mem", default="VRAM,DRAM")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=60, help="seconds per configuration")
    ap.add_argument("--reader-gpu", type=int, default=0, help="VRAM: the reading process's GPU (1: a peer GPU, "
                    "the writer staying on 0)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    os.environ["BENCH_NIXL_READER_GPU"] = str(args.reader_gpu)  # (the spawned reader inherits it)
    nixl_module()
    results = []
    ctx = mp.get_context("spawn")
    for mem in args.mem.split(","):
        if mem == "VRAM" and not torch.cuda.is_available():
            continue
        for tls in args.tls.split(";"):
            for ndesc in (int(d) for d in args.descs.split(",")):
                q = ctx.Queue()
                p = ctx.Process(target=one, args=(tls, mem, args.mb << 20, ndesc, args.repeat, q))
                p.start()
                p.join(args.timeout)
                if p.is_alive():
                    p.kill()
                    r = {"tls": tls, "mem": mem, "descs": ndesc, "error": f"timed out after {args.timeout} s"}
                else:
                    r = q.get() if not q.empty() else {"tls": tls, "mem": mem, "descs": ndesc,
                                                       "error": f"exit {p.exitcode}"}
                results.append(r)
                fig = (f"{r['gbps']:8.2f} GB/s (first {r['first_s'] * 1e3:.1f} ms, backend {r['backend']}, "
                       f"landed {r['landed']})" if "gbps" in r else r["error"])
                print(f"{mem} UCX_TLS={tls:28s} descs={ndesc:5d}: {fig}", flush=True)
    settings = {k: v for k, v in vars(args).items() if k != "json"}
    if args.json:
        Path(args.json).write_text(json.dumps({"settings": settings, "results": results}, indent=2))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main()
