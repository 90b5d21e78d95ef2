"""A mixed batch's attention in two launches: its decode-like requests through the decode launch, the rest
through the extend kernel.

A chunked-prefill step holds prefill chunks (hundreds of queries) beside decode rows (one query each). The
extend kernel (``kernels.extend_attention``) runs a batch in query tiles of 128 rows with no key splits: a
decode row then fills one row of such a tile per query head and its program reads every key alone, ~300 us a
layer at 8B shape against ~100 us to read the decode rows' keys at copy bandwidth (issue 30). Split instead:

* ``decode``: the requests whose queries fit one decode tile (``q_len * group <= DECODE_ROWS``, as
  ``choose_config`` decides) run through ``paged_attention`` with the batch's ``split_len``: the launch a
  decode step gives them, so a decode row's output is the same bits in a mixed step as in a decode step;
* ``extend``: the others through ``extend_attention``, their step's K/V read densely.

Both write into one output tensor. ``split_mixed`` reads only the metadata's host copies (a mixed step is
eager, never captured), so it never waits for the device; the model builds it once per forward
(``ForwardBatch.mixed_split``) and every layer reuses it. The engine puts a step's decode rows first, then its
chunks (``ModelRunner._target_step``): both parts are runs of query rows, sliced as views; any other order is
gathered and scattered through index tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

from kernels.attention import DECODE_ROWS, paged_attention
from kernels.attention_ref import AttentionMetadata, pack_int64
from kernels.extend_attention import extend_attention

ALIGN = 16  # bytes: the alignment Triton specialises a pointer argument on


@dataclass(frozen=True)
class Part:
    """Some requests of a batch as a batch of their own."""

    meta: AttentionMetadata  # those requests alone: query rows and key runs counted from 0, host copies set
    rows: slice | torch.Tensor  # their query rows in the batch: one run (a slice), else [n] int64 on the device


@dataclass(frozen=True)
class MixedSplit:
    decode: Part  # requests with 0 < q_len * group <= DECODE_ROWS: the decode launch
    extend: Part  # the rest (empty requests too): the extend kernel


def split_mixed(meta: AttentionMetadata, group: int) -> MixedSplit | None:
    """The batch's decode-like requests and the rest (``group``: query heads per KV head), or None when there
    is nothing to split: a custom mask, no host copies of the metadata (reading the device would wait for
    it), or every request on one side."""
    if meta.custom_mask is not None or None in (meta.qo_indptr_cpu, meta.kv_indptr_cpu, meta.prefix_lens_cpu):
        return None
    qo = meta.qo_indptr_cpu
    short = [0 < (qo[b + 1] - qo[b]) * group <= DECODE_ROWS for b in range(len(qo) - 1)]
    if all(short) or not any(short):
        return None
    return MixedSplit(decode=_part(meta, [b for b, s in enumerate(short) if s]),
                      extend=_part(meta, [b for b, s in enumerate(short) if not s]))


def _part(meta: AttentionMetadata, reqs: list[int]) -> Part:
    """Requests ``reqs`` (ascending) of ``meta``: their index tensors in one host-to-device copy; their rows
    and key slots as slices of the batch's when the requests are neighbours, else gathered."""
    qo, kv, pre = meta.qo_indptr_cpu, meta.kv_indptr_cpu, meta.prefix_lens_cpu
    device = meta.qo_indptr.device
    q_lens = [qo[b + 1] - qo[b] for b in reqs]
    kv_lens = [kv[b + 1] - kv[b] for b in reqs]
    first, end = reqs[0], reqs[-1] + 1
    # Every index tensor the kernels read starts 16 bytes in line: Triton specialises a pointer argument on it,
    # and a slice starting wherever the batch's other requests end compiled the kernels again as the number of
    # decode rows or chunks changed parity (1.4 s a compile, mid-serve, H100).
    if end - first == len(reqs):
        rows: slice | torch.Tensor = slice(qo[first], qo[end])
        kv_indices = meta.kv_indices[kv[first]:kv[end]]
        if kv_indices.data_ptr() % ALIGN:
            kv_indices = kv_indices.clone()
    else:
        rows = _runs(qo, reqs).to(device)
        kv_indices = meta.kv_indices[_runs(kv, reqs).to(device)]
    qo_sub, kv_sub = list(accumulate(q_lens, initial=0)), list(accumulate(kv_lens, initial=0))
    pre_sub = [pre[b] for b in reqs]
    qo_t, kv_t, pre_t = pack_int64([qo_sub, kv_sub, pre_sub], device)
    sub = AttentionMetadata(
        qo_indptr=qo_t, kv_indptr=kv_t, kv_indices=kv_indices, prefix_lens=pre_t,
        qo_indptr_cpu=qo_sub, kv_indptr_cpu=kv_sub, prefix_lens_cpu=pre_sub,
        max_q_len=max(q_lens), max_kv_len=max(kv_lens), split_len=meta.split_len)
    return Part(meta=sub, rows=rows)


def _runs(indptr: list[int], reqs: list[int]) -> torch.Tensor:
    """The positions ``indptr[b]..indptr[b + 1]`` of every request of ``reqs``, in order (on the host)."""
    return torch.cat([torch.arange(indptr[b], indptr[b + 1], dtype=torch.int64) for b in reqs])


def mixed_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, loc: torch.Tensor,
                    split: MixedSplit, sm_scale: float, window: int = 0, q_positions: torch.Tensor | None = None,
                    *, backend: str = "auto", kv_new: tuple[torch.Tensor, torch.Tensor] | None = None,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """o [T, Hq, D] of the batch ``split`` was made from: ``split.decode``'s rows by ``paged_attention`` (the
    metadata's ``split_len``), ``split.extend``'s by ``extend_attention`` fed this step's K/V: ``kv_new`` (k, v
    [T, Hkv, D], row-aligned with ``q``, as stored: the chunks' rows are a view when they are one run), else
    gathered from the cache slots ``loc [T]`` the step wrote. ``window`` / ``q_positions [T]``: the sliding
    window, as in ``paged_attention``; ``backend`` goes to both kernels; ``out``: a contiguous destination of q's
    shape and dtype. Rows of no request are left unwritten."""
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    elif out.shape != q.shape or out.dtype != q.dtype or not out.is_contiguous():
        raise ValueError("out must be a contiguous tensor of q's shape and dtype")
    dec, ext = split.decode, split.extend
    pos = None if q_positions is None else q_positions[dec.rows]
    o = paged_attention(q[dec.rows], k_cache, v_cache, dec.meta, sm_scale, window, pos, backend=backend,
                        out=_dest(out, dec.rows))
    _scatter(out, dec.rows, o)
    if kv_new is not None:
        k_new, v_new = kv_new[0][ext.rows], kv_new[1][ext.rows]
    else:
        slots = loc[ext.rows]
        k_new, v_new = k_cache[slots], v_cache[slots]
    o = extend_attention(q[ext.rows], k_new, v_new, k_cache, v_cache, ext.meta, sm_scale, window,
                         backend=backend, out=_dest(out, ext.rows))
    _scatter(out, ext.rows, o)
    return out


def _dest(out: torch.Tensor, rows: slice | torch.Tensor) -> torch.Tensor | None:
    """Where a part's kernel writes: its rows of ``out`` when they are one run (a contiguous view), else a
    tensor of the kernel's own."""
    return out[rows] if isinstance(rows, slice) else None


def _scatter(out: torch.Tensor, rows: slice | torch.Tensor, o: torch.Tensor) -> None:
    """A part's output into ``out``'s rows (written in place already when they are one run)."""
    if not isinstance(rows, slice):
        out.index_copy_(0, rows, o)


__all__ = ["MixedSplit", "Part", "mixed_attention", "split_mixed"]
