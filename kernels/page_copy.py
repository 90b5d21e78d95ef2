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

from dataclasses import dataclass

import numpy as np
import torch

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
               backend: str = "auto", block: int | None = None, settings: KernelSettings | None = None) -> None:
    """As ``copy_pages_ref``, in one launch on CUDA (queued on the current stream; the caller synchronises).
    ``settings``: the launch (default ``KERNEL``, what the sweep chose); ``block``: elements of the pools' dtype
    per program, instead of the settings' ``block_bytes``."""
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
    ids = page_ids(src_pages, dst_pages, src.device)
    src_w, dst_w = as_words(src, k.word_bytes), as_words(dst, k.word_bytes)
    n, planes = len(src_pages), src.shape[0] * src.shape[1]
    page = page_size * src_w.shape[3] * src_w.shape[4]  # words of one page of one plane
    block_bytes = k.block_bytes if block is None else block * src.element_size()
    block = triton.next_power_of_2(max(1, min(block_bytes // src_w.element_size(), page)))
    groups, blocks = triton.cdiv(n, k.pages_per_program), triton.cdiv(page, block)
    grid = (groups * blocks, planes) if k.flat_grid else (groups, planes, blocks)
    _copy_pages_kernel[grid](src_w, dst_w, ids, n, src_w[0, 0].numel(), dst_w[0, 0].numel(), PAGE=page,
                             BLOCK=block, PAGES=k.pages_per_program, FLAT=k.flat_grid, num_warps=k.num_warps)


@dataclass
class PeerSettings:
    """How pages cross from one GPU to a peer GPU of the host (NVLink or PCIe), chosen by
    ``bench/bench_handoff.py --peer`` on two GPUs (docs/benchmarks.md):

    - ``push``: the copy kernel runs on the source GPU and stores straight into the peer's pages (peer access
      enabled, ``shared.handoff.peer``): one launch, no staging;
    - ``staged``: runs of pages gathered on the source GPU into a contiguous buffer, one peer memcpy
      (``cudaMemcpyPeerAsync``, what ``copy_`` between devices issues) into a buffer on the destination GPU,
      one scatter kernel there: no kernel ever touches the peer's memory (works where the driver refuses a
      peer pointer to a kernel), at the price of a buffer on each GPU and two local copies."""

    mode: str = "push"
    staging_bytes: int = 64 << 20  # staged: the buffers' size on each GPU (a hand-off goes through in pieces)
    push_refused: str = ""  # why push was given up for staged at a hand-off (a probe's scratch memory passed,
    # the decode pools mapped by CUDA IPC did not): every later copy is staged


PEER = PeerSettings()


def copy_pages_peer(dst: torch.Tensor, src: torch.Tensor, src_pages: list[int], dst_pages: list[int],
                    page_size: int, mode: str | None = None) -> None:
    """As ``copy_pages`` from ``src`` (on this thread's current GPU and stream) into ``dst`` on a peer GPU, the
    way ``mode`` (default ``PEER.mode``) says; queued, not waited for (the caller synchronises its stream: the
    staged scatter's stream on the peer is joined back into it). With the default mode, a push refused at its
    launch (before any byte moved: Triton's check of the peer pointer) turns ``PEER`` to staged for good."""
    chosen = mode or PEER.mode
    if chosen == "push":
        try:
            copy_pages(dst, src, src_pages, dst_pages, page_size)
            return
        except Exception as e:
            if mode is not None:  # a probe of that mode: its failure is the answer
                raise
            PEER.mode, PEER.push_refused = "staged", f"{type(e).__name__}: {e}"
        _copy_staged(dst, src, src_pages, dst_pages, page_size)
    elif chosen == "staged":
        _copy_staged(dst, src, src_pages, dst_pages, page_size)
    else:
        raise ValueError(f"peer copy mode must be push or staged, got {chosen!r}")


_STAGING: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.cuda.Stream]] = {}


def _staging(dst: torch.Tensor, src: torch.Tensor, numel: int):
    """(source buffer, destination buffer, the destination GPU's scatter stream): flat buffers of ``numel``
    elements, made once per (devices, dtype, size)."""
    key = (src.device, dst.device, src.dtype, numel)
    if key not in _STAGING:
        _STAGING[key] = (torch.empty(numel, dtype=src.dtype, device=src.device),
                         torch.empty(numel, dtype=dst.dtype, device=dst.device), torch.cuda.Stream(dst.device))
    return _STAGING[key]


def _copy_staged(dst: torch.Tensor, src: torch.Tensor, src_pages: list[int], dst_pages: list[int],
                 page_size: int) -> None:
    """``PeerSettings.staged``: per piece of at most ``staging_bytes``, a gather on the source GPU (this thread's
    current stream), a peer memcpy on that stream, a scatter on the destination GPU's stream; a piece's gather
    overlaps the last piece's scatter, its memcpy waits for that scatter (they share the destination buffer)."""
    _check(dst, src)
    per_page = src[:, :, :page_size].numel() * src.element_size()
    step = max(1, min(len(src_pages), PEER.staging_bytes // per_page))
    here = torch.cuda.current_stream(src.device)
    flat_src, flat_dst, there = _staging(dst, src, step * per_page // src.element_size())
    there.wait_stream(here)  # nothing of this copy on the destination before what the caller queued
    for lo in range(0, len(src_pages), step):
        n = min(step, len(src_pages) - lo)
        shape = (*src.shape[:2], n * page_size, *src.shape[3:])  # a piece: a contiguous prefix of the buffers
        stage_src, stage_dst = (flat[:n * per_page // src.element_size()].view(shape) for flat in (flat_src, flat_dst))
        copy_pages(stage_src, src, src_pages[lo:lo + n], list(range(n)), page_size)
        here.wait_stream(there)  # the last piece's scatter has read the destination buffer
        stage_dst.copy_(stage_src, non_blocking=True)
        there.wait_stream(here)
        with torch.cuda.stream(there):
            copy_pages(dst, stage_dst, list(range(n)), dst_pages[lo:lo + n], page_size)
    here.wait_stream(there)  # the caller's wait on its stream covers the last scatter


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
                           PAGES: tl.constexpr, FLAT: tl.constexpr):
        """Block ``blk`` of PAGES pages of one plane: ids[0] the source pages, ids[1] the destination ones."""
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
                if PAGE % BLOCK == 0:  # no tail: unmasked, vectorised
                    tl.store(dst_at, tl.load(src_at))
                else:
                    tl.store(dst_at, tl.load(src_at, mask=offs < PAGE), mask=offs < PAGE)


__all__ = ["KERNEL", "PEER", "KernelSettings", "PeerSettings", "as_words", "copy_pages", "copy_pages_peer",
           "copy_pages_ref", "page_ids", "page_runs"]
