"""Speculative kernels: each Triton kernel equals its torch reference (interpreter on the CPU), and the
shared/spec functions that call them (``select_tree``, ``greedy_accept``) keep their contract."""

from __future__ import annotations

import pytest
import torch
from kernel_checks import DEVICE

from kernels.spec_kernels import (
    build_tree,
    build_tree_ref,
    gather_accepted,
    gather_accepted_ref,
    greedy_verify,
    greedy_verify_ref,
    move_kv,
    move_kv_ref,
)
from shared.spec.tree import Candidates, select_tree


def make_candidates(B: int, k: int, steps: int, vocab: int, seed: int, ties: bool = False) -> Candidates:
    """Candidates grown the way the draft loop grows them: k leaves per level, k children each.
    ``ties``: probabilities on a coarse grid so many scores are equal (stable order matters)."""
    g = torch.Generator().manual_seed(seed)

    def probs(n):
        p = torch.rand(B, n, generator=g)
        if ties:
            p = (p * 4).ceil() / 4
        return p.sort(dim=1, descending=True).values

    cand = Candidates.first_level(torch.randint(0, vocab, (B, k), generator=g), probs(k))
    leaf_idx = torch.arange(k).expand(B, k)
    for i in range(steps - 1):
        child_p = probs(k * k)
        scores = (cand.scores.gather(1, leaf_idx).repeat_interleave(k, dim=1) * child_p)
        first_child = cand.tokens.shape[1]
        cand.add(torch.randint(0, vocab, (B, k * k), generator=g), leaf_idx.repeat_interleave(k, dim=1), scores,
                 depth=i + 2)
        leaf_idx = first_child + scores.topk(k, dim=1).indices
    return cand


def to_dev(*xs):
    return [x.to(DEVICE) for x in xs]


# ---- tree build ----------------------------------------------------------------------------------
@pytest.mark.parametrize("k,steps,n,ties", [(1, 3, 4, False), (3, 4, 10, True), (4, 5, 16, False)])
def test_build_tree_reference_is_select_tree(k, steps, n, ties):
    cand = make_candidates(3, k, steps, 50, seed=k * 10 + steps, ties=ties)
    root = torch.tensor([7, 8, 9])
    ref = build_tree_ref(root, cand.tokens, cand.parents, cand.scores, cand.depths, n, steps)
    tree = select_tree(root, cand, n, steps)
    for f in ("tokens", "parents", "depths", "mask"):
        assert torch.equal(getattr(ref, f), getattr(tree, f)), f
    assert torch.equal(tree.mask, walked_ancestors(tree.parents))


def walked_ancestors(parents: torch.Tensor) -> torch.Tensor:
    """[B, N, N] ancestor-or-self mask by walking each node's parent links one by one."""
    B, N = parents.shape
    mask = torch.zeros(B, N, N, dtype=torch.bool)
    for b in range(B):
        for i in range(N):
            j = i
            while j >= 0:
                mask[b, i, j] = True
                j = int(parents[b, j])
    return mask


def test_build_tree_positions_are_committed_len_plus_depth():
    cand = make_candidates(2, 3, 4, 50, seed=4)
    t = build_tree_ref(torch.tensor([1, 2]), cand.tokens, cand.parents, cand.scores, cand.depths, 9, 4,
                       committed_len=torch.tensor([5, 11]))
    assert torch.equal(t.positions, torch.tensor([[5], [11]]) + t.depths)


@pytest.mark.parametrize("k,steps,n,ties", [(1, 3, 4, False), (2, 3, 6, True), (4, 5, 16, True)])
def test_build_tree_kernel_matches_reference(k, steps, n, ties):
    cand = make_candidates(3, k, steps, 50, seed=n, ties=ties)
    root, L = torch.tensor([3, 4, 5]), torch.tensor([0, 17, 40])
    args = to_dev(root, cand.tokens, cand.parents, cand.scores, cand.depths)
    out = build_tree(*args, n, steps, committed_len=L.to(DEVICE), backend="triton")
    ref = build_tree_ref(root, cand.tokens, cand.parents, cand.scores, cand.depths, n, steps, committed_len=L)
    for f in ("tokens", "parents", "depths", "mask", "positions"):
        assert torch.equal(getattr(out, f).cpu(), getattr(ref, f)), f


# ---- greedy verify -------------------------------------------------------------------------------
def random_tree_and_argmax(B: int, k: int, steps: int, n: int, vocab: int, seed: int):
    """A tree and a target argmax that follows some child of each node with probability 0.75."""
    cand = make_candidates(B, k, steps, vocab, seed)
    tree = build_tree_ref(torch.randint(0, vocab, (B,)), cand.tokens, cand.parents, cand.scores, cand.depths, n,
                          steps)
    g = torch.Generator().manual_seed(seed + 1)
    argmax = torch.randint(0, vocab, (B, n), generator=g)
    for b in range(B):
        for node in range(n):
            kids = [m for m in range(n) if int(tree.parents[b, m]) == node]
            if kids and torch.rand(1, generator=g).item() < 0.75:
                argmax[b, node] = tree.tokens[b, kids[int(torch.randint(len(kids), (1,), generator=g))]]
    return tree, argmax


@pytest.mark.parametrize("k,steps,n", [(1, 4, 5), (3, 4, 12)])
def test_greedy_verify_kernel_matches_reference(k, steps, n):
    tree, argmax = random_tree_and_argmax(6, k, steps, n, 20, seed=k)
    ref = greedy_verify_ref(tree.parents, tree.tokens, argmax, steps)
    out = greedy_verify(*to_dev(tree.parents, tree.tokens, argmax), steps, backend="triton")
    for f in ("accept_index", "accept_len", "bonus"):
        assert torch.equal(getattr(out, f).cpu(), getattr(ref, f)), f
    assert ref.accept_len.max() > 1  # some drafts accepted: the walk itself was exercised


# ---- speculative sampling ------------------------------------------------------------------------
# ---- KV move -------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_move_kv_kernel_matches_reference(dtype):
    """Compaction moves: request 0 keeps path [0, 2, 3] (a slot is read by one move and written by the
    next), request 1 is a padding row (sink slot 0 onto itself), request 2 keeps [0, 1, 4]."""
    g = torch.Generator().manual_seed(0)
    layers, slots, heads, d = 3, 48, 2, 8
    base = [torch.randn(slots, heads, d, generator=g).to(dtype) for _ in range(2 * layers)]
    src = torch.tensor([[16, 18, 19], [0, 0, 0], [32, 33, 36]])
    dst = torch.tensor([[16, 17, 18], [0, 0, 0], [32, 33, 34]])
    ref = [c.clone() for c in base]
    move_kv_ref(ref[:layers], ref[layers:], src, dst)
    out = [c.clone().to(DEVICE) for c in base]
    move_kv(out[:layers], out[layers:], src.to(DEVICE), dst.to(DEVICE), backend="triton")
    for o, r, b in zip(out, ref, base):
        assert torch.equal(o.cpu(), r)
        assert torch.equal(r[17], b[18]) and torch.equal(r[18], b[19]) and torch.equal(r[34], b[36])


# ---- accepted-path gather ------------------------------------------------------------------------
@pytest.mark.parametrize("vocab,width", [(50, 12), (5000, 40)])
def test_gather_accepted_kernel_matches_reference(vocab, width):
    steps, n = 3, 8
    tree, argmax = random_tree_and_argmax(5, 2, steps, n, vocab, seed=3)
    acc = greedy_verify_ref(tree.parents, tree.tokens, argmax, steps)
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(5, n, vocab, generator=g) * 3
    feats = torch.randn(5, n, width, generator=g).bfloat16()
    ref = gather_accepted_ref(acc.accept_index, acc.accept_len, acc.bonus, tree.tokens, logits, feats)
    out = gather_accepted(*to_dev(acc.accept_index, acc.accept_len, acc.bonus, tree.tokens, logits, feats),
                          backend="triton")
    assert torch.equal(out.tokens.cpu(), ref.tokens)
    torch.testing.assert_close(out.logprobs.cpu(), ref.logprobs, atol=1e-5, rtol=1e-5)
    assert torch.equal(out.feats.cpu(), ref.feats)
    assert acc.accept_len.min() < steps + 1  # padded slots (past the accepted length) are covered too
