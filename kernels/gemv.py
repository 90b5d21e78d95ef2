"""Skinny GEMM (``y = x @ W.T + b`` for a few rows of ``x``): the decode-step projections.

At batch 1 a decode step is a chain of GEMVs over the weights (qkv, o, gate/up, down, LM head); the
step can go no faster than reading every weight byte once. cuBLAS reaches 0.68-0.96 of the copy
bandwidth on these shapes at M=1 and adds a split-K reduction launch for some of them. This kernel
streams each weight row block once with wide, pipelined loads:

* one program owns ``BLOCK_N`` output columns (weight rows) for all ``M <= 16`` rows of ``x`` and
  walks K in ``BLOCK_K`` steps; x (a few KB) stays in L2 and is re-read by every program;
* ``M == 1``: the product is an element-wise multiply accumulated in a ``[BLOCK_N, BLOCK_K]`` float32
  tile and reduced once at the end (no tensor cores needed: the arithmetic is 2 flops per weight byte);
* ``1 < M <= 16``: ``tl.dot`` of the weight tile with x padded to 16 rows (tensor cores, float32
  accumulation), so verify (N draft tokens) and small decode batches read the weights once too.

``linear(x, weight, bias)`` is the entry point: the kernel on CUDA for bf16/fp16 with ``M <= 16``,
``torch.nn.functional.linear`` (the reference of the same contract) everywhere else.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from kernels.launch import fast

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

MAX_ROWS = 16  # rows of x the kernel takes; more go to cuBLAS (the GEMM is no longer bandwidth-bound)


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


if triton is not None:
    @triton.jit
    def _gemv_kernel(X, W, B, Y, M, N, K, stride_xm, stride_wn, stride_ym,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr):
        pid = tl.program_id(0)
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        offs_n_safe = tl.where(n_ok, offs_n, 0)  # clamp rows past N: loads stay in bounds and unmasked
        offs_k = tl.arange(0, BLOCK_K)
        w_ptrs = W + offs_n_safe[:, None] * stride_wn + offs_k[None, :]
        if BLOCK_M == 1:
            acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
            for k in range(0, K, BLOCK_K):
                if EVEN_K:
                    w = tl.load(w_ptrs + k, cache_modifier=".cg")
                    x = tl.load(X + k + offs_k)
                else:
                    k_ok = (k + offs_k) < K
                    w = tl.load(w_ptrs + k, mask=k_ok[None, :], other=0.0, cache_modifier=".cg")
                    x = tl.load(X + k + offs_k, mask=k_ok, other=0.0)
                acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
            y = tl.sum(acc, 1)
            if HAS_BIAS:
                y += tl.load(B + offs_n_safe).to(tl.float32)
            tl.store(Y + offs_n, y.to(Y.dtype.element_ty), mask=n_ok)
        else:
            offs_m = tl.arange(0, BLOCK_M)
            m_ok = offs_m < M
            x_ptrs = X + offs_m[:, None] * stride_xm + offs_k[None, :]
            acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
            for k in range(0, K, BLOCK_K):
                if EVEN_K:
                    w = tl.load(w_ptrs + k, cache_modifier=".cg")
                    x = tl.load(x_ptrs + k, mask=m_ok[:, None], other=0.0)
                else:
                    k_ok = (k + offs_k) < K
                    w = tl.load(w_ptrs + k, mask=k_ok[None, :], other=0.0, cache_modifier=".cg")
                    x = tl.load(x_ptrs + k, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
                acc = tl.dot(w, tl.trans(x), acc)
            if HAS_BIAS:
                acc += tl.load(B + offs_n_safe).to(tl.float32)[:, None]
            tl.store(Y + offs_m[None, :] * stride_ym + offs_n[:, None], acc.to(Y.dtype.element_ty),
                     mask=n_ok[:, None] & m_ok[None, :])


# EYRIE_GEMV=0: every product through F.linear (read once: a linear is called ~130 times an eager step)
ENABLED = os.environ.get("EYRIE_GEMV", "1") != "0"


@functools.lru_cache(maxsize=256)
def choose_config(m: int, n: int, k: int, sms: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) for an [m, k] x [n, k]^T product.

    From ``bench/bench_gemv.py --tune`` on an H100 (docs/benchmarks.md): at M=1, 16 weight rows per
    program and 1024-wide K steps (2 KB of each row in flight, 16-byte loads) with 8 warps and 3
    stages was best summed over the 8B shapes (0.83-1.06 of the copy bandwidth, cuBLAS 0.68-0.96);
    at 2-16 rows, 64 rows x 256 K through ``tl.dot`` with 4 warps and 4 stages (0.80-1.02).
    At M=1, narrower blocks when the matrix is too small to give every SM a program.
    """
    block_n, block_k, warps, stages = (16, 1024, 8, 3) if m == 1 else (64, 256, 4, 4)
    while m == 1 and block_n > 4 and -(-n // block_n) < sms:
        block_n //= 2
    return block_n, min(block_k, max(16, triton.next_power_of_2(k)) if triton else block_k), warps, stages


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           backend: str = "auto", config: tuple[int, int, int, int] | None = None,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``; the Triton kernel for few rows on CUDA (or ``backend="triton"``)."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    use = triton is not None and (backend == "triton" or (backend == "auto" and x.is_cuda and ENABLED))
    if (rows > MAX_ROWS or not use or rows == 0 or weight.dim() != 2 or weight.stride(1) != 1
            or x.dtype != weight.dtype or (x.is_cuda and x.dtype == torch.float32 and backend == "auto")):
        return linear_ref(x, weight, bias)
    lead = x.shape[:-1]
    x2 = x.reshape(rows, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    n, k = weight.shape
    if out is None:
        out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 4
    block_n, block_k, warps, stages = config or choose_config(rows, n, k, sms)
    block_m = 1 if rows == 1 else MAX_ROWS
    fast(_gemv_kernel)[(triton.cdiv(n, block_n),)](
        x2, weight, bias if bias is not None else weight, out, rows, n, k,
        x2.stride(0), weight.stride(0), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=bias is not None,
        EVEN_K=k % block_k == 0, num_warps=warps, num_stages=stages)
    return out.reshape(*lead, n)


__all__ = ["MAX_ROWS", "choose_config", "linear", "linear_ref"]
