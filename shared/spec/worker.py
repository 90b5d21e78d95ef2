"""The EAGLE speculative loop: draft extend, tree draft, verify, accept, compact, draft extend.

Positions are computed from committed lengths, never advanced in place (seed 002): for a request
with committed length L, draft step i runs at position L + i and tree node n is verified at
position L + depth(n). Every forward batch is built from the cache of the runner executing it
(seed 001). One function gives the draft extend's shifted tokens, whatever the draft kind or the
chunking (seed 000). Every per-token output of verification is gathered by one accept index
(seed 004). Empty batches run the same code as full ones, with widths from the draft (seed 003).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from shared.batch import build_forward_batch
from shared.config import EngineConfig, SpecConfig
from shared.memory.kv_cache import KVCache
from shared.model.drafts import DraftHead, load_draft
from shared.model.llama import TargetOutput
from shared.request import Request
from shared.scheduler import Chunk
from shared.spec.state import DraftState
from shared.spec.tree import Candidates, DraftTree, select_tree
from shared.spec.verify import Acceptance, greedy_accept, sampled_accept


def shifted_tokens(req: Request, start: int, end: int) -> list[int]:
    """Draft input ids for draft positions [start, end): tokens start+1 .. end.

    The tail token (at ``end``) is the next prompt token when the chunk stops inside the prompt and
    the token the target sampled when it does not: both are simply the request's token at ``end``.
    """
    ids = req.all_ids
    if end >= len(ids):
        raise ValueError(f"{req.rid}: tail token at {end} is not known yet ({len(ids)} tokens)")
    return ids[start + 1:end + 1]


class SpecWorker:
    def __init__(self, engine, draft: DraftHead, spec: SpecConfig, config: EngineConfig):
        from shared.engine import make_cache

        self.engine = engine
        self.target = engine.model
        self.target_cache: KVCache = engine.cache
        self.draft = draft
        self.spec = spec
        if draft.kind == "mtp" and draft.num_caches < spec.steps:
            raise ValueError(f"spec steps: the multi-layer draft has {draft.num_caches} layers, "
                             f"steps={spec.steps} needs one per step")
        n_caches = spec.steps if draft.kind == "mtp" else 1
        self.caches = [make_cache(draft.config, draft.layers_per_cache, config, engine.max_context)
                       for _ in range(n_caches)]
        self.capture_mode = "aux" if draft.kind == "eagle3" else "last"
        self.aux_layers = getattr(draft, "aux_layers", ())

    @classmethod
    def load(cls, path: str | Path, engine, config: EngineConfig) -> "SpecWorker":
        draft = load_draft(path, engine.model, config.dtype, config.device)
        return cls(engine, draft, config.spec or SpecConfig(), config)

    @property
    def dtype(self) -> torch.dtype:
        return self.target.lm_head.weight.dtype

    @property
    def headroom(self) -> int:
        s = self.spec
        return max(s.num_draft_tokens, s.topk * s.steps) + 1

    def cache_of_step(self, step: int) -> int:
        """Draft step ``step`` (0 = the extend that produces the first tree level) -> cache index."""
        return self.draft.cache_for_step(step) if self.draft.kind == "mtp" else 0

    # ---- draft extend ----------------------------------------------------------------------------
    def features(self, out: TargetOutput) -> torch.Tensor:
        return out.aux_hidden if self.capture_mode == "aux" else out.hidden

    def draft_extend_prefill(self, chunks: list[Chunk], out: TargetOutput) -> None:
        """Run the draft over each prefill chunk; requests whose prompt completed get a DraftState."""
        spans = [(c.req, c.start, c.end) for c in chunks]
        finals = [c.completes_prompt and c.req.finish_reason is None for c in chunks]
        self.draft_extend(spans, self.features(out), finals)

    def draft_extend(self, spans: list[tuple[Request, int, int]], features: torch.Tensor,
                     finals: list[bool]) -> None:
        """Draft positions [start, end) of each request, fed target features [sum(end-start), W].

        Every draft cache runs the extend (a multi-layer draft keeps all its layers' KV complete);
        the first tree level of the next step comes from cache 0's layer at each span's last row.
        """
        q_lens = [e - s for _, s, e in spans]
        ids = torch.tensor([t for r, s, e in spans for t in shifted_tokens(r, s, e)], dtype=torch.int64)
        pos = torch.cat([torch.arange(s, e) for _, s, e in spans]) if spans else torch.zeros(0, dtype=torch.int64)
        ends = torch.tensor(q_lens, dtype=torch.int64).cumsum(0) - 1
        last_rows = ends[torch.tensor(finals, dtype=torch.bool)] if spans else ends
        state_out = None
        for c, cache in enumerate(self.caches):
            rows = [r.handles[1 + c].row for r, _, _ in spans]
            for r, _, e in spans:
                cache.reserve(r.handles[1 + c], e)
            batch = build_forward_batch(cache, rows, [s for _, s, _ in spans], q_lens, ids, pos, pos,
                                        logits_rows=last_rows)
            o = self.draft(batch, cache, c, features, from_target=True)
            if c == 0:
                state_out = o
        finishing = [r for (r, _, e), f in zip(spans, finals) if f]
        self._set_states(finishing, state_out.hidden[last_rows], state_out.logits)

    def _set_states(self, reqs: list[Request], hidden: torch.Tensor, logits: torch.Tensor) -> None:
        topk_p, topk_draft = torch.softmax(logits, dim=-1).topk(self.spec.topk, dim=-1)
        topk_ids = self.draft.to_target_ids(topk_draft)
        for i, req in enumerate(reqs):
            req.draft_state = DraftState(
                bonus_token=req.all_ids[req.kv_len], committed_len=req.kv_len, hidden=hidden[i],
                topk_p=topk_p[i], topk_ids=topk_ids[i],
            )

    # ---- one decode step -------------------------------------------------------------------------
    def decode_step(self, reqs: list[Request]) -> list[tuple[Request, list[int]]]:
        t0 = time.perf_counter()
        tree = self.draft_tree(reqs)
        t1 = time.perf_counter()
        out, acc = self.verify(reqs, tree)
        t2 = time.perf_counter()
        events = self.commit(reqs, tree, out, acc)
        for req in reqs:
            req.stats.draft_time_s += (t1 - t0) / max(len(reqs), 1)
            req.stats.verify_time_s += (t2 - t1) / max(len(reqs), 1)
        return events

    def draft_tree(self, reqs: list[Request]) -> DraftTree:
        """``steps - 1`` draft forwards grow the tree below the first level from the extend."""
        s = self.spec
        k = s.topk
        states = [r.draft_state for r in reqs]
        B = len(reqs)
        dev = self.target_cache.spec.device
        L = torch.tensor([st.committed_len for st in states], dtype=torch.int64)
        cand = Candidates.first_level(self._stack([st.topk_ids for st in states], (B, k), torch.int64),
                                      self._stack([st.topk_p for st in states], (B, k), torch.float32))
        leaf_idx = torch.arange(k, device=dev).expand(B, k)  # candidate index of each leaf
        leaf_hidden = self._stack([st.hidden for st in states], (B, self.draft.hidden_width), self.dtype)
        leaf_hidden = leaf_hidden.unsqueeze(1).expand(B, k, -1)
        ancestors = torch.zeros(B, k, 0, dtype=torch.bool, device=dev)  # over earlier forwards' leaves
        step_cache: list[int] = []
        for i in range(s.steps - 1):
            c = self.cache_of_step(i + 1)
            step_cache.append(c)
            same = torch.tensor([sc == c for sc in step_cache for _ in range(k)], dtype=torch.bool, device=dev)
            visible = torch.cat([ancestors, torch.eye(k, dtype=torch.bool, device=dev).expand(B, k, k)], 2)
            o = self._draft_forward(reqs, c, L, i, cand.tokens.gather(1, leaf_idx), leaf_hidden,
                                    visible[:, :, same], scratch_before=int(same[:-k].sum()))
            child_p, child_draft = torch.softmax(o.logits, dim=-1).topk(k, dim=-1)  # [B*k, k]
            child_tokens = self.draft.to_target_ids(child_draft).view(B, k * k)
            parent_scores = cand.scores.gather(1, leaf_idx)
            scores = (parent_scores.unsqueeze(2) * child_p.view(B, k, k)).view(B, k * k)
            base = cand.tokens.shape[1]
            cand.add(child_tokens, leaf_idx.repeat_interleave(k, dim=1), scores, depth=i + 2)
            best = scores.topk(k, dim=1).indices  # the next leaves, among this level's children
            parent_slot = best // k  # which current leaf each next leaf hangs from
            leaf_hidden = o.hidden.view(B, k, -1).gather(1, parent_slot.unsqueeze(2).expand(-1, -1, o.hidden.shape[-1]))
            ancestors = torch.cat([ancestors.gather(1, parent_slot.unsqueeze(2).expand(-1, -1, ancestors.shape[2])),
                                   torch.nn.functional.one_hot(parent_slot, k).bool()], 2)
            leaf_idx = base + best
        for c, cache in enumerate(self.caches):  # scratch K/V of the tree is dropped
            for r, st in zip(reqs, states):
                cache.shrink(r.handles[1 + c], st.committed_len)
        roots = torch.tensor([st.bonus_token for st in states], dtype=torch.int64, device=dev)
        return select_tree(roots, cand, s.num_draft_tokens, s.steps)

    def _draft_forward(self, reqs, c: int, L: torch.Tensor, step: int, tokens: torch.Tensor,
                       hidden: torch.Tensor, visible: torch.Tensor, scratch_before: int):
        """Draft forward ``step`` (position L + step) of the k leaves of every request, on cache c."""
        B, k = tokens.shape
        cache = self.caches[c]
        for r, l in zip(reqs, L.tolist()):
            cache.reserve(r.handles[1 + c], l + scratch_before + k)
        write = (L.unsqueeze(1) + scratch_before + torch.arange(k)).flatten()
        positions = (L + step).repeat_interleave(k)
        batch = build_forward_batch(
            cache, [r.handles[1 + c].row for r in reqs], L.tolist(), [k] * B, tokens.flatten().cpu(),
            positions, write, extra_lens=[scratch_before + k] * B, custom_mask=visible.flatten(),
        )
        return self.draft(batch, cache, c, hidden.reshape(B * k, -1), from_target=False)

    def _stack(self, tensors: list[torch.Tensor], shape: tuple, dtype) -> torch.Tensor:
        dev = self.target_cache.spec.device
        if not tensors:
            return torch.zeros(shape, dtype=dtype, device=dev)
        return torch.stack([t.to(dev) for t in tensors]).to(dtype)

    # ---- verify ----------------------------------------------------------------------------------
    def verify(self, reqs: list[Request], tree: DraftTree) -> tuple[TargetOutput, Acceptance]:
        B, N = tree.tokens.shape
        L = torch.tensor([r.draft_state.committed_len for r in reqs], dtype=torch.int64)
        for r, l in zip(reqs, L.tolist()):
            self.target_cache.reserve(r.handles[0], l + N)
        write = (L.unsqueeze(1) + torch.arange(N)).flatten()
        positions = (L.unsqueeze(1) + tree.depths.cpu()).flatten()
        batch = build_forward_batch(
            self.target_cache, [r.handles[0].row for r in reqs], L.tolist(), [N] * B,
            tree.tokens.flatten().cpu(), positions, write, custom_mask=tree.mask.flatten(),
        )
        out = self.target(batch, self.target_cache, capture=self.capture_mode, aux_layers=self.aux_layers)
        logits = out.logits.view(B, N, -1)
        if all(r.params.greedy for r in reqs):
            acc = greedy_accept(tree, logits.argmax(dim=-1), self.spec.steps)
        else:
            acc = sampled_accept(tree, logits, [r.params for r in reqs], [r.generator for r in reqs],
                                 self.spec.steps)
        return out, acc

    # ---- accept: commit tokens, compact K/V, extend the draft ------------------------------------
    def commit(self, reqs: list[Request], tree: DraftTree, out: TargetOutput,
               acc: Acceptance) -> list[tuple[Request, list[int]]]:
        B, N = tree.tokens.shape
        stride = acc.accept_index.shape[1]  # steps + 1: the one stride of every gather below
        path = acc.accept_index.clamp(min=0)
        flat = (path + torch.arange(B, device=path.device).unsqueeze(1) * N).flatten()  # [B*stride]
        logprobs = torch.log_softmax(out.logits, dim=-1)
        # Token committed after path node d: the next path node's token, or the bonus after the last.
        nxt_tok = torch.cat([tree.tokens.gather(1, path[:, 1:]), acc.bonus.unsqueeze(1)], 1)
        nxt_tok = torch.where(torch.arange(stride, device=path.device) == (acc.accept_len - 1).unsqueeze(1),
                              acc.bonus.unsqueeze(1), nxt_tok)
        token_lp = logprobs[flat].gather(1, nxt_tok.reshape(-1, 1)).view(B, stride)
        path_features = self.features(out)[flat].view(B, stride, -1)
        lens, toks, lps = acc.accept_len.tolist(), nxt_tok.tolist(), token_lp.tolist()
        index_host = acc.accept_index.tolist()
        events, spans, feats = [], [], []
        for b, req in enumerate(reqs):
            n = lens[b]
            L = req.draft_state.committed_len
            taken = req.commit(toks[b][:n], lps[b][:n])
            events.append((req, taken))
            req.stats.verify_steps += 1
            req.stats.accepted_drafts += n - 1
            req.stats.proposed_drafts += self.spec.steps
            if req.finish_reason is not None:
                continue
            self.target_cache.compact(req.handles[0], L, index_host[b][:n])
            self.target_cache.shrink(req.handles[0], L + n)
            req.kv_len = L + n
            spans.append((req, L, L + n))
            feats.append(path_features[b, :n])
        width = self.draft.feature_width(from_target=True)
        features = torch.cat(feats) if feats else torch.zeros(0, width, device=path.device, dtype=self.dtype)
        self.draft_extend(spans, features, [True] * len(spans))
        return events
