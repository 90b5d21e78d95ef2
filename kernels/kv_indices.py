"""Flatten request-to-token rows into the packed ``kv_indices`` of the attention contract.

Contract: for request b, ``out[kv_indptr[b] : kv_indptr[b] + kv_lens[b]] = table[rows[b], :kv_lens[b]]``.
The Triton kernel writes into a preallocated buffer without reading sizes on the host, so it can be
captured in a CUDA graph; the torch reference is the CPU path and the test oracle.
"""

from __future__ import annotations

import torch

from kernels.launch import fast

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a dependency, but keep the reference usable
    triton = None


def gather_kv_indices_ref(table: torch.Tensor, rows: torch.Tensor, kv_lens: torch.Tensor) -> torch.Tensor:
    width = int(kv_lens.max()) if kv_lens.numel() else 0
    take = torch.arange(width, device=table.device).unsqueeze(0) < kv_lens.unsqueeze(1)
    return table[rows, :width][take]


if triton is not None:
    @triton.jit
    def _gather_kv_indices_kernel(table_ptr, table_stride, rows_ptr, kv_lens_ptr, kv_indptr_ptr, out_ptr,
                                  BLOCK: tl.constexpr):
        b = tl.program_id(0)
        row = tl.load(rows_ptr + b)
        n = tl.load(kv_lens_ptr + b)
        start = tl.load(kv_indptr_ptr + b)
        for off in range(0, n, BLOCK):
            idx = off + tl.arange(0, BLOCK)
            m = idx < n
            v = tl.load(table_ptr + row * table_stride + idx, mask=m)
            tl.store(out_ptr + start + idx, v, mask=m)


def gather_kv_indices(table: torch.Tensor, rows: torch.Tensor, kv_lens: torch.Tensor, kv_indptr: torch.Tensor,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """kv_indices for ``rows``; on CUDA into ``out`` (or a buffer sized rows x table width)."""
    if not table.is_cuda or triton is None:
        return gather_kv_indices_ref(table, rows, kv_lens)
    if out is None:
        out = torch.zeros(rows.numel() * table.shape[1], dtype=table.dtype, device=table.device)
    if rows.numel():
        # The kernel reads rows[b] at rows_ptr + b: a strided view (one column of a [B, caches] map of a
        # multi-layer draft) must be made contiguous, or request b reads another request's row.
        fast(_gather_kv_indices_kernel)[(rows.numel(),)](
            table, table.stride(0), rows.contiguous(), kv_lens.contiguous(), kv_indptr.contiguous(), out, BLOCK=256)
    return out
