"""Acceptance: which tree path the target agrees with, and the bonus token after it.

Both rules return ``accept_index [B, steps + 1]``: the node indices of the accepted path, root
first, padded with -1. Its shape gives the stride of every per-token gather that follows (seed 004).

Sampling uses multi-candidate speculative sampling with the draft as a point mass on each child
(tree tokens are chosen by top-k, deterministically): child x of the current node is accepted with
probability p(x); on rejection p <- normalize(p with x removed) and the next sibling is tried; the
bonus token is drawn from what is left of p. Each committed token therefore has exactly the target
distribution ``target_probs`` defines. Greedy is the same rule with p one-hot, run vectorised.
"""

from __future__ import annotations

import torch

from kernels.spec_kernels import Acceptance, DraftTree, greedy_verify
from shared.sampling import SamplingParams, target_probs


def greedy_accept(tree: DraftTree, target_argmax: torch.Tensor, steps: int) -> Acceptance:
    """target_argmax [B, N]: the target's greedy token after each node (contract: ``greedy_verify_ref``)."""
    return greedy_verify(tree.parents, tree.tokens, target_argmax, steps)


def sampled_accept(tree: DraftTree, logits: torch.Tensor, params: list[SamplingParams],
                   generators: list[torch.Generator], steps: int) -> Acceptance:
    """logits [B, N, V] of the target after each node; one generator per request."""
    B, N, V = logits.shape
    probs = target_probs(logits.reshape(B * N, V), [p for p in params for _ in range(N)]).view(B, N, V).cpu()
    parents, tokens = tree.parents.cpu(), tree.tokens.cpu()
    index = torch.full((B, steps + 1), -1, dtype=torch.int64)
    bonus = torch.empty(B, dtype=torch.int64)
    for b in range(B):
        path, last_p = _walk(parents[b], tokens[b], probs[b], generators[b], steps)
        index[b, :len(path)] = torch.tensor(path)
        bonus[b] = _draw(last_p, generators[b])
    device = logits.device
    index = index.to(device)
    return Acceptance(index, (index >= 0).sum(dim=1), bonus.to(device))


def _walk(parents, tokens, probs, gen, steps) -> tuple[list[int], torch.Tensor]:
    """The accepted path from the root and the (residual) distribution at its end."""
    path, cur = [0], 0
    while len(path) <= steps:
        p = probs[cur].double().clone()
        children = (parents == cur).nonzero().flatten().tolist()
        nxt = None
        for c in children:
            x = int(tokens[c])
            px = float(p[x])
            if px >= 1.0 or (px > 0.0 and torch.rand(1, generator=gen, dtype=torch.float64).item() < px):
                nxt = c
                break
            p[x] = 0.0
            p /= p.sum()
        if nxt is None:
            return path, p
        path.append(nxt)
        cur = nxt
    return path, probs[cur].double()


def _draw(p: torch.Tensor, gen: torch.Generator) -> int:
    if (p == 1.0).any():  # greedy rows draw nothing
        return int(p.argmax())
    u = torch.rand(1, generator=gen, dtype=torch.float64).item()
    cdf = p.cumsum(0)
    at = torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], dtype=torch.float64), right=True)
    return int(at.clamp(max=p.numel() - 1))
