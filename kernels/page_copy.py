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


__all__ = ["KERNEL", "KernelSettings", "as_words", "copy_pages", "copy_pages_ref", "page_ids",
           "page_runs"]
