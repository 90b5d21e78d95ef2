"""Decode steps against the rows of a verify step, for tests/unit/kernels/test_attention_invariance.py (the
kernel under the interpreter) and tests/gpu/test_attention_invariance_gpu.py (the kernel on CUDA).

``verify_vs_decode`` runs one verify step over several requests' trees (or chains) after their prefixes, then
every tree node as a decode step of its own (its prefix and its ancestors' slots as its keys) in one batch, and
the first node of each tree alone, and asserts the rows are the same bits (``torch.equal``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.attention import paged_attention
from kernels.attention_ref import AttentionMetadata, paged_attention_ref
from kernels.spec_kernels import ancestor_mask


@dataclass(frozen=True)
class Shape:
    hkv: int = 2
    group: int = 4
    d: int = 16


def _depths(parents: list[int]) -> list[int]:
    out = []
    for p in parents:
        out.append(0 if p < 0 else out[p] + 1)
    return out


def _path(parents: list[int], i: int) -> list[int]:
    """Node indices from the root down to ``i``."""
    path = [i]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


class Pool:
    """K/V caches whose slots come page by page in a shuffled order (page 0 is the sink)."""

    def __init__(self, num_slots: int, page_size: int, dtype: torch.dtype, seed: int, device: str,
                 shape: Shape = Shape()):
        g = torch.Generator().manual_seed(seed)
        pages = -(-num_slots // page_size)
        self.order = (torch.randperm(pages, generator=g) + 1).tolist()
        self.page_size, self.device, self.shape = page_size, device, shape
        total = (pages + 1) * page_size
        self.k = torch.randn(total, shape.hkv, shape.d, generator=g).to(dtype).to(device)
        self.v = torch.randn(total, shape.hkv, shape.d, generator=g).to(dtype).to(device)
        self.gen = g

    def take(self, n: int) -> list[int]:
        """n slots of one request: whole pages, positions in page order."""
        slots = []
        while len(slots) < n:
            page = self.order.pop()
            slots += [page * self.page_size + i for i in range(self.page_size)]
        return slots[:n]

    def queries(self, n: int) -> torch.Tensor:
        s = self.shape
        return torch.randn(n, s.hkv * s.group, s.d, generator=self.gen).to(self.k.dtype).to(self.device)


def metadata(kv_lists: list[list[int]], q_lens: list[int], prefixes: list[int], device: str,
             masks=None) -> AttentionMetadata:
    qo, kv = [0], [0]
    for n, ql in zip(kv_lists, q_lens):
        qo.append(qo[-1] + ql)
        kv.append(kv[-1] + len(n))
    meta = AttentionMetadata(
        qo_indptr=torch.tensor(qo, device=device), kv_indptr=torch.tensor(kv, device=device),
        kv_indices=torch.tensor([s for n in kv_lists for s in n], dtype=torch.int64, device=device),
        prefix_lens=torch.tensor(prefixes, dtype=torch.int64, device=device),
        max_q_len=max(q_lens), max_kv_len=max(kv[i + 1] - kv[i] for i in range(len(q_lens))))
    if masks is not None:
        meta.custom_mask = torch.cat([m.reshape(-1) for m in masks]).to(device)
        meta.mask_indptr = torch.tensor([0] + torch.tensor([m.numel() for m in masks]).cumsum(0).tolist(),
                                        device=device)
    return meta


def verify_vs_decode(prefixes: list[int], trees: list[list[int]], page_size: int, device: str,
                     dtype=torch.float32, window: int = 0, seed: int = 0, shape: Shape = Shape(), **kw) -> None:
    """One verify step over every request's tree, then every tree node as a decode step of its own (all of them
    in one batch, then the first node of each tree alone): each node's row must be the same bits. ``kw`` goes
    to every ``paged_attention`` call (``split_len`` ...)."""
    pool = Pool(sum(prefixes) + sum(len(t) for t in trees) + 4 * page_size, page_size, dtype, seed, device, shape)
    pre = [pool.take(p) for p in prefixes]
    nodes = [pool.take(len(t)) for t in trees]
    q = pool.queries(sum(len(t) for t in trees))
    masks = [ancestor_mask(torch.tensor([t]), len(t))[0] for t in trees]
    meta = metadata([p + n for p, n in zip(pre, nodes)], [len(t) for t in trees], prefixes, device, masks)
    pos = torch.tensor([p + d for p, t in zip(prefixes, trees) for d in _depths(t)], device=device)
    qp = pos if window else None
    verify = paged_attention(q, pool.k, pool.v, meta, 0.37, window, qp, backend="triton", **kw)
    ref = paged_attention_ref(q, pool.k, pool.v, meta, 0.37, window, qp)
    torch.testing.assert_close(verify.float(), ref.float(), atol=2e-2, rtol=2e-2)  # the right answer, too

    kv_lists, lens = [], []
    for p, t, n in zip(pre, trees, nodes):
        for i in range(len(t)):
            kv_lists.append(p + [n[a] for a in _path(t, i)])  # the ancestors' slots at their positions
            lens.append(len(kv_lists[-1]) - 1)
    decode = paged_attention(q, pool.k, pool.v, metadata(kv_lists, [1] * len(lens), lens, device), 0.37, window,
                             backend="triton", **kw)
    assert torch.equal(decode, verify), (decode.float() - verify.float()).abs().max()
    first = [sum(len(t) for t in trees[:r]) for r in range(len(trees))]
    alone = paged_attention(q[first], pool.k, pool.v, metadata([kv_lists[i] for i in first], [1] * len(first),
                            [lens[i] for i in first], device), 0.37, window, backend="triton", **kw)
    assert torch.equal(alone, verify[first])


def causal_vs_decode(prefixes: list[int], q_lens: list[int], page_size: int, device: str, seed: int = 0,
                     dtype=torch.float32, shape: Shape = Shape(), **kw) -> None:
    """A causal multi-row step (draft extend, a short chunk) against each of its rows as a decode step."""
    pool = Pool(sum(prefixes) + sum(q_lens) + 4 * page_size, page_size, dtype, seed, device, shape)
    kv = [pool.take(p + n) for p, n in zip(prefixes, q_lens)]
    q = pool.queries(sum(q_lens))
    step = paged_attention(q, pool.k, pool.v, metadata(kv, q_lens, prefixes, device), 0.4, backend="triton", **kw)
    singles, lens = [], []
    for p, n, slots in zip(prefixes, q_lens, kv):
        for j in range(n):
            singles.append(slots[:p + j + 1])
            lens.append(p + j)
    decode = paged_attention(q, pool.k, pool.v, metadata(singles, [1] * len(lens), lens, device), 0.4,
                             backend="triton", **kw)
    assert torch.equal(decode, step)
