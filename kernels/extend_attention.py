"""Causal extend / chunked-prefill attention in Triton, with this step's K/V read unpaged (TMA on Hopper).

The contract is that of ``kernels.attention_ref.paged_attention_ref`` restricted to causal metadata
(``custom_mask is None``): request ``b`` owns query rows ``q[qo_indptr[b]:qo_indptr[b+1]]`` and key
slots ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]``; the first ``prefix_lens[b]`` slots are the cached
prefix, which every query of ``b`` sees, and the remaining ``q_len`` slots hold this step's tokens,
query ``j`` seeing this-step keys ``0..j``. ``extend_attention`` returns what the reference returns,
but reads the two parts of the keys differently:

* the **prefix** is gathered from the token-major caches ``k_cache/v_cache [num_slots, Hkv, D]``
  through ``kv_indices`` (pointer loads; any page size);
* **this step's** keys come from ``k_new/v_new [T, Hkv, D]``, the same (already rotated) rows that
  were written into the cache, row-aligned with ``q`` (key ``j`` of request ``b`` is row
  ``qo_indptr[b] + j``). These rows are dense, so on sm90+ they (and the query tile) are loaded with
  tensor descriptors (TMA, ``triton.tools.tensor_descriptor.TensorDescriptor`` built on the host)
  over the 2-D view ``[T, H * D]``; elsewhere with plain pointer loads.

How the kernel is laid out (FlashAttention-2 style):

* One program owns ``BLOCK_T = BLOCK_M / PACK`` consecutive query tokens of one request and ``PACK``
  query heads of one KV head (``config.pack``; GQA packing): query row ``r`` of the tile is token
  ``m0 + r % BLOCK_T`` of head ``h + r // BLOCK_T``, so each K/V tile loaded serves ``PACK`` heads.
  With ``PACK == 1`` (the default) the query tile is a single TMA box; packed tiles are gathered with
  pointer loads (once per program). The grid is ``(B * Hq / PACK, query blocks)`` with the head
  fastest, so the query heads that share a KV head run side by side and find its tiles in L2
  (``head_major`` swaps the two: every query block of one head before the next head;
  ``request_major`` adds the request as the grid's slowest axis, ``(Hq / PACK, query blocks, B)``, so
  a batch's programs run request by request and only one request's K/V is streamed through L2 at a
  time, as in a batch of one).
* Causal load balance: program ``(.., j)`` takes the request's ``j``-th query block counted from the
  END, so the blocks with the most keys are dispatched first and the short ones fill the tail.
* Each program walks its keys in five runs, paying for masks only where needed:
    1. full prefix tiles                (gathered, no mask)
    2. the prefix's last partial tile   (gathered, bounds mask)
    3. this-step keys ``[0, d0)``       (TMA, no mask; ``d0`` = the first query ``m0`` rounded down to
                                         the key tile grid; the bulk; optionally warp-specialised)
    4. full diagonal tiles from ``d0``  (TMA, causal mask)
    5. the diagonal's last partial tile (pointer loads, causal + bounds mask)
  Run 5 exists only in a request's last query block when ``q_len`` is not a multiple of
  ``BLOCK_N``; loading it with masks means no key or value row outside the request is ever read
  (rows of ``k_new/v_new`` that belong to no request, e.g. CUDA-graph padding, may hold anything).
* Runs 3 and 4 cover whole key tiles of any power-of-two ``BLOCK_N`` (wider than ``BLOCK_T`` too: the
  diagonal run then starts before ``m0`` and masks what the block does not see). Softmax is online, in float32,
  in the exp2 domain (``sm_scale * log2(e)`` folded into one multiply-add). Every row sees at least
  one key in the first tile it processes, so the running max is finite from the first tile on.
* Sliding window (``window > 0``, Mistral): query ``tok`` (position ``prefix + tok``) sees keys at
  positions ``(prefix + tok - window, prefix + tok]``. Runs 1 and 3 then start at the key tile that
  holds the block's first visible key, every run is masked, and the online softmax skips a tile in
  which a row sees nothing yet (its running max stays -inf instead of turning the row into NaN).
* The output is stored with masked pointer stores (a TMA store of a partial block would write into
  the next request's rows). Query rows that belong to no request are left unwritten.

No host synchronisation: the grid comes from Python ints only (``meta.max_q_len``, else the host
copy ``qo_indptr_cpu``, else q's row count), so a call can be captured in a CUDA graph.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from kernels.attention_ref import AttentionMetadata, paged_attention_ref
from kernels.launch import fast

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a dependency, but keep the reference usable
    triton = None

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - Triton < 3.4: pointer loads only
    TensorDescriptor = None

LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class ExtendConfig:
    """Launch parameters of one call; ``choose_extend_config`` picks them, benchmarks may override them."""

    block_m: int  # query rows per program: block_m / pack tokens of each of pack heads
    block_n: int  # keys per inner iteration; a power of two >= 16 (wider than block_m / pack too)
    num_warps: int
    num_stages: int
    tma: bool  # this step's K/V and the query tile through tensor descriptors (else pointer loads)
    warp_specialize: bool = False  # tl.range(warp_specialize=True) on the main (run 3) loop
    head_major: bool = False  # launch order: every query block of one head before the next head
    request_major: bool = False  # launch order: every program of one request before the next request
    pack: int = 1  # query heads of one KV head per program (GQA packing): block_m = pack * query tokens


# Default launch on sm90 for 16-bit inputs with head_dim <= 128 and a chunk of more than 64 tokens:
# the best of ``python bench/bench_extend.py --tune`` on an H100 (2026-11-23, 8192 tokens, 32/8 heads
# x 128, bf16): 64 x 64 tiles, 4 warps, 3 stages, 526 TFLOP/s; 128 x 128 / 8 warps / 3 stages 486,
# 128 x 128 / 8 warps / 2 stages 426 (docs/benchmarks.md).
# Compiled offline for sm_90a with Triton 3.6 (the H100 image's; bf16, D=128, GQA 4; ``python
# bench/compile_extend.py``): 164 registers, no local memory, 113 KiB of shared memory, so two 4-warp
# programs share an SM (2 x (113 + 1 reserved) KiB = the SM's 228 KiB; one program's softmax overlaps
# the other's MMAs, which within one program take turns with the softmax); the 8-warp 128 x 128 tiles
# take 225 KiB and 254 registers, one program per SM.
# Request by request: the same launch order in a batch of one; at 4 x 4096 tokens it raced at 0.849x SDPA
# against 0.747x for the head-fastest order over the whole batch, in the same final (H100, 2026-11-23,
# ``--tune-shapes``; docs/benchmarks.md).
HOPPER_CONFIG = ExtendConfig(block_m=64, block_n=64, num_warps=4, num_stages=3, tma=True, request_major=True)
# From 16384 query tokens on: 128 x 128 tiles, 8 warps, head-major order. ``--tune-shapes`` on an H100
# (docs/bench/extend_shapes_h100.json, one run, the kernel before GQA packing): 513 TFLOP/s at 16384
# tokens against 479 for HOPPER_CONFIG in the same run (SDPA 597: 0.86x against 0.80x); at 8192 and at
# 4 x 4096 it is slower than HOPPER_CONFIG (447 vs 451, 413 vs 436), hence the threshold.
LONG_CONFIG = ExtendConfig(block_m=128, block_n=128, num_warps=8, num_stages=3, tma=True, head_major=True)
# Without tensor descriptors (pre-Hopper GPUs): 64 KiB of shared memory (sm80: 255 registers, a small spill).
POINTER_CONFIG = ExtendConfig(block_m=128, block_n=64, num_warps=8, num_stages=2, tma=False)


if triton is not None:
    @triton.jit
    def _load_rows(ptr, rows, stride_row, col, offs_d, row_ok, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                   CHECK_ROWS: tl.constexpr, UPCAST: tl.constexpr):
        """x[rows, col:col + HEAD_DIM] as a [len(rows), BLOCK_D] tile; masked rows / padded columns read 0."""
        ptrs = ptr + rows[:, None] * stride_row + col + offs_d[None, :]
        if CHECK_ROWS:
            x = tl.load(ptrs, mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
        elif BLOCK_D != HEAD_DIM:
            x = tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
        else:
            x = tl.load(ptrs)
        if UPCAST:  # the CPU interpreter's tl.dot mishandles bfloat16 operands: compute them in float32
            x = x.to(tl.float32)
        return x

    @triton.jit
    def _load_new(desc, ptr, row0, offs_n, stride_row, head, stride_head, offs_d, HEAD_DIM: tl.constexpr,
                  BLOCK_D: tl.constexpr, USE_TMA: tl.constexpr, UPCAST: tl.constexpr):
        """A full tile of this step's rows ``row0 + offs_n`` (all inside the request) of one head of k_new / v_new."""
        if USE_TMA:  # the descriptor views the tensor as [T, H * HEAD_DIM]
            x = desc.load([row0.to(tl.int32), head * HEAD_DIM])
            if UPCAST:
                x = x.to(tl.float32)
        else:
            x = _load_rows(ptr, row0 + offs_n, stride_row, head * stride_head, offs_d, offs_n, HEAD_DIM, BLOCK_D,
                           False, UPCAST)
        return x

    @triton.jit
    def _softmax_step(acc, m_i, l_i, s, v, visible, qk_scale, MASKED: tl.constexpr, PRECISION: tl.constexpr,
                      SAFE: tl.constexpr = False):
        """Fold one tile of raw scores ``s = q k^T`` [BLOCK_M, BLOCK_N] and its values into the online softmax.

        ``SAFE``: a row may see no key of this tile before it has seen any (sliding window): its max
        stays -inf and it adds nothing, instead of exp2(-inf - -inf) = NaN.
        """
        if MASKED:
            s = tl.where(visible, s * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            if SAFE:
                m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
            else:
                m_ref = m_new
            p = tl.exp2(s - m_ref[:, None])
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
            m_ref = m_new
            p = tl.exp2(s * qk_scale - m_new[:, None])
        alpha = tl.exp2(m_i - m_ref)  # m_i = -inf on the first tile: alpha = 0
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PRECISION)
        return acc, m_new, l_i

    @triton.jit
    def _extend_kernel(Q, QD, Kn, KnD, Vn, VnD, Kc, Vc, O,
                       qo_indptr, kv_indptr, kv_indices, prefix_lens,
                       qk_scale, num_q_heads, window,
                       stride_qt, stride_qh, stride_knt, stride_knh, stride_vnt, stride_vnh,
                       stride_kct, stride_kch, stride_vct, stride_vch, stride_ot, stride_oh,
                       GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, USE_TMA: tl.constexpr,
                       WARP_SPEC: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                       HEAD_MAJOR: tl.constexpr, PACK: tl.constexpr, REQUEST_MAJOR: tl.constexpr,
                       SLIDING: tl.constexpr):
        # PACK query heads (of one KV head) per program: row r is token m0 + r % BLOCK_T of head h + r // BLOCK_T.
        BLOCK_T: tl.constexpr = BLOCK_M // PACK
        if HEAD_MAJOR:  # grid (query blocks, B * Hq / PACK): one head's blocks run together, sharing its K/V in L2
            bh = tl.program_id(1)
            j = tl.program_id(0)
        else:  # grid (B * Hq / PACK, query blocks): the longest block of every head first
            bh = tl.program_id(0)
            j = tl.program_id(1)
        if REQUEST_MAJOR:  # a third grid axis for the request: bh is the head group alone
            b = tl.program_id(2)
            h = bh * PACK
        else:
            b = bh // (num_q_heads // PACK)
            h = (bh % (num_q_heads // PACK)) * PACK
        kvh = h // GROUP
        q_start = tl.load(qo_indptr + b)
        q_len = tl.load(qo_indptr + b + 1) - q_start
        n_blocks = tl.cdiv(q_len, BLOCK_T)
        if j >= n_blocks:  # this request has fewer query blocks than the static grid
            return
        m0 = (n_blocks - 1 - j) * BLOCK_T  # longest blocks first
        kv_start = tl.load(kv_indptr + b)
        prefix = tl.load(prefix_lens + b)

        offs_m = tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        if PACK == 1:  # one head: the verified single-head code, no per-row head arithmetic
            tok = m0 + offs_m  # query index inside the request
        else:
            tok = m0 + offs_m % BLOCK_T  # query index inside the request
            row_head = h + offs_m // BLOCK_T
        row_ok = tok < q_len
        if USE_TMA and PACK == 1:
            # Rows past the request are other requests' tokens (or TMA's zero fill past T): they only
            # produce output rows that are never stored, since rows never mix.
            q = QD.load([(q_start + m0).to(tl.int32), h * HEAD_DIM])
            if UPCAST:
                q = q.to(tl.float32)
        elif PACK == 1:
            q = _load_rows(Q, q_start + tok, stride_qt, h * stride_qh, offs_d, row_ok, HEAD_DIM, BLOCK_D, True, UPCAST)
        else:  # PACK heads: one gather of the query tile per program
            q_ptrs = Q + (q_start + tok)[:, None] * stride_qt + row_head[:, None] * stride_qh + offs_d[None, :]
            q = tl.load(q_ptrs, mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
            if UPCAST:
                q = q.to(tl.float32)

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

        # Keys are counted from the prefix's start (key i at position i); query tok is at prefix + tok.
        # With a window, key i is visible to query tok iff i > prefix + tok - window.
        lowest = prefix + m0 - window  # keys <= lowest are hidden from every row of the block
        # 1. Full prefix tiles, gathered through kv_indices: every query sees every prefix key.
        prefix_full = (prefix // BLOCK_N) * BLOCK_N
        prefix_lo = 0
        if SLIDING:
            prefix_lo = tl.minimum(tl.maximum(lowest + 1, 0) // BLOCK_N * BLOCK_N, prefix_full)
        for start in range(prefix_lo, prefix_full, BLOCK_N):
            slot = tl.load(kv_indices + kv_start + start + offs_n)
            k = _load_rows(Kc, slot, stride_kct, kvh * stride_kch, offs_d, offs_n, HEAD_DIM, BLOCK_D, False, UPCAST)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
            v = _load_rows(Vc, slot, stride_vct, kvh * stride_vch, offs_d, offs_n, HEAD_DIM, BLOCK_D, False, UPCAST)
            if SLIDING:
                visible = (start + offs_n)[None, :] > (prefix + tok - window)[:, None]
                acc, m_i, l_i = _softmax_step(acc, m_i, l_i, s, v, visible, qk_scale, True, PRECISION, True)
            else:
                acc, m_i, l_i = _softmax_step(acc, m_i, l_i, s, v, None, qk_scale, False, PRECISION)
        # 2. The prefix's partial last tile; keys past the prefix read nothing (K and V masked to 0).
        if prefix_full < prefix:
            n_ok = prefix_full + offs_n < prefix
            slot = tl.load(kv_indices + kv_start + prefix_full + offs_n, mask=n_ok, other=0)
            k = _load_rows(Kc, slot, stride_kct, kvh * stride_kch, offs_d, n_ok, HEAD_DIM, BLOCK_D, True, UPCAST)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
            v = _load_rows(Vc, slot, stride_vct, kvh * stride_vch, offs_d, n_ok, HEAD_DIM, BLOCK_D, True, UPCAST)
            visible = n_ok[None, :]
            if SLIDING:
                visible = visible & ((prefix_full + offs_n)[None, :] > (prefix + tok - window)[:, None])
            acc, m_i, l_i = _softmax_step(acc, m_i, l_i, s, v, visible, qk_scale, True, PRECISION, SLIDING)

        # 3. This step's keys before the tile that holds the block's first query: seen by every row, no mask
        # (with a window: from the tile of the block's first visible key on, masked).
        diag_start = (m0 // BLOCK_N) * BLOCK_N
        new_lo = 0
        if SLIDING:
            new_lo = tl.minimum(tl.maximum(lowest + 1 - prefix, 0) // BLOCK_N * BLOCK_N, diag_start)
        for start in tl.range(new_lo, diag_start, BLOCK_N, warp_specialize=WARP_SPEC):
            k = _load_new(KnD, Kn, q_start + start, offs_n, stride_knt, kvh, stride_knh, offs_d, HEAD_DIM, BLOCK_D,
                          USE_TMA, UPCAST)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
            v = _load_new(VnD, Vn, q_start + start, offs_n, stride_vnt, kvh, stride_vnh, offs_d, HEAD_DIM, BLOCK_D,
                          USE_TMA, UPCAST)
            if SLIDING:
                visible = (start + offs_n)[None, :] > (tok - window)[:, None]
                acc, m_i, l_i = _softmax_step(acc, m_i, l_i, s, v, visible, qk_scale, True, PRECISION, True)
            else:
                acc, m_i, l_i = _softmax_step(acc, m_i, l_i, s, v, None, qk_scale, False, PRECISION)

        # 4. Full tiles of the diagonal: key j visible to query tok iff j <= tok.
        q_end = tl.minimum(m0 + BLOCK_T, q_len)
        diag_full = diag_start + ((q_end - diag_start) // BLOCK_N) * BLOCK_N
        for start in range(diag_start, diag_full, BLOCK_N):
            k = _load_new(KnD, Kn, q_start + start, offs_n, stride_knt, kvh, stride_knh, offs_d, HEAD_DIM, BLOCK_D,
                          USE_TMA, UPCAST)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
            v = _load_new(VnD, Vn, q_start + start, offs_n, stride_vnt, kvh, stride_vnh, offs_d, HEAD_DIM, BLOCK_D,
                          USE_TMA, UPCAST)
            visible = (start + offs_n)[None, :] <= tok[:, None]
            if SLIDING:
                visible = visible & ((start + offs_n)[None, :] > (tok - window)[:, None])
            acc, m_i, l_i = _softmax_step(acc, m_i, l_i, s, v, visible, qk_scale, True, PRECISION, SLIDING)
        # 5. The diagonal's partial last tile (the request ends inside it): masked pointer loads.
        if diag_full < q_end:
            key = diag_full + offs_n
            n_ok = key < q_len
            k = _load_rows(Kn, q_start + key, stride_knt, kvh * stride_knh, offs_d, n_ok, HEAD_DIM, BLOCK_D, True,
                           UPCAST)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
            v = _load_rows(Vn, q_start + key, stride_vnt, kvh * stride_vnh, offs_d, n_ok, HEAD_DIM, BLOCK_D, True,
                           UPCAST)
            visible = (key[None, :] <= tok[:, None]) & n_ok[None, :]
            if SLIDING:
                visible = visible & (key[None, :] > (tok - window)[:, None])
            acc, m_i, l_i = _softmax_step(acc, m_i, l_i, s, v, visible, qk_scale, True, PRECISION, SLIDING)

        if SLIDING:  # rows past the request may have seen nothing (never stored): no 0 / 0
            l_i = tl.where(l_i == 0.0, 1.0, l_i)
        out = acc / l_i[:, None]  # l_i >= 1 on every row: its running max came from a visible key (itself)
        if PACK == 1:
            o_ptrs = O + (q_start + tok)[:, None] * stride_ot + h * stride_oh + offs_d[None, :]
        else:
            o_ptrs = O + (q_start + tok)[:, None] * stride_ot + row_head[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM))


@functools.lru_cache(maxsize=8)
def _capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def _rows_view_ok(x: torch.Tensor) -> bool:
    """Can ``x [T, H, D]`` be described as the 2-D TMA tensor ``[T, H * D]`` (strides ``[x.stride(0), 1]``)?"""
    d = x.shape[2]
    return (x.shape[0] > 0 and x.stride(2) == 1 and (x.shape[1] == 1 or x.stride(1) == d)
            and x.data_ptr() % 16 == 0 and (x.stride(0) * x.element_size()) % 16 == 0)


def tma_supported(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor) -> bool:
    """Tensor descriptors for q / k_new / v_new: sm90+ (or the interpreter), a power-of-two head dim of
    at least 16 bytes, 16-byte aligned bases and row strides, heads packed next to each other."""
    if TensorDescriptor is None:
        return False
    if q.is_cuda and _capability(q.device.index if q.device.index is not None else torch.cuda.current_device())[0] < 9:
        return False
    d = q.shape[2]
    if d & (d - 1) or d * q.element_size() < 16:
        return False
    return all(_rows_view_ok(x) for x in (q, k_new, v_new))


# Launches measured per device: ``python bench/bench_extend.py --tune-shapes --write-table PATH`` writes
# the fastest candidate of every benchmark shape under the device's name; ``EYRIE_EXTEND_CONFIGS``
# points at another file. A device or shape key the table lacks falls back to the rules below.
TUNED_TABLE = Path(__file__).with_name("extend_configs.json")


def table_key(dtype: torch.dtype, head_dim: int, group: int) -> str:
    """The table's shape key: dtype, head dim and GQA group (``bf16_d128_g4`` for Llama-3-8B)."""
    name = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}.get(dtype, str(dtype))
    return f"{name}_d{head_dim}_g{group}"


@functools.lru_cache(maxsize=4)
def _load_table(path: str) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise ValueError(f"extend-attention config table {path} is unreadable: {e}") from e


def tuned_entries(device_name: str, key: str, path: str | None = None) -> list[tuple[int, int, ExtendConfig]]:
    """``(min_max_q_len, min_tokens, config)`` rows of the table for this device and shape key, in file order."""
    return list(_tuned_rows(device_name, key, path or os.environ.get("EYRIE_EXTEND_CONFIGS") or str(TUNED_TABLE)))


@functools.lru_cache(maxsize=32)
def _tuned_rows(device_name: str, key: str, path: str) -> tuple[tuple[int, int, ExtendConfig], ...]:
    """``tuned_entries``' rows, parsed once per table, device and key (each extend launch reads them)."""
    table = _load_table(path)
    rows = table.get("devices", {}).get(device_name, {}).get(key, [])
    out = []
    for row in rows:
        try:
            out.append((int(row["min_max_q_len"]), int(row["min_tokens"]), ExtendConfig(**row["config"])))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"extend-attention config table: bad row {row!r} for {device_name} / {key}: {e}") from e
    return tuple(out)


def pick_tuned(entries: list[tuple[int, int, ExtendConfig]], max_q_len: int, tokens: int, group: int,
               tma: bool) -> ExtendConfig | None:
    """The last row whose thresholds this call meets (rows ascend), among those it can launch: the same
    load path (descriptors or pointers) and a packing that divides the group."""
    best = None
    for min_q, min_t, cfg in entries:
        if max_q_len >= min_q and tokens >= min_t and cfg.tma == tma and group % cfg.pack == 0:
            best = cfg
    return best


def choose_extend_config(q: torch.Tensor, max_q_len: int, tma: bool, group: int = 1) -> ExtendConfig:
    """The launch for ``q`` (``[T, Hq, D]``): on CUDA, ``choose_cuda_config`` for this device; off CUDA
    (the interpreter) small tiles, for fast tests."""
    if not q.is_cuda:
        bm = 32 if max_q_len > 16 else 16
        return ExtendConfig(block_m=bm, block_n=16, num_warps=4, num_stages=1, tma=tma)
    name = _device_name(q.device.index if q.device.index is not None else torch.cuda.current_device())
    return choose_cuda_config(name, q.dtype, q.shape[2], max_q_len, q.shape[0], tma, group)


def choose_cuda_config(device_name: str, dtype: torch.dtype, head_dim: int, max_q_len: int, tokens: int, tma: bool,
                       group: int = 1, table: str | None = None) -> ExtendConfig:
    """Tile sizes from host ints only (no autotuning at serving time). For a chunk of more than 64 tokens,
    the tuned table's row for this device, shape key and size when it has one; otherwise
    ``HOPPER_CONFIG`` (``POINTER_CONFIG`` without descriptors) for 16-bit inputs with head_dim <= 128
    and long chunks, ``LONG_CONFIG`` from 16384 query tokens on, smaller tiles for short chunks,
    float32 and big heads."""
    if max_q_len > 64:
        entries = tuned_entries(device_name, table_key(dtype, head_dim, group), table)
        tuned = pick_tuned(entries, max_q_len, tokens, group, tma)
        if tuned is not None:
            return tuned
    if dtype == torch.float32:
        return ExtendConfig(block_m=64, block_n=32, num_warps=4, num_stages=2, tma=tma)
    if head_dim > 128:
        return ExtendConfig(block_m=64, block_n=64, num_warps=4, num_stages=2, tma=tma)
    if max_q_len <= 64:
        return ExtendConfig(block_m=64, block_n=64, num_warps=4, num_stages=3 if tma else 2, tma=tma)
    if tma and max_q_len >= 16384:
        return LONG_CONFIG
    return HOPPER_CONFIG if tma else POINTER_CONFIG


@functools.lru_cache(maxsize=8)
def _device_name(device_index: int) -> str:
    return torch.cuda.get_device_name(device_index)


def _use_triton(q: torch.Tensor, backend: str) -> bool:
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"backend must be auto, triton or torch, got {backend!r}")
    return triton is not None and (backend == "triton" or (backend == "auto" and q.is_cuda))


def _rows_descriptor(x: torch.Tensor, block_rows: int) -> TensorDescriptor:
    t, heads, d = x.shape
    return TensorDescriptor(x, [t, heads * d], [x.stride(0), 1], [block_rows, d])


def extend_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, meta: AttentionMetadata, sm_scale: float, window: int = 0, *,
                     backend: str = "auto", out: torch.Tensor | None = None,
                     config: ExtendConfig | None = None) -> torch.Tensor:
    """o [T, Hq, D] equal to ``paged_attention_ref(q, k_cache, v_cache, meta, sm_scale, window)`` for causal
    metadata (``window > 0``: the sliding window, query ``j`` of a request at position ``prefix + j``).

    ``k_new / v_new [T, Hkv, D]`` are this step's keys and values (already rotated), row-aligned with
    ``q`` and equal to what the cache holds at this step's slots; the prefix comes from the caches.
    ``backend``: "auto" runs Triton on CUDA tensors and the torch reference otherwise, "triton" forces
    the kernel (the CPU interpreter in tests), "torch" the reference. ``config`` overrides the launch
    choice (tests, benchmarks); ``out`` is an optional contiguous [T, Hq, D] destination of q's dtype.
    Rows of ``q`` that belong to no request are left unwritten.
    """
    if meta.custom_mask is not None:
        raise ValueError("extend_attention is causal only (custom_mask must be None); use paged_attention")
    T, hq, d = q.shape
    hkv = k_cache.shape[1]
    if k_new.shape != (T, hkv, d) or v_new.shape != (T, hkv, d):
        raise ValueError(f"k_new / v_new must be [{T}, {hkv}, {d}], got {tuple(k_new.shape)} / {tuple(v_new.shape)}")
    if hq % hkv:
        raise ValueError(f"{hq} query heads are not a multiple of {hkv} kv heads")
    if window < 0:
        raise ValueError(f"window must be >= 0, got {window}")
    if not _use_triton(q, backend) or T == 0 or meta.batch_size == 0:
        ref = paged_attention_ref(q, k_cache, v_cache, meta, sm_scale, window)
        return ref if out is None else out.copy_(ref)
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or not out.is_contiguous():
        raise ValueError("out must be a contiguous tensor of q's shape and dtype")
    q, k_new, v_new = (x if x.stride(2) == 1 else x.contiguous() for x in (q, k_new, v_new))
    if k_cache.stride(2) != 1 or v_cache.stride(2) != 1:
        raise ValueError("the caches need a contiguous head dimension")
    if k_new.dtype != q.dtype or v_new.dtype != q.dtype or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError("q, k_new, v_new and the caches must share one dtype")
    # The engine's launches (no override) decide once per batch, shape and layout: every layer reuses it (``plans``)
    key = None if config is not None else (
        "extend", q.shape, q.dtype, q.device, hkv, q.stride(), k_new.stride(), v_new.stride(),
        q.data_ptr() % 16, k_new.data_ptr() % 16, v_new.data_ptr() % 16)
    plan = None if key is None else meta.plans.get(key)
    if plan is None:
        max_q = meta.static_max_q_len(q.shape[0])
        can_tma = tma_supported(q, k_new, v_new)
        plan = (max_q, can_tma, config or choose_extend_config(q, max_q, can_tma, hq // hkv))
        if key is not None:
            meta.plans[key] = plan
    max_q, can_tma, cfg = plan
    if cfg.tma and not can_tma:
        raise ValueError("config asks for tensor descriptors, but these tensors / this device cannot use them")
    if cfg.block_n < 16 or cfg.block_n & (cfg.block_n - 1):
        raise ValueError(f"block_n ({cfg.block_n}) must be a power of two >= 16")
    if (hq // hkv) % cfg.pack or cfg.block_m % cfg.pack or (cfg.block_m // cfg.pack) & (cfg.block_m // cfg.pack - 1):
        raise ValueError(f"pack ({cfg.pack}) must divide the GQA group ({hq // hkv}) and block_m ({cfg.block_m}) "
                         "into a power of two")
    n_qblocks = -(-max_q // (cfg.block_m // cfg.pack))
    if n_qblocks == 0:
        return out
    block_d = max(16, triton.next_power_of_2(d))  # tl.dot needs K, N >= 16
    if cfg.tma:
        qd, knd, vnd = (_rows_descriptor(q, cfg.block_m), _rows_descriptor(k_new, cfg.block_n),
                        _rows_descriptor(v_new, cfg.block_n))
    else:
        qd, knd, vnd = q, k_new, v_new  # unused: the pointer path reads the tensors themselves
    upcast = q.dtype == torch.bfloat16 and not q.is_cuda  # only the interpreter runs off CUDA
    precision = "ieee" if (q.dtype == torch.float32 or upcast) else "tf32"
    n_heads = (1 if cfg.request_major else meta.batch_size) * hq // cfg.pack
    grid = (n_qblocks, n_heads) if cfg.head_major else (n_heads, n_qblocks)
    grid = (*grid, meta.batch_size if cfg.request_major else 1)
    fast(_extend_kernel)[grid](
        q, qd, k_new, knd, v_new, vnd, k_cache, v_cache, out,
        meta.qo_indptr, meta.kv_indptr, meta.kv_indices, meta.prefix_lens,
        sm_scale * LOG2E, hq, window,
        q.stride(0), q.stride(1), k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1), out.stride(0), out.stride(1),
        GROUP=hq // hkv, HEAD_DIM=d, BLOCK_D=block_d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, USE_TMA=cfg.tma,
        WARP_SPEC=cfg.warp_specialize, PRECISION=precision, UPCAST=upcast, HEAD_MAJOR=cfg.head_major, PACK=cfg.pack,
        REQUEST_MAJOR=cfg.request_major, SLIDING=window > 0,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


__all__ = ["ExtendConfig", "HOPPER_CONFIG", "LONG_CONFIG", "POINTER_CONFIG", "TUNED_TABLE", "choose_cuda_config",
           "choose_extend_config", "extend_attention", "pick_tuned", "table_key", "tuned_entries",
           "tma_supported"]
