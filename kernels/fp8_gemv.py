"""Skinny GEMM over FP8 weights (``y = x @ (W_fp8 * scale).T + b``): the decode, verify and draft projections
of an FP8 checkpoint (``shared/model/fp8.py``), up to ``MAX_ROWS`` rows of ``x``.

The layout of ``kernels/gemv.py``: one program owns ``BLOCK_N`` weight rows for a tile of 16 rows of ``x``
(the tiles of one weight block side by side, so it is read from HBM once) and walks K in ``BLOCK_K`` steps,
reading each FP8 weight byte once (half the bytes of bf16: the batch-1 step's floor halves). Each step is a
``tl.dot`` of the x tile (its left operand) with the FP8 tile converted to x's dtype (exact), inside one scale
block, scaled per step (block scales) or once per output (per-channel scales: ``BK >= K``).

Every row count from 1 to ``MAX_ROWS`` runs this same launch (a single row is a tile of 16 with 15 masked
rows, and the launch shape depends on the weight's shape only), so a row's output is the same bits whatever
the other rows: a decode step and a verify step compute the same product for a position, and greedy
speculation is exactly lossless in these products. A small product (few weight blocks per SM: the 8B's down, o
and qkv) splits K over several programs per block (``choose_split``, from the shape alone); the last program of
an output tile to arrive adds the float32 shares in split order, so the bits still do not depend on the rows.
The activations stay in their dtype (weight-only).
``EYRIE_FP8_ONE_ROW=tile`` sends one row through the older one-row code instead (an element-wise float32
tile reduced at the end, as ``kernels/gemv.py`` at M=1; a step may span power-of-two scale blocks): it sums
in another order than 2+ rows, so it is for timing comparisons only (``bench/bench_fp8.py``).

``fp8_linear(x, weight, scale, block, bias)`` is the entry point: the kernel on CUDA (and under
``TRITON_INTERPRET=1``, as the CPU tests run it), the dequantized ``F.linear`` elsewhere. ``check_config``
refuses, under the interpreter too, the block sizes the compiler would.
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

TILE_ROWS = 16  # rows one tl.dot program takes (every row count, 1 included)
MAX_ROWS = 1024  # rows the kernel takes: every decode and verify step (more: prefill chunks)
SPLIT_ROWS = 256  # rows per launch under split-K (its float32 shares: split x SPLIT_ROWS x N at most)


def fp8_linear_ref(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    n, k = weight.shape
    bn, bk = block
    full = scale.float().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return F.linear(x.float(), weight.float() * full, None if bias is None else bias.float()).to(x.dtype)


if triton is not None:
    @triton.jit
    def _block_scaled(w, s_rows, k, KB, BK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """The [BLOCK_N, BLOCK_K] float32 weight tile at column ``k`` times its block scales: one scale column
        when the step lies in one block, else the step's BLOCK_K // BK columns, each over its BK weights.
        (An if/else, not an early return: the compiler builds the code after a constexpr ``if``'s return.)"""
        if BLOCK_K <= BK:
            out = w * tl.load(s_rows + k // BK)[:, None]
        else:
            J: tl.constexpr = BLOCK_K // BK
            cols = k // BK + tl.arange(0, J)
            sc = tl.load(s_rows[:, None] + cols[None, :], mask=cols[None, :] < KB, other=0.0)
            out = tl.reshape(tl.reshape(w, [BLOCK_N, J, BK]) * sc[:, :, None], [BLOCK_N, BLOCK_K])
        return out

    @triton.jit
    def _step_product(x, w, s_ptrs, X_LEFT: tl.constexpr, PER_CHANNEL: tl.constexpr, PRECISION: tl.constexpr):
        """One K step's product of the x tile [BLOCK_M, BLOCK_K] and the weight tile [BLOCK_N, BLOCK_K] (in x's
        dtype), in the accumulator's orientation (``X_LEFT``: [BLOCK_M, BLOCK_N], else [BLOCK_N, BLOCK_M]), times
        the step's block scales (``s_ptrs``: a scale per weight row) unless the scales are per channel."""
        if X_LEFT:
            part = tl.dot(x, tl.trans(w), input_precision=PRECISION)
            if not PER_CHANNEL:
                part = part * tl.load(s_ptrs)[None, :]
        else:
            part = tl.dot(w, tl.trans(x), input_precision=PRECISION)
            if not PER_CHANNEL:
                part = part * tl.load(s_ptrs)[:, None]
        return part

    @triton.jit
    def _fp8_gemv_kernel(X, W, S, B, Y, P, C, M, N, K, KB, K_PER, stride_xm, stride_wn, stride_sn, stride_ym,
                         BN: tl.constexpr, BK: tl.constexpr, PER_CHANNEL: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr, X_LEFT: tl.constexpr,
                         SPLIT: tl.constexpr):
        pid_m = tl.program_id(0)  # the row tiles of one weight block run side by side: it is read once from HBM
        pid_n = tl.program_id(1)
        k_lo = tl.program_id(2) * K_PER  # split-K: this program's share [k_lo, k_hi) of K (all of it at SPLIT 1)
        k_hi = tl.minimum(K, k_lo + K_PER)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        offs_n_safe = tl.where(n_ok, offs_n, 0)
        offs_k = tl.arange(0, BLOCK_K)
        w_ptrs = W + offs_n_safe[:, None] * stride_wn + offs_k[None, :]
        s_rows = S + (offs_n_safe // BN) * stride_sn  # this program's rows of the scale
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        m_ok = offs_m < M
        x_ptrs = X + offs_m[:, None] * stride_xm + offs_k[None, :]
        if BLOCK_M == 1:  # a [BLOCK_N, BLOCK_K] float32 tile, reduced once at the end (as kernels/gemv.py)
            tile = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
            for k in range(k_lo, k_hi, BLOCK_K):
                k_ok = (k + offs_k) < k_hi
                w = tl.load(w_ptrs + k, mask=k_ok[None, :], other=0.0, cache_modifier=".cg").to(tl.float32)
                x = tl.load(x_ptrs + k, mask=k_ok[None, :], other=0.0).to(tl.float32)
                if PER_CHANNEL:
                    tile += w * x
                elif BN % BLOCK_N == 0:  # one scale row for the program: scale the BLOCK_K x's, not the tile
                    s_row = S + (pid_n * BLOCK_N // BN) * stride_sn
                    tile += w * (x * tl.load(s_row + (k + offs_k) // BK, mask=k_ok, other=0.0)[None, :])
                else:
                    tile += _block_scaled(w, s_rows, k, KB, BK, BLOCK_N, BLOCK_K) * x
            acc = tl.sum(tile, 1)[:, None]
        else:  # tl.dot of the x tile and the FP8 tile (exact in x's dtype), scaled per step (BLOCK_K <= BK)
            if X_LEFT:  # x's 16 rows the dot's left operand: the accumulator [BLOCK_M, BLOCK_N], turned at the end
                acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            else:
                acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
            for k in range(k_lo, k_hi, BLOCK_K):
                k_ok = (k + offs_k) < k_hi
                w = tl.load(w_ptrs + k, mask=k_ok[None, :], other=0.0, cache_modifier=".cg")
                x = tl.load(x_ptrs + k, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
                acc += _step_product(x, w.to(x.dtype), s_rows + k // BK, X_LEFT, PER_CHANNEL, PRECISION)
            if X_LEFT:
                acc = tl.trans(acc)
        out_mask = n_ok[:, None] & m_ok[None, :]
        if SPLIT == 1:
            _finish(acc, s_rows, B, Y, offs_m, offs_n, offs_n_safe, out_mask, stride_ym, PER_CHANNEL, HAS_BIAS)
        else:  # each split's partial sum to P; the tile's last program to arrive adds them in split order
            p_ptrs = P + (offs_m[None, :] * N + offs_n[:, None])
            tl.store(p_ptrs + tl.program_id(2) * M * N, acc, mask=out_mask)
            tile = C + pid_m * tl.num_programs(1) + pid_n
            tl.debug_barrier()  # every thread's partial stored before the (one-thread) release below
            if tl.atomic_add(tile, 1, sem="acq_rel") == SPLIT - 1:  # the others' partials are all written
                tl.store(tile, 0)  # the counter back to zero for the next launch (and a CUDA graph's replays)
                total = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
                for part in range(SPLIT):  # always this order: a row's bits never depend on which came last
                    total += tl.load(p_ptrs + part * M * N, mask=out_mask, other=0.0, cache_modifier=".cg")
                _finish(total, s_rows, B, Y, offs_m, offs_n, offs_n_safe, out_mask, stride_ym, PER_CHANNEL,
                        HAS_BIAS)

    @triton.jit
    def _finish(acc, s_rows, B, Y, offs_m, offs_n, offs_n_safe, out_mask, stride_ym, PER_CHANNEL: tl.constexpr,
                HAS_BIAS: tl.constexpr):
        """The [BLOCK_N, BLOCK_M] float32 sums times the per-channel scales, plus the bias, stored in Y's dtype."""
        if PER_CHANNEL:
            acc = acc * tl.load(s_rows)[:, None]
        if HAS_BIAS:
            acc += tl.load(B + offs_n_safe).to(tl.float32)[:, None]
        tl.store(Y + offs_m[None, :] * stride_ym + offs_n[:, None], acc.to(Y.dtype.element_ty), mask=out_mask)


def _pow2(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


@functools.lru_cache(maxsize=256)
def choose_config(m: int, n: int, k: int, bk: int, sms: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages). The ``tl.dot`` launch (``m`` > 1, and one row too unless
    ``EYRIE_FP8_ONE_ROW=tile``, which asks for ``m == 1``): 32 weight rows x 256, halved down to 16 rows while
    the weight blocks do not cover half the SMs, a step inside one scale block, 4 warps, 4 stages. Tuned on an
    H100 at the 8B's shapes with x's rows the dot's left operand (``bench/bench_fp8_gemv.py --tune``, 1 and 8
    rows: 0.50-0.86 of the copy bandwidth, 1.5-2.4x the 64 x 256 launch with the weight on the left; every
    shape's best within 3%, docs/benchmarks.md). It depends on the shape only, never on ``m``: a row's output
    is then the same bits whatever the other rows (verify's rows and a decode step's agree). ``m == 1`` (the
    one-row tile): ``kernels/gemv.py``'s M=1 shape (16 rows, 1 KB of each FP8 row in flight, 8 warps, 3
    stages), a step spanning whole power-of-two scale blocks or lying in one."""
    block_n, block_k, warps, stages = (16, 1024, 8, 3) if m == 1 else (32, 256, 4, 4)
    while block_n > (4 if m == 1 else 16) and -(-n // block_n) < (sms if m == 1 else sms // 2):
        block_n //= 2
    block_k = max(16, min(block_k, triton.next_power_of_2(k) if triton else block_k))
    if bk < k and (m > 1 or not _pow2(bk)):  # the step inside one block
        block_k = min(block_k, bk & -bk)
    return block_n, block_k, warps, stages


def choose_split(n: int, k: int, block_n: int, block_k: int, sms: int) -> int:
    """How many programs share each weight block's K (split-K): doubled while the blocks are fewer than 3 per SM
    and each share keeps 4+ steps, so a small product (o, qkv, down at one decode row) has bytes in flight on
    every SM instead of one ramping program per SM. ``EYRIE_FP8_SPLIT``: a count instead (1: off). It depends on
    the shape only, never on the rows: the shares are added in one order, so a row's bits are the same at every
    row count."""
    forced = os.environ.get("EYRIE_FP8_SPLIT", "auto")
    if forced != "auto":
        split = int(forced)
        if split < 1:
            raise ValueError(f"EYRIE_FP8_SPLIT must be 'auto' or a count >= 1, got {forced!r}")
        return split
    blocks, split = -(-n // block_n), 1
    while blocks * split < 3 * sms and k // (split * 2) >= 4 * block_k:
        split *= 2
    return split


_COUNTERS: dict[tuple[torch.device, int], torch.Tensor] = {}


def _counters(weight: torch.Tensor, tiles: int) -> torch.Tensor:
    """The split-K arrival counters of ``weight``'s launches (one per output tile), zero between launches (the
    last program of a tile sets it back), so every launch of one weight reuses them: kept per weight, never
    shared by two products that could run at once."""
    key = (weight.device, weight.data_ptr())
    c = _COUNTERS.get(key)
    if c is None or c.numel() < tiles:
        c = _COUNTERS[key] = torch.zeros(max(tiles, 64), dtype=torch.int32, device=weight.device)
    return c


def check_config(rows: int, k: int, bk: int, config: tuple[int, int, int, int]) -> int:
    """The BLOCK_K a launch of ``config`` over tiles of ``rows`` rows runs with (1: the one-row tile code; 2+:
    the ``tl.dot`` code, its step capped at the scale block), or a ValueError
    for what the compiler would refuse (the interpreter accepts more: this check runs under both)."""
    block_n, block_k, warps, stages = config
    if bk < k:
        if rows > 1:  # a step asked for that neither tiles the block's power-of-two part nor is tiled by it
            if block_k % (bk & -bk) and (bk & -bk) % block_k:
                raise ValueError(f"fp8_linear: BLOCK_K {block_k} and the scale block {bk} do not tile each other")
            block_k = min(block_k, bk & -bk)
        if (bk % block_k if block_k <= bk else block_k % bk or not _pow2(bk)) or block_k < 16:
            raise ValueError(f"fp8_linear: BLOCK_K {block_k} and the scale block {bk} do not tile each other")
    if not (_pow2(block_n) and _pow2(block_k) and block_k >= 16 and (rows == 1 or block_n >= 16)):
        raise ValueError(f"fp8_linear: BLOCK_N {block_n} and BLOCK_K {block_k} must be powers of two, BLOCK_K >= 16"
                         f" (and BLOCK_N >= 16 for tl.dot at 2+ rows)")
    if not (_pow2(warps) and stages >= 1):
        raise ValueError(f"fp8_linear: num_warps {warps} must be a power of two and num_stages {stages} >= 1")
    return block_k


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
               bias: torch.Tensor | None = None, *, backend: str = "auto",
               config: tuple[int, int, int, int] | None = None, max_rows: int | None = MAX_ROWS,
               x_left: bool | None = None, split: int | None = None) -> torch.Tensor:
    """``x @ (weight * scale).T + bias`` for FP8 ``weight`` [N, K] with ``scale`` in ``block``s: the kernel up to
    ``max_rows`` rows (None: at every row count, a row's bits never depending on the others), the reference
    past them. ``x_left``: x's rows the ``tl.dot``'s left operand (None: ``EYRIE_FP8_DOT``, ``xw`` or ``wx``,
    default ``xw``; ``wx``, the weight tile on the left, is 1.3-1.7x slower on an H100); one choice for every
    row count, as the launch shape. ``split``: how many programs share K (None: ``choose_split``; 1 for the
    one-row tile code)."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    n, k = weight.shape
    bn, bk = block
    use = triton is not None and (backend == "triton" or (backend == "auto" and x.is_cuda))
    if not use or rows == 0 or (max_rows is not None and rows > max_rows) or (bk < k and bk & -bk < 16):
        return fp8_linear_ref(x, weight, scale, block, bias)
    lead = x.shape[:-1]
    x2 = x.reshape(rows, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 4
    tile_rows = 1 if rows == 1 and os.environ.get("EYRIE_FP8_ONE_ROW", "dot") == "tile" else TILE_ROWS
    block_n, block_k, warps, stages = config or choose_config(tile_rows, n, k, min(bk, k), sms)
    block_k = check_config(tile_rows, k, min(bk, k), (block_n, block_k, warps, stages))
    scale = scale.float().contiguous()
    if split is None:
        split = 1 if tile_rows == 1 else choose_split(n, k, block_n, block_k, sms)
    if split < 1 or (split > 1 and tile_rows == 1):
        raise ValueError(f"fp8_linear: split {split} must be >= 1 (and 1 for the one-row tile code)")
    k_per = triton.cdiv(triton.cdiv(k, split), block_k) * block_k  # whole steps per share: scale blocks stay whole
    split = triton.cdiv(k, k_per)
    # Split-K's float32 shares are split x rows x n: past SPLIT_ROWS rows (a prefill chunk) the rows go in
    # launches of SPLIT_ROWS (whole 16-row tiles, each tile's sums the same), so they stay a few MiB
    step = rows if split == 1 else SPLIT_ROWS
    for lo in range(0, rows, step):
        hi = min(rows, lo + step)
        grid = (triton.cdiv(hi - lo, tile_rows), triton.cdiv(n, block_n), split)
        if split > 1:
            partials = torch.empty(split, hi - lo, n, dtype=torch.float32, device=x.device)
            counters = _counters(weight, grid[0] * grid[1])
        else:
            partials = counters = scale
        fast(_fp8_gemv_kernel)[grid](
            x2[lo:hi], weight, scale, bias if bias is not None else scale, out[lo:hi], partials, counters, hi - lo, n,
            k, scale.shape[1], k_per, x2.stride(0), weight.stride(0), scale.stride(0), out.stride(0),
            BN=bn, BK=bk, PER_CHANNEL=bk >= k, BLOCK_M=tile_rows, BLOCK_N=block_n, BLOCK_K=block_k,
            HAS_BIAS=bias is not None, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
            X_LEFT=os.environ.get("EYRIE_FP8_DOT", "xw") == "xw" if x_left is None else x_left, SPLIT=split,
            num_warps=warps, num_stages=stages)
    return out.reshape(*lead, n)


def same_rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                     backend: str = "auto", max_rows: int | None = MAX_ROWS) -> torch.Tensor:
    """``x @ weight.T + bias`` for a dense (bf16/fp16/fp32) ``weight`` through the same ``tl.dot`` launch as
    the FP8 product (the conversion is a no-op and the per-channel scale is one 1.0): a row's output is the
    same bits at every row count up to ``max_rows`` (None: every count), which ``kernels/gemv.py`` (one row,
    2-16, then cuBLAS) does not give. An FP8 target's bf16 LM head runs it (``shared/model/fp8.py prepare``),
    and a bf16 target's every projection under the engine's ``batch_invariant``, so a decode step's logits and
    a verify step's agree."""
    unit = unit_scale(x.device)
    return fp8_linear(x, weight, unit, (weight.shape[0], weight.shape[1]), bias, backend=backend, max_rows=max_rows)


_UNIT: dict[torch.device, torch.Tensor] = {}


def unit_scale(device: torch.device) -> torch.Tensor:
    if device not in _UNIT:  # made once per device, outside any CUDA-graph capture's allocations
        _UNIT[device] = torch.ones(1, 1, dtype=torch.float32, device=device)
    return _UNIT[device]


__all__ = ["MAX_ROWS", "TILE_ROWS", "check_config", "choose_config", "choose_split", "fp8_linear", "fp8_linear_ref",
           "same_rows_linear", "unit_scale"]
