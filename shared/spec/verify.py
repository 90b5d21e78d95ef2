"""Acceptance: which tree path the target agrees with, and the bonus token after it.

Both rules return ``accept_index [B, steps + 1]``: the node indices of the accepted path, root
first, padded with -1. Its shape gives the stride of every per-token gather that follows (seed 004).

Sampling uses multi-candidate speculative sampling with the draft as a point mass on each child
(tree tokens are chosen by top-k, deterministically): child x of the current node is accepted with
probability p(x); on rejection p <- normalize(p with x removed) and the next sibling is tried; the
bonus token is drawn from what is left of p. Each committed token therefore has exactly the target
distribution ``target_probs`` defines. Greedy is the same rule with p one-hot, and
``sampled_accept`` runs both, row by row, in one call for greedy, sampled and mixed batches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.spec_kernels import greedy_verify
from kernels.spec_sampling import SamplingRows, target_weights, tree_verify
from shared.spec.tree import DraftTree


@dataclass
class Acceptance:
    accept_index: torch.Tensor  # [B, steps+1] int64 node indices of the accepted path, -1 padded
    accept_len: torch.Tensor  # [B] int64 accepted nodes including the root (>= 1)
    bonus: torch.Tensor  # [B] int64 the target's token after the last accepted node


def greedy_accept(tree: DraftTree, target_argmax: torch.Tensor, steps: int) -> Acceptance:
    """target_argmax [B, N]: the target's greedy token after each node."""
    if target_argmax.is_cuda:  # one Triton launch, same contract (kernels/spec_kernels.py: greedy_verify)
        acc = greedy_verify(tree.parents, tree.tokens, target_argmax, steps)
        return Acceptance(acc.accept_index, acc.accept_len, acc.bonus)
    B = target_argmax.shape[0]
    device = target_argmax.device
    cur = torch.zeros(B, dtype=torch.int64, device=device)
    alive = torch.ones(B, dtype=torch.bool, device=device)
    index = torch.full((B, steps + 1), -1, dtype=torch.int64, device=device)
    index[:, 0] = 0
    for d in range(1, steps + 1):
        want = target_argmax.gather(1, cur.unsqueeze(1))
        match = (tree.parents == cur.unsqueeze(1)) & (tree.tokens == want) & alive.unsqueeze(1)
        found = match.any(dim=1)
        nxt = match.to(torch.int8).argmax(dim=1)
        index[:, d] = torch.where(found, nxt, -1)
        cur = torch.where(found, nxt, cur)
        alive &= found
    return Acceptance(index, (index >= 0).sum(dim=1), target_argmax.gather(1, cur.unsqueeze(1)).squeeze(1))


def sampled_accept(tree: DraftTree, logits: torch.Tensor, rows: SamplingRows, committed_len: torch.Tensor,
                   steps: int) -> Acceptance:
    """Greedy and sampled rows together, on the device, with no host sync (graph-capturable).
    logits [B, N, V] of the target after each node; each row draws with its own parameters and seed
    (kernels/spec_sampling.py: the rule, the integer draws, and their Triton kernels)."""
    tw = target_weights(logits, rows)
    acc = tree_verify(tw, logits.argmax(dim=-1), tree.parents, tree.tokens, rows, committed_len, steps)
    return Acceptance(acc.accept_index, acc.accept_len, acc.bonus)
