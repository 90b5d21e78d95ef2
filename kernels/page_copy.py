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


# Elements per program and warps per program on CUDA (bench/tune_page_copy.py swept them on an H100:
# docs/benchmarks.md). A page-plane larger than BLOCK is split over several programs, so every program
# issues its loads at once instead of looping over a dependent chain of blocks.
BLOCK = 16384
NUM_WARPS = 8


def copy_pages(dst: torch.Tensor, src: torch.Tensor, src_pages: list[int], dst_pages: list[int], page_size: int,
               backend: str = "auto", block: int = BLOCK, num_warps: int = NUM_WARPS) -> None:
    """As ``copy_pages_ref``, in one launch on CUDA (queued on the current stream; the caller synchronises)."""
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"backend must be auto, triton or torch, got {backend!r}")
    use_triton = triton is not None and (backend == "triton" or (backend == "auto" and src.is_cuda))
    if not use_triton or not src_pages:
        copy_pages_ref(dst, src, src_pages, dst_pages, page_size)
        return
    _check(dst, src)
    if len(src_pages) != len(dst_pages):
        raise ValueError(f"{len(src_pages)} source pages, {len(dst_pages)} destination pages")
    pairs = sorted(zip(src_pages, dst_pages))  # programs in source order: neighbours read neighbouring pages
    ids = _page_ids([s for s, _ in pairs], [d for _, d in pairs], src.device)
    planes = src.shape[0] * src.shape[1]
    page_elems = page_size * src.shape[3] * src.shape[4]
    block = min(block, triton.next_power_of_2(page_elems))
    grid = (len(src_pages), planes, triton.cdiv(page_elems, block))
    _copy_pages_kernel[grid](src, dst, ids[0], ids[1], src.shape[2] * src.shape[3] * src.shape[4],
                             dst.shape[2] * dst.shape[3] * dst.shape[4], page_elems, BLOCK=block,
                             num_warps=num_warps)


def _page_ids(src_pages: list[int], dst_pages: list[int], device: torch.device) -> torch.Tensor:
    """[2, pages] int64 on ``device``; on CUDA from pinned memory, so the upload is queued, not waited for."""
    ids = torch.tensor([src_pages, dst_pages], dtype=torch.int64)
    if device.type == "cuda":
        ids = ids.pin_memory()
    return ids.to(device, non_blocking=True)


if triton is not None:

    @triton.jit
    def _copy_pages_kernel(src, dst, src_ids, dst_ids, src_plane, dst_plane, page_elems, BLOCK: tl.constexpr):
        page = tl.program_id(0)
        plane = tl.program_id(1).to(tl.int64)
        offs = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < page_elems
        s = tl.load(src_ids + page)
        d = tl.load(dst_ids + page)
        src_base = src + plane * src_plane + s * page_elems
        dst_base = dst + plane * dst_plane + d * page_elems
        tl.store(dst_base + offs, tl.load(src_base + offs, mask=mask), mask=mask)


__all__ = ["BLOCK", "NUM_WARPS", "copy_pages", "copy_pages_ref", "page_runs"]
