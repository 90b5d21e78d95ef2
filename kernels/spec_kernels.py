"""Small speculative-decoding kernels, each beside the plain-torch reference of its contract.

Each replaces a chain of small torch ops (tens of launches per decode step) by one launch:

* ``build_tree``: EAGLE-2 tree (``DraftTree``) from the draft candidates' scores: the best
  ``num_nodes - 1`` candidates by score (stable), put back in creation order after the root; node
  tokens, parents, depths, ancestor-or-self mask and, when asked, positions.
* ``greedy_verify``: the accepted path (``Acceptance``) where every node's token equals the
  target's argmax after its parent.
  Sampled (and mixed) batches are verified by ``kernels.spec_sampling.tree_verify``, which returns
  the same ``Acceptance``.
* ``move_kv``: the accepted path's K/V copied to its new positions in every layer at once (page size
  > 1, where compaction moves bytes instead of re-pointing slots).
* ``gather_accepted``: per accepted-path slot, the committed token (the next path node's token, or
  the bonus token after the last), its target log-probability (log-softmax fused, the gathered logits
  never materialised) and the path node's feature row.

Each contract has one torch version, its ``*_ref`` here. The wrappers run the kernel on CUDA tensors
(or with ``backend="triton"``, as the interpreter tests do) and the reference otherwise, so callers
(shared/spec) call the wrapper on every device. None reads a device value on the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.launch import fast

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a dependency, but keep the references usable
    triton = None


def _use_triton(x: torch.Tensor, backend: str) -> bool:
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"backend must be auto, triton or torch, got {backend!r}")
    return triton is not None and (backend == "triton" or (backend == "auto" and x.is_cuda))


def _p2(n: int) -> int:
    return max(2, triton.next_power_of_2(n)) if triton is not None else n


# =================================================================================================
# Tree build
# =================================================================================================
@dataclass
class DraftTree:
    tokens: torch.Tensor  # [B, N] int64, node 0 = root (the bonus token), then creation order
    parents: torch.Tensor  # [B, N] int64, -1 for the root; a parent's index is below its child's
    depths: torch.Tensor  # [B, N] int64, root 0
    mask: torch.Tensor  # [B, N, N] bool, node i sees node j iff j is i or an ancestor of i
    positions: torch.Tensor | None = None  # [B, N] int64 committed_len + depth, when committed_len was given

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]


def ancestor_mask(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """parents [B, N] (-1 = root) -> [B, N, N] ancestor-or-self, following parent links ``max_depth`` times."""
    B, N = parents.shape
    node = torch.arange(N, device=parents.device)
    mask = torch.eye(N, dtype=torch.bool, device=parents.device).expand(B, -1, -1).clone()
    cur = node.expand(B, -1)
    for _ in range(max_depth):
        cur = torch.where(cur >= 0, parents.gather(1, cur.clamp(min=0)), -1)
        mask |= cur.unsqueeze(2) == node  # -1 (past the root) matches no node
    return mask


def build_tree_ref(root: torch.Tensor, cand_tokens: torch.Tensor, cand_parents: torch.Tensor,
                   cand_scores: torch.Tensor, cand_depths: torch.Tensor, num_nodes: int, max_depth: int,
                   committed_len: torch.Tensor | None = None) -> DraftTree:
    """Candidates [B, M] (parents: candidate index, -1 = the root; a parent precedes its children and
    scores never grow along a path) -> the tree of the root plus the ``num_nodes - 1`` best candidates."""
    B, M = cand_tokens.shape
    dev = cand_tokens.device
    order = torch.sort(cand_scores, dim=1, descending=True, stable=True).indices[:, :num_nodes - 1]
    sel = order.sort(dim=1).values  # creation order: parents first
    node_of = torch.full((B, M), -1, dtype=torch.int64, device=dev)
    node_of.scatter_(1, sel, torch.arange(1, num_nodes, device=dev).expand(B, -1))
    cand_parent = cand_parents.gather(1, sel)
    node_parent = torch.where(cand_parent < 0, 0, node_of.gather(1, cand_parent.clamp(min=0)))
    parents = torch.cat([torch.full((B, 1), -1, dtype=torch.int64, device=dev), node_parent], 1)
    tokens = torch.cat([root.view(B, 1).to(torch.int64), cand_tokens.gather(1, sel)], 1)
    depths = torch.cat([torch.zeros(B, 1, dtype=torch.int64, device=dev), cand_depths.gather(1, sel)], 1)
    positions = None if committed_len is None else committed_len.view(B, 1) + depths
    return DraftTree(tokens=tokens, parents=parents, depths=depths, mask=ancestor_mask(parents, max_depth),
                     positions=positions)


if triton is not None:
    @triton.jit
    def _build_tree_kernel(scores, ctok, cpar, cdep, root, committed, node_of,
                           tokens, parents, depths, mask, positions,
                           M, max_depth,
                           NUM_NODES: tl.constexpr, M_P2: tl.constexpr, N_P2: tl.constexpr, CHUNK: tl.constexpr,
                           HAS_POS: tl.constexpr):
        b = tl.program_id(0)
        offs_c = tl.arange(0, M_P2)
        c_ok = offs_c < M
        s = tl.load(scores + b * M + offs_c, mask=c_ok, other=0.0)
        # Stable descending rank: candidates scoring higher, or equal and made earlier, come first.
        rank = tl.zeros([M_P2], tl.int32)
        for j0 in range(0, M, CHUNK):
            offs_j = j0 + tl.arange(0, CHUNK)
            j_ok = offs_j < M
            sj = tl.load(scores + b * M + offs_j, mask=j_ok, other=0.0)
            before = (sj[None, :] > s[:, None]) | ((sj[None, :] == s[:, None]) & (offs_j[None, :] < offs_c[:, None]))
            rank += tl.sum((before & j_ok[None, :]).to(tl.int32), 1)
        chosen = c_ok & (rank < NUM_NODES - 1)
        node = tl.cumsum(chosen.to(tl.int32), 0)  # 1-based node index of a chosen candidate, creation order
        tl.store(node_of + b * M + offs_c, tl.where(chosen, node, -1), mask=c_ok)
        tl.debug_barrier()  # node_of is read back below by other threads of this program
        cp = tl.load(cpar + b * M + offs_c, mask=chosen, other=-1)
        parent_node = tl.where(cp < 0, 0, tl.load(node_of + b * M + tl.maximum(cp, 0), mask=chosen, other=0))
        out = b * NUM_NODES + node
        tl.store(tokens + out, tl.load(ctok + b * M + offs_c, mask=chosen), mask=chosen)
        tl.store(parents + out, parent_node.to(tl.int64), mask=chosen)
        tl.store(depths + out, tl.load(cdep + b * M + offs_c, mask=chosen), mask=chosen)
        tl.store(tokens + b * NUM_NODES, tl.load(root + b).to(tl.int64))
        tl.store(parents + b * NUM_NODES, tl.full([], -1, tl.int64))
        tl.store(depths + b * NUM_NODES, tl.zeros([], tl.int64))
        tl.debug_barrier()  # the node-ordered parents are read back by other threads

        offs_n = tl.arange(0, N_P2)
        n_ok = offs_n < NUM_NODES
        par = tl.load(parents + b * NUM_NODES + offs_n, mask=n_ok, other=-1)
        anc = offs_n[:, None] == offs_n[None, :]
        cur = offs_n.to(tl.int64)
        for _ in range(max_depth):
            up = tl.sum(tl.where(cur[:, None] == offs_n[None, :], par[None, :], 0), 1)  # par[cur]
            cur = tl.where(cur >= 0, up, -1)
            anc = anc | (cur[:, None] == offs_n[None, :])
        grid_ok = n_ok[:, None] & n_ok[None, :]
        tl.store(mask + b * NUM_NODES * NUM_NODES + offs_n[:, None] * NUM_NODES + offs_n[None, :],
                 anc.to(tl.uint8), mask=grid_ok)
        if HAS_POS:
            dep = tl.load(depths + b * NUM_NODES + offs_n, mask=n_ok, other=0)
            tl.store(positions + b * NUM_NODES + offs_n, tl.load(committed + b) + dep, mask=n_ok)


def build_tree(root: torch.Tensor, cand_tokens: torch.Tensor, cand_parents: torch.Tensor, cand_scores: torch.Tensor,
               cand_depths: torch.Tensor, num_nodes: int, max_depth: int, committed_len: torch.Tensor | None = None,
               backend: str = "auto") -> DraftTree:
    """One launch for the whole tree (the two sorts become a rank count in the kernel)."""
    if not _use_triton(cand_scores, backend) or cand_tokens.shape[0] == 0:
        return build_tree_ref(root, cand_tokens, cand_parents, cand_scores, cand_depths, num_nodes, max_depth,
                              committed_len)
    B, M = cand_tokens.shape
    if not 1 <= num_nodes - 1 <= M:
        raise ValueError(f"num_nodes {num_nodes} needs 1..{M} candidates")
    dev = cand_tokens.device
    i64 = {"dtype": torch.int64, "device": dev}
    out = DraftTree(tokens=torch.empty(B, num_nodes, **i64), parents=torch.empty(B, num_nodes, **i64),
                    depths=torch.empty(B, num_nodes, **i64),
                    mask=torch.empty(B, num_nodes, num_nodes, dtype=torch.bool, device=dev),
                    positions=None if committed_len is None else torch.empty(B, num_nodes, **i64))
    node_of = torch.empty(B, M, dtype=torch.int32, device=dev)
    fast(_build_tree_kernel)[(B,)](
        cand_scores.float().contiguous(), cand_tokens.contiguous(), cand_parents.contiguous(),
        cand_depths.contiguous(), root.contiguous(), committed_len if committed_len is not None else root,
        node_of, out.tokens, out.parents, out.depths, out.mask.view(torch.uint8),
        out.positions if out.positions is not None else out.tokens, M, max_depth,
        NUM_NODES=num_nodes, M_P2=_p2(M), N_P2=_p2(num_nodes), CHUNK=min(64, _p2(M)),
        HAS_POS=committed_len is not None, num_warps=4 if M <= 256 else 8,
    )
    return out


# =================================================================================================
# Greedy verify
# =================================================================================================
@dataclass
class Acceptance:
    """The accepted path of a tree (greedy or sampled). ``accept_index``'s width (steps + 1) is the
    stride of every per-token gather that follows (seed 004)."""

    accept_index: torch.Tensor  # [B, steps+1] int64 node indices of the accepted path, root first, -1 padded
    accept_len: torch.Tensor  # [B] int64 accepted nodes including the root (>= 1)
    bonus: torch.Tensor  # [B] int64 the target's token committed after the last accepted node


def greedy_verify_ref(parents: torch.Tensor, tokens: torch.Tensor, target_argmax: torch.Tensor,
                      steps: int) -> Acceptance:
    """From the root, repeatedly follow the first child whose token is the target's argmax after the
    current node; the bonus is the argmax after the last accepted node."""
    B = tokens.shape[0]
    dev = tokens.device
    cur = torch.zeros(B, dtype=torch.int64, device=dev)
    alive = torch.ones(B, dtype=torch.bool, device=dev)
    index = torch.full((B, steps + 1), -1, dtype=torch.int64, device=dev)
    index[:, 0] = 0
    for d in range(1, steps + 1):
        want = target_argmax.gather(1, cur.unsqueeze(1))
        match = (parents == cur.unsqueeze(1)) & (tokens == want) & alive.unsqueeze(1)
        found = match.any(dim=1)
        nxt = match.to(torch.int8).argmax(dim=1)
        index[:, d] = torch.where(found, nxt, -1)
        cur = torch.where(found, nxt, cur)
        alive &= found
    return Acceptance(index, (index >= 0).sum(dim=1), target_argmax.gather(1, cur.unsqueeze(1)).squeeze(1))


if triton is not None:
    @triton.jit
    def _greedy_verify_kernel(parents, tokens, argmax, index, length, bonus, N, STEPS: tl.constexpr,
                              N_P2: tl.constexpr):
        b = tl.program_id(0)
        offs = tl.arange(0, N_P2)
        ok = offs < N
        par = tl.load(parents + b * N + offs, mask=ok, other=-2)
        tok = tl.load(tokens + b * N + offs, mask=ok, other=-1)
        cur = tl.zeros([], tl.int64)
        alive = tl.full([], 1, tl.int32)
        n_acc = tl.full([], 1, tl.int64)
        tl.store(index + b * (STEPS + 1), n_acc * 0)
        for d in range(1, STEPS + 1):
            want = tl.load(argmax + b * N + cur)
            match = (par == cur) & (tok == want) & ok
            nxt = tl.min(tl.where(match, offs, N_P2), 0).to(tl.int64)
            found = (nxt < N_P2) & (alive != 0)
            tl.store(index + b * (STEPS + 1) + d, tl.where(found, nxt, -1))
            cur = tl.where(found, nxt, cur)
            n_acc += found.to(tl.int64)
            alive = found.to(tl.int32)
        tl.store(length + b, n_acc)
        tl.store(bonus + b, tl.load(argmax + b * N + cur))


def greedy_verify(parents: torch.Tensor, tokens: torch.Tensor, target_argmax: torch.Tensor, steps: int,
                  backend: str = "auto") -> Acceptance:
    if not _use_triton(tokens, backend) or tokens.shape[0] == 0:
        return greedy_verify_ref(parents, tokens, target_argmax, steps)
    B, N = tokens.shape
    dev = tokens.device
    out = Acceptance(torch.empty(B, steps + 1, dtype=torch.int64, device=dev),
                         torch.empty(B, dtype=torch.int64, device=dev), torch.empty(B, dtype=torch.int64, device=dev))
    fast(_greedy_verify_kernel)[(B,)](
        parents.contiguous(), tokens.contiguous(), target_argmax.contiguous(), out.accept_index, out.accept_len,
        out.bonus, N, STEPS=steps, N_P2=_p2(N), num_warps=1)
    return out


# =================================================================================================
# KV move for accepted-path compaction
# =================================================================================================
def move_kv_ref(k_layers: list[torch.Tensor], v_layers: list[torch.Tensor], src: torch.Tensor,
                dst: torch.Tensor) -> None:
    """In place, every layer: ``cache[dst[b, i]] = cache[src[b, i]]`` for K and V, all reads before
    the writes. ``src, dst [B, S]`` slots; rows touch disjoint slots except no-op pairs (src == dst),
    e.g. padding rows that move the sink slot 0 onto itself."""
    s, d = src.reshape(-1), dst.reshape(-1)
    for cache in (*k_layers, *v_layers):
        cache[d] = cache[s]


_PTR_TABLES: dict[tuple[int, ...], torch.Tensor] = {}


def _pointer_table(caches: list[torch.Tensor]) -> torch.Tensor:
    """Device table of the caches' addresses, built once per set of caches (outside graph capture:
    the decode phases warm up eagerly before they are captured)."""
    key = tuple(c.data_ptr() for c in caches)
    table = _PTR_TABLES.get(key)
    if table is None:
        if caches[0].is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("move_kv: run once eagerly before capturing (its pointer table is built then)")
        table = torch.tensor(key, dtype=torch.int64).to(caches[0].device)
        _PTR_TABLES[key] = table
    return table


if triton is not None:
    @triton.jit
    def _move_kv_kernel(table, src, dst, S, row_elems, DT: tl.constexpr, S_P2: tl.constexpr, BLOCK: tl.constexpr):
        b = tl.program_id(0)
        layer = tl.program_id(1)
        chunk = tl.program_id(2)
        base = tl.load(table + layer).to(tl.pointer_type(DT))
        offs_s = tl.arange(0, S_P2)
        s_ok = offs_s < S
        si = tl.load(src + b * S + offs_s, mask=s_ok, other=0)
        di = tl.load(dst + b * S + offs_s, mask=s_ok, other=0)
        offs_e = chunk * BLOCK + tl.arange(0, BLOCK)
        m = s_ok[:, None] & (offs_e < row_elems)[None, :]
        x = tl.load(base + si[:, None] * row_elems + offs_e[None, :], mask=m)
        tl.debug_barrier()  # every read of this request's rows lands before any write
        tl.store(base + di[:, None] * row_elems + offs_e[None, :], x, mask=m)


_TL_DTYPES = {}
if triton is not None:
    _TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16,
                  torch.uint8: tl.uint8, torch.int8: tl.int8}


def move_kv(k_layers: list[torch.Tensor], v_layers: list[torch.Tensor], src: torch.Tensor, dst: torch.Tensor,
            backend: str = "auto") -> None:
    """One launch moves the rows of every layer's K and V (contract: ``move_kv_ref``)."""
    caches = [*k_layers, *v_layers]
    if not _use_triton(caches[0], backend) or src.numel() == 0:
        return move_kv_ref(k_layers, v_layers, src, dst)
    first = caches[0]
    if any(c.dtype != first.dtype or c.shape[1:] != first.shape[1:] or not c.is_contiguous() for c in caches):
        raise ValueError("move_kv needs contiguous caches of one dtype and row shape")
    src2, dst2 = src.reshape(src.shape[0], -1), dst.reshape(dst.shape[0], -1)
    B, S = src2.shape
    row_elems = first[0].numel()
    block = min(1024, _p2(row_elems))
    fast(_move_kv_kernel)[(B, len(caches), triton.cdiv(row_elems, block))](
        _pointer_table(caches), src2.contiguous(), dst2.contiguous(), S, row_elems,
        DT=_TL_DTYPES[first.dtype], S_P2=_p2(S), BLOCK=block, num_warps=4)


# =================================================================================================
# Accepted-path gather (bonus token, log-probabilities, features)
# =================================================================================================
@dataclass
class AcceptedPath:
    tokens: torch.Tensor  # [B, S] int64 token committed after path slot d (the bonus after the last)
    logprobs: torch.Tensor  # [B, S] float32 target log p of that token after path node d
    feats: torch.Tensor  # [B, S, W] the path nodes' feature rows


def gather_accepted_ref(accept_index: torch.Tensor, accept_len: torch.Tensor, bonus: torch.Tensor,
                        tree_tokens: torch.Tensor, logits: torch.Tensor, feats: torch.Tensor) -> AcceptedPath:
    """Slot d of the path (node ``accept_index[b, d]``, -1 read as the root): the committed token is
    the next path node's token, or ``bonus`` at the last accepted slot (and at the final slot);
    logprob = log_softmax(logits[node])[token] in float32; the feature row of the node."""
    stride = accept_index.shape[1]
    path = accept_index.clamp(min=0)
    slot = torch.arange(stride, device=accept_index.device)
    last = accept_len - 1
    tokens = torch.cat([tree_tokens.gather(1, path[:, 1:]), bonus.unsqueeze(1)], 1)
    tokens = torch.where(slot == last.unsqueeze(1), bonus.unsqueeze(1), tokens)
    logprobs = torch.log_softmax(logits.gather(1, path.unsqueeze(2).expand(-1, -1, logits.shape[2])), dim=-1)
    logprobs = logprobs.gather(2, tokens.unsqueeze(2)).squeeze(2)
    path_feats = feats.gather(1, path.unsqueeze(2).expand(-1, -1, feats.shape[2]))
    return AcceptedPath(tokens=tokens, logprobs=logprobs, feats=path_feats)


if triton is not None:
    @triton.jit
    def _gather_accepted_kernel(accept_index, accept_len, bonus, tree_tokens, logits, feats,
                                out_tokens, out_logprobs, out_feats, S, N, V, W,
                                BLOCK_V: tl.constexpr, BLOCK_W: tl.constexpr):
        b = tl.program_id(0)
        d = tl.program_id(1)
        node = tl.maximum(tl.load(accept_index + b * S + d), 0)
        nxt = tl.maximum(tl.load(accept_index + b * S + d + 1, mask=d + 1 < S, other=0), 0)
        last = tl.load(accept_len + b) - 1
        from_tree = tl.load(tree_tokens + b * N + nxt)
        token = tl.where((d == last) | (d + 1 >= S), tl.load(bonus + b), from_tree)
        tl.store(out_tokens + b * S + d, token)
        row = logits + (b * N + node) * V
        m = tl.full([], float("-inf"), tl.float32)
        s = tl.zeros([], tl.float32)
        for lo in range(0, V, BLOCK_V):  # online log-sum-exp over the vocabulary
            offs = lo + tl.arange(0, BLOCK_V)
            x = tl.load(row + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(x, 0))
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
            m = m_new
        picked = tl.load(row + token).to(tl.float32)
        tl.store(out_logprobs + b * S + d, picked - m - tl.log(s))
        for lo in range(0, W, BLOCK_W):
            offs = lo + tl.arange(0, BLOCK_W)
            f = tl.load(feats + (b * N + node) * W + offs, mask=offs < W)
            tl.store(out_feats + (b * S + d) * W + offs, f, mask=offs < W)


def gather_accepted(accept_index: torch.Tensor, accept_len: torch.Tensor, bonus: torch.Tensor,
                    tree_tokens: torch.Tensor, logits: torch.Tensor, feats: torch.Tensor,
                    backend: str = "auto") -> AcceptedPath:
    """One launch of B x S programs (contract: ``gather_accepted_ref``)."""
    if not _use_triton(logits, backend) or accept_index.shape[0] == 0:
        return gather_accepted_ref(accept_index, accept_len, bonus, tree_tokens, logits, feats)
    B, S = accept_index.shape
    N, V = logits.shape[1], logits.shape[2]
    W = feats.shape[2]
    dev = logits.device
    out = AcceptedPath(tokens=torch.empty(B, S, dtype=torch.int64, device=dev),
                       logprobs=torch.empty(B, S, dtype=torch.float32, device=dev),
                       feats=torch.empty(B, S, W, dtype=feats.dtype, device=dev))
    fast(_gather_accepted_kernel)[(B, S)](accept_index.contiguous(), accept_len.contiguous(), bonus.contiguous(),
                                          tree_tokens.contiguous(), logits.contiguous(), feats.contiguous(),
                                          out.tokens, out.logprobs, out.feats, S, N, V, W,
                                          BLOCK_V=min(4096, _p2(V)), BLOCK_W=min(1024, _p2(W)),
                                          num_warps=8 if V >= 8192 else 4)
    return out
