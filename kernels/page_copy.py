"""Copy a request's KV pages between two pools in one launch: the same-host hand-off's data path.

A pool is one tensor per cache, ``[K/V, layer, slot, kv head, head dim]`` (``shared.memory.kv_cache``).
A request's pages are scattered in both pools (each side's allocator hands out whatever is free), so a
copy per run of pages costs a launch and, across processes, a synchronisation per run: 256 runs of one
16-token page at Llama-3.1-8B's shape moved 45 GB/s on an H100 where one contiguous copy moved 660
(``bench/bench_handoff.py --cross-process``). ``copy_pages`` moves every page of every (K/V, layer) plane
in one kernel, one program per (page, plane), reading the page ids from two small device tensors.

``copy_pages_ref`` is the contract in torch (one copy per run of pages contiguous on both sides); the
wrapper runs the kernel on CUDA pools (or with ``backend="triton"``, as the interpreter test does) and
the reference otherwise, so the CPU's shared-memory pools take the same call.
"""

from __future__ import annotations

import itertools
import os
import threading
from dataclasses import dataclass, field

import numpy as np
import torch

from kernels.launch import fast

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a dependency, but keep the reference usable
    triton = None


def page_runs(src_pages: list[int], dst_pages: list[int]) -> list[tuple[int, int, int]]:
    """(first source page, first destination page, count) for each run contiguous on both sides."""
    if len(src_pages) != len(dst_pages):
        raise ValueError(f"{len(src_pages)} source pages, {len(dst_pages)} destination pages")
    runs: list[list[int]] = []
    for s, d in zip(src_pages, dst_pages):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1][2] += 1
        else:
            runs.append([s, d, 1])
    return [tuple(r) for r in runs]


def _check(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.dim() != 5 or src.dim() != 5 or dst.shape[:2] != src.shape[:2] or dst.shape[3:] != src.shape[3:]:
        raise ValueError(f"pools differ in shape: {tuple(dst.shape)} and {tuple(src.shape)} "
                         "(want [K/V, layer, slot, kv head, head dim] alike but for the slots)")
    if dst.dtype != src.dtype or not dst.is_contiguous() or not src.is_contiguous():
        raise ValueError("pools must be contiguous and of one dtype")


def copy_pages_ref(dst: torch.Tensor, src: torch.Tensor, src_pages: list[int], dst_pages: list[int],
                   page_size: int) -> None:
    """Writes ``dst``'s pages ``dst_pages`` from ``src``'s pages ``src_pages`` (every K/V plane, every layer)."""
    _check(dst, src)
    for s, d, n in page_runs(src_pages, dst_pages):
        dst[:, :, d * page_size:(d + n) * page_size] = src[:, :, s * page_size:(s + n) * page_size]


@dataclass
class KernelSettings:
    """The kernel's launch settings on CUDA (bench/tune_page_copy.py sweeps them on an H100: docs/benchmarks.md).
    A page-plane larger than a block is split over several programs, so every program issues its loads at once
    instead of looping over a dependent chain of blocks."""

    block_bytes: int = 32768  # bytes of one page-plane per program
    num_warps: int = 8
    pages_per_program: int = 1
    word_bytes: int = 8  # the bytes move as words of this size (the widest integer dtype dividing a row)
    flat_grid: bool = False  # a 2D grid (page x block, plane) instead of 3D (page, plane, block)


KERNEL = KernelSettings()


def copy_pages(dst: torch.Tensor, src: torch.Tensor, src_pages: list[int], dst_pages: list[int], page_size: int,
               backend: str = "auto", block: int | None = None, settings: KernelSettings | None = None,
               raw_dst: bool = False, ids: torch.Tensor | None = None) -> None:
    """As ``copy_pages_ref``, in one launch on CUDA (queued on the current device's current stream; the caller
    synchronises). ``settings``: the launch (default ``KERNEL``, what the sweep chose); ``block``: elements of the
    pools' dtype per program, instead of the settings' ``block_bytes``; ``raw_dst``: ``dst`` goes to the kernel as
    an address (Triton's launcher refuses a pointer it cannot resolve in the current context, such as a peer GPU's
    memory mapped by CUDA IPC, even where peer access makes it reachable: ``PeerSettings.push``); ``ids``: the
    pages as ``page_ids`` would upload them, already on the launching GPU (the staged mode uploads a request's
    once)."""
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"backend must be auto, triton or torch, got {backend!r}")
    use_triton = triton is not None and (backend == "triton" or (backend == "auto" and src.is_cuda))
    if not use_triton or not len(src_pages):
        copy_pages_ref(dst, src, src_pages, dst_pages, page_size)
        return
    _check(dst, src)
    if len(src_pages) != len(dst_pages):
        raise ValueError(f"{len(src_pages)} source pages, {len(dst_pages)} destination pages")
    k = settings or KERNEL
    launch = torch.device("cuda", torch.cuda.current_device()) if src.is_cuda or dst.is_cuda else src.device
    ids = page_ids(src_pages, dst_pages, launch) if ids is None else ids
    src_w, dst_w = as_words(src, k.word_bytes), as_words(dst, k.word_bytes)
    n, planes = len(src_pages), src.shape[0] * src.shape[1]
    page = page_size * src_w.shape[3] * src_w.shape[4]  # words of one page of one plane
    block_bytes = k.block_bytes if block is None else block * src.element_size()
    block = triton.next_power_of_2(max(1, min(block_bytes // src_w.element_size(), page)))
    groups, blocks = triton.cdiv(n, k.pages_per_program), triton.cdiv(page, block)
    grid = (groups * blocks, planes) if k.flat_grid else (groups, planes, blocks)
    fast(_copy_pages_kernel)[grid](
        src_w, dst_w.data_ptr() if raw_dst else dst_w, ids, n, src_w[0, 0].numel(), dst_w[0, 0].numel(), PAGE=page,
        BLOCK=block, PAGES=k.pages_per_program, FLAT=k.flat_grid, RAW=raw_dst,
        ALIGNED=raw_dst and _aligned16(dst_w, page, block), num_warps=k.num_warps)


PEER_MODES = ("staged", "pull", "push", "runs", "runs-strided")


def _whole_from_env(name: str, default: int) -> int:
    raw = os.environ.get(name, str(default))
    if not raw.strip().isdigit() or int(raw) < 1:
        raise ValueError(f"{name} must be a whole number >= 1, got {raw!r}")
    return int(raw)


@dataclass
class PeerSettings:
    """How pages cross from one GPU to a peer GPU of the host (NVLink or PCIe), chosen by
    ``bench/bench_handoff.py --peer`` on two GPUs (docs/benchmarks.md); ``EYRIE_PEER_COPY`` names the mode:

    - ``pull`` (the default: 0.83-0.84 of cudaMemcpyPeer on scattered, run-of-8 and contiguous pages, two GPUs
      of one host over NVLink, docs/benchmarks.md): the copy kernel on the destination GPU reading the source
      pages over the link (peer access);
    - ``staged``: pipelined in chunks of ``chunk_bytes`` (``EYRIE_PEER_CHUNK_MB``) through
      ``buffers`` (``EYRIE_PEER_BUFFERS``) staging buffers on each GPU: the gather of chunk i+1 on the source
      GPU, the peer memcpy (``cudaMemcpyPeerAsync``, the copy engines) of chunk i on a copy stream, the scatter
      of chunk i-1 on the destination GPU, ordered by events; no kernel touches the peer's memory, so it works
      wherever a peer memcpy does (0.57-0.71 measured);
    - ``push``: the copy kernel on the source GPU storing into the peer's pages (peer access; the destination
      passed as an address: Triton refuses a pointer into a peer's CUDA IPC mapping at launch). On two H200s
      its stores into the IPC mapping faulted (illegal address): only when named, never chosen by itself;
    - ``runs``: one peer memcpy per run of pages contiguous on both sides, per (K/V, layer) plane;
    - ``runs-strided``: one strided ``copy_`` per run covering every plane (torch's copy kernel over the link; it
      faulted as push did: only when named)."""

    mode: str = field(default_factory=lambda: os.environ.get("EYRIE_PEER_COPY", "pull"))
    chunk_bytes: int = field(default_factory=lambda: _whole_from_env("EYRIE_PEER_CHUNK_MB", 64) << 20)
    # staged: the staging buffers on each GPU (2: chunk i's memcpy beside chunk i+1's gather and i-1's scatter)
    buffers: int = field(default_factory=lambda: _whole_from_env("EYRIE_PEER_BUFFERS", 2))
    kernel: KernelSettings | None = None  # push, pull: the launch of the kernel crossing the link (None: KERNEL)
    push_refused: str = ""  # why push was given up for staged at a hand-off: every later copy is staged


PEER = PeerSettings()


def copy_pages_peer(dst: torch.Tensor, src: torch.Tensor, src_pages: list[int], dst_pages: list[int],
                    page_size: int, mode: str | None = None, chunk_bytes: int | None = None) -> None:
    """As ``copy_pages`` from ``src`` (on this thread's current GPU and stream) into ``dst`` on a peer GPU, the
    way ``mode`` (default ``PEER.mode``) says; queued, not waited for (the caller synchronises its stream: the
    work on other streams is joined back into it). With the default mode, a push refused at its launch (before
    any byte moved) turns ``PEER`` to staged for good."""
    chosen = mode or PEER.mode
    if chosen not in PEER_MODES:
        raise ValueError(f"peer copy mode must be one of {', '.join(PEER_MODES)}, got {chosen!r}")
    _check(dst, src)
    if len(src_pages) != len(dst_pages):
        raise ValueError(f"{len(src_pages)} source pages, {len(dst_pages)} destination pages")
    if not len(src_pages):
        return
    if chosen == "push":
        try:
            copy_pages(dst, src, src_pages, dst_pages, page_size, settings=PEER.kernel, raw_dst=dst.is_cuda)
            return
        except Exception as e:
            if mode is not None:  # a probe of that mode: its failure is the answer
                raise
            PEER.mode, PEER.push_refused = "staged", f"{type(e).__name__}: {e}"
        chosen = "staged"
    if chosen == "staged":
        _copy_staged(dst, src, src_pages, dst_pages, page_size, chunk_bytes or PEER.chunk_bytes)
    elif chosen == "pull":
        _on_peer(dst, src, lambda: copy_pages(dst, src, src_pages, dst_pages, page_size, settings=PEER.kernel))
    else:
        _copy_runs(dst, src, src_pages, dst_pages, page_size, strided=chosen == "runs-strided")


def _streams(device: torch.device) -> dict:
    """This process's side streams on a GPU (made once): "peer" (kernels there), "copy" (peer memcpys)."""
    if device not in _STREAMS:
        _STREAMS[device] = {"peer": torch.cuda.Stream(device), "copy": torch.cuda.Stream(device)}
    return _STREAMS[device]


_STREAMS: dict[torch.device, dict] = {}


def _current(device: torch.device):
    return torch.cuda.current_stream(device) if device.type == "cuda" else None


def _on_peer(dst: torch.Tensor, src: torch.Tensor, work) -> None:
    """``work`` on a stream of ``dst``'s GPU, after what the caller queued on its stream, joined back into it."""
    here = _current(src.device)
    if here is None:
        work()
        return
    there = _streams(dst.device)["peer"]
    there.wait_stream(here)
    with torch.cuda.stream(there):
        work()
    here.wait_stream(there)


def _copy_runs(dst: torch.Tensor, src: torch.Tensor, src_pages: list[int], dst_pages: list[int], page_size: int,
               strided: bool) -> None:
    """``PeerSettings.runs``/``runs-strided``: per run of pages contiguous on both sides, a peer memcpy per plane
    (each contiguous), or one strided copy of every plane; on the caller's stream (``copy_`` between devices
    orders itself against the destination GPU's current stream)."""
    planes = src.shape[0] * src.shape[1]
    flat_src = src.view(planes, src.shape[2], -1)
    flat_dst = dst.view(planes, dst.shape[2], -1)
    for s, d, n in page_runs(src_pages, dst_pages):
        s, d, rows = s * page_size, d * page_size, n * page_size
        if strided:
            flat_dst[:, d:d + rows].copy_(flat_src[:, s:s + rows], non_blocking=True)
            continue
        for p in range(planes):
            flat_dst[p, d:d + rows].copy_(flat_src[p, s:s + rows], non_blocking=True)


_STAGING: dict[tuple, dict] = {}
_STAGING_LOCK = threading.Lock()  # a hand-off's staged copy is queued whole before another's (shared buffers)


def _staging(dst: torch.Tensor, src: torch.Tensor, nbytes: int) -> dict:
    """{"bufs": ``PEER.buffers`` pairs (source buffer, destination buffer) of ``nbytes`` bytes, "done": the event
    after which the last copy through them is over (None before the first)}, made once per (devices, size, count)
    and shared by every cache (viewed as each one's dtype): ``buffers`` x ``chunk_bytes`` on each GPU in all."""
    key = (src.device, dst.device, nbytes, PEER.buffers)
    if key not in _STAGING:
        _STAGING[key] = {"bufs": [(torch.empty(nbytes, dtype=torch.uint8, device=src.device),
                                   torch.empty(nbytes, dtype=torch.uint8, device=dst.device))
                                  for _ in range(PEER.buffers)], "done": None}
    return _STAGING[key]


def staged_chunks(n_pages: int, per_page: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """(first, end) of each chunk of a request's pages: at most ``chunk_bytes`` each (one page at least)."""
    step = max(1, min(n_pages, chunk_bytes // per_page))
    return [(lo, min(lo + step, n_pages)) for lo in range(0, n_pages, step)]


def _copy_staged(dst: torch.Tensor, src: torch.Tensor, src_pages: list[int], dst_pages: list[int],
                 page_size: int, chunk_bytes: int) -> None:
    """``PeerSettings.staged``: chunk i's gather (this thread's current stream, source GPU) -> its peer memcpy (the
    source GPU's copy stream) -> its scatter (a stream of the destination GPU), ordered by events; a buffer is
    gathered into again only once its memcpy is done, copied into again once its scatter is done. The buffers
    are shared by the process's hand-offs: one is queued after the last one through them is over."""
    per_page = src[:, :, :page_size].numel()  # elements of one page, every plane
    chunks = staged_chunks(len(src_pages), per_page * src.element_size(), chunk_bytes)
    local = [p for lo, hi in chunks for p in range(hi - lo)]  # each page's place in its chunk's buffer
    with _STAGING_LOCK:
        staging = _staging(dst, src, max(chunk_bytes, per_page * src.element_size()))
        if not src.is_cuda:
            for (lo, hi), pair in zip(chunks, itertools.cycle(staging["bufs"])):
                stage_src, stage_dst = _chunk_views(pair, src, lo, hi, page_size)
                copy_pages(stage_src, src, src_pages[lo:hi], local[lo:hi], page_size)
                stage_dst.copy_(stage_src)
                copy_pages(dst, stage_dst, local[lo:hi], dst_pages[lo:hi], page_size)
            return
        here = torch.cuda.current_stream(src.device)
        if staging["done"] is not None:
            here.wait_event(staging["done"])  # another hand-off's chunks may still be in the buffers
        _pipeline(dst, src, src_pages, dst_pages, page_size, chunks, local, staging["bufs"], here)
        staging["done"] = torch.cuda.Event()
        staging["done"].record(here)


def _pipeline(dst: torch.Tensor, src: torch.Tensor, src_pages: list[int], dst_pages: list[int], page_size: int,
              chunks: list[tuple[int, int]], local: list[int], bufs: list, here) -> None:
    """``_copy_staged``'s chunks on CUDA, queued on three streams; joined back into ``here`` at the end."""
    copier, there = _streams(src.device)["copy"], _streams(dst.device)["peer"]
    gathers = chunk_ids(src_pages, local, chunks, src.device)  # one upload per side, on the stream that reads it
    there.wait_stream(here)  # nothing of this copy on the destination before what the caller queued
    with torch.cuda.stream(there):
        scatters = chunk_ids(local, dst_pages, chunks, dst.device)
    copied, scattered = [None] * len(bufs), [None] * len(bufs)
    for i, (lo, hi) in enumerate(chunks):
        slot = i % len(bufs)
        stage_src, stage_dst = _chunk_views(bufs[slot], src, lo, hi, page_size)
        if copied[slot] is not None:
            here.wait_event(copied[slot])  # the memcpy of chunk i - buffers has read this source buffer
        copy_pages(stage_src, src, src_pages[lo:hi], local[lo:hi], page_size, ids=gathers[2 * lo:2 * hi])
        copier.wait_stream(here)
        if scattered[slot] is not None:
            copier.wait_event(scattered[slot])  # the scatter of chunk i - buffers has read this destination buffer
        with torch.cuda.stream(copier):
            stage_dst.copy_(stage_src, non_blocking=True)
            copied[slot] = torch.cuda.Event()
            copied[slot].record(copier)
        there.wait_event(copied[slot])
        with torch.cuda.stream(there):
            copy_pages(dst, stage_dst, local[lo:hi], dst_pages[lo:hi], page_size, ids=scatters[2 * lo:2 * hi])
            scattered[slot] = torch.cuda.Event()
            scattered[slot].record(there)
    here.wait_stream(copier)
    here.wait_stream(there)  # the caller's wait on its stream covers the last scatter


def _chunk_views(pair: tuple[torch.Tensor, torch.Tensor], src: torch.Tensor, lo: int, hi: int, page_size: int):
    """A chunk of pages [lo, hi) as a pool of ``src``'s shape and dtype: a prefix of each staging buffer."""
    shape = (*src.shape[:2], (hi - lo) * page_size, *src.shape[3:])
    nbytes = torch.Size(shape).numel() * src.element_size()
    return tuple(b[:nbytes].view(src.dtype).view(shape) for b in pair)


def chunk_ids(first: list[int], second: list[int], chunks: list[tuple[int, int]], device: torch.device) -> torch.Tensor:
    """Per chunk [lo, hi), ``page_ids`` of its pages (its ``first`` row, then its ``second`` row, ordered by the
    first), at [2 lo, 2 hi) of one flat int64 tensor on ``device``, uploaded once (pinned, queued)."""
    pairs = np.array([first, second], dtype=np.int64)
    flat = np.empty(2 * len(first), dtype=np.int64)
    for lo, hi in chunks:
        part = pairs[:, lo:hi]
        flat[2 * lo:2 * hi] = part[:, np.argsort(part[0], kind="stable")].ravel()
    ids = torch.from_numpy(flat)
    if device.type == "cuda":
        ids = ids.pin_memory()
    return ids.to(device, non_blocking=True)


def _aligned16(pool_w: torch.Tensor, page: int, block: int) -> bool:
    """Every block the kernel stores into ``pool_w`` (a pool as words) starts on 16 bytes: its base, and a page's
    and a block's bytes, are multiples of 16 (a plane is a whole number of pages)."""
    word = pool_w.element_size()
    return pool_w.data_ptr() % 16 == 0 and page * word % 16 == 0 and block * word % 16 == 0


def as_words(pool: torch.Tensor, word_bytes: int) -> torch.Tensor:
    """The pool's bytes as integer words of ``word_bytes`` (or fewer, when a plane's last dimension does not
    divide), the same memory: the copy moves bytes, whatever the dtype."""
    row = pool.shape[-1] * pool.element_size()
    for size, dtype in ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8)):
        if size <= word_bytes and row % size == 0:
            return pool.view(dtype)
    raise ValueError(f"word_bytes must be 1, 2, 4 or 8, got {word_bytes}")


def page_ids(src_pages, dst_pages, device: torch.device) -> torch.Tensor:
    """[2, pages] int64 on ``device``, ordered by source page (neighbouring programs read neighbouring pages),
    built in one array op (no Python per page); on CUDA uploaded from pinned memory, queued, not waited for."""
    ids = np.array([src_pages, dst_pages], dtype=np.int64)
    ids = torch.from_numpy(np.ascontiguousarray(ids[:, np.argsort(ids[0], kind="stable")]))
    if device.type == "cuda":
        ids = ids.pin_memory()
    return ids.to(device, non_blocking=True)


if triton is not None:

    @triton.jit
    def _copy_pages_kernel(src, dst, ids, n, src_plane, dst_plane, PAGE: tl.constexpr, BLOCK: tl.constexpr,
                           PAGES: tl.constexpr, FLAT: tl.constexpr, RAW: tl.constexpr, ALIGNED: tl.constexpr):
        """Block ``blk`` of PAGES pages of one plane: ids[0] the source pages, ids[1] the destination ones. RAW:
        ``dst`` is the destination's address (an int64), of ``src``'s element type; ALIGNED: every block of it
        starts on 16 bytes (the wrapper checked)."""
        if RAW:
            dst = dst.to(tl.pointer_type(src.dtype.element_ty), bitcast=True)
        if FLAT:
            group = tl.program_id(0) // tl.cdiv(PAGE, BLOCK)
            blk = tl.program_id(0) % tl.cdiv(PAGE, BLOCK)
        else:
            group = tl.program_id(0)
            blk = tl.program_id(2)
        plane = tl.program_id(1).to(tl.int64)
        offs = blk * BLOCK + tl.arange(0, BLOCK)
        for i in tl.static_range(PAGES):
            p = group * PAGES + i
            if p < n:
                s = tl.load(ids + p)
                d = tl.load(ids + n + p)
                src_at = src + plane * src_plane + s * PAGE + offs
                dst_at = dst + plane * dst_plane + d * PAGE + offs
                if ALIGNED:  # what Triton knows of an aligned pointer argument, for the address: 16-byte stores
                    dst_at = tl.multiple_of(dst_at, 16)
                if PAGE % BLOCK == 0:  # no tail: unmasked, vectorised
                    tl.store(dst_at, tl.load(src_at))
                else:
                    tl.store(dst_at, tl.load(src_at, mask=offs < PAGE), mask=offs < PAGE)


__all__ = ["KERNEL", "PEER", "PEER_MODES", "KernelSettings", "PeerSettings", "as_words", "chunk_ids", "copy_pages",
           "copy_pages_peer", "copy_pages_ref", "page_ids", "page_runs", "staged_chunks"]
