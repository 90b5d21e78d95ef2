"""Sampled verification (kernels/spec_sampling.py): each Triton kernel against its torch reference
(the interpreter on the CPU, tiny shapes), bit for bit where the contract is integer; the exact uniform
draw, the counter-based hash, the top-k / top-p threshold rule against a plain loop, and the boundary
of an inverse-CDF draw."""

from __future__ import annotations

import pytest
import torch
from kernel_checks import DEVICE, no_host_reads

from kernels import spec_sampling
from kernels.spec_kernels import ancestor_mask, greedy_verify_ref
from kernels.spec_sampling import (
    QUANT_BITS,
    SamplingRows,
    TargetWeights,
    draw_limbs,
    quantize,
    request_key,
    target_weights,
    target_weights_ref,
    thresholds_ref,
    tree_verify,
    tree_verify_ref,
    uniform_below,
)

# Rows: greedy, temperature, top-k, top-p, top-k + top-p, top-k beyond the vocabulary, a tiny top-p.
TEMPERATURE = [0.0, 0.7, 1.0, 1.3, 0.9, 1.1, 0.8]
TOP_K = [0, 0, 3, 0, 5, 10_000, 0]
TOP_P = [1.0, 1.0, 1.0, 0.75, 0.9, 1.0, 0.05]


def rows_for(B: int, seed: int, device=DEVICE) -> SamplingRows:
    g = torch.Generator().manual_seed(seed)
    pick = torch.arange(B) % len(TEMPERATURE)
    return SamplingRows(temperature=torch.tensor(TEMPERATURE)[pick].to(device),
                        top_k=torch.tensor(TOP_K)[pick].to(device), top_p=torch.tensor(TOP_P)[pick].to(device),
                        seed=torch.randint(-2**63, 2**63 - 1, (B,), generator=g).to(device))


def tree_case(B: int, V: int, seed: int):
    """A 7-node tree (root with three children, one repeating a sibling's token, then two levels) and
    logits that make its children likely, with tied logits in every row."""
    g = torch.Generator().manual_seed(seed)
    parents = torch.tensor([-1, 0, 0, 0, 1, 1, 4]).expand(B, -1).contiguous()
    tokens = torch.randint(0, V, (B, 7), generator=g)
    tokens[:, 3] = tokens[:, 2]  # a duplicate sibling: no mass left for it once the first was tried
    logits = torch.randn(B, 7, V, generator=g) * 2
    logits[torch.arange(B).unsqueeze(1), parents[:, 1:], tokens[:, 1:]] += 3.0 + torch.tensor(V).log()
    logits[..., 1] = logits[..., 0]  # ties
    return parents, tokens, logits


def test_uniform_below_is_floor_h_times_bound_over_2_to_60():
    g = torch.Generator().manual_seed(0)
    hi = torch.randint(0, 1 << 30, (4000,), generator=g)
    lo = torch.randint(0, 1 << 30, (4000,), generator=g)
    bound = (torch.randint(1, 1 << 60, (4000,), generator=g) >> torch.randint(0, 60, (4000,), generator=g)).clamp(min=1)
    edges = torch.tensor([[0, 0, 1], [(1 << 30) - 1, (1 << 30) - 1, (1 << 60) - 1], [(1 << 30) - 1, (1 << 30) - 1, 1],
                          [0, 1, (1 << 60) - 1], [1 << 29, 0, 3]])
    hi, lo, bound = torch.cat([hi, edges[:, 0]]), torch.cat([lo, edges[:, 1]]), torch.cat([bound, edges[:, 2]])
    got = uniform_below(hi, lo, bound)
    want = [((h << 30 | l) * b) >> 60 for h, l, b in zip(hi.tolist(), lo.tolist(), bound.tolist())]
    assert got.tolist() == want
    assert bool((got >= 0).all()) and bool((got < bound).all())


def test_draws_depend_on_seed_length_and_node_only_and_look_uniform():
    from scipy.stats import chisquare

    seeds = torch.tensor([5, 5, -7, 2**62])
    a = draw_limbs(request_key(seeds, torch.tensor([9, 9, 9, 9])).unsqueeze(1), torch.arange(6).unsqueeze(0))
    assert torch.equal(a[0][0], a[0][1]) and torch.equal(a[1][0], a[1][1])  # same request, same draws
    b = draw_limbs(request_key(seeds, torch.tensor([10, 10, 10, 10])).unsqueeze(1), torch.arange(6).unsqueeze(0))
    assert not bool((a[0] == b[0]).any())  # the next committed length draws afresh
    keys = request_key(torch.arange(20_000) * 1_000_003, torch.arange(20_000) % 7)
    hi, lo = draw_limbs(keys, torch.zeros_like(keys) + 3)
    for bound in (10, 1000):  # consecutive seeds give uniform draws, in the high and the low digits
        counts = torch.bincount(uniform_below(hi, lo, torch.full_like(hi, bound)), minlength=bound)
        assert chisquare(counts.double().numpy()).pvalue > 1e-3, bound


def kept_by_loop(W: list[int], k: int, p: float) -> set[int]:
    """The documented rule, plainly: the top-k by weight (ties at the k-th all kept), then the most
    likely tokens while the mass before them is below top_p of what top-k kept (ties all kept)."""
    order = sorted(range(len(W)), key=lambda i: -W[i])
    if 0 < k < len(W):
        order = [i for i in order if W[i] >= W[order[k - 1]]]
    if p >= 1:
        return set(order)
    reach = float(p) * float(sum(W[i] for i in order))
    kept, mass = set(), 0
    for i in order:
        if float(mass) >= reach and W[i] < min(W[j] for j in kept):
            break
        kept.add(i)
        mass += W[i]
    return kept


@pytest.mark.parametrize("k,p", [(0, 1.0), (3, 1.0), (4, 1.0), (0, 0.5), (0, 0.75), (3, 0.6), (6, 0.3), (0, 0.01)])
def test_thresholds_keep_the_documented_sets_ties_included(k, p):
    w = torch.tensor([0.5, 1.0, 0.25, 0.25, 0.125, 0.25, 0.5, 0.0625, 0.03125, 1.0])  # ties at several ranks
    rows = SamplingRows(temperature=torch.ones(1), top_k=torch.tensor([k]), top_p=torch.tensor([p]),
                        seed=torch.zeros(1, dtype=torch.int64))
    tw = thresholds_ref(w.view(1, 1, -1), rows)
    W = quantize(w).tolist()
    kept = {i for i, x in enumerate(W) if x >= int(tw.thresh)}
    assert kept == kept_by_loop(W, k, torch.tensor(p).item())
    assert int(tw.total) == sum(W[i] for i in kept)


def test_target_weights_kernel_matches_reference():
    B, V = 7, 40
    _, _, logits = tree_case(B, V, seed=1)
    rows = rows_for(B, seed=1)
    out = target_weights(logits.to(DEVICE), rows, backend="triton")
    ref = target_weights_ref(logits, rows_for(B, seed=1, device="cpu"))
    sampled = rows.temperature.cpu() > 0
    torch.testing.assert_close(out.weights.cpu()[sampled], ref.weights[sampled], rtol=2e-6, atol=1e-7)
    again = thresholds_ref(out.weights.cpu(), rows_for(B, seed=1, device="cpu"))  # the integer half, exactly
    assert torch.equal(out.thresh.cpu()[sampled], again.thresh[sampled])
    assert torch.equal(out.total.cpu()[sampled], again.total[sampled])
    assert not bool(out.thresh.cpu()[~sampled].any() or out.total.cpu()[~sampled].any())  # greedy rows: none
    assert bool((again.thresh[sampled][2:] > 0).any())  # some rows did cut by top-k / top-p


@pytest.mark.parametrize("V,steps", [(40, 3), (3000, 2)])
def test_tree_verify_kernel_matches_reference_bit_for_bit(V, steps):
    """V 3000 > one 2048-token block: the bonus draw crosses blocks. Many seeds, mixed greedy and
    sampled rows, a duplicate sibling, tied logits, a committed length past 2**32."""
    B = 10
    parents, tokens, logits = tree_case(B, V, seed=V)
    L = torch.randint(0, 1 << 34, (B,), generator=torch.Generator().manual_seed(V))
    accepted = rejected = 0
    for trial in range(3):
        rows = rows_for(B, seed=trial, device="cpu")
        tw = target_weights_ref(logits, rows)
        argmax = logits.argmax(-1)
        ref = tree_verify_ref(tw, argmax, parents, tokens, rows, L, steps)
        dev = [x.to(DEVICE) for x in (tw.weights, tw.thresh, tw.total, argmax, parents, tokens, L)]
        rows_dev = SamplingRows(**{f: getattr(rows, f).to(DEVICE) for f in ("temperature", "top_k", "top_p", "seed")})
        out = tree_verify(TargetWeights(*dev[:3]), dev[3], dev[4], dev[5], rows_dev, dev[6], steps, backend="triton")
        for f in ("accept_index", "accept_len", "bonus"):
            assert torch.equal(getattr(out, f).cpu(), getattr(ref, f)), (trial, f)
        accepted += int((ref.accept_len > 1).sum())
        rejected += int((ref.accept_len < steps + 1).sum())
    assert accepted > 0 and rejected > 0


def test_greedy_rows_are_greedy_verify():
    B, V, steps = 6, 30, 3
    parents, tokens, logits = tree_case(B, V, seed=3)
    tokens[:, 1] = logits[:, 0].argmax(-1)  # the root's first child is what the target wants
    rows = SamplingRows(temperature=torch.zeros(B), top_k=torch.zeros(B, dtype=torch.int64), top_p=torch.ones(B),
                        seed=torch.arange(B))
    argmax = logits.argmax(-1)
    tw = target_weights_ref(logits, rows)
    want = greedy_verify_ref(parents, tokens, argmax, steps)
    dev = [x.to(DEVICE) for x in (tw.weights, tw.thresh, tw.total, argmax, parents, tokens)]
    rows_dev = SamplingRows(**{f: getattr(rows, f).to(DEVICE) for f in ("temperature", "top_k", "top_p", "seed")})
    for got in (tree_verify_ref(tw, argmax, parents, tokens, rows, torch.zeros(B, dtype=torch.int64), steps),
                tree_verify(TargetWeights(*dev[:3]), dev[3], dev[4], dev[5], rows_dev,
                            torch.zeros(B, dtype=torch.int64, device=DEVICE), steps, backend="triton")):
        for f in ("accept_index", "accept_len", "bonus"):
            assert torch.equal(getattr(got, f).cpu(), getattr(want, f)), f
    assert bool((want.accept_len > 1).all())


def test_a_draw_on_a_cdf_boundary_takes_the_token_after_it(monkeypatch):
    """The bonus is the first token whose running mass exceeds the draw u (integers: no rounding):
    u equal to the mass of tokens 0..i draws token i+1, one less draws token i."""
    w = torch.tensor([0.5, 0.25, 1.0, 0.125])
    W = quantize(w)
    parents, tokens = torch.tensor([[-1, 0]]), torch.tensor([[0, 3]])  # one child: token 3
    rows = SamplingRows(temperature=torch.ones(1), top_k=torch.zeros(1, dtype=torch.int64), top_p=torch.ones(1),
                        seed=torch.zeros(1, dtype=torch.int64))
    tw = thresholds_ref(w.expand(1, 2, 4), rows)
    left = int(tw.total[0, 0]) - int(W[3])  # the child is rejected: its token leaves the residual
    edges = {int(W[0]): 1, int(W[0]) - 1: 0, int(W[0] + W[1]): 2, int(W[0] + W[1]) - 1: 1, left - 1: 2, 0: 0}
    for u, token in edges.items():
        def limbs(key, j, u=u):  # child draw: past its mass (rejected); bonus draw (j = 0): exactly u
            h = torch.where(j == 0, -(-(u << 60) // left), (1 << 60) - 1)  # smallest h with floor(h*left/2^60) = u
            return h >> 30, h & ((1 << 30) - 1)
        monkeypatch.setattr(spec_sampling, "draw_limbs", limbs)
        acc = tree_verify_ref(tw, torch.tensor([[2, 2]]), parents, tokens, rows, torch.zeros(1, dtype=torch.int64), 1)
        assert acc.accept_len.item() == 1 and acc.bonus.item() == token, (u, acc.bonus.item(), token)
    assert int(W[3]) == 1 << (QUANT_BITS - 3)


def test_sampled_acceptance_reads_nothing_on_the_host(monkeypatch):
    """The engine's acceptance (weights and walk) is a pure device computation: CUDA-graph capturable."""
    from kernels.spec_kernels import DraftTree
    from shared.spec.verify import sampled_accept

    B, V = 7, 40
    parents, tokens, logits = tree_case(B, V, seed=5)
    depths = torch.tensor([0, 1, 1, 1, 2, 2, 3]).expand(B, -1)
    tree = DraftTree(tokens=tokens, parents=parents, depths=depths, mask=ancestor_mask(parents, 3))
    tree = DraftTree(*[t.to(DEVICE) for t in (tree.tokens, tree.parents, tree.depths, tree.mask)])
    logits = logits.to(DEVICE)
    rows, L = rows_for(B, seed=2), torch.full((B,), 40, device=DEVICE)
    with no_host_reads(monkeypatch):
        acc = sampled_accept(tree, logits, rows, L, 3)
    assert acc.accept_index.shape == (B, 4) and acc.bonus.shape == (B,)


def test_a_repeated_sibling_is_never_accepted_and_rejected_tokens_are_never_the_bonus():
    """Children 1 and 2 of the root carry the same token: the second has no mass left once the first
    was tried, so it is never accepted; when every child of the root is rejected, the bonus is none of
    their tokens. 4000 seeds through the reference, 8 of them through the kernel as well."""
    B, V = 4000, 6
    parents = torch.tensor([-1, 0, 0, 0]).expand(B, -1).contiguous()
    tokens = torch.tensor([0, 2, 2, 3]).expand(B, -1).contiguous()
    logits = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.05, 0.15]).log().expand(B, 4, V).contiguous()
    rows = SamplingRows(temperature=torch.ones(B), top_k=torch.zeros(B, dtype=torch.int64), top_p=torch.ones(B),
                        seed=torch.arange(B) * 7919)
    L = torch.full((B,), 3)
    tw = target_weights_ref(logits, rows)
    acc = tree_verify_ref(tw, logits.argmax(-1), parents, tokens, rows, L, 1)
    first = acc.accept_index[:, 1]
    assert not bool((first == 2).any())
    assert bool((first == 1).any() and (first == 3).any() and (first == -1).any())
    assert not bool(torch.isin(acc.bonus[first == -1], torch.tensor([2, 3])).any())
    few = slice(0, 8)
    sub = SamplingRows(*(getattr(rows, f)[few].to(DEVICE) for f in ("temperature", "top_k", "top_p", "seed")))
    out = tree_verify(TargetWeights(*(t[few].to(DEVICE) for t in (tw.weights, tw.thresh, tw.total))),
                      logits.argmax(-1)[few].to(DEVICE), parents[few].to(DEVICE), tokens[few].to(DEVICE), sub,
                      L[few].to(DEVICE), 1, backend="triton")
    assert torch.equal(out.accept_index.cpu(), acc.accept_index[few]) and torch.equal(out.bonus.cpu(), acc.bonus[few])
