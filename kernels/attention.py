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
* A query's output is the same bits in every launch of one split length, so a verify step's row equals the
  decode step at its position (speculation stays exactly lossless; tests/unit/kernels/test_attention_invariance.py):
  - keys are read in tiles of BLOCK_N *positions* from position 0, and split (flash-decoding) every
    ``split_len`` positions from 0 (``choose_split_len``: one length per cache, from its longest context and
    the SM count, never from the batch, the query count or the step's context);
  - decode-like launches (decode, verify, draft, short causal steps) share one tile shape (``DECODE_ROWS`` rows,
    32-key tiles, 4 warps), so a row's dots and sums run in one order whatever the other rows are (long causal
    blocks, extend, keep a compute-bound tile: the same prefill runs with and without a draft);
  - under a custom mask a query's visible step slots, in column order, stand at positions prefix, prefix + 1, ...
    (a tree node's ancestors by depth, nodes being in creation order, parents first: where a decode step has
    those tokens). Tiles past the prefix gather each query's own keys by position and run the tile once per
    query of the block, keeping that query's rows;
  - a split's partial (normalised output, log-sum-exp) is merged into the running one in split order with
    fmas (``_merge_factors``): either a few programs per block each run every n'th split and write its partials,
    which the combine kernel merges (few blocks: batch 1 at long context uses many SMs), or one program runs
    every split of its block and merges as it goes (enough programs already, or too many partials to hold).
    Both give the same bits, so the choice may follow the batch.
* A tile a row sees nothing of leaves its state exactly as it was, and a split it sees nothing of (log-sum-exp
  -inf) merges as nothing: the first key a block reads (a window's start) may differ between steps.
* Softmax is online in float32 in the exp2 domain; a row that sees no key in a split contributes
  nothing (weight 0) instead of NaN.
* Sliding window (``window > 0``): the block's keys start at the tile holding the first one its earliest query
  sees (``min(q_pos) - window + 1``), and each row drops the keys at or before its ``q_pos - window`` (the
  prefix only, under a custom mask).

No host synchronisation: the grid comes from Python ints only (rows, heads, splits and a static
``max_q_len`` bound from the metadata or the tensor shapes), so it can be captured in a CUDA graph.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, replace

import torch

from kernels.attention_ref import AttentionMetadata, check_window_args, pack_int64, paged_attention_ref
from kernels.launch import fast

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
    num_splits: int  # programs per (query block, kv head), each running every num_splits'th split of the block
    num_warps: int   # and writing its partials for the combine kernel; 1: one program runs every split (same bits)
    num_stages: int
    split_len: int = 0  # keys per split, a multiple of block_n (0: paged_attention's choice)
    tail_split: int = 0  # > 0 (a split launch): a block uses cdiv(its splits, this) of its programs, one alone
    #                     writing its rows itself: short rows as a serial launch, a long one's splits shared


if triton is not None:
    @triton.jit
    def _attn_tile(acc, m_i, l_i, q, slot, ok, visible, K, V, stride_kt, stride_kh, stride_vt, stride_vh, kvh,
                   offs_d, d_ok, qk_scale, PRECISION: tl.constexpr):
        """One key tile of the online softmax: ``slot`` [BLOCK_N] the keys' cache slots (``ok``: a real key),
        ``visible`` [BLOCK_M, BLOCK_N] which of them each row sees. Every row's arithmetic is its own: a row's
        result depends only on its query, its keys and their order, never on the other rows of the tile."""
        k = tl.load(K + slot[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :], mask=d_ok[None, :], other=0.0)
        k = k.to(q.dtype)  # a no-op except under the interpreter's bf16 upcast (see UPCAST)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no visible key yet stays at 0
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        # Keys that are not real read the sink slot, and 0 * (whatever lives there) must stay 0.
        v = tl.load(V + slot[:, None] * stride_vt + kvh * stride_vh + offs_d[None, :],
                    mask=ok[:, None] & d_ok[None, :], other=0.0)
        v = v.to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=PRECISION)
        return acc, m_new, l_i

    @triton.jit
    def _step_cols(mask_ptr, row_base, extra, r, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr):
        """One query's mask row over this step's ``extra`` slots: for each rank ``r`` [BLOCK_N] the column of
        its (r+1)-th visible slot (columns in order: a tree node's ancestors by depth), and how many it sees."""
        col = tl.zeros([BLOCK_N], tl.int32)
        total = tl.zeros([1], tl.int32)
        for e0 in range(0, extra, BLOCK_E):
            offs_e = e0 + tl.arange(0, BLOCK_E)
            e_ok = offs_e < extra
            bits = (tl.load(mask_ptr + row_base + offs_e, mask=e_ok, other=0) != 0).to(tl.int32)
            cs = tl.cumsum(bits, 0) + total
            col += tl.sum(((cs[None, :] <= r[:, None]) & e_ok[None, :]).to(tl.int32), 1)
            total += tl.sum(bits, 0)
        return col, total

    @triton.jit
    def _nested_in(mask_ptr, mask_base, tj, tok, own_col, extra, BLOCK_E: tl.constexpr):
        """[BLOCK_M]: the row's query sees exactly the step slots query ``tj`` sees up to the row's own last one
        (``own_col``): its keys are the first of tj's, at the same positions (a tree node on tj's path)."""
        differ = tl.zeros_like(own_col)
        for e0 in range(0, extra, BLOCK_E):
            offs_e = e0 + tl.arange(0, BLOCK_E)
            upto = (offs_e[None, :] <= own_col[:, None]) & (offs_e < extra)[None, :]
            mine = tl.load(mask_ptr + mask_base + tok[:, None] * extra + offs_e[None, :], mask=upto, other=0) != 0
            theirs = tl.load(mask_ptr + mask_base + tj * extra + offs_e, mask=offs_e < extra, other=0) != 0
            differ += tl.sum((upto & (mine != theirs[None, :])).to(tl.int32), 1)
        return (differ == 0) & (own_col >= 0)

    @triton.jit
    def _visible(offs_n, vis_end, q_pos, prefix, window, HAS_MASK: tl.constexpr, SLIDING: tl.constexpr):
        """[BLOCK_M, BLOCK_N]: row m sees key positions [0, vis_end[m]), and under a window only the prefix keys
        after ``q_pos - window`` (this step's keys under a mask stay as the mask says)."""
        visible = offs_n[None, :] < vis_end[:, None]
        if SLIDING:
            in_window = offs_n[None, :] > q_pos[:, None] - window
            if HAS_MASK:
                in_window = in_window | (offs_n[None, :] >= prefix)
            visible = visible & in_window
        return visible

    @triton.jit
    def _split_partial(q, lo, hi, gather_from, kv_start, kv_len, prefix, extra, mask_base, first_tok, n_tok, tok,
                       vis_end, own_col, q_pos, window, kv_indices, K, V, stride_kt, stride_kh, stride_vt, stride_vh,
                       kvh, mask_ptr, offs_d, d_ok, qk_scale, HAS_MASK: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr,
                       PRECISION: tl.constexpr, SLIDING: tl.constexpr):
        """The keys at positions [lo, hi) (``lo`` a multiple of BLOCK_N) in tiles of BLOCK_N positions: o [BLOCK_M,
        BLOCK_D] (normalised) and its log2-sum-exp (-inf for a row that saw nothing).

        Positions below ``gather_from`` (a multiple of BLOCK_N) are the same slots for every row: one shared
        tile. Above it (a custom mask's step keys) each query's keys are gathered by position: its visible step
        slots in column order are positions prefix, prefix+1, ..., so a tree node's tile holds exactly the keys
        a decode step at its position holds, in the same places. One gathered tile serves every query of the
        block whose visible step slots are the first ones of another's (a tree path's nodes: one pass per
        leaf); the rows of each query are updated by one pass only."""
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        for start in range(lo, tl.minimum(hi, gather_from), BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            ok = offs_n < kv_len
            slot = tl.load(kv_indices + kv_start + offs_n, mask=ok, other=0)  # slot 0 is the sink: safe to read
            visible = _visible(offs_n, vis_end, q_pos, prefix, window, HAS_MASK, SLIDING) & ok[None, :]
            acc, m_i, l_i = _attn_tile(acc, m_i, l_i, q, slot, ok, visible, K, V, stride_kt, stride_kh, stride_vt,
                                       stride_vh, kvh, offs_d, d_ok, qk_scale, PRECISION)
        if HAS_MASK:
            if hi > tl.maximum(lo, gather_from):  # a split of shared prefix tiles only needs no pass
                done = tl.zeros([BLOCK_M], tl.int32)  # rows already updated by a pass
                for jj in range(0, n_tok):  # last query first: in a tree, a node not yet covered is a leaf
                    tj = first_tok + n_tok - 1 - jj
                    mine = (tok == tj) & (done == 0)
                    if tl.max(mine.to(tl.int32), 0) > 0:
                        covers = mine | _nested_in(mask_ptr, mask_base, tj, tok, own_col, extra, BLOCK_E) & (done == 0)
                        end_j = tl.max(tl.where(tok == tj, vis_end, 0), 0)  # past it the tiles are nothing to tj
                        for start in range(tl.maximum(lo, gather_from), tl.minimum(hi, end_j), BLOCK_N):
                            offs_n = start + tl.arange(0, BLOCK_N)
                            r = offs_n - prefix
                            in_prefix = r < 0
                            col, cnt = _step_cols(mask_ptr, mask_base + tj * extra, extra, r, BLOCK_N, BLOCK_E)
                            ok = in_prefix | (r < cnt)
                            slot = tl.load(kv_indices + kv_start + tl.where(in_prefix, offs_n, prefix + col), mask=ok,
                                           other=0)
                            visible = _visible(offs_n, vis_end, q_pos, prefix, window, HAS_MASK, SLIDING) & ok[None, :]
                            a2, m2, l2 = _attn_tile(acc, m_i, l_i, q, slot, ok, visible, K, V, stride_kt, stride_kh,
                                                    stride_vt, stride_vh, kvh, offs_d, d_ok, qk_scale, PRECISION)
                            acc = tl.where(covers[:, None], a2, acc)
                            m_i = tl.where(covers, m2, m_i)
                            l_i = tl.where(covers, l2, l_i)
                        done = tl.where(covers, 1, done)
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(tl.where(l_i == 0.0, 1.0, l_i)))
        return o, lse

    @triton.jit
    def _merge_factors(M, lse):
        """Merging a split's (o, lse) into the running (M, W, A): A <- A * a + o * b, W <- W * a + b (as fmas).
        The attention kernel (all splits in one program) and the combine kernel (one split per program) merge
        with this, in split order, so both give the same bits; a split a row saw nothing of changes nothing."""
        m_new = tl.maximum(M, lse)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        return m_new, tl.exp2(M - m_safe), tl.exp2(lse - m_safe)

    # The row count is not specialized on (divisible by 16, equal to 1): an eager step's odd count (a mixed step's
    # decode rows) reuses the kernel its graphs compiled at start instead of compiling one mid-serve (~1 s on an H100)
    @triton.jit
    def _all_splits(q, s_lo, s_hi, first_key, kv_end, split_len, gather_from, kv_start, kv_len, prefix, extra,
                    mask_base, first_tok, n_tok, tok, vis_end, own_col, q_pos, window, kv_indices, K, V, stride_kt,
                    stride_kh, stride_vt, stride_vh, kvh, mask_ptr, offs_d, d_ok, qk_scale, HAS_MASK: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr,
                    PRECISION: tl.constexpr, SLIDING: tl.constexpr):
        """Splits [s_lo, s_hi) of a block, each one's partial merged into the running result in order (what the
        combine kernel does with the partials of a split launch: the same operations, so the same bits)."""
        M = tl.full([BLOCK_M], float("-inf"), tl.float32)
        W = tl.zeros([BLOCK_M], tl.float32)
        A = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for s in range(s_lo, s_hi):
            lo = tl.maximum(s * split_len, first_key)
            hi = tl.minimum(s * split_len + split_len, kv_end)
            o, lse = _split_partial(q, lo, hi, gather_from, kv_start, kv_len, prefix, extra, mask_base, first_tok,
                                    n_tok, tok, vis_end, own_col, q_pos, window, kv_indices, K, V, stride_kt,
                                    stride_kh, stride_vt, stride_vh, kvh, mask_ptr, offs_d, d_ok, qk_scale,
                                    HAS_MASK, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_E, PRECISION, SLIDING)
            M, a, wb = _merge_factors(M, lse)
            A = tl.fma(A, a[:, None], o * wb[:, None])
            W = tl.fma(W, a, wb)
        return A / tl.where(W == 0.0, 1.0, W)[:, None]

    @triton.jit(do_not_specialize=["num_rows", "tail_split"])
    def _attn_kernel(Q, K, V, O, Opart, Lse, Range,
                     qo_indptr, kv_indptr, kv_indices, prefix_lens, mask_ptr, mask_indptr, QPos,
                     qk_scale, num_kv_heads, num_q_heads, num_rows, window, split_len, tail_split,
                     stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
                     GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_Q: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, SERIAL: tl.constexpr,
                     HAS_MASK: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                     SLIDING: tl.constexpr, TAIL: tl.constexpr):
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
        first_tok = qb * BLOCK_Q
        n_tok = tl.minimum(q_len - first_tok, BLOCK_Q)
        tok = first_tok + offs_m // GROUP  # query index inside the request
        head = kvh * GROUP + offs_m % GROUP
        row_ok = (offs_m < BLOCK_Q * GROUP) & (tok < q_len)
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < HEAD_DIM
        row = q_start + tok
        q = tl.load(Q + row[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        if UPCAST:  # the CPU interpreter's tl.dot mishandles bfloat16 operands: compute them in float32
            q = q.to(tl.float32)

        # Keys by position: row m sees [0, vis_end[m]) (a decode row at position p: [0, p]); the block reads
        # [first_key, kv_end). Under a mask a query's position-p key is its p - prefix'th visible step slot.
        if HAS_MASK:
            cnt = tl.zeros([BLOCK_M], tl.int32)
            own_col = tl.full([BLOCK_M], -1, tl.int32)  # the row's last visible step slot (a tree node: itself)
            unlike_chain = tl.zeros([BLOCK_M], tl.int32)  # columns where the row differs from "sees 0..tok"
            for e0 in range(0, extra, BLOCK_E):
                offs_e = e0 + tl.arange(0, BLOCK_E)
                e_ok = row_ok[:, None] & (offs_e < extra)[None, :]
                seen = tl.load(mask_ptr + mask_base + tok[:, None] * extra + offs_e[None, :], mask=e_ok, other=0) != 0
                cnt += tl.sum(seen.to(tl.int32), 1)
                own_col = tl.maximum(own_col, tl.max(tl.where(seen, offs_e[None, :], -1), 1).to(tl.int32))
                unlike_chain += tl.sum((e_ok & (seen != (offs_e[None, :] <= tok[:, None]))).to(tl.int32), 1)
            vis_end = tl.where(row_ok, prefix + cnt, 0)
            # A chain (each query sees the step's slots up to its own) has its keys at their columns: no gather.
            gather_from = tl.where(tl.max(unlike_chain, 0) == 0, kv_len, (prefix // BLOCK_N) * BLOCK_N)
        else:
            vis_end = tl.where(row_ok, prefix + tok + 1, 0)
            own_col = tl.full([BLOCK_M], -1, tl.int32)  # unused without a mask
            gather_from = kv_len
        kv_end = tl.max(vis_end, 0)
        first_key = kv_end * 0
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
            first_key = (tl.minimum(first_key, kv_end) // BLOCK_N) * BLOCK_N  # tiles stay on BLOCK_N positions

        # Keys are cut into splits of ``split_len`` positions (a multiple of BLOCK_N) from position 0, whatever
        # the step: split s is [s * split_len, (s + 1) * split_len). SERIAL runs every split here and merges
        # them in order; otherwise program ``split`` writes its partial and the combine kernel merges them.
        s_lo = first_key // split_len
        s_hi = tl.cdiv(kv_end, split_len)
        if SERIAL:
            out = _all_splits(q, s_lo, s_hi, first_key, kv_end, split_len, gather_from, kv_start, kv_len, prefix,
                              extra, mask_base, first_tok, n_tok, tok, vis_end, own_col, q_pos, window, kv_indices, K,
                              V, stride_kt, stride_kh, stride_vt, stride_vh, kvh, mask_ptr, offs_d, d_ok, qk_scale,
                              HAS_MASK, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_E, PRECISION, SLIDING)
            tl.store(O + row[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                     out.to(O.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
        else:
            # Program ``split`` of the block's P programs runs splits split, split + P, ... of the block's
            # [s_lo, s_hi), writing each one's partial; the combine kernel merges [s_lo, s_hi) in order (Range).
            # TAIL: a block uses only cdiv(its splits, tail_split) of its P programs: one of few splits runs them
            # all in program 0 and writes its output itself (Range [-1, 0): the combine leaves its rows), so
            # short rows cost what a serial launch costs while a long row's splits are shared.
            used = tl.num_programs(2) + s_lo * 0  # tensors from here (TAIL's branch reassigns both)
            solo = used < 0  # never, without TAIL
            if TAIL:
                used = tl.minimum(used, tl.maximum(1, tl.cdiv(s_hi - s_lo, tail_split)))
                solo = used == 1
            if solo:
                if split == 0:
                    out = _all_splits(q, s_lo, s_hi, first_key, kv_end, split_len, gather_from, kv_start, kv_len,
                                      prefix, extra, mask_base, first_tok, n_tok, tok, vis_end, own_col, q_pos, window,
                                      kv_indices, K, V, stride_kt, stride_kh, stride_vt, stride_vh, kvh, mask_ptr,
                                      offs_d, d_ok, qk_scale, HAS_MASK, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_E, PRECISION,
                                      SLIDING)
                    tl.store(O + row[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                             out.to(O.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
                    if kvh == 0:
                        tl.store(Range + row * 2, row * 0 - 1, mask=row_ok)
                        tl.store(Range + row * 2 + 1, row * 0, mask=row_ok)
            elif split < used:
                _split_partials(Opart, Lse, Range, q, split, used, s_lo, s_hi, first_key, kv_end, split_len,
                                gather_from, kv_start, kv_len, prefix, extra, mask_base, first_tok, n_tok, tok, vis_end,
                                own_col, q_pos, window, kv_indices, K, V, stride_kt, stride_kh, stride_vt, stride_vh,
                                kvh, mask_ptr, offs_d, d_ok, qk_scale, row, row_ok, head, num_rows, num_q_heads,
                                HEAD_DIM, HAS_MASK, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_E, PRECISION, SLIDING)

    @triton.jit
    def _split_partials(Opart, Lse, Range, q, split, used, s_lo, s_hi, first_key, kv_end, split_len, gather_from,
                        kv_start, kv_len, prefix, extra, mask_base, first_tok, n_tok, tok, vis_end, own_col, q_pos,
                        window, kv_indices, K, V, stride_kt, stride_kh, stride_vt, stride_vh, kvh, mask_ptr, offs_d,
                        d_ok, qk_scale, row, row_ok, head, num_rows, num_q_heads, HEAD_DIM: tl.constexpr,
                        HAS_MASK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                        BLOCK_E: tl.constexpr, PRECISION: tl.constexpr, SLIDING: tl.constexpr):
        """Program ``split`` of the ``used`` a block runs: splits split, split + used, ... of [s_lo, s_hi), each
        one's partial written for the combine kernel (program 0 of KV head 0 writes the rows' Range)."""
        if (split == 0) & (kvh == 0):
            tl.store(Range + row * 2, s_lo + row * 0, mask=row_ok)
            tl.store(Range + row * 2 + 1, s_hi + row * 0, mask=row_ok)
        for s in range(s_lo + split, s_hi, used):
            lo = tl.maximum(s * split_len, first_key)
            hi = tl.minimum(s * split_len + split_len, kv_end)
            o, lse = _split_partial(q, lo, hi, gather_from, kv_start, kv_len, prefix, extra, mask_base,
                                    first_tok, n_tok, tok, vis_end, own_col, q_pos, window, kv_indices, K, V,
                                    stride_kt, stride_kh, stride_vt, stride_vh, kvh, mask_ptr, offs_d, d_ok,
                                    qk_scale, HAS_MASK, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_E, PRECISION, SLIDING)
            part = (s * num_rows + row) * num_q_heads + head  # Opart [S, T, Hq, D], Lse [S, T, Hq]
            tl.store(Opart + part[:, None] * HEAD_DIM + offs_d[None, :], o,
                     mask=(row_ok & (lse > float("-inf")))[:, None] & d_ok[None, :])
            tl.store(Lse + part, lse, mask=row_ok)

    @triton.jit
    def _merge_split(Opart, Lse, s, num_rows, num_q_heads, s_lo, s_hi, t, h, offs_d, d_ok, HEAD_DIM: tl.constexpr,
                     M, A, W):
        """One split's partial of (row ``t``, head ``h``) merged into the running max, sum and weight; a split
        outside the row's block's [s_lo, s_hi) was not written and merges as nothing."""
        part = (s * num_rows + t) * num_q_heads + h
        one = tl.zeros([1], tl.int32) + s
        lse = tl.load(Lse + part + one * 0, mask=(one >= s_lo) & (one < s_hi), other=float("-inf"))
        o = tl.load(Opart + part * HEAD_DIM + offs_d, mask=d_ok & (lse > float("-inf")), other=0.0)
        M, a, wb = _merge_factors(M, lse)
        return M, tl.fma(A, a, o * wb), tl.fma(W, a, wb)

    @triton.jit(do_not_specialize=["num_rows", "num_splits"])
    def _combine_kernel(Opart, Lse, O, Range, num_rows, num_q_heads, num_splits, stride_ot, stride_oh,
                        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS_P2: tl.constexpr,
                        UNROLL: tl.constexpr):
        """Merge the split partials of one (row, head) in split order (``_merge_factors``), over the splits its
        block ran (``Range``: [s_lo, s_hi), as the serial launch runs them): unrolled (``UNROLL``) so the loads
        issue together, else a loop (an unrolled loop of hundreds of splits takes minutes to compile); the same
        operations in the same order either way, so the same bits. A split the row saw nothing of (lse -inf, its
        partial never written) is not read. A row of no request has no range written: clamped, it merges only
        what lies in the buffers (its output is unspecified, as the serial launch leaves it unwritten)."""
        t = tl.program_id(0)
        h = tl.program_id(1)
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < HEAD_DIM
        first = tl.load(Range + t * 2)  # -1: the row's block ran every split and wrote it (a TAIL launch)
        s_lo = tl.maximum(first, 0)
        s_hi = tl.minimum(tl.load(Range + t * 2 + 1), num_splits)
        M = tl.full([1], float("-inf"), tl.float32)
        W = tl.zeros([1], tl.float32)
        A = tl.zeros([BLOCK_D], tl.float32)
        if UNROLL:
            for s in tl.static_range(SPLITS_P2):
                M, A, W = _merge_split(Opart, Lse, s, num_rows, num_q_heads, s_lo, s_hi, t, h, offs_d, d_ok,
                                       HEAD_DIM, M, A, W)
        else:
            for s in range(s_lo, s_hi):
                M, A, W = _merge_split(Opart, Lse, s, num_rows, num_q_heads, s_lo, s_hi, t, h, offs_d, d_ok,
                                       HEAD_DIM, M, A, W)
        out = A / tl.where(W == 0.0, 1.0, W)
        tl.store(O + t * stride_ot + h * stride_oh + offs_d, out.to(O.dtype.element_ty),
                 mask=d_ok & (offs_d * 0 + first >= 0))


@functools.lru_cache(maxsize=8)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _sms(device: torch.device) -> int:
    return _num_sms(device.index or 0) if device.type == "cuda" else 4


DECODE_ROWS = 64  # tile rows of every decode-like launch (decode, verify, draft): one tile shape, one summation order
MIN_SPLIT_KEYS = 64
MAX_SPLIT_KEYS = 512  # a longer split leaves short contexts on too few SMs (batch 1 at 1k: 2 splits per head)
SIZING_CONTEXT = 16384  # the context the split length fills the SMs at; longer ones get more splits
MAX_SPLITS = 256  # at the longest context; past it the split length grows instead
UNROLLED_SPLITS = 32  # the combine unrolls up to this many splits; past it a loop (256 unrolled: minutes of compile)
PARTIAL_BYTES = 64 << 20  # the float32 partials a split launch may write; past it one program runs every split
SPLIT_PROGRAMS = 2  # programs per SM a launch aims at: fewer blocks than that get floor(that / blocks) programs
#                     each, running every n'th split of the block; more run serially. On an H100 (bench_split_
#                     attention.py, graph bounds of a 4096-token engine): decode at 8 / 16 rows fastest with 4 / 2
#                     programs per block, at 32+ rows serially (one per split: 1.8x slower at 32 rows x 640 keys)


def _tail_setting() -> tuple[int, int]:
    """``EYRIE_ATTN_TAIL=P:T`` (opt-in until measured: bench/bench_split_attention.py --tails): where a launch
    would run each block serially (many rows), P programs per block instead, a block using cdiv(its splits, T) of
    them: a long row among short ones (a long prompt's hand-off joining streams) no longer sets the launch's time
    alone. Unset: (0, 0)."""
    raw = os.environ.get("EYRIE_ATTN_TAIL", "")
    try:
        p, t = (int(x) for x in raw.split(":")) if raw else (0, 0)
    except ValueError:
        raise ValueError(f"EYRIE_ATTN_TAIL must be PROGRAMS:SPLITS (e.g. 4:8), got {raw!r}") from None
    return (p, t) if p > 1 and t > 0 else (0, 0)


TAIL_PROGRAMS, TAIL_SPLITS = _tail_setting()


def choose_split_len(max_context: int, num_kv_heads: int, device: torch.device) -> int:
    """Keys per split, fixed for an engine's life (its longest context, its KV heads per GPU, the SM count).

    Splits are cut at multiples of this from position 0, whatever the step, so a query at position p reduces
    its keys in the same order in a decode step and as a row of a verify step. Sized so one request at
    ``min(max_context, SIZING_CONTEXT)`` keys runs ~2 waves of programs: a power of two in
    [``MIN_SPLIT_KEYS``, ``MAX_SPLIT_KEYS``], longer only to keep ``MAX_SPLITS`` splits at the longest context.
    """
    ctx = max(1, max_context)
    want = -(-min(ctx, SIZING_CONTEXT) * num_kv_heads // (2 * _sms(device)))
    split = min(MAX_SPLIT_KEYS, max(MIN_SPLIT_KEYS, triton.next_power_of_2(want)))
    return max(split, triton.next_power_of_2(-(-ctx // MAX_SPLITS)))


def choose_config(q: torch.Tensor, num_kv_heads: int, batch: int, max_q_len: int, max_kv_len: int | None,
                  num_splits: int | None = None, *, split_len: int | None = None,
                  has_mask: bool = False) -> AttnConfig:
    """Tile sizes for Hopper-class GPUs; the interpreter gets the same logic with a small SM count.

    Decode-like launches (a custom mask, or every query of a request in one ``DECODE_ROWS``-row tile: decode,
    verify, draft) are memory bound and share one tile shape whatever their query count: 64 rows, 32-key
    tiles, 4 warps, 3 stages, so a row's sums run in one order in a decode step and in a verify step. Long
    causal query blocks (extend) are compute bound: 128-row tiles, 64-key tiles, 8 warps, 3 stages. Measured
    on an H100 (bench_attention --tune): decode at batch 64 x 4096 keys moves KV at 85% of the copy bandwidth
    with 32-key tiles (71% with 64); extend at 4096 tokens reaches 230 TFLOP/s with 64-key tiles (218 with 128).

    Keys split every ``split_len`` positions (``choose_split_len``; ``num_splits`` instead: that many over
    ``max_kv_len``, for tests and benchmarks: one program per split). A launch of fewer blocks than
    ``SPLIT_PROGRAMS`` per SM gives each block floor(that / blocks) programs, each running every n'th split of
    it, and merges the partials in a second kernel; one with enough programs (or too many partials to hold)
    runs every split of a query block in one program, merging in the same order: the same bits either way.
    """
    group = q.shape[1] // num_kv_heads
    d = q.shape[2]
    fp32 = q.dtype == torch.float32
    if has_mask or max_q_len * group <= DECODE_ROWS:
        block_m = max(DECODE_ROWS, triton.next_power_of_2(group))
        block_q = block_m // group
        block_n, num_warps, num_stages = 32, 4, 3
    else:
        # One query block of ``rows_cap // group`` tokens whatever the longest query: a request of fewer tokens
        # masks the rest of it (its rows are grouped as with a block of its own length, so the same bits). A
        # block of ``max_q_len`` tokens made ``BLOCK_Q`` a constexpr of the batch: a draft catching up 25 or 31
        # positions compiled the kernel again mid-serve (0.67 s each, H100).
        rows_cap = 64 if (fp32 or d > 128) else 128
        block_q = max(1, rows_cap // group)
        block_m = max(16, triton.next_power_of_2(block_q * group))
        block_n, num_warps, num_stages = 64, 8, 2 if fp32 else 3
    bound = max(1, max_kv_len if max_kv_len is not None else 1 << 20)
    if num_splits is not None:
        split_len = -(-bound // max(1, num_splits))
    split_len = -(-max(split_len or MIN_SPLIT_KEYS, block_n) // block_n) * block_n
    n_splits = -(-bound // split_len)
    programs = max(1, -(-max_q_len // block_q) * batch * num_kv_heads)
    if num_splits is not None:  # one program per split
        serial, per_block = num_splits <= 1, n_splits
    else:  # about SPLIT_PROGRAMS programs per SM in all; each runs every per_block'th split of its block
        partials = q.shape[0] * n_splits * q.shape[1] * d * 4
        per_block = min(n_splits, SPLIT_PROGRAMS * _sms(q.device) // programs)
        serial = per_block <= 1 or partials > PARTIAL_BYTES
        if serial and TAIL_PROGRAMS > 1 and n_splits > TAIL_SPLITS and partials <= PARTIAL_BYTES:
            return AttnConfig(block_q=block_q, block_m=block_m, block_n=block_n,
                              num_splits=min(TAIL_PROGRAMS, n_splits), split_len=split_len, num_warps=num_warps,
                              num_stages=num_stages, tail_split=TAIL_SPLITS)
    return AttnConfig(block_q=block_q, block_m=block_m, block_n=block_n, num_splits=1 if serial else per_block,
                      split_len=split_len, num_warps=num_warps, num_stages=num_stages)


def _use_triton(q: torch.Tensor, backend: str) -> bool:
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"backend must be auto, triton or torch, got {backend!r}")
    return triton is not None and (backend == "triton" or (backend == "auto" and q.is_cuda))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    sm_scale: float, window: int = 0, q_positions: torch.Tensor | None = None, *,
                    backend: str = "auto", num_splits: int | None = None, split_len: int | None = None,
                    config: AttnConfig | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """o [T, Hq, D] under the contract of ``paged_attention_ref``; Triton on CUDA, the reference elsewhere.

    ``window`` / ``q_positions``: the sliding window, as in the reference. Keys split every ``split_len``
    positions: the argument, else ``meta.split_len`` (the engine's, from ``choose_split_len``), else one
    chosen from the cache's slot count; a row's output is the same bits in any launch with the same split
    length. ``num_splits`` / ``config`` override the launch choice (tests and benchmarks); ``out`` is an
    optional contiguous [T, Hq, D] destination of q's dtype. Rows of ``q`` that belong to no request are
    left unwritten, as in the reference.
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
    B = meta.batch_size
    # The engine's launches (no override) decide once per batch and shape: every layer reuses it (``plans``)
    engine = config is None and num_splits is None and split_len is None
    key = ("paged", q.shape, q.dtype, q.device, k_cache.shape) if engine else None
    plan = None if key is None else meta.plans.get(key)
    if plan is None:
        max_q = meta.static_max_q_len(q.shape[0])
        max_kv = meta.static_max_kv_len()
        bound = k_cache.shape[0] if max_kv is None else max_kv  # a request's keys are distinct slots
        has_mask = meta.custom_mask is not None
        split_len = split_len or (config.split_len if config else 0) or meta.split_len \
            or choose_split_len(k_cache.shape[0], hkv, q.device)
        cfg = config or choose_config(q, hkv, B, max_q, bound, num_splits, split_len=split_len, has_mask=has_mask)
        plan = (max_q, bound, split_len, cfg)
        if key is not None:
            meta.plans[key] = plan
    max_q, bound, split_len, cfg = plan
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or not out.is_contiguous():
        raise ValueError("out must be a contiguous tensor of q's shape and dtype")
    n_qblocks = -(-max_q // cfg.block_q)
    if n_qblocks == 0:
        return out
    _launch(q, k_cache, v_cache, meta, sm_scale, window, q_positions, cfg, cfg.split_len or split_len, bound,
            n_qblocks, out)
    return out


def _launch(q, k_cache, v_cache, meta, sm_scale, window, q_positions, cfg, split_len, bound, n_qblocks, out):
    T, hq, d = q.shape
    hkv = k_cache.shape[1]
    B = meta.batch_size
    split_len = -(-max(split_len, cfg.block_n) // cfg.block_n) * cfg.block_n
    has_mask = meta.custom_mask is not None
    mask = meta.custom_mask.view(torch.uint8) if has_mask else meta.kv_indices  # any pointer when unused
    mask_indptr = meta.mask_indptr if has_mask else meta.kv_indptr
    sliding = window > 0
    q_pos = q_positions if (sliding and has_mask) else meta.qo_indptr  # any pointer when unused
    serial = cfg.num_splits <= 1
    S = 1 if serial else -(-bound // split_len)  # the partials cover every split of the longest context
    P = 1 if serial else min(cfg.num_splits, S)  # programs per block, each running every P'th split
    if not serial:
        opart = torch.empty((S, T, hq, d), dtype=torch.float32, device=q.device)
        lse = torch.empty((S, T, hq), dtype=torch.float32, device=q.device)
        ranges = torch.empty((T, 2), dtype=torch.int32, device=q.device)
    else:
        opart = lse = ranges = out  # unused
    block_d = max(16, triton.next_power_of_2(d))  # tl.dot needs K, N >= 16
    upcast = q.dtype == torch.bfloat16 and not q.is_cuda  # only the interpreter runs off CUDA
    precision = "ieee" if (q.dtype == torch.float32 or upcast) else "tf32"
    fast(_attn_kernel)[(n_qblocks, B * hkv, P)](
        q, k_cache, v_cache, out, opart, lse, ranges,
        meta.qo_indptr, meta.kv_indptr, meta.kv_indices, meta.prefix_lens, mask, mask_indptr, q_pos,
        sm_scale * LOG2E, hkv, hq, T, window, split_len, max(1, cfg.tail_split),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        out.stride(0), out.stride(1),
        GROUP=hq // hkv, HEAD_DIM=d, BLOCK_D=block_d, BLOCK_Q=cfg.block_q, BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, BLOCK_E=MASK_COLS, SERIAL=serial, HAS_MASK=has_mask, PRECISION=precision,
        UPCAST=upcast, SLIDING=sliding, TAIL=cfg.tail_split > 0 and not serial, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if not serial:
        unroll = S <= UNROLLED_SPLITS
        fast(_combine_kernel)[(T, hq)](opart, lse, out, ranges, T, hq, S, out.stride(0), out.stride(1), HEAD_DIM=d,
                                       BLOCK_D=block_d, SPLITS_P2=triton.next_power_of_2(S) if unroll else 1,
                                       UNROLL=unroll, num_warps=4 if d >= 128 else 2)


def warm_launches(dtype: torch.dtype, num_q_heads: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  split_len: int, window: int = 0) -> int:
    """Compile now every launch of ``paged_attention`` without a custom mask that a step over these caches may
    take (``dtype`` queries, ``num_q_heads`` heads, ``split_len`` keys a split), so serving never compiles one:
    both tile shapes (decode-like; causal, which a request of 17 to 63 queries takes, e.g. a draft catching up a
    backlog: 1.3 s a compile mid-serve, H100 c128), each serial, split and split with a tail, and the combine
    kernel at every unrolled split count and the loop. Each runs on one request reading the caches' first
    slots into scratch (nothing is written to the caches). Returns the launches run (0 without Triton)."""
    if triton is None:
        return 0
    hkv, d = k_cache.shape[1], k_cache.shape[2]
    device, launches = k_cache.device, 0
    for q_len in (1, DECODE_ROWS // max(1, num_q_heads // hkv) + 1):
        q = torch.zeros(q_len, num_q_heads, d, dtype=dtype, device=device)
        qo, kv, idx, pre = pack_int64([[0, q_len], [0, q_len], list(range(q_len)), [0]], device)
        base = choose_config(q, hkv, 1, q_len, q_len, split_len=split_len)
        runs = [(replace(base, num_splits=1, tail_split=0), q_len)]
        counts = [1 << i for i in range(UNROLLED_SPLITS.bit_length())] + [UNROLLED_SPLITS + 1]
        runs += [(replace(base, num_splits=2, tail_split=0), s * base.split_len)
                 for s in (counts if q_len == 1 else counts[:1])]  # the combine kernel is the same for both
        if TAIL_PROGRAMS > 1:
            runs.append((replace(base, num_splits=2, tail_split=TAIL_SPLITS), q_len))
        for cfg, bound in runs:
            meta = AttentionMetadata(qo_indptr=qo, kv_indptr=kv, kv_indices=idx, prefix_lens=pre,
                                     qo_indptr_cpu=[0, q_len], kv_indptr_cpu=[0, q_len], prefix_lens_cpu=[0],
                                     max_q_len=q_len, max_kv_len=bound, split_len=split_len)
            paged_attention(q, k_cache, v_cache, meta, d ** -0.5, window, config=cfg, backend="triton")
            launches += 1
    return launches


MASK_COLS = 32  # mask columns read per step when mapping a query's visible step slots to positions

__all__ = ["AttentionMetadata", "AttnConfig", "choose_config", "choose_split_len", "paged_attention", "warm_launches"]
