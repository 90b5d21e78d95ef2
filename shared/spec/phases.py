"""The decode step's tensor phases: draft loop, verify, and compaction + draft extend; and a plain
decode step's two (target decode with the draft's features, draft extend over its one position).

Each phase is a pure function of device tensors with static shapes (every request of the batch has
the same number of tree nodes, draft leaves and extend slots), so each can be captured in a CUDA
graph per batch-size bucket and replayed; on the CPU the same functions run eagerly. Nothing here
reads a value back to the host. Positions come from committed lengths (seed 002): draft step i of a
request with committed length L runs at L + i, tree node n at L + depth(n), extend slot j at L + j.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.spec_kernels import Acceptance, DraftTree, gather_accepted, move_kv
from kernels.spec_sampling import SamplingRows
from shared.config import SpecConfig
from shared.forward_batch import build_uniform_batch
from shared.logits_process import LogitsRows, process_logits
from shared.memory.kv_cache import KVCache
from shared.model.drafts import DraftHead
from shared.model.llama import LlamaForCausalLM
from shared.sampling import top_logprobs
from shared.spec.tree import Candidates, select_tree
from shared.spec.verify import sampled_accept


@dataclass
class DecodeInputs:
    """One decode step's batch. Padding rows use request row 0 (all slots on the sink page) and L=0."""

    target_rows: torch.Tensor  # [B] int64 rows in the target request-to-token map
    draft_rows: torch.Tensor  # [B, C] int64 rows in each draft cache's map
    L: torch.Tensor  # [B] int64 committed lengths
    bonus: torch.Tensor  # [B] int64 the token at position L (root of the tree)
    hidden: torch.Tensor  # [B, Hd] draft recurrent hidden state
    topk_p: torch.Tensor  # [B, K] float32 first tree level probabilities, most likely first (K: state_topk)
    topk_ids: torch.Tensor  # [B, K] int64 first tree level target token ids
    sampling: SamplingRows  # [B] each request's temperature, top-k, top-p, seed (padding: greedy)


@dataclass
class StepOutput:
    accept_len: torch.Tensor  # [B] int64 accepted nodes incl. the root = tokens committed this step
    accept_index: torch.Tensor  # [B, steps+1] int64 the accepted path's tree nodes (-1 past its end)
    tokens: torch.Tensor  # [B, steps+1] int64 committed tokens in order (first accept_len valid)
    logprobs: torch.Tensor  # [B, steps+1] float32 target log p of each committed token
    hidden: torch.Tensor  # [B, Hd] next draft state: recurrent hidden
    topk_p: torch.Tensor  # [B, K] next draft state: first tree level (K: state_topk)
    topk_ids: torch.Tensor  # [B, K]
    # With top logprobs asked for (eager steps only): each committed token's distribution's n best
    top_logprobs: torch.Tensor | None = None  # [B, steps+1, n] float32 log p, most likely first
    top_ids: torch.Tensor | None = None  # [B, steps+1, n] int64 their token ids


@dataclass
class PlainDraft:
    """The draft state a plain decode step leaves: the draft run over the one position the target wrote."""

    hidden: torch.Tensor  # [B, Hd] recurrent hidden
    topk_p: torch.Tensor  # [B, k] float32 first tree level of the next speculative step
    topk_ids: torch.Tensor  # [B, k] int64 its target token ids


class SpecPhases:
    """The phases of one target and its draft head, each running on its own KV cache(s).

    ``capture_mode`` ("last" or "aux") and ``aux_layers`` say which target hidden states feed the
    draft (``TargetOutput.features``); ``draft_caches[c]`` is the cache of draft layer c (one for
    EAGLE and EAGLE-3, one per step for a multi-layer draft)."""

    def __init__(self, target: LlamaForCausalLM, target_cache: KVCache, draft_head: DraftHead,
                 draft_caches: list[KVCache], spec: SpecConfig, capture_mode: str, aux_layers: tuple[int, ...],
                 state_topk: int | None = None):
        self.target, self.target_cache = target, target_cache
        self.draft_head, self.caches = draft_head, draft_caches
        self.spec = spec
        # The first level's width the draft states carry (the widest shape's topk): a narrower shape drafts
        # from its first ``spec.topk`` columns (most likely first) and leaves states of the full width.
        self.state_topk = state_topk or spec.topk
        self.capture_mode, self.aux_layers = capture_mode, aux_layers
        k, steps = spec.topk, spec.steps
        # Which cache each draft loop forward runs on, and how many scratch slots precede it there.
        self.step_cache = [draft_head.cache_for_step(i + 1) for i in range(steps - 1)]
        self.scratch_before = [k * self.step_cache[:i].count(c) for i, c in enumerate(self.step_cache)]
        # Columns of the scratch-ancestor mask that live in the cache of forward i.
        dev = target_cache.layout.device
        self.visible_cols = [
            torch.tensor([j * k + m for j, sc in enumerate(self.step_cache[:i + 1]) for m in range(k) if sc == c],
                         dtype=torch.int64, device=dev)
            for i, c in enumerate(self.step_cache)
        ]

    def scratch_len(self, c: int) -> int:
        return self.spec.topk * self.step_cache.count(c)

    # ---- draft loop ------------------------------------------------------------------------------
    def draft(self, inp: DecodeInputs) -> DraftTree:
        """``steps - 1`` draft forwards grow the tree below the first level (from the last extend)."""
        k = self.spec.topk
        B = inp.L.numel()
        dev = inp.L.device
        cand = Candidates.first_level(inp.topk_ids[:, :k], inp.topk_p[:, :k])
        leaf_idx = torch.arange(k, device=dev).expand(B, k)  # candidate index of each leaf
        leaf_hidden = inp.hidden.unsqueeze(1).expand(B, k, -1)
        ancestors = torch.zeros(B, k, 0, dtype=torch.bool, device=dev)  # over earlier forwards' leaves
        eye = torch.eye(k, dtype=torch.bool, device=dev).expand(B, k, k)
        for i, c in enumerate(self.step_cache):
            visible = torch.cat([ancestors, eye], 2).index_select(2, self.visible_cols[i])  # this cache's slots
            base = self.scratch_before[i]
            cache = self.caches[c]
            batch = build_uniform_batch(
                cache, inp.draft_rows[:, c], inp.L, k, base + k, cand.tokens.gather(1, leaf_idx).reshape(-1),
                (inp.L + i).repeat_interleave(k), (inp.L.unsqueeze(1) + base + torch.arange(k, device=dev)),
                custom_mask=visible,
            )
            o = self.draft_head(batch, cache, c, leaf_hidden.reshape(B * k, -1), from_target=False)
            child_p, child_draft = torch.softmax(o.logits, dim=-1).topk(k, dim=-1)  # [B*k, k]
            scores = (cand.scores.gather(1, leaf_idx).unsqueeze(2) * child_p.view(B, k, k)).view(B, k * k)
            first_child = cand.tokens.shape[1]
            cand.add(self.draft_head.to_target_ids(child_draft).view(B, k * k), leaf_idx.repeat_interleave(k, dim=1),
                     scores, depth=i + 2)
            best = scores.topk(k, dim=1).indices  # the next leaves, among this level's children
            parent_slot = best // k  # which current leaf each next leaf hangs from
            leaf_hidden = o.hidden.view(B, k, -1).gather(1, parent_slot.unsqueeze(2).expand(-1, -1, o.hidden.shape[-1]))
            ancestors = torch.cat([ancestors.gather(1, parent_slot.unsqueeze(2).expand(-1, -1, ancestors.shape[2])),
                                   F.one_hot(parent_slot, k).bool()], 2)
            leaf_idx = first_child + best
        return select_tree(inp.bonus, cand, self.spec.num_draft_tokens, self.spec.steps)

    # ---- verify ----------------------------------------------------------------------------------
    def verify(self, inp: DecodeInputs, tree: DraftTree) -> tuple[torch.Tensor, torch.Tensor]:
        """One target forward over every tree node: logits [B, N, V] and features [B, N, W]."""
        B, N = tree.tokens.shape
        dev = inp.L.device
        batch = build_uniform_batch(
            self.target_cache, inp.target_rows, inp.L, N, N, tree.tokens.reshape(-1),
            (inp.L.unsqueeze(1) + tree.depths).reshape(-1), inp.L.unsqueeze(1) + torch.arange(N, device=dev),
            custom_mask=tree.mask,
        )
        out = self.target(batch, self.target_cache, capture=self.capture_mode, aux_layers=self.aux_layers)
        feats = out.features()
        return out.logits.view(B, N, -1), feats.view(B, N, feats.shape[-1])

    def accept(self, inp: DecodeInputs, tree: DraftTree, logits: torch.Tensor) -> Acceptance:
        """Every row by its own rule (greedy or sampled with its parameters and seed), on the device,
        from ``logits`` (after any penalties and filters)."""
        return sampled_accept(tree, logits, inp.sampling, inp.L, self.spec.steps)

    def verify_extend(self, inp: DecodeInputs, tree: DraftTree, processing: LogitsRows | None = None,
                      top_n: int = 0) -> StepOutput:
        """Verify, acceptance on the device, compaction and draft extend in one function: greedy,
        sampled and mixed batches run the three as one graph (no logits copied between graphs, no eager
        launches between them, nothing read back by the host)."""
        logits, feats = self.verify(inp, tree)
        return self.accept_extend(inp, tree, logits, feats, processing, top_n)

    def accept_extend(self, inp: DecodeInputs, tree: DraftTree, logits: torch.Tensor, feats: torch.Tensor,
                      processing: LogitsRows | None = None, top_n: int = 0,
                      extend: Callable[..., StepOutput] | None = None) -> StepOutput:
        """Everything after the target forward: the penalties, filters and grammar masks (``processing``),
        the acceptance, then ``extend`` (this object's, or its captured graph, which may hold the logits in
        the target's dtype). With ``processing``, the committed tokens' logprobs are those of the processed
        logits (the distribution they were accepted from), in float32; with ``top_n``, each committed
        token's ``top_n`` best alternatives come along."""
        if processing is not None:
            logits = process_logits(logits, processing, tree.tokens, tree.mask, tree.depths)
        out = (extend or self.extend)(inp, tree, self.accept(inp, tree, logits), logits, feats)
        if processing is None and top_n == 0:
            return out
        return self.with_top_logprobs(out, logits, top_n)

    @staticmethod
    def with_top_logprobs(out: StepOutput, logits: torch.Tensor, top_n: int) -> StepOutput:
        """``out`` with each committed token's log-probability read again from ``logits`` (float32), and
        the ``top_n`` best (none for 0) at each accepted path slot: slot d's token was drawn from the
        logits of path node d (-1 past the path: read as the root, ignored)."""
        B, N, V = logits.shape
        path = out.accept_index.clamp(min=0)
        rows = torch.log_softmax(logits.gather(1, path.unsqueeze(2).expand(-1, -1, V)).float(), dim=-1)  # [B, S, V]
        out = dataclasses.replace(out, logprobs=rows.gather(2, out.tokens.unsqueeze(2)).squeeze(2))
        if top_n == 0:
            return out
        values, ids = top_logprobs(rows, top_n)
        return dataclasses.replace(out, top_logprobs=values, top_ids=ids)

    # ---- a plain decode step (the adaptive policy's step without a draft) -------------------------
    def plain_decode(self, rows: torch.Tensor, lengths: torch.Tensor,
                     tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One target token per request at its length ([B] each), capturing the draft's features as
        verify does: logits [B, V] and features [B, W]."""
        batch = build_uniform_batch(self.target_cache, rows, lengths, 1, 1, tokens, lengths, lengths.unsqueeze(1))
        out = self.target(batch, self.target_cache, capture=self.capture_mode, aux_layers=self.aux_layers)
        return out.logits, out.features()

    def plain_extend(self, draft_rows: torch.Tensor, lengths: torch.Tensor, tokens: torch.Tensor,
                     feats: torch.Tensor) -> PlainDraft:
        """The draft over the one position a plain decode step wrote (``lengths`` [B]), fed its feature
        [B, W] and the token sampled there [B] (draft position t takes the token at t + 1): the padded
        extend of a speculative step with one slot, on every draft cache."""
        hidden, logits = self._extend(draft_rows, lengths, tokens.unsqueeze(1), feats.unsqueeze(1),
                                      torch.zeros_like(lengths))
        topk_p, topk_ids = self.first_level(logits)
        return PlainDraft(hidden=hidden, topk_p=topk_p, topk_ids=topk_ids)

    # ---- compaction and draft extend -------------------------------------------------------------
    def extend(self, inp: DecodeInputs, tree: DraftTree, acc: Acceptance, logits: torch.Tensor,
               feats: torch.Tensor) -> StepOutput:
        """Keep the accepted path's K/V at positions L.., gather every per-token output by the one
        accept index, and run the draft over the committed tokens (padded to steps + 1 slots)."""
        # Per path slot (the stride of every gather is steps + 1, seed 004): the committed token, its
        # log-probability and the node's feature row.
        path = gather_accepted(acc.accept_index, acc.accept_len, acc.bonus, tree.tokens, logits, feats)
        self._compact_target(inp, acc.accept_index, acc.accept_index >= 0)
        ext_hidden, ext_logits = self._extend(inp.draft_rows, inp.L, path.tokens, path.feats, acc.accept_len - 1)
        topk_p, topk_ids = self.first_level(ext_logits)
        return StepOutput(accept_len=acc.accept_len, accept_index=acc.accept_index, tokens=path.tokens,
                          logprobs=path.logprobs, hidden=ext_hidden, topk_p=topk_p, topk_ids=topk_ids)

    def first_level(self, draft_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The next tree's first level from the draft's logits [B, Vd]: probabilities [B, K] float32 and
        target token ids [B, K] int64, most likely first (K = ``state_topk``)."""
        topk_p, topk_draft = torch.softmax(draft_logits, dim=-1).topk(self.state_topk, dim=-1)
        return topk_p, self.draft_head.to_target_ids(topk_draft)

    def _compact_target(self, inp: DecodeInputs, accept_index: torch.Tensor, valid: torch.Tensor) -> None:
        """Accepted node n at path depth d moves from position L + n to L + d (n >= d)."""
        cache = self.target_cache
        table = cache.req_to_token.table
        B, stride = accept_index.shape
        N = self.spec.num_draft_tokens
        dev = accept_index.device
        rows = inp.target_rows.unsqueeze(1)
        if cache.page_size == 1:
            # Re-point positions: the accepted nodes' slots first, the others after (still owned).
            node = torch.arange(N, device=dev).expand(B, N)
            depth_of = torch.full((B, N), N, dtype=torch.int64, device=dev)
            depth_of.scatter_(1, accept_index.clamp(min=0), torch.where(valid, torch.arange(stride, device=dev), N))
            depth_of[:, 0] = 0
            order = torch.argsort(depth_of * (N + 1) + node, dim=1)
            span = inp.L.unsqueeze(1) + node
            table[rows, span] = table[rows, span].gather(1, order)
            return
        src = table[rows, inp.L.unsqueeze(1) + accept_index.clamp(min=0)]
        dst = table[rows, inp.L.unsqueeze(1) + torch.arange(stride, device=dev)]
        src = torch.where(valid, src, 0)  # padding moves go to the sink slot 0
        dst = torch.where(valid, dst, 0)
        move_kv(cache.k, cache.v, src, dst)

    def _extend(self, draft_rows: torch.Tensor, L: torch.Tensor, tokens: torch.Tensor, feats: torch.Tensor,
                last: torch.Tensor):
        """Draft positions L .. L+stride-1 over (target feature, committed token) [B, stride]; rows past
        ``last`` (the accepted length) are padding whose K/V lands beyond the committed length and is
        never read. ``draft_rows`` [B, C]: each draft cache's rows."""
        B, stride = tokens.shape
        dev = tokens.device
        slots = L.unsqueeze(1) + torch.arange(stride, device=dev)
        out_rows = torch.arange(B, device=dev) * stride + last
        hidden = logits = None
        for c, cache in enumerate(self.caches):
            batch = build_uniform_batch(cache, draft_rows[:, c], L, stride, stride, tokens.reshape(-1),
                                        slots.reshape(-1), slots, logits_rows=out_rows)
            o = self.draft_head(batch, cache, c, feats.reshape(B * stride, -1), from_target=True)
            if c == 0:
                hidden, logits = o.hidden[out_rows], o.logits
        return hidden, logits
