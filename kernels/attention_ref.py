"""Paged attention: the contract and its plain-torch reference.

One contract covers every attention Eyrie runs (extend / chunked prefill, decode, tree verify,
tree draft). Each request ``b`` of a batch owns

* query rows ``q[qo_indptr[b]:qo_indptr[b+1]]``                      (``q_len``)
* key/value slots ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]``        (``kv_len``)
  into the token-major caches ``k_cache/v_cache [num_slots, Hkv, D]``.

The first ``prefix_lens[b]`` key slots are the committed prefix: every query of ``b`` sees them.
The remaining ``extra = kv_len - prefix_lens[b]`` slots are the tokens of this step:

* ``custom_mask is None``: causal, ``extra == q_len`` and query ``j`` sees extra slots ``0..j``
  (extend, chunked prefill and decode);
* otherwise a row-major ``[q_len, extra]`` bool block per request, the blocks concatenated in
  request order starting at ``mask_indptr[b]`` (tree verify: ancestors and self; tree draft).

Queries use ``Hq = G * Hkv`` heads (GQA); query head ``h`` reads kv head ``h // G``.

Sliding window (``window > 0``, Mistral): key slot ``i`` of a request sits at position ``i`` (the
request-to-token row is indexed by position), and a query at position ``p`` sees only keys with
``i > p - window``, i.e. positions ``(p - window, p]``. A causal query ``j`` is at ``p = prefix + j``;
under a custom mask the query positions are given (``q_positions [T]``, the RoPE positions: a tree
node at depth ``d`` is at ``prefix + d``), the window bounds the prefix keys, and this step's keys
stay as the mask says (they are the node's tree ancestors, fewer than ``window`` positions back
whenever the tree is shallower than the window, which the engine checks).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


def _host_bound(bound: int | None, indptr: list[int] | None) -> int | None:
    if bound is not None:
        return bound
    if indptr is not None:
        return max((indptr[i + 1] - indptr[i] for i in range(len(indptr) - 1)), default=0)
    return None


@dataclass
class AttentionMetadata:
    qo_indptr: torch.Tensor  # [B+1] int64, query row offsets
    kv_indptr: torch.Tensor  # [B+1] int64, offsets into kv_indices
    kv_indices: torch.Tensor  # [total_kv] int64, cache slots, prefix first then this step's
    prefix_lens: torch.Tensor  # [B] int64, kv entries every query of the request sees
    custom_mask: torch.Tensor | None = None  # [sum q_len*extra] bool, None = causal
    mask_indptr: torch.Tensor | None = None  # [B+1] int64 offsets into custom_mask
    # Host copies used by the torch reference to avoid a device sync per request.
    qo_indptr_cpu: list[int] | None = None
    kv_indptr_cpu: list[int] | None = None
    prefix_lens_cpu: list[int] | None = None
    mask_indptr_cpu: list[int] | None = None
    # Static host bounds (Python ints, no device read) that size the Triton kernel's grid: any
    # request's query count is <= max_q_len and key count <= max_kv_len. None: derived from the host
    # copies above, else from the tensor shapes (q's row count), which is correct but launches more.
    max_q_len: int | None = None
    max_kv_len: int | None = None
    # Keys per attention split (kernels.attention.choose_split_len), fixed for the cache's life: the kernel
    # cuts splits at multiples of it, so a query's sum runs in one order whatever the step. None: the kernel's.
    split_len: int | None = None
    # Launch decisions made for this batch (tile shapes, split counts), reused by every layer's call with the same
    # shapes: one forward launches each attention 32 times over one metadata. Not copied by ``replace``.
    plans: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def batch_size(self) -> int:
        return self.qo_indptr.numel() - 1

    def static_max_q_len(self, num_rows: int) -> int:
        """An upper bound on any request's query count known on the host without reading the device:
        ``max_q_len``, else from the host copy of ``qo_indptr``, else the query row count."""
        bound = _host_bound(self.max_q_len, self.qo_indptr_cpu)
        return num_rows if bound is None else bound

    def static_max_kv_len(self) -> int | None:
        """The same for key counts (``max_kv_len``, else the host ``kv_indptr``), None when unknown."""
        return _host_bound(self.max_kv_len, self.kv_indptr_cpu)

    def host(self) -> tuple[list[int], list[int], list[int], list[int] | None]:
        qo = self.qo_indptr_cpu if self.qo_indptr_cpu is not None else self.qo_indptr.tolist()
        kv = self.kv_indptr_cpu if self.kv_indptr_cpu is not None else self.kv_indptr.tolist()
        pre = self.prefix_lens_cpu if self.prefix_lens_cpu is not None else self.prefix_lens.tolist()
        mi = None
        if self.custom_mask is not None:
            mi = self.mask_indptr_cpu if self.mask_indptr_cpu is not None else self.mask_indptr.tolist()
        return qo, kv, pre, mi


def visible_mask(q_len: int, kv_len: int, prefix_len: int, block: torch.Tensor | None,
                 device: torch.device, window: int = 0, q_pos: torch.Tensor | None = None) -> torch.Tensor:
    """[q_len, kv_len] bool: which key slots each query of one request may read.

    ``window > 0``: also hide keys at or before ``q_pos - window`` (``q_pos [q_len]``: the queries'
    positions; default ``prefix_len + j``, the causal ones); under a mask only the prefix is bounded.
    """
    extra = kv_len - prefix_len
    mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=device)
    if block is None:
        if extra != q_len:
            raise ValueError(f"causal attention needs extra == q_len, got {extra} and {q_len}")
        mask[:, prefix_len:] = torch.ones(q_len, q_len, dtype=torch.bool, device=device).tril()
    else:
        mask[:, prefix_len:] = block.view(q_len, extra)
    if window > 0:
        if q_pos is None:
            q_pos = prefix_len + torch.arange(q_len, device=device)
        key = torch.arange(kv_len, device=device)
        in_window = key.unsqueeze(0) > (q_pos.to(device).unsqueeze(1) - window)
        if block is not None:
            in_window[:, prefix_len:] = True
        mask &= in_window
    return mask


def check_window_args(meta: AttentionMetadata, window: int, q_positions: torch.Tensor | None) -> None:
    """A windowed call under a custom mask needs the query positions (the tree depth is not in the metadata)."""
    if window < 0:
        raise ValueError(f"window must be >= 0, got {window}")
    if window > 0 and meta.custom_mask is not None and q_positions is None:
        raise ValueError("a sliding window under a custom mask needs q_positions")


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: AttentionMetadata, sm_scale: float, window: int = 0,
                        q_positions: torch.Tensor | None = None) -> torch.Tensor:
    """o [T, Hq, D]: softmax(q k^T * sm_scale + mask) v per request, accumulated in float32.

    ``window`` / ``q_positions [T] int64``: the sliding window (module docstring); 0 = none.
    """
    check_window_args(meta, window, q_positions)
    T, hq, d = q.shape
    hkv = k_cache.shape[1]
    group = hq // hkv
    out = torch.empty_like(q)
    qo, kv, pre, mi = meta.host()
    for b in range(len(qo) - 1):
        qs, qe, ks, ke = qo[b], qo[b + 1], kv[b], kv[b + 1]
        if qe == qs:
            continue
        idx = meta.kv_indices[ks:ke]
        k = k_cache[idx].float().repeat_interleave(group, dim=1)  # [kv, Hq, D]
        v = v_cache[idx].float().repeat_interleave(group, dim=1)
        block = None
        if mi is not None:
            block = meta.custom_mask[mi[b]:mi[b + 1]]
        q_pos = None if block is None or window == 0 else q_positions[qs:qe]
        mask = visible_mask(qe - qs, ke - ks, pre[b], block, q.device, window, q_pos)
        scores = torch.einsum("qhd,khd->hqk", q[qs:qe].float(), k) * sm_scale
        scores = scores.masked_fill(~mask.unsqueeze(0), float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[qs:qe] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
    return out


def pack_int64(fields: list, device: torch.device) -> list[torch.Tensor]:
    """Int lists / arrays on ``device`` through one buffer (pinned and copied without a wait on a GPU), one view
    each, every view 16 bytes in line: Triton specialises a pointer argument on that, so a view out of line
    compiled the kernel reading it again."""
    sizes = [len(v) for v in fields]
    starts = [0]
    for n in sizes:
        starts.append(starts[-1] + n + n % 2)  # two int64 are 16 bytes
    host = torch.empty(starts[-1], dtype=torch.int64, pin_memory=device.type == "cuda")
    flat = host.numpy()
    for v, at, n in zip(fields, starts, sizes):
        flat[at:at + n] = v
    out = host.to(device, non_blocking=True)
    return [out[at:at + n] for at, n in zip(starts, sizes)]
