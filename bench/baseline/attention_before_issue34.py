"""Paged attention in Triton: one kernel for extend / chunked prefill, decode, tree verify and tree draft.

The contract is ``kernels.attention_ref.paged_attention_ref`` (read its docstring): per request a
run of query rows, a run of cache slots (prefix first, then this step's), and either causal or a
packed custom mask over this step's slots. ``paged_attention`` runs the Triton kernel when the
tensors are on CUDA (or when ``backend="triton"``, e.g. under ``TRITON_INTERPRET=1`` in the tests)
and the torch reference otherwise, so CPU and GPU share one contract.

How the kernel is laid out:

* One program owns one *query block* of one request and one KV head: ``BLOCK_Q`` consecutive query
  tokens times the ``G`` query heads that read that KV head (GQA), packed into the ``BLOCK_M`` rows
  of one tile (row ``m`` is token ``m // G``, head ``m % G``). Every K/V tile is therefore loaded
  once for all heads of its group, and decode (one token) still fills a tensor-core tile with G heads.
* K/V rows are gathered through ``kv_indices`` (token slots), so any page size works: a page only
  changes which slots are neighbours, never the kernel.
* Keys are split into ``NUM_SPLITS`` contiguous chunks (flash-decoding): each (block, head, split)
  program writes a partial output and its log-sum-exp, and a second small kernel merges them. Batch 1
  at long context thereby uses many SMs. With one split the first kernel writes the output itself.
* Masking costs only where needed: keys every row of the block sees (the prefix; for causal also this
  step's keys up to the block's first query) run an unmasked loop, the rest a masked one.
* Softmax is online in float32 in the exp2 domain; a row that sees no key in a split contributes
  nothing (weight 0) instead of NaN.
* Sliding window (``window > 0``): the block's keys start at the first one its earliest query sees
  (``min(q_pos) - window + 1``; the splits share out the keys from there), and every tile is masked,
  each row dropping the keys at or before its ``q_pos - window`` (the prefix only, under a custom mask).

No host synchronisation: the grid comes from Python ints only (rows, heads, splits and a static
``max_q_len`` bound from the metadata or the tensor shapes), so it can be captured in a CUDA graph.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

from kernels.attention_ref import AttentionMetadata, check_window_args, paged_attention_ref

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a dependency, but keep the reference usable
    triton = None

LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class AttnConfig:
    """Launch parameters of one call; ``choose_config`` picks them, benchmarks may override them."""

    block_q: int  # query tokens per program
    block_m: int  # tile rows = next power of two >= block_q * group (at least 16 for tl.dot)
    block_n: int  # keys per inner iteration
    num_splits: int  # key chunks per (query block, kv head), merged by the combine kernel
    num_warps: int
    num_stages: int


if triton is not None:
    @triton.jit
    def _attn_tile(acc, m_i, l_i, q, start, end, kv_start, prefix, extra, mask_base, tok, row_ok,
                   kv_indices, K, V, stride_kt, stride_kh, stride_vt, stride_vh, kvh, mask_ptr, offs_d, d_ok,
                   qk_scale, q_pos, window, MASKED: tl.constexpr, HAS_MASK: tl.constexpr, BLOCK_N: tl.constexpr,
                   PRECISION: tl.constexpr, SLIDING: tl.constexpr):
        """One key tile [start, start + BLOCK_N) of the online softmax; ``end`` bounds the keys."""
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < end
        slot = tl.load(kv_indices + kv_start + offs_n, mask=n_ok, other=0)  # slot 0 is the sink: safe to read
        k = tl.load(K + slot[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :], mask=d_ok[None, :], other=0.0)
        k = k.to(q.dtype)  # a no-op except under the interpreter's bf16 upcast (see UPCAST)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        if MASKED:
            if HAS_MASK:
                col = offs_n - prefix  # column in this request's [q_len, extra] mask block
                in_step = (col >= 0) & n_ok
                bits = tl.load(mask_ptr + mask_base + tok[:, None] * extra + col[None, :],
                               mask=row_ok[:, None] & in_step[None, :], other=0)
                visible = ((col[None, :] < 0) | (bits != 0)) & n_ok[None, :]
            else:
                visible = (offs_n[None, :] <= prefix + tok[:, None]) & n_ok[None, :]
            if SLIDING:  # key slot i is at position i: keep (q_pos - window, q_pos]
                in_window = offs_n[None, :] > q_pos[:, None] - window
                if HAS_MASK:  # this step's keys (tree ancestors) are the mask's alone
                    in_window = in_window | (offs_n[None, :] >= prefix)
                visible = visible & in_window
        else:
            visible = n_ok[None, :] & (tok[:, None] >= 0)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no visible key yet stays at 0
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        # Masked: keys past the range read the sink slot, and 0 * (whatever lives there) must stay 0.
        v = tl.load(V + slot[:, None] * stride_vt + kvh * stride_vh + offs_d[None, :],
                    mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        v = v.to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=PRECISION)
        return acc, m_new, l_i

    @triton.jit
    def _attn_kernel(Q, K, V, O, Opart, Lse,
                     qo_indptr, kv_indptr, kv_indices, prefix_lens, mask_ptr, mask_indptr, QPos,
                     qk_scale, num_kv_heads, num_q_heads, num_rows, window,
                     stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
                     GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_Q: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
                     HAS_MASK: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                     SLIDING: tl.constexpr):
        qb = tl.program_id(0)
        bh = tl.program_id(1)
        split = tl.program_id(2)
        b = bh // num_kv_heads
        kvh = bh % num_kv_heads
        q_start = tl.load(qo_indptr + b)
        q_len = tl.load(qo_indptr + b + 1) - q_start
        if qb * BLOCK_Q >= q_len:  # this request has fewer query blocks than the static grid
            return
        kv_start = tl.load(kv_indptr + b)
        kv_len = tl.load(kv_indptr + b + 1) - kv_start
        prefix = tl.load(prefix_lens + b)
        extra = kv_len - prefix
        mask_base = 0
        if HAS_MASK:
            mask_base = tl.load(mask_indptr + b)

        offs_m = tl.arange(0, BLOCK_M)
        tok = qb * BLOCK_Q + offs_m // GROUP  # query index inside the request
        head = kvh * GROUP + offs_m % GROUP
        row_ok = (offs_m < BLOCK_Q * GROUP) & (tok < q_len)
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < HEAD_DIM
        row = q_start + tok
        q = tl.load(Q + row[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        if UPCAST:  # the CPU interpreter's tl.dot mishandles bfloat16 operands: compute them in float32
            q = q.to(tl.float32)

        # Keys this block reads, and the prefix of them that every row of the block sees.
        first_tok = qb * BLOCK_Q
        if HAS_MASK:
            kv_end = kv_len
            full_end = prefix
        else:
            last_tok = tl.minimum(q_len, first_tok + BLOCK_Q) - 1
            kv_end = tl.minimum(kv_len, prefix + last_tok + 1)
            full_end = prefix + first_tok + 1
        full_end = tl.minimum(full_end, kv_end)
        first_key = 0
        q_pos = tok  # unused without a window
        if SLIDING:
            if HAS_MASK:
                q_pos = tl.load(QPos + row, mask=row_ok, other=0)
            else:
                q_pos = prefix + tok
            earliest = tl.min(tl.where(row_ok, q_pos, 2147483647), 0)
            first_key = tl.maximum(earliest - window + 1, 0)
            if HAS_MASK:
                first_key = tl.minimum(first_key, prefix)
            first_key = tl.minimum(first_key, kv_end)
            full_end = first_key  # every tile masked: each row has its own window
        if NUM_SPLITS > 1:
            chunk = tl.cdiv(tl.cdiv(kv_end - first_key, NUM_SPLITS), BLOCK_N) * BLOCK_N
            lo = first_key + split * chunk
            hi = tl.minimum(lo + chunk, kv_end)
        else:
            lo = first_key
            hi = kv_end

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        mid = tl.maximum(tl.minimum(hi, full_end), lo)
        for start in range(lo, mid, BLOCK_N):
            acc, m_i, l_i = _attn_tile(acc, m_i, l_i, q, start, mid, kv_start, prefix, extra, mask_base, tok, row_ok,
                                       kv_indices, K, V, stride_kt, stride_kh, stride_vt, stride_vh, kvh, mask_ptr,
                                       offs_d, d_ok, qk_scale, q_pos, window, False, HAS_MASK, BLOCK_N, PRECISION,
                                       SLIDING)
        for start in range(mid, hi, BLOCK_N):
            acc, m_i, l_i = _attn_tile(acc, m_i, l_i, q, start, hi, kv_start, prefix, extra, mask_base, tok, row_ok,
                                       kv_indices, K, V, stride_kt, stride_kh, stride_vt, stride_vh, kvh, mask_ptr,
                                       offs_d, d_ok, qk_scale, q_pos, window, True, HAS_MASK, BLOCK_N, PRECISION,
                                       SLIDING)

        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        if NUM_SPLITS == 1:
            tl.store(O + row[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                     out.to(O.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
        else:
            lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(tl.where(l_i == 0.0, 1.0, l_i)))
            part = (split * num_rows + row) * num_q_heads + head  # Opart [S, T, Hq, D], Lse [S, T, Hq]
            tl.store(Opart + part[:, None] * HEAD_DIM + offs_d[None, :], out, mask=row_ok[:, None] & d_ok[None, :])
            tl.store(Lse + part, lse, mask=row_ok)

    @triton.jit
    def _combine_kernel(Opart, Lse, O, num_rows, num_q_heads, stride_ot, stride_oh,
                        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr,
                        SPLITS_P2: tl.constexpr):
        """Merge the split partials of one (row, head): weights 2^(lse_s - max lse)."""
        t = tl.program_id(0)
        h = tl.program_id(1)
        offs_s = tl.arange(0, SPLITS_P2)
        s_ok = offs_s < NUM_SPLITS
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < HEAD_DIM
        part = (offs_s * num_rows + t) * num_q_heads + h
        lse = tl.load(Lse + part, mask=s_ok, other=float("-inf"))
        m = tl.max(lse, 0)
        w = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))
        o = tl.load(Opart + part[:, None] * HEAD_DIM + offs_d[None, :], mask=s_ok[:, None] & d_ok[None, :], other=0.0)
        total = tl.sum(w, 0)
        out = tl.sum(o * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
        tl.store(O + t * stride_ot + h * stride_oh + offs_d, out.to(O.dtype.element_ty), mask=d_ok)


@functools.lru_cache(maxsize=8)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def choose_config(q: torch.Tensor, num_kv_heads: int, batch: int, max_q_len: int, max_kv_len: int | None,
                  num_splits: int | None = None) -> AttnConfig:
    """Tile sizes for Hopper-class GPUs; the interpreter gets the same logic with a small SM count.

    Small query blocks (decode, verify, draft) are memory bound: 32-key tiles, 4 warps, 3 stages, and
    as many key splits as keep ~2 waves of programs on the SMs, each split covering at least
    ``MIN_SPLIT_KEYS`` keys when the longest context is known. Long query blocks (extend) are compute
    bound: 128-row tiles, 64-key tiles, 8 warps, 3 stages. Measured on an H100 (bench_attention
    --tune): decode at batch 64 x 4096 keys moves KV at 85% of the copy bandwidth with 32-key tiles
    (71% with 64); extend at 4096 tokens reaches 230 TFLOP/s with 64-key tiles (218 with 128).
    """
    group = q.shape[1] // num_kv_heads
    d = q.shape[2]
    fp32 = q.dtype == torch.float32
    rows_cap = 64 if (fp32 or d > 128) else 128
    block_q = max(1, min(max_q_len, max(1, rows_cap // group)))
    block_m = max(16, triton.next_power_of_2(block_q * group))
    n_qblocks = -(-max_q_len // block_q) if max_q_len else 0
    small = block_m <= 64
    if num_splits is None and os.environ.get("EYRIE_ATTN_SPLITS"):  # a diagnostic: the same key split at every
        num_splits = int(os.environ["EYRIE_ATTN_SPLITS"])            # q length (decode vs verify), read at capture
    if num_splits is None:
        sms = _num_sms(q.device.index or 0) if q.is_cuda else 4
        programs = max(1, n_qblocks * batch * num_kv_heads)
        num_splits = max(1, min(64, -(-2 * sms // programs)))
        if max_kv_len is not None:
            num_splits = max(1, min(num_splits, -(-max_kv_len // MIN_SPLIT_KEYS)))
    if small:
        block_n, num_warps, num_stages = 32, 4, 3
    else:
        block_n, num_warps, num_stages = 64, 8, 2 if fp32 else 3
    return AttnConfig(block_q=block_q, block_m=block_m, block_n=block_n, num_splits=num_splits,
                      num_warps=num_warps, num_stages=num_stages)


MIN_SPLIT_KEYS = 64


def _use_triton(q: torch.Tensor, backend: str) -> bool:
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"backend must be auto, triton or torch, got {backend!r}")
    return triton is not None and (backend == "triton" or (backend == "auto" and q.is_cuda))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    sm_scale: float, window: int = 0, q_positions: torch.Tensor | None = None, *,
                    backend: str = "auto", num_splits: int | None = None, config: AttnConfig | None = None,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """o [T, Hq, D] under the contract of ``paged_attention_ref``; Triton on CUDA, the reference elsewhere.

    ``window`` / ``q_positions``: the sliding window, as in the reference. ``num_splits`` / ``config``
    override the launch choice (tests and benchmarks); ``out`` is an optional contiguous [T, Hq, D]
    destination of q's dtype. Rows of ``q`` that belong to no request are left unwritten, as in the reference.
    """
    check_window_args(meta, window, q_positions)
    if not _use_triton(q, backend) or q.shape[0] == 0 or meta.batch_size == 0:
        ref = paged_attention_ref(q, k_cache, v_cache, meta, sm_scale, window, q_positions)
        return ref if out is None else out.copy_(ref)
    T, hq, d = q.shape
    hkv = k_cache.shape[1]
    if hq % hkv:
        raise ValueError(f"{hq} query heads are not a multiple of {hkv} kv heads")
    if q.stride(2) != 1:
        q = q.contiguous()
    if k_cache.stride(2) != 1 or v_cache.stride(2) != 1:
        raise ValueError("the caches need a contiguous head dimension")
    group = hq // hkv
    B = meta.batch_size
    max_q = meta.static_max_q_len(q.shape[0])
    cfg = config or choose_config(q, hkv, B, max_q, meta.static_max_kv_len(), num_splits)
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or not out.is_contiguous():
        raise ValueError("out must be a contiguous tensor of q's shape and dtype")
    n_qblocks = -(-max_q // cfg.block_q)
    if n_qblocks == 0:
        return out
    has_mask = meta.custom_mask is not None
    mask = meta.custom_mask.view(torch.uint8) if has_mask else meta.kv_indices  # any pointer when unused
    mask_indptr = meta.mask_indptr if has_mask else meta.kv_indptr
    sliding = window > 0
    q_pos = q_positions if (sliding and has_mask) else meta.qo_indptr  # any pointer when unused
    S = cfg.num_splits
    if S > 1:
        opart = torch.empty((S, T, hq, d), dtype=torch.float32, device=q.device)
        lse = torch.empty((S, T, hq), dtype=torch.float32, device=q.device)
    else:
        opart = lse = out  # unused
    block_d = max(16, triton.next_power_of_2(d))  # tl.dot needs K, N >= 16
    upcast = q.dtype == torch.bfloat16 and not q.is_cuda  # only the interpreter runs off CUDA
    precision = "ieee" if (q.dtype == torch.float32 or upcast) else "tf32"
    _attn_kernel[(n_qblocks, B * hkv, S)](
        q, k_cache, v_cache, out, opart, lse,
        meta.qo_indptr, meta.kv_indptr, meta.kv_indices, meta.prefix_lens, mask, mask_indptr, q_pos,
        sm_scale * LOG2E, hkv, hq, T, window,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=d, BLOCK_D=block_d, BLOCK_Q=cfg.block_q, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        NUM_SPLITS=S, HAS_MASK=has_mask, PRECISION=precision, UPCAST=upcast, SLIDING=sliding,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if S > 1:
        _combine_kernel[(T, hq)](opart, lse, out, T, hq, out.stride(0), out.stride(1),
                                 HEAD_DIM=d, BLOCK_D=block_d, NUM_SPLITS=S, SPLITS_P2=triton.next_power_of_2(S),
                                 num_warps=4 if d >= 128 else 2)
    return out


__all__ = ["AttentionMetadata", "AttnConfig", "choose_config", "paged_attention"]
