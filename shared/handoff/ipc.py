"""Same-host hand-offs: the decode instance's KV pools mapped into the prefill process.

The decode side exports each of its pools (one tensor per cache, ``[K/V, layer, slot, kv head, head
dim]``, target first) once, in its handshake reply: on CUDA as CUDA IPC handles (the same GPU, or a
peer GPU of the host), on the CPU as named shared memory (torch's file_system sharing). The prefill
side maps them (``open_pools``) and writes a request's pages straight into the pages the decode side
reserved (``write_in_place``: each prefill step's pages as soon as the step ran, while the next one
computes; per cache, one copy of all layers per run of pages contiguous on both sides in the torch
reference; on CUDA all of a cache's new pages in one kernel, ``kernels.page_copy``, on a side stream that
waits for the step's event, synchronised per increment off the engine's thread; into a peer GPU's pools
``kernels.page_copy.copy_pages_peer``, once ``shared.handoff.peer`` enabled peer access and proved a copy).
Nothing in
the handles is code: they are JSON, never pickle.

The decode side cannot stop a write from another process, so the writer keeps to a lease: it writes
no page after ``write_deadline`` (the host's CLOCK_MONOTONIC, the reservation's attach deadline), and
the decode side frees an aborted in-place reservation only once the writer says it stopped or the
deadline has passed.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from kernels.page_copy import copy_pages, copy_pages_peer
from shared.handoff.peer import ready as peer_ready
from shared.handoff.wire import Increment, PageSource, Prefilled, TransferCancelled, TransferError, TransportFailed

WRITE_MARGIN_S = 1.0  # a copy starts only this long before the lease ends (a run's copy takes far less)
_EXPORTED: dict[int, torch.Tensor] = {}  # this process's exported pools: a same-process import takes them back


def host_id() -> str:
    """Equal for two processes exactly when they share a host (and its CLOCK_MONOTONIC)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "no-boot-id"
    return f"{socket.gethostname()}/{boot}"


def device_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid) if device.type == "cuda" else "cpu"


@dataclass(frozen=True)
class PoolHandle:
    """How another process on this host maps one pool."""

    kind: str  # cpu | cuda
    pid: int
    key: int  # the pool's id in the exporting process
    shape: tuple[int, ...]
    dtype: str
    device_uuid: str  # "cpu", or the GPU's UUID
    cpu: tuple = ()  # (torch_shm_manager socket, shared memory name, bytes)
    cuda: dict | None = None  # the fields of torch's CUDA IPC reduction (bytes as hex)


def export_pools(pools: list[torch.Tensor]) -> bytes:
    """The handles of ``pools`` (b"" when one of them cannot be shared: a CPU pool not in shared memory)."""
    handles = []
    for pool in pools:
        handle = _export(pool)
        if handle is None:
            return b""
        handles.append(handle.__dict__)
    return json.dumps(handles).encode()


def _export(pool: torch.Tensor) -> PoolHandle | None:
    key = id(pool)
    _EXPORTED[key] = pool
    common = dict(pid=os.getpid(), key=key, shape=tuple(pool.shape), dtype=str(pool.dtype).removeprefix("torch."),
                  device_uuid=device_uuid(pool.device))
    if pool.device.type == "cpu":
        storage = pool.untyped_storage()
        if not storage.is_shared():
            return None
        manager, name, size = storage._share_filename_cpu_()
        return PoolHandle(kind="cpu", cpu=(manager.decode(), name.decode(), size), **common)
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(pool)
    (_, size, stride, offset, _, _, device, handle, storage_bytes, storage_offset, _, ref_handle, ref_offset,
     event_handle, event_sync) = args
    cuda = dict(size=list(size), stride=list(stride), offset=offset, device=device, handle=handle.hex(),
                storage_bytes=storage_bytes, storage_offset=storage_offset, ref_handle=ref_handle.hex(),
                ref_offset=ref_offset, event_handle=event_handle.hex() if event_handle else "",
                event_sync=event_sync)
    return PoolHandle(kind="cuda", cuda=cuda, **common)


def pool_handles(blob: bytes) -> list[PoolHandle]:
    return [PoolHandle(**{**h, "shape": tuple(h["shape"]), "cpu": tuple(h["cpu"])}) for h in json.loads(blob)]


def reachable(blob: bytes, device: torch.device) -> str | None:
    """Why a process whose pools live on ``device`` cannot write into the exported pools (None: it can)."""
    if not blob:
        return "the decode instance exports no pools"
    for h in pool_handles(blob):
        if h.kind == "cpu":
            if device.type != "cpu":
                return "the decode pools are in host memory, this side's on " + str(device)
            continue
        if device.type != "cuda":
            return "the decode pools are on a GPU, this side's in host memory"
        if h.device_uuid == device_uuid(device):
            continue
        peer = local_index(h.device_uuid)
        if peer is None:
            return f"the decode GPU {h.device_uuid} is not visible to this process"
        why = peer_ready(device, torch.device("cuda", peer))  # peer access enabled, a copy proven
        if why is not None:
            return why
    return None


def local_index(uuid: str) -> int | None:
    """This process's index of the GPU with ``uuid`` (the exporter's index may differ: CUDA_VISIBLE_DEVICES)."""
    found = [i for i in range(torch.cuda.device_count()) if device_uuid(torch.device("cuda", i)) == uuid]
    return found[0] if found else None


def open_pools(blob: bytes) -> list[torch.Tensor]:
    """Map the exported pools into this process (the same tensors when they were exported here)."""
    return [_open(h) for h in pool_handles(blob)]


def _open(h: PoolHandle) -> torch.Tensor:
    if h.pid == os.getpid() and h.key in _EXPORTED:
        return _EXPORTED[h.key]
    dtype = getattr(torch, h.dtype)
    if h.kind == "cpu":
        manager, name, size = h.cpu
        storage = torch.UntypedStorage._new_shared_filename_cpu(manager.encode(), name.encode(), size)
        return torch.empty(0, dtype=dtype).set_(storage, 0, h.shape)
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    c = h.cuda
    index = local_index(h.device_uuid)
    return rebuild_cuda_tensor(
        torch.Tensor, torch.Size(c["size"]), tuple(c["stride"]), c["offset"], torch.UntypedStorage, dtype,
        c["device"] if index is None else index, bytes.fromhex(c["handle"]), c["storage_bytes"], c["storage_offset"],
        False, bytes.fromhex(c["ref_handle"]), c["ref_offset"], bytes.fromhex(c["event_handle"]) or None,
        c["event_sync"])


@dataclass
class Written:
    bytes: int  # K + V bytes written
    last: Prefilled  # what the last increment carried (the draft state, the first token)


def write_in_place(source: PageSource, pools: list[torch.Tensor], dest_page_ids: list[list[int]],
                   deadline: float) -> Written:
    """Copy the request's pages (every cache, every layer) into ``pools`` at ``dest_page_ids``, each
    increment's pages as soon as it comes (on CUDA on a side stream, after the event of the step that
    wrote them). Raises TransferCancelled when the guard was cancelled, TransferError past the lease."""
    if len(pools) != len(source.caches) or len(dest_page_ids) != len(source.caches):
        raise TransferError(f"{len(source.caches)} caches here, {len(pools)} pools and {len(dest_page_ids)} "
                            "page lists on the decode side")
    device = source.caches[0].pool.device
    side = _side_stream(device) if device.type == "cuda" else None
    host_waits = side is not None and PEER_WAIT == "host" and any(p.device != device for p in pools)
    written, sent, last = 0, source.first_unsent(), None
    for inc in source.increments():
        if time.monotonic() > deadline - WRITE_MARGIN_S:
            raise TransferError("the decode side's write deadline passed before the pages were written")
        if side is not None:
            # Each increment waits for the step that wrote its pages (its event), not for the whole prefill
            # stream: by the time a hand-off starts, that stream holds later chunks (other requests' too), and
            # waiting for all of them held the first increment back. Without an event (an increment of
            # pages already written), everything queued so far is waited for.
            waited = inc.written if inc.written is not None else torch.cuda.default_stream(device)
            if host_waits:
                # Into a peer GPU (the decode service's): this host thread waits (the GIL let go), so that
                # nothing this process queues on the decode GPU sits there waiting for a chunk still computing
                # here; another process's work blocked on that GPU takes its share of the time slices the GPU
                # gives the decode service's steps (two processes time-slice one GPU without MPS).
                waited.synchronize()
            elif inc.written is not None:
                side.wait_event(inc.written)
            else:
                side.wait_stream(waited)
        with source.guard.access():  # an abort waits for this increment's copies, then no other starts
            try:
                written += _write_increment(source, pools, dest_page_ids, inc, sent, side)
            except (TransferError, TransferCancelled):
                raise
            except Exception as e:  # the copy itself failed (a peer pointer refused, a CUDA error)
                _drain(pools)  # no copy queued before the failure lands after it (another transport may resend)
                raise TransportFailed(f"the in-place write failed: {type(e).__name__}: {e}") from e
        sent, last = source.first_unsent(inc.done), inc.last
    return Written(written, last)


def _drain(pools: list[torch.Tensor]) -> None:
    """Wait for everything this process queued on the pools' GPUs and its own (best effort: after a failure)."""
    devices = {p.device for p in pools if p.device.type == "cuda"}
    if devices and torch.cuda.is_available():
        devices.add(torch.device("cuda", torch.cuda.current_device()))
    for device in devices:
        try:
            torch.cuda.synchronize(device)
        except Exception:  # noqa: S110 (a broken context: nothing more can land either)
            pass


# How an increment into a peer GPU's pools waits for the chunk that wrote its pages: ``host`` (this process's thread
# waits for its event, then queues the copy) or ``device`` (the copy queued at once behind a stream wait, the wait
# then pending on the decode GPU too): ``EYRIE_PEER_WAIT``, for the A/B of bench/gpu_session.sh pd2-arrivals.
PEER_WAIT = "device" if os.environ.get("EYRIE_PEER_WAIT") == "device" else "host"

_SIDE_STREAMS = threading.local()


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """The calling thread's copy stream on ``device``, made once (not a new stream per hand-off). One per
    thread: hand-offs in flight together must not queue behind each other's waits for their prefill."""
    streams = _SIDE_STREAMS.__dict__.setdefault("by_device", {})
    if device not in streams:
        streams[device] = torch.cuda.Stream(device)
    return streams[device]


def _write_increment(source: PageSource, pools: list[torch.Tensor], dest_page_ids: list[list[int]],
                     inc: Increment, sent: list[int], side) -> int:
    """Copy pages [sent[c], inc.done[c]) of each cache (every plane; one launch per cache on CUDA, all queued
    on ``side`` before the one wait), then (CUDA) wait for them, so that no copy is in flight once the guard is
    let go."""
    written = 0
    with torch.cuda.stream(side) if side is not None else nullcontext():
        for cache, pool, src, dst, lo, hi in zip(source.caches, pools, inc.page_ids, dest_page_ids, sent, inc.done):
            if hi > len(dst) or (inc.last is not None and hi != len(dst)):
                raise TransferError(f"{hi} pages to send, {len(dst)} reserved")
            if hi > lo and pool.device != cache.pool.device:  # a peer GPU's pool (``shared.handoff.peer``)
                copy_pages_peer(pool, cache.pool, src[lo:hi], dst[lo:hi], cache.page_size)
            elif hi > lo:
                copy_pages(pool, cache.pool, src[lo:hi], dst[lo:hi], cache.page_size)
            written += max(0, hi - lo) * cache.page_size * cache.pool[:, :, 0].numel() * cache.pool.element_size()
    if side is not None:
        side.synchronize()
    return written


__all__ = ["PoolHandle", "TransferCancelled", "Written", "export_pools", "host_id", "local_index",
           "open_pools", "reachable", "write_in_place"]
