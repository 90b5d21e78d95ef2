"""Skinny GEMM over FP8 weights (``y = x @ (W_fp8 * scale).T + b`` for up to 16 rows of ``x``): the decode,
verify and draft projections of an FP8 checkpoint (``shared/model/fp8.py``).

The layout of ``kernels/gemv.py``: one program owns ``BLOCK_N`` weight rows for every row of ``x`` and walks
K in ``BLOCK_K`` steps, reading each FP8 weight byte once (half the bytes of bf16: the batch-1 step's floor
halves). The weight is converted to float32 in registers; its scale ``S`` [ceil(N / BN), ceil(K / BK)] is
applied per element for block scales (``BLOCK_K`` at most ``BK``, so one K step meets one scale column of
each row) or once per output for per-channel scales (``BK >= K``). The activations stay in their dtype
(no activation quantization here: more exact than the W8A8 product prefill uses).

``fp8_linear(x, weight, scale, block, bias)`` is the entry point: the kernel on CUDA (and under
``TRITON_INTERPRET=1``, as the CPU tests run it), the dequantized ``F.linear`` elsewhere.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

MAX_ROWS = 16


def fp8_linear_ref(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    n, k = weight.shape
    bn, bk = block
    full = scale.float().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return F.linear(x.float(), weight.float() * full, None if bias is None else bias.float()).to(x.dtype)


if triton is not None:
    @triton.jit
    def _scaled(w, s_rows, k, KB, BK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """The [BLOCK_N, BLOCK_K] weight tile at column ``k`` times its block scales: one scale column when
        the step lies in one block, else the step's BLOCK_K // BK columns, each over its BK weights."""
        if BLOCK_K <= BK:
            return w * tl.load(s_rows + k // BK)[:, None]
        J: tl.constexpr = BLOCK_K // BK
        cols = k // BK + tl.arange(0, J)
        sc = tl.load(s_rows[:, None] + cols[None, :], mask=cols[None, :] < KB, other=0.0)
        return tl.reshape(tl.reshape(w, [BLOCK_N, J, BK]) * sc[:, :, None], [BLOCK_N, BLOCK_K])

    @triton.jit
    def _fp8_gemv_kernel(X, W, S, B, Y, M, N, K, KB, stride_xm, stride_wn, stride_sn, stride_ym,
                         BN: tl.constexpr, BK: tl.constexpr, PER_CHANNEL: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         HAS_BIAS: tl.constexpr):
        pid = tl.program_id(0)
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        offs_n_safe = tl.where(n_ok, offs_n, 0)
        offs_k = tl.arange(0, BLOCK_K)
        w_ptrs = W + offs_n_safe[:, None] * stride_wn + offs_k[None, :]
        s_rows = S + (offs_n_safe // BN) * stride_sn  # this program's rows of the scale
        offs_m = tl.arange(0, BLOCK_M)
        m_ok = offs_m < M
        x_ptrs = X + offs_m[:, None] * stride_xm + offs_k[None, :]
        if BLOCK_M == 1:  # a [BLOCK_N, BLOCK_K] float32 tile, reduced once at the end (as kernels/gemv.py)
            tile = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
            for k in range(0, K, BLOCK_K):
                k_ok = (k + offs_k) < K
                w = tl.load(w_ptrs + k, mask=k_ok[None, :], other=0.0, cache_modifier=".cg").to(tl.float32)
                if not PER_CHANNEL:
                    w = _scaled(w, s_rows, k, KB, BK, BLOCK_N, BLOCK_K)
                x = tl.load(X + k + offs_k, mask=k_ok, other=0.0).to(tl.float32)
                tile += w * x[None, :]
            acc = tl.sum(tile, 1)[:, None]
        else:
            acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
            for k in range(0, K, BLOCK_K):
                k_ok = (k + offs_k) < K
                w = tl.load(w_ptrs + k, mask=k_ok[None, :], other=0.0, cache_modifier=".cg").to(tl.float32)
                if not PER_CHANNEL:
                    w = _scaled(w, s_rows, k, KB, BK, BLOCK_N, BLOCK_K)
                x = tl.load(x_ptrs + k, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
                acc = tl.dot(w.to(x.dtype), tl.trans(x), acc)
        if PER_CHANNEL:
            acc = acc * tl.load(s_rows)[:, None]
        if HAS_BIAS:
            acc += tl.load(B + offs_n_safe).to(tl.float32)[:, None]
        tl.store(Y + offs_m[None, :] * stride_ym + offs_n[:, None], acc.to(Y.dtype.element_ty),
                 mask=n_ok[:, None] & m_ok[None, :])


@functools.lru_cache(maxsize=256)
def choose_config(m: int, n: int, k: int, bk: int, sms: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages): ``kernels/gemv.py``'s shapes at M=1 (16 rows, 1 KB of each
    FP8 row in flight, 8 warps, 3 stages) and at 2-16 rows (64 rows x 256 through ``tl.dot``). A K step spans
    whole scale blocks or lies in one (power-of-two blocks; others step by their largest power-of-two divisor).
    Not yet tuned on a GPU for FP8: ``bench/bench_fp8.py`` times it against the floor."""
    block_n, block_k, warps, stages = (16, 1024, 8, 3) if m == 1 else (64, 256, 4, 4)
    while m == 1 and block_n > 4 and -(-n // block_n) < sms:
        block_n //= 2
    block_k = max(16, min(block_k, triton.next_power_of_2(k) if triton else block_k))
    if bk < k and bk & (bk - 1):  # not a power of two: steps inside a block
        block_k = min(block_k, bk & -bk)
    return block_n, block_k, warps, stages


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
               bias: torch.Tensor | None = None, *, backend: str = "auto",
               config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """``x @ (weight * scale).T + bias`` for FP8 ``weight`` [N, K] with ``scale`` in ``block``s."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    n, k = weight.shape
    bn, bk = block
    use = triton is not None and (backend == "triton" or (backend == "auto" and x.is_cuda))
    if not use or rows == 0 or rows > MAX_ROWS or (bk < k and bk & -bk < 16):
        return fp8_linear_ref(x, weight, scale, block, bias)
    lead = x.shape[:-1]
    x2 = x.reshape(rows, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 4
    block_n, block_k, warps, stages = config or choose_config(rows, n, k, min(bk, k), sms)
    if bk < k and (bk % block_k if block_k <= bk else block_k % bk or bk & (bk - 1)):
        raise ValueError(f"fp8_linear: BLOCK_K {block_k} and the scale block {bk} do not tile each other")
    scale = scale.float().contiguous()
    _fp8_gemv_kernel[(triton.cdiv(n, block_n),)](
        x2, weight, scale, bias if bias is not None else scale, out, rows, n, k, scale.shape[1],
        x2.stride(0), weight.stride(0), scale.stride(0), out.stride(0),
        BN=bn, BK=bk, PER_CHANNEL=bk >= k, BLOCK_M=1 if rows == 1 else MAX_ROWS, BLOCK_N=block_n,
        BLOCK_K=block_k, HAS_BIAS=bias is not None, num_warps=warps, num_stages=stages)
    return out.reshape(*lead, n)


__all__ = ["choose_config", "fp8_linear", "fp8_linear_ref"]
