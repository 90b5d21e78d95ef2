"""The forward batch: what one model forward reads, built for the cache of the runner that runs it.

Every forward in Eyrie (prefill chunk, decode, tree verify, draft step, draft extend) has the same
shape: request ``b`` has ``q_len[b]`` query tokens written at positions ``write_pos`` of its row in
the request-to-token map, and its keys are the row's slots ``[0, kv_len[b])``: the committed prefix
``[0, prefix_len[b])`` that every query sees, then this step's slots, causal or under a mask.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from kernels.attention_ref import AttentionMetadata, pack_int64
from shared.memory.kv_cache import KVCache

if TYPE_CHECKING:
    from kernels.mixed_attention import MixedSplit


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, RoPE positions
    out_cache_loc: torch.Tensor  # [T] int64, slot each token's K/V is written to
    attn: AttentionMetadata
    logits_rows: torch.Tensor | None = None  # [R] int64 rows of T that need logits; None = all
    cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None  # RoPE of `positions`, memoised per forward
    # split_mixed(attn, group) per GQA group, memoised per forward: every layer of a mixed step shares one split
    mixed_splits: dict[int, MixedSplit | None] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    def mixed_split(self, group: int) -> MixedSplit | None:
        """The batch's decode-like requests and its long ones as two batches (``kernels.mixed_attention``), made
        on the first layer's call from the metadata's host copies and reused by the others."""
        if group not in self.mixed_splits:
            from kernels.mixed_attention import split_mixed

            self.mixed_splits[group] = split_mixed(self.attn, group)
        return self.mixed_splits[group]


def build_forward_batch(
    cache: KVCache,
    rows: list[int],
    prefix_lens: list[int],
    q_lens: list[int],
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    write_pos: torch.Tensor,
    extra_lens: list[int] | None = None,
    custom_mask: torch.Tensor | None = None,
    logits_rows: torch.Tensor | None = None,
) -> ForwardBatch:
    """Assemble a forward batch over ``cache``.

    ``write_pos [T]``: row position each query token's K/V goes to (must be reserved).
    ``extra_lens``: slots after the prefix that the step attends to (default ``q_lens``, causal).
    ``custom_mask``: concatenated ``[q_len, extra]`` bool blocks (tree verify / tree draft).
    """
    device = cache.layout.device
    extra = q_lens if extra_lens is None else extra_lens
    kv_lens = [p + e for p, e in zip(prefix_lens, extra)]
    qo, kv = _indptr(q_lens), _indptr(kv_lens)
    # Every host int the batch reads goes in one pinned buffer and one copy that does not wait for the device,
    # and the slots are gathered from the device table by host-built (row, position) pairs: a tensor per field
    # from pageable memory (ten copies, each waiting for the work queued before it) and a boolean mask (a
    # read back) made the host wait for the device's queue to drain once per field.
    rows_np, kv_np = np.asarray(rows, dtype=np.int64), np.asarray(kv_lens, dtype=np.int64)
    kv_rows = np.repeat(rows_np, kv_np)
    kv_pos = np.arange(kv[-1], dtype=np.int64) - np.repeat(np.asarray(kv[:-1], dtype=np.int64), kv_np)
    tok_req = np.repeat(rows_np, np.asarray(q_lens, dtype=np.int64))
    fields = {"kv_rows": kv_rows, "kv_pos": kv_pos, "tok_req": tok_req, "qo": qo, "kv": kv, "prefix": prefix_lens}
    given = {"ids": input_ids, "positions": positions, "write_pos": write_pos, "logits_rows": logits_rows}
    fields.update((k, t.reshape(-1).numpy()) for k, t in given.items()
                  if t is not None and t.device.type == "cpu" and t.dtype == torch.int64)
    on_device = dict(zip(fields, pack_int64(list(fields.values()), device)))
    on_device.update((k, t.to(device)) for k, t in given.items() if t is not None and k not in on_device)
    table = cache.req_to_token.table
    meta = AttentionMetadata(
        qo_indptr=on_device["qo"], kv_indptr=on_device["kv"],
        kv_indices=table[on_device["kv_rows"], on_device["kv_pos"]],
        prefix_lens=on_device["prefix"],
        qo_indptr_cpu=qo, kv_indptr_cpu=kv, prefix_lens_cpu=list(prefix_lens),
        max_q_len=max(q_lens, default=0), max_kv_len=max(kv_lens, default=0), split_len=attention_split_len(cache),
    )
    if custom_mask is not None:
        mi = _indptr([q * e for q, e in zip(q_lens, extra)])
        meta.custom_mask = custom_mask.to(device)
        meta.mask_indptr = torch.tensor(mi, dtype=torch.int64, device=device)
        meta.mask_indptr_cpu = mi
    return ForwardBatch(
        input_ids=on_device["ids"],
        positions=on_device["positions"],
        out_cache_loc=table[on_device["tok_req"], on_device["write_pos"]],
        attn=meta,
        logits_rows=on_device.get("logits_rows"),
    )


def attention_split_len(cache: KVCache) -> int | None:
    """The attention's keys per split for every forward over ``cache``: one length for the cache's life (its
    engine's context, headroom excluded), so a query's keys sum in one order in a decode step and in a verify
    step, and in an engine with a draft as in the same engine without."""
    layout = cache.layout
    if layout.device.type != "cuda":
        return None  # the torch reference: no splits
    from kernels.attention import choose_split_len

    return choose_split_len(layout.context or layout.max_context, layout.num_kv_heads, layout.device)


def _indptr(lens: list[int]) -> list[int]:
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return out


def build_uniform_batch(
    cache: KVCache,
    rows: torch.Tensor,
    prefix_lens: torch.Tensor,
    q_len: int,
    extra: int,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    write_pos: torch.Tensor,
    custom_mask: torch.Tensor | None = None,
    logits_rows: torch.Tensor | None = None,
    kv_buffer: torch.Tensor | None = None,
) -> ForwardBatch:
    """A batch where every request has ``q_len`` queries and ``extra`` slots after its prefix.

    Every decode-side phase has this shape (decode 1/1, verify N/N, draft step k/(base+k), padded
    draft extend (steps+1)/(steps+1)). Built from device tensors only, with no host read, so it
    can run inside a CUDA graph; ``kv_buffer`` is the static home of kv_indices when captured.
    ``custom_mask``: [B, q_len, extra] bool, or None for causal.
    """
    from kernels.kv_indices import gather_kv_indices

    B = rows.numel()
    device = rows.device
    table = cache.req_to_token.table
    kv_lens = prefix_lens + extra
    kv_indptr = torch.zeros(B + 1, dtype=torch.int64, device=device)
    kv_indptr[1:] = kv_lens.cumsum(0)
    meta = AttentionMetadata(
        qo_indptr=torch.arange(B + 1, device=device) * q_len,
        kv_indptr=kv_indptr,
        kv_indices=gather_kv_indices(table, rows, kv_lens, kv_indptr, kv_buffer),
        prefix_lens=prefix_lens,
        max_q_len=q_len, max_kv_len=table.shape[1],  # static bounds for the kernel grid (no host read)
        split_len=attention_split_len(cache),
    )
    if custom_mask is not None:
        meta.custom_mask = custom_mask.reshape(-1)
        meta.mask_indptr = torch.arange(B + 1, device=device) * (q_len * extra)
    tok_rows = rows.repeat_interleave(q_len)
    return ForwardBatch(
        input_ids=input_ids, positions=positions, out_cache_loc=table[tok_rows, write_pos.reshape(-1)],
        attn=meta, logits_rows=logits_rows,
    )
