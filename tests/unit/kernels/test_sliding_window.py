"""Sliding-window attention (Mistral): the reference, the paged kernel and the extend kernel agree.

A query at position p sees keys at positions (p - window, p]. The reference is checked against a
dense attention written from that sentence alone; the Triton kernels (under TRITON_INTERPRET=1 on the
CPU, tiny shapes) against the reference with prompts, prefixes and chunks longer than the window,
decode with key splits, and tree verify (a node at depth d is at position prefix + d).
"""

from __future__ import annotations

import pytest
import torch
from test_attention import TOL, make_case, tree_mask
from test_extend_attention import make_case as make_extend_case

from kernels.attention import paged_attention
from kernels.attention_ref import paged_attention_ref
from kernels.extend_attention import ExtendConfig, extend_attention


def dense_window_attention(q, k, v, q_pos, k_pos, allowed, window, scale):
    """One request, one head group: softmax over keys with k_pos in (q_pos - window, q_pos] and ``allowed``."""
    group = q.shape[1] // k.shape[1]
    k, v = k.float().repeat_interleave(group, 1), v.float().repeat_interleave(group, 1)
    see = allowed & (k_pos[None, :] > q_pos[:, None] - window) & (k_pos[None, :] <= q_pos[:, None])
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    probs = torch.softmax(scores.masked_fill(~see[None], float("-inf")), -1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def request_kv(k, v, meta, b):
    idx = meta.kv_indices[meta.kv_indptr[b]:meta.kv_indptr[b + 1]]
    return k[idx], v[idx]


@pytest.mark.parametrize("window", [1, 5, 16])
def test_reference_is_the_windowed_causal_attention(window):
    """Chunks after a prefix longer than the window: each query sees exactly the keys of its window."""
    q_lens, prefix = [12, 7, 1], [0, 20, 30]
    q, k, v, meta = make_case(q_lens, prefix, q_lens, 4, 4, 2, 8, torch.float32, seed=window)
    out = paged_attention_ref(q, k, v, meta, 0.4, window)
    full = paged_attention_ref(q, k, v, meta, 0.4)
    for b, (n, p) in enumerate(zip(q_lens, prefix)):
        kb, vb = request_kv(k, v, meta, b)
        qs = int(meta.qo_indptr[b])
        dev = q.device
        want = dense_window_attention(q[qs:qs + n], kb, vb, torch.arange(p, p + n, device=dev),
                                      torch.arange(p + n, device=dev),
                                      torch.ones(n, p + n, dtype=torch.bool, device=dev), window, 0.4)
        torch.testing.assert_close(out[qs:qs + n], want, atol=1e-5, rtol=1e-5)
    assert (out - full).abs().max() > 0.1  # the window changes the output: the comparison has teeth


def test_reference_tree_node_sees_its_window_and_its_ancestors():
    """Tree verify: node at depth d (position prefix + d) sees prefix keys in its window and its ancestors."""
    parents = [-1, 0, 0, 1, 3]
    depth = [0, 1, 1, 2, 3]
    prefix, window = 25, 6
    mask = tree_mask(parents)
    q, k, v, meta = make_case([5], [prefix], [5], 4, 4, 2, 8, torch.float32, masks=[mask], seed=3)
    dev = q.device
    pos = torch.tensor([prefix + d for d in depth], device=dev)
    out = paged_attention_ref(q, k, v, meta, 0.5, window, pos)
    kb, vb = request_kv(k, v, meta, 0)
    k_pos = torch.cat([torch.arange(prefix, device=dev), pos])
    allowed = torch.cat([torch.ones(5, prefix, dtype=torch.bool, device=dev), mask.to(dev)], 1)
    torch.testing.assert_close(out, dense_window_attention(q, kb, vb, pos, k_pos, allowed, window, 0.5),
                               atol=1e-5, rtol=1e-5)


def test_window_under_a_mask_needs_positions():
    q, k, v, meta = make_case([3], [9], [3], 1, 2, 2, 8, torch.float32, masks=[tree_mask([-1, 0, 1])])
    with pytest.raises(ValueError, match="q_positions"):
        paged_attention_ref(q, k, v, meta, 0.5, 4)
    with pytest.raises(ValueError, match="q_positions"):
        paged_attention(q, k, v, meta, 0.5, 4, backend="triton")


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("window", [3, 16])
def test_paged_kernel_extend_past_the_window(page_size, window):
    """Prompts and chunks longer than the window, a prefix longer than it, a one-token request (GQA)."""
    q_lens, prefix = [40, 21, 1, 9], [0, 35, 50, 2]
    q, k, v, meta = make_case(q_lens, prefix, q_lens, page_size, 4, 2, 16, torch.float32, seed=window)
    ref = paged_attention_ref(q, k, v, meta, 0.37, window)
    out = paged_attention(q, k, v, meta, 0.37, window, backend="triton")
    torch.testing.assert_close(out, ref, **TOL[torch.float32])


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_kernel_decode_past_the_window(num_splits, dtype):
    """Decode (one query) over contexts far longer than the window, keys split or not."""
    prefix = [70, 9, 130]
    q, k, v, meta = make_case([1, 1, 1], prefix, [1, 1, 1], 4, 8, 2, 16, dtype, seed=num_splits)
    ref = paged_attention_ref(q, k, v, meta, 0.3, 24)
    out = paged_attention(q, k, v, meta, 0.3, 24, backend="triton", num_splits=num_splits)
    torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])


@pytest.mark.parametrize("num_splits", [1, 2])
def test_paged_kernel_tree_verify_past_the_window(num_splits):
    """Tree verify with positions: two requests, prefixes longer than the window."""
    parents = [-1, 0, 0, 1, 2, 3]
    depth = torch.tensor([0, 1, 1, 2, 2, 3])
    prefix, window = [33, 12], 8
    mask = tree_mask(parents)
    q, k, v, meta = make_case([6, 6], prefix, [6, 6], 4, 4, 2, 16, torch.float32, masks=[mask, mask], seed=7)
    pos = torch.cat([p + depth for p in prefix]).to(q.device)
    ref = paged_attention_ref(q, k, v, meta, 0.5, window, pos)
    out = paged_attention(q, k, v, meta, 0.5, window, pos, backend="triton", num_splits=num_splits)
    torch.testing.assert_close(out, ref, **TOL[torch.float32])
    assert (ref - paged_attention_ref(q, k, v, meta, 0.5)).abs().max() > 0.1


@pytest.mark.parametrize("tiles", [(16, 16), (32, 16), (16, 32)], ids=lambda t: f"m{t[0]}n{t[1]}")
@pytest.mark.parametrize("tma", [True, False], ids=["tma", "pointer"])
@pytest.mark.parametrize("window", [5, 20])
def test_extend_kernel_past_the_window(tiles, tma, window):
    """Fresh prompts longer than the window, chunks after longer prefixes (partial tiles both sides)."""
    q_lens, prefix = [45, 21, 1, 33], [0, 37, 50, 3]
    q, k_new, v_new, k, v, meta = make_extend_case(q_lens, prefix, 4, 4, 2, 16, torch.float32,
                                                   seed=window + tiles[0])
    cfg = ExtendConfig(block_m=tiles[0], block_n=tiles[1], num_warps=4, num_stages=1, tma=tma)
    ref = paged_attention_ref(q, k, v, meta, 0.37, window)
    out = extend_attention(q, k_new, v_new, k, v, meta, 0.37, window, backend="triton", config=cfg)
    torch.testing.assert_close(out, ref, **TOL[torch.float32])
    assert (ref - paged_attention_ref(q, k, v, meta, 0.37)).abs().max() > 0.1


def test_extend_kernel_window_with_packed_heads():
    q, k_new, v_new, k, v, meta = make_extend_case([40, 9], [20, 30], 4, 8, 2, 16, torch.bfloat16, seed=5)
    cfg = ExtendConfig(block_m=32, block_n=16, num_warps=4, num_stages=1, tma=False, pack=2)
    ref = paged_attention_ref(q, k, v, meta, 0.37, 11)
    out = extend_attention(q, k_new, v_new, k, v, meta, 0.37, 11, backend="triton", config=cfg)
    torch.testing.assert_close(out.float(), ref.float(), **TOL[torch.bfloat16])


@pytest.mark.parametrize("programs", [2, 3])
def test_paged_kernel_programs_over_every_nth_split_past_the_window(programs):
    """A few programs per block each running every n'th split (the block's first splits skipped: they are past
    the window) give the serial launch's bits, in decode and in tree verify."""
    from kernels.attention import AttnConfig

    def config(n):
        return AttnConfig(block_q=16, block_m=64, block_n=16, num_splits=n, num_warps=4, num_stages=3, split_len=16)

    prefix = [70, 9, 130]
    q, k, v, meta = make_case([1, 1, 1], prefix, [1, 1, 1], 4, 8, 2, 16, torch.float32, seed=11)
    serial = paged_attention(q, k, v, meta, 0.3, 24, backend="triton", config=config(1))
    strided = paged_attention(q, k, v, meta, 0.3, 24, backend="triton", config=config(programs))
    assert torch.equal(serial, strided)
    torch.testing.assert_close(strided, paged_attention_ref(q, k, v, meta, 0.3, 24), **TOL[torch.float32])
    parents, depth = [-1, 0, 0, 1, 2, 3], torch.tensor([0, 1, 1, 2, 2, 3])
    mask = tree_mask(parents)
    q, k, v, meta = make_case([6, 6], [33, 12], [6, 6], 4, 4, 2, 16, torch.float32, masks=[mask, mask], seed=12)
    pos = torch.cat([p + depth for p in [33, 12]]).to(q.device)
    tree_config = AttnConfig(block_q=8, block_m=32, block_n=16, num_splits=1, num_warps=4, num_stages=3,
                             split_len=16)
    serial = paged_attention(q, k, v, meta, 0.5, 8, pos, backend="triton", config=tree_config)
    strided = paged_attention(q, k, v, meta, 0.5, 8, pos, backend="triton",
                              config=AttnConfig(**{**tree_config.__dict__, "num_splits": programs}))
    assert torch.equal(serial, strided)
    torch.testing.assert_close(strided, paged_attention_ref(q, k, v, meta, 0.5, 8, pos), **TOL[torch.float32])
