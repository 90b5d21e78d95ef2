"""EAGLE-2 draft trees: candidates grown level by level, the best ``num_draft_tokens - 1`` kept.

A candidate's score is the product of draft probabilities along its path, so it never exceeds its
parent's. Candidates are numbered in the order they were made (a parent before its children);
selection sorts by score, stably, so a parent always ranks before its children and every selected
node's parent is selected too. Nodes are then put back in creation order: node 0 is the root (the
bonus token), and every node's parent has a smaller index.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.spec_kernels import build_tree


@dataclass
class Candidates:
    tokens: torch.Tensor  # [B, M] int64 target token ids
    parents: torch.Tensor  # [B, M] int64 candidate index of the parent, -1 = the root
    scores: torch.Tensor  # [B, M] float32 path probability
    depths: torch.Tensor  # [B, M] int64, 1 for the first level

    @classmethod
    def first_level(cls, topk_ids: torch.Tensor, topk_p: torch.Tensor) -> Candidates:
        return cls(tokens=topk_ids, parents=torch.full_like(topk_ids, -1), scores=topk_p.float(),
                   depths=torch.ones_like(topk_ids))

    def add(self, tokens: torch.Tensor, parents: torch.Tensor, scores: torch.Tensor, depth: int) -> None:
        self.tokens = torch.cat([self.tokens, tokens], 1)
        self.parents = torch.cat([self.parents, parents], 1)
        self.scores = torch.cat([self.scores, scores], 1)
        self.depths = torch.cat([self.depths, torch.full_like(tokens, depth)], 1)


@dataclass
class DraftTree:
    tokens: torch.Tensor  # [B, N] int64, node 0 = root (the bonus token)
    parents: torch.Tensor  # [B, N] int64, -1 for the root
    depths: torch.Tensor  # [B, N] int64, root 0
    mask: torch.Tensor  # [B, N, N] bool, node i sees node j iff j is i or an ancestor of i

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]


def select_tree(root: torch.Tensor, cand: Candidates, num_nodes: int, max_depth: int) -> DraftTree:
    if root.is_cuda:  # one Triton launch, same contract (kernels/spec_kernels.py: build_tree)
        t = build_tree(root, cand.tokens, cand.parents, cand.scores, cand.depths, num_nodes, max_depth)
        return DraftTree(tokens=t.tokens, parents=t.parents, depths=t.depths, mask=t.mask)
    B, M = cand.tokens.shape
    order = torch.sort(cand.scores, dim=1, descending=True, stable=True).indices[:, :num_nodes - 1]
    sel = order.sort(dim=1).values  # creation order: parents first
    node_of = torch.full((B, M), -1, dtype=torch.int64, device=sel.device)
    node_of.scatter_(1, sel, torch.arange(1, num_nodes, device=sel.device).expand(B, -1))
    cand_parent = cand.parents.gather(1, sel)
    node_parent = torch.where(cand_parent < 0, 0, node_of.gather(1, cand_parent.clamp(min=0)))
    parents = torch.cat([torch.full((B, 1), -1, dtype=torch.int64, device=sel.device), node_parent], 1)
    tokens = torch.cat([root.view(B, 1), cand.tokens.gather(1, sel)], 1)
    depths = torch.cat([torch.zeros(B, 1, dtype=torch.int64, device=sel.device), cand.depths.gather(1, sel)], 1)
    return DraftTree(tokens=tokens, parents=parents, depths=depths, mask=ancestor_mask(parents, max_depth))


def ancestor_mask(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """[B, N, N] ancestor-or-self, by following parent links at most ``max_depth`` times."""
    B, N = parents.shape
    mask = torch.eye(N, dtype=torch.bool, device=parents.device).expand(B, N, N).clone()
    cur = torch.arange(N, device=parents.device).expand(B, N)
    for _ in range(max_depth):
        cur = parents.gather(1, cur.clamp(min=0)).masked_fill(cur < 0, -1)
        hit = cur >= 0
        at = cur.clamp(min=0).unsqueeze(2)
        mask.scatter_(2, at, hit.unsqueeze(2) | mask.gather(2, at))
    return mask
