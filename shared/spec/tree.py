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

from kernels.spec_kernels import DraftTree, build_tree


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


def select_tree(root: torch.Tensor, cand: Candidates, num_nodes: int, max_depth: int) -> DraftTree:
    """root [B] (the bonus token) and the candidates -> the tree (contract: ``build_tree_ref``)."""
    return build_tree(root, cand.tokens, cand.parents, cand.scores, cand.depths, num_nodes, max_depth)
