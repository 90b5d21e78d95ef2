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

Two prologues fold the small kernels around a projection into it, computed while the weights stream:
``silu_mul_linear`` (an MLP's down projection reads ``silu(gate) * up`` from the gate/up output) and
``add_rmsnorm_linear`` (a layer's pre-norm: every program recomputes the RMS of its few rows, program
0 writes the residual sum). Each rounds where the separate kernels round, so fused == unfused.

``linear(x, weight, bias)`` is the plain entry point. All three run the kernel on CUDA for bf16/fp16
with ``M <= 16`` and their references (``F.linear`` after the separate kernels) everywhere else.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from kernels.fused import silu_mul
from kernels.norm_rope import rms_norm

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
    def _x_tile(X, R, NW, k, offs_m, offs_k, m_ok, K, stride_xm, rstd, PROLOGUE: tl.constexpr):
        """The [BLOCK_M, BLOCK_K] slice of the GEMM's input at column k, after the prologue."""
        k_ok = (k + offs_k) < K
        mask = m_ok[:, None] & k_ok[None, :]
        off = offs_m[:, None] * stride_xm + k + offs_k[None, :]
        if PROLOGUE == 1:  # silu(gate) * up, X = [gate | up] of width 2K
            g = tl.load(X + off, mask=mask, other=0.0).to(tl.float32)
            u = tl.load(X + off + K, mask=mask, other=0.0).to(tl.float32)
            x = (g / (1.0 + tl.exp(-g)) * u).to(X.dtype.element_ty)
        elif PROLOGUE == 2:  # weight * rmsnorm(X + R), rounded where the separate kernels round
            s = tl.load(X + off, mask=mask, other=0.0) + tl.load(R + off, mask=mask, other=0.0)
            normed = (s.to(tl.float32) * rstd[:, None]).to(X.dtype.element_ty)
            x = tl.load(NW + k + offs_k, mask=k_ok, other=0.0)[None, :] * normed
        else:
            x = tl.load(X + off, mask=mask, other=0.0)
        return x

    @triton.jit
    def _gemv_kernel(X, R, NW, S, W, B, Y, M, N, K, stride_xm, stride_wn, stride_ym, eps,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, PROLOGUE: tl.constexpr):
        pid = tl.program_id(0)
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        offs_n_safe = tl.where(n_ok, offs_n, 0)  # clamp rows past N: loads stay in bounds and unmasked
        offs_k = tl.arange(0, BLOCK_K)
        offs_m = tl.arange(0, BLOCK_M)
        m_ok = offs_m < M
        w_ptrs = W + offs_n_safe[:, None] * stride_wn + offs_k[None, :]
        rstd = tl.zeros([BLOCK_M], tl.float32)
        if PROLOGUE == 2:
            # Every program computes the rows' RMS itself (x is a few KB in L2); program 0 also
            # writes the residual sum X + R to S, the stream the rest of the layer reads.
            ss = tl.zeros([BLOCK_M], tl.float32)
            for k in range(0, K, BLOCK_K):
                k_ok = (k + offs_k) < K
                mask = m_ok[:, None] & (k_ok[None, :] | EVEN_K)
                off = offs_m[:, None] * stride_xm + k + offs_k[None, :]
                s = tl.load(X + off, mask=mask, other=0.0) + tl.load(R + off, mask=mask, other=0.0)
                if pid == 0:
                    tl.store(S + off, s, mask=mask)
                sf = s.to(tl.float32)
                ss += tl.sum(sf * sf, 1)
            rstd = tl.rsqrt(ss / K + eps)
        if BLOCK_M == 1:
            acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
            for k in range(0, K, BLOCK_K):
                if EVEN_K:
                    w = tl.load(w_ptrs + k, cache_modifier=".cg")
                else:
                    w = tl.load(w_ptrs + k, mask=((k + offs_k) < K)[None, :], other=0.0, cache_modifier=".cg")
                x = _x_tile(X, R, NW, k, offs_m, offs_k, m_ok, K, stride_xm, rstd, PROLOGUE)
                acc += w.to(tl.float32) * x.to(tl.float32)
            y = tl.sum(acc, 1)
            if HAS_BIAS:
                y += tl.load(B + offs_n_safe).to(tl.float32)
            tl.store(Y + offs_n, y.to(Y.dtype.element_ty), mask=n_ok)
        else:
            acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
            for k in range(0, K, BLOCK_K):
                if EVEN_K:
                    w = tl.load(w_ptrs + k, cache_modifier=".cg")
                else:
                    w = tl.load(w_ptrs + k, mask=((k + offs_k) < K)[None, :], other=0.0, cache_modifier=".cg")
                x = _x_tile(X, R, NW, k, offs_m, offs_k, m_ok, K, stride_xm, rstd, PROLOGUE)
                acc = tl.dot(w, tl.trans(x), acc)
            if HAS_BIAS:
                acc += tl.load(B + offs_n_safe).to(tl.float32)[:, None]
            tl.store(Y + offs_m[None, :] * stride_ym + offs_n[:, None], acc.to(Y.dtype.element_ty),
                     mask=n_ok[:, None] & m_ok[None, :])


def _enabled() -> bool:
    return os.environ.get("EYRIE_GEMV", "1") != "0"


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


def _triton_ok(x: torch.Tensor, weight: torch.Tensor, rows: int, backend: str) -> bool:
    use = triton is not None and (backend == "triton" or (backend == "auto" and x.is_cuda and _enabled()))
    return (use and 0 < rows <= MAX_ROWS and weight.dim() == 2 and weight.stride(1) == 1
            and x.dtype == weight.dtype and not (x.is_cuda and x.dtype == torch.float32 and backend == "auto"))


def _launch(x2, weight, bias, out, prologue, config, residual=None, norm_weight=None, summed=None, eps=0.0):
    rows = x2.shape[0]
    n, k = weight.shape
    sms = torch.cuda.get_device_properties(x2.device).multi_processor_count if x2.is_cuda else 4
    block_n, block_k, warps, stages = config or choose_config(rows, n, k, sms)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x2, residual if residual is not None else x2, norm_weight if norm_weight is not None else weight,
        summed if summed is not None else out, weight, bias if bias is not None else weight, out, rows, n, k,
        x2.stride(0), weight.stride(0), out.stride(0), eps,
        BLOCK_M=1 if rows == 1 else MAX_ROWS, BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=bias is not None,
        EVEN_K=k % block_k == 0, PROLOGUE=prologue, num_warps=warps, num_stages=stages)
    return out


def _rows(x: torch.Tensor) -> tuple[int, torch.Tensor]:
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    x2 = x.reshape(rows, x.shape[-1])
    return rows, (x2 if x2.stride(-1) == 1 else x2.contiguous())


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           backend: str = "auto", config: tuple[int, int, int, int] | None = None,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``; the Triton kernel for few rows on CUDA (or ``backend="triton"``)."""
    rows, x2 = _rows(x)
    if not _triton_ok(x, weight, rows, backend):
        return linear_ref(x, weight, bias)
    if out is None:
        out = torch.empty(rows, weight.shape[0], dtype=x.dtype, device=x.device)
    return _launch(x2, weight, bias, out, 0, config).reshape(*x.shape[:-1], weight.shape[0])


def silu_mul_linear(gate_up: torch.Tensor, weight: torch.Tensor, *, backend: str = "auto",
                    config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """``F.linear(silu(gate) * up, weight)`` for ``gate_up = [gate | up]`` (an MLP's down projection),
    the activation computed while the weights stream in: no launch and no round trip for it."""
    rows, x2 = _rows(gate_up)
    if not _triton_ok(gate_up, weight, rows, backend) or gate_up.shape[-1] != 2 * weight.shape[1]:
        return linear_ref(silu_mul(gate_up), weight)
    out = torch.empty(rows, weight.shape[0], dtype=gate_up.dtype, device=gate_up.device)
    return _launch(x2, weight, None, out, 1, config).reshape(*gate_up.shape[:-1], weight.shape[0])


def add_rmsnorm_linear(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                       weight: torch.Tensor, bias: torch.Tensor | None = None, *, backend: str = "auto",
                       config: tuple[int, int, int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(F.linear(rms_norm(x + residual) * norm_weight, weight, bias), x + residual)``: the pre-norm
    of a layer folded into its first projection (contract: ``kernels.norm_rope.rms_norm_ref``)."""
    rows, x2 = _rows(x)
    if (not _triton_ok(x, weight, rows, backend) or residual.shape != x.shape or residual.dtype != x.dtype
            or norm_weight.dtype != x.dtype):
        normed, summed = rms_norm(x, norm_weight, eps, residual)
        return linear_ref(normed, weight, bias), summed
    _, r2 = _rows(residual)
    out = torch.empty(rows, weight.shape[0], dtype=x.dtype, device=x.device)
    summed = torch.empty_like(x2)
    _launch(x2, weight, bias, out, 2, config, residual=r2, norm_weight=norm_weight, summed=summed, eps=eps)
    return out.reshape(*x.shape[:-1], weight.shape[0]), summed.reshape(x.shape)


__all__ = ["MAX_ROWS", "add_rmsnorm_linear", "choose_config", "linear", "linear_ref", "silu_mul_linear"]
