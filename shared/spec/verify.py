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

import torch

from kernels.spec_kernels import Acceptance, DraftTree
from kernels.spec_sampling import SamplingRows, target_weights, tree_verify


def sampled_accept(tree: DraftTree, logits: torch.Tensor, rows: SamplingRows, committed_len: torch.Tensor,
                   steps: int) -> Acceptance:
    """Greedy and sampled rows together, on the device, with no host sync (graph-capturable).
    logits [B, N, V] of the target after each node; each row draws with its own parameters and seed
    (kernels/spec_sampling.py: the rule, the integer draws, and their Triton kernels)."""
    tw = target_weights(logits, rows)
    acc = tree_verify(tw, logits.argmax(dim=-1), tree.parents, tree.tokens, rows, committed_len, steps)
    return acc
