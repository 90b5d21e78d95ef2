"""On the GPU: every Triton kernel equals its torch reference at real shapes.

Fresh random inputs on every run (seeded from the clock, printed on failure), outputs poisoned
before each run (NaN-filled destinations, the caching allocator's free blocks filled with NaN, and
every cache slot no request owns, the sink page included, set to NaN), tolerances per dtype.
Llama-3-8B attention heads (32 query / 8 kv, head dim 128) and vocabulary (128256).
"""

from __future__ import annotations

import pytest
import torch

from kernels.attention import paged_attention
from kernels.attention_ref import AttentionMetadata, paged_attention_ref
from kernels.spec_kernels import (
    ancestor_mask,
    build_tree,
    build_tree_ref,
    gather_accepted,
    gather_accepted_ref,
    greedy_verify,
    greedy_verify_ref,
    move_kv,
    move_kv_ref,
)
from tests.gpu.gpu_checks import poison_allocator, seeded_generator

pytestmark = pytest.mark.gpu

HQ, HKV, D = 32, 8, 128
TOL = {torch.float32: {"atol": 1e-4, "rtol": 1e-4}, torch.float16: {"atol": 3e-3, "rtol": 3e-3},
       torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2}}


@pytest.fixture
def gen():
    return seeded_generator()


def paged_case(gen, q_lens, prefix, extra, page_size, dtype, masks=None):
    """Caches with pages in shuffled order; every slot no request owns (incl. the sink page) is NaN."""
    kv_lens = [p + e for p, e in zip(prefix, extra)]
    pages_per = [-(-n // page_size) for n in kv_lens]
    num_pages = sum(pages_per)
    order = torch.randperm(num_pages, device="cuda", generator=gen) + 1
    idx, used = [], 0
    for n, pp in zip(kv_lens, pages_per):
        pos = torch.arange(n, device="cuda")
        idx.append(order[used:used + pp][pos // page_size] * page_size + pos % page_size)
        used += pp
    kv_indices = torch.cat(idx)
    slots = (num_pages + 1) * page_size
    k = torch.full((slots, HKV, D), float("nan"), dtype=dtype, device="cuda")
    v = torch.full_like(k, float("nan"))
    k[kv_indices] = torch.randn(kv_indices.numel(), HKV, D, device="cuda", generator=gen).to(dtype)
    v[kv_indices] = torch.randn(kv_indices.numel(), HKV, D, device="cuda", generator=gen).to(dtype)
    q = torch.randn(sum(q_lens), HQ, D, device="cuda", generator=gen).to(dtype)
    qo = torch.tensor([0] + q_lens, device="cuda").cumsum(0)
    kv = torch.tensor([0] + kv_lens, device="cuda").cumsum(0)
    meta = AttentionMetadata(qo_indptr=qo, kv_indptr=kv, kv_indices=kv_indices,
                             prefix_lens=torch.tensor(prefix, device="cuda"),
                             max_q_len=max(q_lens), max_kv_len=max(kv_lens))
    if masks is not None:
        meta.custom_mask = torch.cat([m.reshape(-1) for m in masks]).cuda()
        meta.mask_indptr = torch.tensor([0] + [m.numel() for m in masks], device="cuda").cumsum(0)
    return q, k, v, meta


def run_and_check(q, k, v, meta, **kw):
    scale = D ** -0.5
    ref = paged_attention_ref(q, k, v, meta, scale)
    poison_allocator()
    out = torch.full_like(q, float("nan"))
    paged_attention(q, k, v, meta, scale, out=out, **kw)
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), ref.float(), **TOL[q.dtype])


# ---- attention -----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("page_size", [1, 16])
def test_decode_matches_reference(gen, dtype, page_size):
    prefix = torch.randint(1, 4096, (8,), generator=gen, device="cuda").tolist()
    run_and_check(*paged_case(gen, [1] * 8, prefix, [1] * 8, page_size, dtype))


@pytest.mark.parametrize("num_splits", [1, 7, 64])
def test_decode_batch1_long_context_any_split(gen, num_splits):
    run_and_check(*paged_case(gen, [1], [8191], [1], 16, torch.bfloat16), num_splits=num_splits)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("page_size", [1, 16])
def test_extend_chunked_prefill_matches_reference(gen, dtype, page_size):
    q_lens = [512, 77, 0, 300]
    prefix = [0, 1500, 40, 2048]
    run_and_check(*paged_case(gen, q_lens, prefix, q_lens, page_size, dtype))


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("n", [8, 64])
def test_tree_verify_matches_reference(gen, page_size, n):
    B = 4
    masks = []
    for _ in range(B):
        parents = [-1] + [int(torch.randint(0, i, (1,))) for i in range(1, n)]
        masks.append(ancestor_mask(torch.tensor([parents]), n)[0])
    prefix = torch.randint(1, 3000, (B,), generator=gen, device="cuda").tolist()
    run_and_check(*paged_case(gen, [n] * B, prefix, [n] * B, page_size, torch.bfloat16, masks))


def test_tree_draft_matches_reference(gen):
    B, k, extra = 6, 4, 12
    masks = []
    for _ in range(B):
        m = torch.rand(k, extra) < 0.3
        m[torch.arange(k), extra - k + torch.arange(k)] = True
        masks.append(m)
    prefix = torch.randint(1, 2000, (B,), generator=gen, device="cuda").tolist()
    run_and_check(*paged_case(gen, [k] * B, prefix, [extra] * B, 16, torch.bfloat16, masks))


# ---- speculative kernels -------------------------------------------------------------------------
def candidates(gen, B, k, steps, vocab):
    """Candidates grown like the draft loop grows them (see shared/spec/phases.py)."""
    p0 = torch.rand(B, k, device="cuda", generator=gen).sort(dim=1, descending=True).values
    tokens = [torch.randint(0, vocab, (B, k), device="cuda", generator=gen)]
    parents, scores = [torch.full((B, k), -1, device="cuda")], [p0]
    depths = [torch.ones(B, k, dtype=torch.int64, device="cuda")]
    leaf = torch.arange(k, device="cuda").expand(B, k)
    made = k
    for i in range(steps - 1):
        child_p = torch.rand(B, k * k, device="cuda", generator=gen)
        s = torch.cat(scores, 1).gather(1, leaf).repeat_interleave(k, dim=1) * child_p
        tokens.append(torch.randint(0, vocab, (B, k * k), device="cuda", generator=gen))
        parents.append(leaf.repeat_interleave(k, dim=1))
        scores.append(s)
        depths.append(torch.full((B, k * k), i + 2, dtype=torch.int64, device="cuda"))
        leaf = made + s.topk(k, dim=1).indices
        made += k * k
    return [torch.cat(x, 1) for x in (tokens, parents, scores, depths)]


@pytest.mark.parametrize("k,steps,n", [(1, 5, 6), (8, 6, 64), (4, 5, 16)])
def test_build_tree_matches_reference(gen, k, steps, n):
    B, vocab = 16, 128256
    tok, par, sc, dep = candidates(gen, B, k, steps, vocab)
    root = torch.randint(0, vocab, (B,), device="cuda", generator=gen)
    L = torch.randint(0, 4000, (B,), device="cuda", generator=gen)
    poison_allocator()
    out = build_tree(root, tok, par, sc, dep, n, steps, committed_len=L)
    ref = build_tree_ref(root, tok, par, sc, dep, n, steps, committed_len=L)
    for f in ("tokens", "parents", "depths", "mask", "positions"):
        assert torch.equal(getattr(out, f), getattr(ref, f)), f


def tree_and_argmax(gen, B, k, steps, n, vocab):
    tok, par, sc, dep = candidates(gen, B, k, steps, vocab)
    tree = build_tree_ref(torch.randint(0, vocab, (B,), device="cuda", generator=gen), tok, par, sc, dep, n, steps)
    # The target's argmax after a node is its first child's token 3 times in 4.
    node = torch.arange(n, device="cuda")
    is_child = tree.parents.unsqueeze(1) == node.view(1, -1, 1)  # [B, n, m]: m is a child of n
    first_child = torch.where(is_child, node.view(1, 1, -1), n).amin(2)  # n for a leaf
    child_tok = torch.where(first_child < n, tree.tokens.gather(1, first_child.clamp(max=n - 1)), 0)
    other = torch.randint(0, vocab, (B, n), device="cuda", generator=gen)
    follow = (torch.rand(B, n, device="cuda", generator=gen) < 0.75) & (first_child < n)
    return tree, torch.where(follow, child_tok, other)


@pytest.mark.parametrize("k,steps,n", [(1, 5, 6), (8, 6, 64)])
def test_greedy_verify_matches_reference(gen, k, steps, n):
    tree, argmax = tree_and_argmax(gen, 64, k, steps, n, 128256)
    poison_allocator()
    out = greedy_verify(tree.parents, tree.tokens, argmax, steps)
    ref = greedy_verify_ref(tree.parents, tree.tokens, argmax, steps)
    for f in ("accept_index", "accept_len", "bonus"):
        assert torch.equal(getattr(out, f), getattr(ref, f)), f


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_move_kv_matches_reference(gen, dtype):
    """32 layers, 64 requests of a 16-slot page each: path moves src >= dst inside the page."""
    layers, B, stride, ps = 32, 64, 6, 16
    caches = [torch.randn(ps * (B + 1), HKV, D, device="cuda", generator=gen).to(dtype) for _ in range(2 * layers)]
    keep = torch.rand(B, ps, device="cuda", generator=gen).argsort(dim=1)[:, :stride].sort(dim=1).values
    base = (torch.arange(B, device="cuda") + 1).unsqueeze(1) * ps
    src, dst = base + keep, base + torch.arange(stride, device="cuda")
    src[::5], dst[::5] = 0, 0  # padding rows: the sink slot onto itself
    ref = [c.clone() for c in caches]
    move_kv_ref(ref[:layers], ref[layers:], src, dst)
    move_kv(caches[:layers], caches[layers:], src, dst)
    for c, r in zip(caches, ref):
        assert torch.equal(c, r)


def test_gather_accepted_matches_reference(gen):
    B, k, steps, n, vocab, width = 32, 4, 5, 16, 128256, 3 * 4096
    tree, argmax = tree_and_argmax(gen, B, k, steps, n, vocab)
    acc = greedy_verify_ref(tree.parents, tree.tokens, argmax, steps)
    logits = torch.randn(B, n, vocab, device="cuda", generator=gen) * 4
    feats = torch.randn(B, n, width, device="cuda", generator=gen).bfloat16()
    poison_allocator()
    out = gather_accepted(acc.accept_index, acc.accept_len, acc.bonus, tree.tokens, logits, feats)
    ref = gather_accepted_ref(acc.accept_index, acc.accept_len, acc.bonus, tree.tokens, logits, feats)
    assert torch.equal(out.tokens, ref.tokens)
    torch.testing.assert_close(out.logprobs, ref.logprobs, atol=1e-4, rtol=1e-5)
    assert torch.equal(out.feats, ref.feats)
