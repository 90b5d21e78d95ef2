"""Sampled speculative verification on the device: greedy, sampled and mixed batches in one launch.

Two contracts, each a Triton kernel (on CUDA tensors, or with ``backend="triton"`` under the
interpreter) beside the plain-torch reference that runs everywhere else:

* ``target_weights``: per tree node, the target's distribution under its request's temperature,
  top-k and top-p, as unnormalised weights ``w = exp((logit - max) / T)`` (float32, 1 at the argmax)
  plus, per node, the integer threshold and total of the kept weights (below). Greedy rows
  (temperature 0) are skipped: they read only the argmax.
* ``tree_verify``: the walk over the draft tree. Multi-candidate speculative sampling with the draft
  as a point mass on each child: child x is accepted with probability p(x); on rejection p <- p
  without x, renormalised, and the next sibling is tried; the bonus is drawn from what is left.
  Greedy rows follow the argmax (the same rule with p one-hot).

Exactness. Everything after the weights is integer arithmetic, so the kernel and the reference agree
bit for bit whatever order they sum in: each weight is quantised elementwise to ``W = floor(w * 2**40)``
(a power-of-two scaling and a truncation: exact), masses are int64 sums, and a draw compares a
uniform integer with an integer mass. (The float inverse CDF this replaces once drew 68449 on the GPU
and 68450 in the reference: a boundary where two summation orders disagree.) The cost is that a token
with ``w < 2**-40`` times the top weight is never drawn.

Top-k and top-p keep the tokens with ``W >= t`` for one threshold per node: ``t_k`` is the k-th
largest W (ties at it all kept), then ``t`` is the largest value with ``sum(W >= t) >= top_p * R_k``
(float64), where ``R_k`` is the mass kept by top-k: the smallest most-likely prefix that reaches
top_p, ties included. The reference sorts; the kernel searches the integer values (16-ary: 11
passes over the row, and none for a row without top-k or top-p); both find the same number.

Randomness is counter-based: every draw is a hash of (request seed, committed length L, node index,
word), the same integer hash in the kernel and the reference. So a request draws the same numbers
with or without CUDA graphs, with or without drafting ahead, beside any other requests, and on
another instance after a hand-off: its seed and L are all the state. Child c of the tree uses draw
c (each node is tried at most once per step); the bonus uses draw 0 (the root is never a child).
Target-only sampling (``shared.sampling.uniforms``) keys its draw by the drawn token's position and
uses draw ``TARGET_ONLY_DRAW``, which no node has: it never repeats a tree's draw.
A uniform integer in [0, R) is ``floor(h * R / 2**60)`` for a 60-bit hash h, computed exactly in
30-bit limbs (R < 2**60 holds for vocabularies below 2**20).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.launch import fast
from kernels.spec_kernels import Acceptance

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a dependency, but keep the references usable
    triton = None

QUANT_BITS = 40  # W = floor(w * 2**40); w <= 1, so W <= 2**40
SEARCH_WAYS = 16  # the kernel finds a threshold in [0, 2**40 + 1) by 16-ary search: 11 passes over the row
SEARCH_ROUNDS = 11
MAX_VOCAB = 1 << 20  # totals stay below 2**60, the range of the exact uniform draw
_M30 = (1 << 30) - 1
TARGET_ONLY_DRAW = (1 << 31) - 1  # the draw index of target-only sampling (no tree node has it)
_M32 = (1 << 32) - 1


@dataclass
class SamplingRows:
    """The sampling parameters of a batch's requests, on the device. Padding rows are all zeros:
    temperature 0, i.e. greedy."""

    temperature: torch.Tensor  # [B] float32, 0 = greedy
    top_k: torch.Tensor  # [B] int64, 0 = off
    top_p: torch.Tensor  # [B] float32, 1 = off
    seed: torch.Tensor  # [B] int64, the request's 64-bit seed (two's complement)


@dataclass
class TargetWeights:
    """The target's distribution after each tree node, in the form both contracts exchange."""

    weights: torch.Tensor  # [B, N, V] float32 exp((logit - max) / T); unset on greedy rows
    thresh: torch.Tensor  # [B, N] int64 kept tokens: W >= thresh (0 on greedy rows)
    total: torch.Tensor  # [B, N] int64 sum of the kept W (0 on greedy rows)


def _use_triton(x: torch.Tensor, backend: str) -> bool:
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"backend must be auto, triton or torch, got {backend!r}")
    return triton is not None and (backend == "triton" or (backend == "auto" and x.is_cuda))


def _p2(n: int) -> int:
    return max(2, 1 << (n - 1).bit_length())


def quantize(w: torch.Tensor) -> torch.Tensor:
    """Elementwise, exact: float32 weights in [0, 1] -> int64 ``floor(w * 2**40)``."""
    return (w.float() * float(1 << QUANT_BITS)).to(torch.int64)


def kept_weights(tw: TargetWeights) -> torch.Tensor:
    """[B, N, V] int64: the quantised weights top-k and top-p keep, zero elsewhere."""
    w = quantize(tw.weights)
    return torch.where(w >= tw.thresh.unsqueeze(-1), w, 0)


# =================================================================================================
# Counter-based draws (the kernel has the same hash below, integer op for integer op)
# =================================================================================================
def _mulmod32(x: torch.Tensor, c: int) -> torch.Tensor:
    """x * c mod 2**32 for x < 2**32, in 16-bit halves of c (no int64 product overflows)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit integer hash (xor-shift-multiply) of x < 2**32."""
    x = x ^ (x >> 16)
    x = _mulmod32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mulmod32(x, 0x846CA68B)
    return x ^ (x >> 16)


def request_key(seed: torch.Tensor, committed_len: torch.Tensor) -> torch.Tensor:
    """[B] int64 in [0, 2**32): the key of one request's draws at committed length L."""
    hi, lo = (seed >> 32) & _M32, seed & _M32
    return _mix32(_mix32(_mix32(hi ^ 0x1E3779B9) ^ lo) ^ (committed_len & _M32))


def draw_limbs(key: torch.Tensor, j: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 60-bit uniform of draw ``j`` under ``key`` as two 30-bit limbs (high, low)."""
    base = _mix32(key ^ 0x5BD1E995)
    return (_mix32(base ^ (j * 2)) & _M30), (_mix32(base ^ (j * 2 + 1)) & _M30)


def uniform_below(hi: torch.Tensor, lo: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    """``floor(h * bound / 2**60)`` for ``h = hi * 2**30 + lo``: uniform in [0, bound) for
    0 <= bound < 2**60, exact in int64 (every partial product < 2**62)."""
    b_hi, b_lo = bound >> 30, bound & _M30
    return hi * b_hi + ((hi * b_lo + lo * b_hi + ((lo * b_lo) >> 30)) >> 30)


# =================================================================================================
# Target weights: temperature, top-k, top-p per row
# =================================================================================================
def target_weights_ref(logits: torch.Tensor, rows: SamplingRows) -> TargetWeights:
    """``logits [B, N, V]`` -> the weights of every node and their top-k / top-p threshold and total
    (see the module docstring for the rule). Greedy rows get threshold and total 0."""
    B = logits.shape[0]
    temp = torch.where(rows.temperature > 0, rows.temperature, 1.0).float().view(B, 1, 1)
    z = logits.float() / temp
    return thresholds_ref(torch.exp(z - z.amax(-1, keepdim=True)), rows)


def thresholds_ref(weights: torch.Tensor, rows: SamplingRows) -> TargetWeights:
    """The top-k / top-p threshold and the kept total of each node's ``weights [B, N, V]``: the
    integer half of ``target_weights``, which the kernel matches exactly given the same weights."""
    B, N, V = weights.shape
    W = quantize(weights).view(B * N, V)
    sampled = (rows.temperature > 0).repeat_interleave(N)
    k = rows.top_k.to(torch.int64).repeat_interleave(N)
    p = rows.top_p.float().repeat_interleave(N)
    k = torch.where((k > 0) & (k < V), k, 0)
    ranked = W.sort(dim=1, descending=True).values  # the kernel searches instead, only where it must
    t_k = torch.where(k > 0, ranked.gather(1, (k - 1).clamp(min=0).unsqueeze(1)).squeeze(1), 0)
    kept = torch.where(ranked >= t_k.unsqueeze(1), ranked, 0)
    cum = kept.cumsum(1)
    reach = p.double() * cum[:, -1].double()
    first = (cum.double() >= reach.unsqueeze(1)).to(torch.int8).argmax(1)  # cum[-1] >= reach always
    t = torch.where(p < 1, kept.gather(1, first.unsqueeze(1)).squeeze(1), t_k)
    total = torch.where(W >= t.unsqueeze(1), W, 0).sum(1)
    t, total = torch.where(sampled, t, 0), torch.where(sampled, total, 0)
    return TargetWeights(weights=weights, thresh=t.view(B, N), total=total.view(B, N))


if triton is not None:
    @triton.jit
    def _quant(w):
        return (w * 1099511627776.0).to(tl.int64)  # 2**40: exact scaling, truncation = floor

    @triton.jit
    def _mass_at_least(w_row, V, cand, BLOCK_V: tl.constexpr):
        """For each candidate threshold t of ``cand [WAYS]``: count and sum of the quantised weights >= t."""
        count = tl.zeros_like(cand)  # int64, like the candidates
        mass = tl.zeros_like(cand)
        for lo in range(0, V, BLOCK_V):
            offs = lo + tl.arange(0, BLOCK_V)
            q = _quant(tl.load(w_row + offs, mask=offs < V, other=0.0))
            keep = (q[:, None] >= cand[None, :]) & (offs < V)[:, None]
            count += tl.sum(keep.to(tl.int64), 0)
            mass += tl.sum(tl.where(keep, q[:, None], 0), 0)
        return count, mass

    @triton.jit
    def _narrow(lo, hi, ok, cand, step, WAYS: tl.constexpr):
        """One round of a WAYS-ary search for the largest t in [lo, hi) with ok(t): ``cand`` are
        lo, lo + step, ... and ``ok`` holds (monotone) up to some of them; the range shrinks to one step."""
        i = tl.arange(0, WAYS)
        best = tl.max(tl.where(ok, i, 0), 0)
        new_lo = tl.sum(tl.where(i == best, cand, 0), 0)
        return new_lo, tl.minimum(new_lo + step, hi)

    @triton.jit
    def _target_weights_kernel(logits, temperature, top_k, top_p, weights, thresh, total, N, V,
                               BLOCK_V: tl.constexpr, SEARCH_BLOCK: tl.constexpr, ROUNDS: tl.constexpr,
                               WAYS: tl.constexpr):
        row = tl.program_id(0)  # b * N + node
        b = row // N
        temp = tl.load(temperature + b)
        t = tl.zeros([], tl.int64)
        mass = tl.zeros([], tl.int64)
        if temp > 0:  # greedy rows read only the argmax
            src = logits + row.to(tl.int64) * V
            dst = weights + row.to(tl.int64) * V
            # One scaling for both passes (two divisions may round apart: the GPU's fp32 division is not
            # exact), and weights clamped to 1: the largest quantises to 2**40, below the searches' top.
            inv = 1.0 / temp
            m = tl.full([], float("-inf"), tl.float32)
            for lo in range(0, V, BLOCK_V):
                offs = lo + tl.arange(0, BLOCK_V)
                x = tl.load(src + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
                m = tl.maximum(m, tl.max(x * inv, 0))
            for lo in range(0, V, BLOCK_V):
                offs = lo + tl.arange(0, BLOCK_V)
                x = tl.load(src + offs, mask=offs < V, other=0.0).to(tl.float32)
                w = tl.minimum(tl.exp(x * inv - m), 1.0)
                tl.store(dst + offs, w, mask=offs < V)
                mass += tl.sum(tl.where(offs < V, _quant(w), 0), 0)
            tl.debug_barrier()  # the weights are read back below by other threads of this program
            k = tl.load(top_k + b)
            p = tl.load(top_p + b)
            ways = tl.arange(0, WAYS).to(tl.int64)
            top = tl.full([], 1099511627777, tl.int64)  # 2**40 + 1: nothing weighs that much
            if (k > 0) & (k < V):  # the largest t with count(W >= t) >= k
                lo_t = t
                hi_t = top
                for _ in range(ROUNDS):
                    step = (hi_t - lo_t + WAYS - 1) // WAYS
                    cand = lo_t + ways * step
                    count, _m = _mass_at_least(dst, V, cand, SEARCH_BLOCK)
                    lo_t, hi_t = _narrow(lo_t, hi_t, (count >= k) & (cand < hi_t), cand, step, WAYS)
                t = lo_t
                _c, kept = _mass_at_least(dst, V, t + ways * 0, SEARCH_BLOCK)
                mass = tl.max(kept, 0)
            if p < 1.0:  # the largest t with sum(W >= t) >= top_p * (the mass top-k kept)
                reach = p.to(tl.float64) * mass.to(tl.float64)
                lo_t = t
                hi_t = top
                for _ in range(ROUNDS):
                    step = (hi_t - lo_t + WAYS - 1) // WAYS
                    cand = lo_t + ways * step
                    _c, got = _mass_at_least(dst, V, cand, SEARCH_BLOCK)
                    lo_t, hi_t = _narrow(lo_t, hi_t, (got.to(tl.float64) >= reach) & (cand < hi_t), cand, step, WAYS)
                t = lo_t
                _c, kept = _mass_at_least(dst, V, t + ways * 0, SEARCH_BLOCK)
                mass = tl.max(kept, 0)
        tl.store(thresh + row, t)
        tl.store(total + row, mass)


def target_weights(logits: torch.Tensor, rows: SamplingRows, backend: str = "auto") -> TargetWeights:
    """One launch, one program per tree node (contract: ``target_weights_ref``; the weights agree to
    float rounding, the thresholds and totals exactly given those weights)."""
    B, N, V = logits.shape
    if V >= MAX_VOCAB:
        raise ValueError(f"a vocabulary of {V} tokens: the exact draws need fewer than {MAX_VOCAB}")
    if not _use_triton(logits, backend) or B == 0:
        return target_weights_ref(logits, rows)
    dev = logits.device
    out = TargetWeights(weights=torch.empty(B, N, V, dtype=torch.float32, device=dev),
                        thresh=torch.empty(B, N, dtype=torch.int64, device=dev),
                        total=torch.empty(B, N, dtype=torch.int64, device=dev))
    fast(_target_weights_kernel)[(B * N,)](logits.contiguous(), rows.temperature.float().contiguous(),
                                           rows.top_k.to(torch.int64).contiguous(), rows.top_p.float().contiguous(),
                                           out.weights, out.thresh, out.total, N, V, BLOCK_V=min(2048, _p2(V)),
                                           SEARCH_BLOCK=min(256, _p2(V)), ROUNDS=SEARCH_ROUNDS, WAYS=SEARCH_WAYS,
                                           num_warps=8 if V >= 4096 else 4)
    return out


# =================================================================================================
# The tree walk
# =================================================================================================
def tree_verify_ref(tw: TargetWeights, argmax: torch.Tensor, parents: torch.Tensor, tokens: torch.Tensor,
                    rows: SamplingRows, committed_len: torch.Tensor, steps: int) -> Acceptance:
    """The accepted path from the root and the bonus token, every request of the batch at once.

    At the current node, children are tried in index order. Child c with token x has residual mass
    ``r = W[x]`` among the kept weights (0 if an earlier sibling had token x), ``R`` is the node's
    total less the r of the siblings tried before it, and c is accepted iff ``U_c < r`` with ``U_c``
    draw c, uniform in [0, R). Accepting moves to c (up to ``steps`` times). When every child is
    rejected, the bonus is drawn from the node's kept weights without the children's tokens; after
    ``steps`` acceptances, from the last node's kept weights: the first token whose running mass
    exceeds draw 0, uniform in [0, what is left). Greedy rows (temperature 0) accept the first child
    whose token is ``argmax`` of the current node, and the bonus is the argmax of the last one.
    """
    B, N = tokens.shape
    dev = tokens.device
    V = tw.weights.shape[-1]
    batch = torch.arange(B, device=dev)
    node = torch.arange(N, device=dev)
    hi, lo = draw_limbs(request_key(rows.seed, committed_len).unsqueeze(1), node.unsqueeze(0))  # [B, N]
    same = (parents.unsqueeze(2) == parents.unsqueeze(1)) & (tokens.unsqueeze(2) == tokens.unsqueeze(1))
    dup = (same & (node.view(1, 1, N) < node.view(1, N, 1))).any(2)  # an earlier sibling has this token
    greedy = rows.temperature <= 0
    cur = torch.zeros(B, dtype=torch.int64, device=dev)
    alive = torch.ones(B, dtype=torch.bool, device=dev)
    ended = torch.zeros(B, dtype=torch.bool, device=dev)
    left = torch.zeros(B, dtype=torch.int64, device=dev)  # mass left where the walk ended by rejection
    gone = torch.zeros(B, N, dtype=torch.bool, device=dev)  # the children rejected there
    index = torch.full((B, steps + 1), -1, dtype=torch.int64, device=dev)
    index[:, 0] = 0
    for d in range(1, steps + 1):
        child = (parents == cur.unsqueeze(1)) & alive.unsqueeze(1)
        want = argmax.gather(1, cur.unsqueeze(1))
        thresh, total = tw.thresh.gather(1, cur.unsqueeze(1)), tw.total.gather(1, cur.unsqueeze(1))
        w = quantize(tw.weights[batch, cur].gather(1, tokens.clamp(min=0)))
        r = torch.where(child & ~dup & (w >= thresh), w, 0)
        before = r.cumsum(1) - r
        accept = child & (r > 0) & (uniform_below(hi, lo, _after_rejections(total, before)) < r)
        accept = torch.where(greedy.unsqueeze(1), child & (tokens == want), accept)
        found = accept.any(1)
        nxt = accept.to(torch.int8).argmax(1)
        stop = alive & ~found
        left = torch.where(stop, total.squeeze(1) - r.sum(1), left)
        gone = torch.where(stop.unsqueeze(1), child, gone)
        ended |= stop
        index[:, d] = torch.where(found, nxt, -1)
        cur = torch.where(found, nxt, cur)
        alive &= found
    last_argmax = argmax.gather(1, cur.unsqueeze(1)).squeeze(1)
    left = torch.where(ended, left, tw.total.gather(1, cur.unsqueeze(1)).squeeze(1))
    kept = quantize(tw.weights[batch, cur])
    kept = torch.where(kept >= tw.thresh.gather(1, cur.unsqueeze(1)), kept, 0)
    removed = torch.zeros(B, V + 1, dtype=torch.bool, device=dev)  # column V: the tokens not removed
    removed.scatter_(1, torch.where(gone, tokens, V), True)
    cum = torch.where(removed[:, :V], 0, kept).cumsum(1)
    u = uniform_below(hi[:, 0], lo[:, 0], left)
    past = cum > u.unsqueeze(1)
    drawn = torch.where(past.any(1), past.to(torch.int8).argmax(1), last_argmax)  # nothing left: rounding only
    bonus = torch.where(greedy, last_argmax, drawn)
    return Acceptance(index, (index >= 0).sum(dim=1), bonus)


def _after_rejections(total: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """The mass the next sibling's draw ranges over once the rejected siblings' mass is removed: the
    renormalisation of p. Its own function so that a test can swap in the classic bug (no
    renormalisation) and see the distribution tests reject it."""
    return total - rejected


if triton is not None:
    @triton.jit
    def _m32():
        return (tl.full([], 1, tl.int64) << 32) - 1  # a literal 0xFFFFFFFF would be uint32

    @triton.jit
    def _mulmod32_k(x, C_HI: tl.constexpr, C_LO: tl.constexpr):
        return (x * C_LO + (((x * C_HI) & 0xFFFF) << 16)) & _m32()

    @triton.jit
    def _mix32_k(x):
        x = x ^ (x >> 16)
        x = _mulmod32_k(x, 0x7FEB, 0x352D)
        x = x ^ (x >> 15)
        x = _mulmod32_k(x, 0x846C, 0xA68B)
        return x ^ (x >> 16)

    @triton.jit
    def _uniform_below_k(hi, lo, bound):
        b_hi = bound >> 30
        b_lo = bound & 0x3FFFFFFF
        return hi * b_hi + ((hi * b_lo + lo * b_hi + ((lo * b_lo) >> 30)) >> 30)

    @triton.jit
    def _tree_verify_kernel(weights, thresh, total, argmax, parents, tokens, temperature, seed, committed,
                            index, length, bonus, N, V, STEPS: tl.constexpr, N_P2: tl.constexpr,
                            BLOCK_V: tl.constexpr):
        b = tl.program_id(0)
        offs = tl.arange(0, N_P2)
        ok = offs < N
        par = tl.load(parents + b * N + offs, mask=ok, other=-2)
        tok = tl.load(tokens + b * N + offs, mask=ok, other=-1)
        sampled = tl.load(temperature + b) > 0
        on = offs * 0  # a scalar flag broadcast as offs * 0 + flag (the interpreter's & needs equal shapes)
        sampled_v = (on + sampled.to(tl.int32)) != 0
        s = tl.load(seed + b)
        m32 = _m32()
        key = _mix32_k(_mix32_k(_mix32_k(((s >> 32) & m32) ^ 0x1E3779B9) ^ (s & m32)) ^ (tl.load(committed + b) & m32))
        base = _mix32_k(key ^ 0x5BD1E995)
        j = offs.to(tl.int64)
        hi = _mix32_k(base ^ (j * 2)) & 0x3FFFFFFF
        lo = _mix32_k(base ^ (j * 2 + 1)) & 0x3FFFFFFF
        earlier = offs[None, :] < offs[:, None]  # [c, c']: c' before c
        same = (par[None, :] == par[:, None]) & (tok[None, :] == tok[:, None]) & ok[None, :]
        dup = tl.max((same & earlier).to(tl.int32), 1)
        cur = tl.zeros([], tl.int64)
        alive = tl.full([], 1, tl.int32)
        ended = tl.zeros([], tl.int32)
        n_acc = tl.full([], 1, tl.int64)
        left = tl.zeros([], tl.int64)
        gone = offs < 0
        tl.store(index + b * (STEPS + 1), n_acc * 0)
        for d in range(1, STEPS + 1):
            child = (par == cur) & ok & ((on + alive) != 0)
            row = b * N + cur
            want = tl.load(argmax + row)
            th = tl.load(thresh + row)
            tot = tl.load(total + row)
            wx = tl.load(weights + row * V + tl.maximum(tok, 0), mask=child & sampled_v, other=0.0)
            q = _quant(wx)
            r = tl.where(child & (dup == 0) & (q >= th), q, 0)
            u = _uniform_below_k(hi, lo, tot - (tl.cumsum(r, 0) - r))
            accept = tl.where(sampled, child & (r > 0) & (u < r), child & (tok == want))
            nxt = tl.min(tl.where(accept, offs, N_P2), 0).to(tl.int64)
            found = nxt < N_P2
            stop = (alive != 0) & (nxt >= N_P2)
            left = tl.where(stop, tot - tl.sum(r, 0), left)
            gone = gone | (child & ((on + stop.to(tl.int32)) != 0))
            ended = tl.where(stop, 1, ended)
            tl.store(index + b * (STEPS + 1) + d, tl.where(found, nxt, -1))
            cur = tl.where(found, nxt, cur)
            n_acc += found.to(tl.int64)
            alive = found.to(tl.int32)
        tl.store(length + b, n_acc)

        row = b * N + cur
        token = tl.load(argmax + row)
        if sampled:
            th = tl.load(thresh + row)
            left = tl.where(ended != 0, left, tl.load(total + row))
            u = _uniform_below_k(tl.sum(tl.where(offs == 0, hi, 0), 0), tl.sum(tl.where(offs == 0, lo, 0), 0), left)
            cum = tl.zeros([], tl.int64)
            drawn = tl.full([], -1, tl.int64)
            for lo_v in range(0, V, BLOCK_V):
                offs_v = lo_v + tl.arange(0, BLOCK_V)
                q = _quant(tl.load(weights + row * V + offs_v, mask=offs_v < V, other=0.0))
                hit = tl.max((gone[None, :] & (tok[None, :] == offs_v[:, None])).to(tl.int32), 1)
                q = tl.where((q >= th) & (hit == 0) & (offs_v < V), q, 0)
                blk = tl.sum(q, 0)
                if (drawn < 0) & (cum + blk > u):
                    past = (cum + tl.cumsum(q, 0)) > u
                    drawn = tl.min(tl.where(past, offs_v, V), 0).to(tl.int64)
                cum += blk
            token = tl.where(drawn >= 0, drawn, token)  # nothing left: rounding only
        tl.store(bonus + b, token)


def tree_verify(tw: TargetWeights, argmax: torch.Tensor, parents: torch.Tensor, tokens: torch.Tensor,
                rows: SamplingRows, committed_len: torch.Tensor, steps: int, backend: str = "auto") -> Acceptance:
    """One program per request (contract: ``tree_verify_ref``, bit for bit)."""
    if not _use_triton(tokens, backend) or tokens.shape[0] == 0:
        return tree_verify_ref(tw, argmax, parents, tokens, rows, committed_len, steps)
    B, N = tokens.shape
    V = tw.weights.shape[-1]
    dev = tokens.device
    out = Acceptance(torch.empty(B, steps + 1, dtype=torch.int64, device=dev),
                         torch.empty(B, dtype=torch.int64, device=dev), torch.empty(B, dtype=torch.int64, device=dev))
    fast(_tree_verify_kernel)[(B,)](
        tw.weights, tw.thresh.contiguous(), tw.total.contiguous(), argmax.contiguous(), parents.contiguous(),
        tokens.contiguous(), rows.temperature.float().contiguous(), rows.seed.to(torch.int64).contiguous(),
        committed_len.to(torch.int64).contiguous(), out.accept_index, out.accept_len, out.bonus, N, V,
        STEPS=steps, N_P2=_p2(N), BLOCK_V=min(2048, _p2(V)), num_warps=8 if V >= 4096 else 4)
    return out
