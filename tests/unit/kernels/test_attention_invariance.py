"""Paged attention gives a query the same bits in a decode step and as a row of a verify step.

Speculation is lossless only if the target's logits at a verify row equal, bit for bit, those a plain decode
step would compute at that position: greedy output with and without the draft must match. So a query at
position p over keys [0, p] must reduce them in one order whatever the step: split bounds at fixed positions
(``split_len``), one tile shape for decode-like launches, a tree node's ancestors read as the positions they
stand for, and the splits merged in one order (one program per split, or one program for all of them).

Runs the kernel under TRITON_INTERPRET=1 on the CPU (conftest sets it) with tiny shapes; every comparison is
``torch.equal``. tests/gpu/test_kernels_gpu.py checks the same on CUDA at the 8B shapes.
"""

from __future__ import annotations

import pytest
import torch
from kernel_checks import DEVICE

from kernels.attention import AttnConfig, paged_attention
from kernels.attention_ref import AttentionMetadata, paged_attention_ref
from kernels.spec_kernels import ancestor_mask

HKV, GROUP, D = 2, 4, 16


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

    def __init__(self, num_slots: int, page_size: int, dtype: torch.dtype, seed: int):
        g = torch.Generator().manual_seed(seed)
        pages = -(-num_slots // page_size)
        self.order = (torch.randperm(pages, generator=g) + 1).tolist()
        self.page_size, self.used = page_size, 0
        total = (pages + 1) * page_size
        self.k = torch.randn(total, HKV, D, generator=g).to(dtype).to(DEVICE)
        self.v = torch.randn(total, HKV, D, generator=g).to(dtype).to(DEVICE)
        self.gen = g

    def take(self, n: int) -> list[int]:
        """n slots of one request: whole pages, positions in page order."""
        slots = []
        while len(slots) < n:
            page = self.order.pop()
            slots += [page * self.page_size + i for i in range(self.page_size)]
        return slots[:n]


def _meta(kv_lists: list[list[int]], q_lens: list[int], prefixes: list[int], masks=None) -> AttentionMetadata:
    qo, kv = [0], [0]
    for n, ql in zip(kv_lists, q_lens):
        qo.append(qo[-1] + ql)
        kv.append(kv[-1] + len(n))
    meta = AttentionMetadata(
        qo_indptr=torch.tensor(qo, device=DEVICE), kv_indptr=torch.tensor(kv, device=DEVICE),
        kv_indices=torch.tensor([s for n in kv_lists for s in n], dtype=torch.int64, device=DEVICE),
        prefix_lens=torch.tensor(prefixes, dtype=torch.int64, device=DEVICE),
        max_q_len=max(q_lens), max_kv_len=max(kv[i + 1] - kv[i] for i in range(len(q_lens))))
    if masks is not None:
        meta.custom_mask = torch.cat([m.reshape(-1) for m in masks]).to(DEVICE)
        meta.mask_indptr = torch.tensor([0] + torch.tensor([m.numel() for m in masks]).cumsum(0).tolist(),
                                        device=DEVICE)
    return meta


def verify_vs_decode(prefixes: list[int], trees: list[list[int]], page_size: int, dtype=torch.float32,
                     window: int = 0, seed: int = 0, **kw) -> None:
    """One verify step over every request's tree, then every tree node as a decode step of its own (all of them
    in one batch, then the first node of each tree alone): each node's row must be the same bits."""
    pool = Pool(sum(prefixes) + sum(len(t) for t in trees) + 4 * page_size, page_size, dtype, seed)
    pre = [pool.take(p) for p in prefixes]
    nodes = [pool.take(len(t)) for t in trees]
    q = torch.randn(sum(len(t) for t in trees), HKV * GROUP, D, generator=pool.gen).to(dtype).to(DEVICE)
    masks = [ancestor_mask(torch.tensor([t]), len(t))[0] for t in trees]
    meta = _meta([p + n for p, n in zip(pre, nodes)], [len(t) for t in trees], prefixes, masks)
    pos = torch.tensor([p + d for p, t in zip(prefixes, trees) for d in _depths(t)], device=DEVICE)
    verify = paged_attention(q, pool.k, pool.v, meta, 0.37, window, pos if window else None, backend="triton", **kw)
    ref = paged_attention_ref(q, pool.k, pool.v, meta, 0.37, window, pos if window else None)
    torch.testing.assert_close(verify.float(), ref.float(), atol=2e-2, rtol=2e-2)  # the right answer, too

    kv_lists, lens = [], []
    for p, t, n in zip(pre, trees, nodes):
        for i in range(len(t)):
            kv_lists.append(p + [n[a] for a in _path(t, i)])  # the ancestors' slots at their positions
            lens.append(len(kv_lists[-1]) - 1)
    decode = paged_attention(q, pool.k, pool.v, _meta(kv_lists, [1] * len(lens), lens), 0.37, window,
                             backend="triton", **kw)
    assert torch.equal(decode, verify), (decode - verify).abs().max()
    first = [sum(len(t) for t in trees[:r]) for r in range(len(trees))]
    alone = paged_attention(q[first], pool.k, pool.v, _meta([kv_lists[i] for i in first], [1] * len(first),
                            [lens[i] for i in first]), 0.37, window, backend="triton", **kw)
    assert torch.equal(alone, verify[first])


TREE = [-1, 0, 0, 1, 2, 3, 3]  # two branches, depth 3
CHAIN = [-1, 0, 1, 2]


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_tree_rows_equal_decode_steps_across_split_bounds(page_size):
    """Prefixes just under, at and past multiples of the split length: a tree's nodes cross a split bound."""
    verify_vs_decode([30, 32, 61, 5], [TREE, CHAIN, TREE, [-1, 0, 0, 0]], page_size, split_len=32, seed=page_size)


@pytest.mark.parametrize("split_len", [32, 64, None])
def test_chain_rows_equal_decode_steps(split_len):
    """A chain (topk 1) under its mask, at several split lengths (None: the one chosen from the cache)."""
    verify_vs_decode([95, 7], [CHAIN, CHAIN], 4, split_len=split_len, seed=3)


def test_bfloat16_rows_equal_decode_steps():
    verify_vs_decode([40, 63], [TREE, CHAIN], 16, torch.bfloat16, split_len=32, seed=4)


def test_one_program_for_every_split_gives_the_split_launch_bits():
    """The serial launch (many programs already: every split in one) and the split launch + combine kernel."""
    pool = Pool(300, 4, torch.float32, 5)
    lens = [150, 33, 97]
    kv = [pool.take(n + 1) for n in lens]
    q = torch.randn(3, HKV * GROUP, D, generator=pool.gen).to(DEVICE)
    meta = _meta(kv, [1, 1, 1], lens)
    serial = AttnConfig(block_q=16, block_m=64, block_n=32, num_splits=1, num_warps=4, num_stages=3, split_len=32)
    a = paged_attention(q, pool.k, pool.v, meta, 0.5, backend="triton", config=serial)
    b = paged_attention(q, pool.k, pool.v, meta, 0.5, backend="triton", num_splits=5, split_len=32)
    assert torch.equal(a, b)
    torch.testing.assert_close(a, paged_attention_ref(q, pool.k, pool.v, meta, 0.5), atol=2e-5, rtol=2e-5)


def test_windowed_tree_rows_equal_decode_steps():
    """Sliding window: the block's first key differs between the steps, the rows' bits do not."""
    verify_vs_decode([70, 45], [TREE, CHAIN], 4, window=24, split_len=32, seed=6)


def test_causal_rows_equal_decode_steps():
    """A causal multi-row step (draft extend, a short chunk) in the decode tile shape: each row as a decode."""
    pool = Pool(200, 4, torch.float32, 7)
    prefixes, q_lens = [33, 64, 9], [5, 3, 8]
    kv = [pool.take(p + n) for p, n in zip(prefixes, q_lens)]
    q = torch.randn(sum(q_lens), HKV * GROUP, D, generator=pool.gen).to(DEVICE)
    step = paged_attention(q, pool.k, pool.v, _meta(kv, q_lens, prefixes), 0.4, backend="triton", split_len=32)
    singles, lens = [], []
    for p, n, slots in zip(prefixes, q_lens, kv):
        for j in range(n):
            singles.append(slots[:p + j + 1])
            lens.append(p + j)
    decode = paged_attention(q, pool.k, pool.v, _meta(singles, [1] * len(lens), lens), 0.4, backend="triton",
                             split_len=32)
    assert torch.equal(decode, step)
