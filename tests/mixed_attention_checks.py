"""A mixed step's attention split in two launches, for tests/unit/kernels/test_mixed_attention.py (the kernels under
the interpreter), tests/gpu/test_mixed_attention_gpu.py (on CUDA, 8B shape) and bench/bench_mixed_attention.py.

``mixed_case`` builds a batch of prefill chunks and decode rows over one paged pool, in any request order;
``check_mixed`` runs it through ``kernels.mixed_attention`` and asserts that the decode-like rows are the bits
``paged_attention`` gives them in a batch of their own (a decode step's launch: its own bounds, the same split
length), that the long rows are the bits ``extend_attention`` gives them in a batch of their own, and that the
whole is the torch reference's within the kernel tests' tolerances."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.attention import paged_attention
from kernels.attention_ref import AttentionMetadata, paged_attention_ref
from kernels.extend_attention import extend_attention
from kernels.mixed_attention import MixedSplit, mixed_attention, split_mixed
from tests.attention_invariance import Pool, Shape

TINY = Shape()  # 2 KV heads x 4 query heads of 16
TOL = {torch.float32: {"atol": 2e-5, "rtol": 2e-5}, torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2}}


@dataclass
class MixedCase:
    pool: Pool  # its k / v [slots, Hkv, D] are the caches
    q: torch.Tensor  # [T, Hq, D]
    loc: torch.Tensor  # [T] int64: the slot each row's K/V was written to (this step's slots)
    positions: torch.Tensor  # [T] int64: prefix + j
    meta: AttentionMetadata  # the whole batch, host copies set (as build_forward_batch sets them)
    slots: list[list[int]]  # per request: its key slots, prefix first
    q_lens: list[int]
    prefixes: list[int]

    def rows(self, reqs: list[int]) -> torch.Tensor:
        qo = self.meta.qo_indptr_cpu
        return torch.cat([torch.arange(qo[b], qo[b + 1]) for b in reqs]).to(self.q.device)


def meta_of(slots: list[list[int]], q_lens: list[int], prefixes: list[int], device, split_len: int | None,
            max_kv_len: int | None = None) -> AttentionMetadata:
    """Causal metadata over these requests, host copies set; ``max_kv_len`` the grid's bound (default: the
    longest request's, as ``build_forward_batch`` sets it; a decode step's is its table width)."""
    qo, kv = [0], [0]
    for s, n in zip(slots, q_lens):
        qo.append(qo[-1] + n)
        kv.append(kv[-1] + len(s))
    t = lambda x: torch.tensor(x, dtype=torch.int64, device=device)  # noqa: E731
    return AttentionMetadata(
        qo_indptr=t(qo), kv_indptr=t(kv), kv_indices=t([x for s in slots for x in s]), prefix_lens=t(prefixes),
        qo_indptr_cpu=qo, kv_indptr_cpu=kv, prefix_lens_cpu=list(prefixes), max_q_len=max(q_lens),
        max_kv_len=max_kv_len or max(len(s) for s in slots), split_len=split_len)


def mixed_case(q_lens: list[int], prefixes: list[int], page_size: int, device, dtype=torch.float32,
               shape: Shape = TINY, split_len: int | None = 32, seed: int = 0) -> MixedCase:
    """Requests of ``q_lens`` queries after ``prefixes`` cached keys, in this order, on shuffled pages."""
    pool = Pool(sum(prefixes) + sum(q_lens) + len(q_lens) * page_size, page_size, dtype, seed, device, shape)
    slots = [pool.take(p + n) for p, n in zip(prefixes, q_lens)]
    loc = torch.tensor([x for s, p in zip(slots, prefixes) for x in s[p:]], dtype=torch.int64, device=device)
    positions = torch.tensor([p + j for p, n in zip(prefixes, q_lens) for j in range(n)], device=device)
    meta = meta_of(slots, q_lens, prefixes, device, split_len)
    return MixedCase(pool, pool.queries(sum(q_lens)), loc, positions, meta, slots, list(q_lens), list(prefixes))


def decode_launch(case: MixedCase, reqs: list[int], scale: float, window: int = 0,
                  backend: str = "triton") -> torch.Tensor:
    """``reqs`` as a decode step runs them: a batch of their own, bounded by the pool (as a decode step's grid is
    by its table width), the batch's split length."""
    meta = meta_of([case.slots[b] for b in reqs], [case.q_lens[b] for b in reqs], [case.prefixes[b] for b in reqs],
                   case.q.device, case.meta.split_len, max_kv_len=case.pool.k.shape[0])
    return paged_attention(case.q[case.rows(reqs)], case.pool.k, case.pool.v, meta, scale, window, backend=backend)


def extend_launch(case: MixedCase, reqs: list[int], scale: float, window: int = 0,
                  backend: str = "triton") -> torch.Tensor:
    """``reqs`` alone through the extend kernel, as a prefill step of only them runs."""
    meta = meta_of([case.slots[b] for b in reqs], [case.q_lens[b] for b in reqs], [case.prefixes[b] for b in reqs],
                   case.q.device, case.meta.split_len)
    rows = case.rows(reqs)
    loc = case.loc[rows]
    return extend_attention(case.q[rows], case.pool.k[loc], case.pool.v[loc], case.pool.k, case.pool.v, meta, scale,
                            window, backend=backend)


def check_mixed(case: MixedCase, decode_reqs: list[int], scale: float = 0.37, window: int = 0,
                backend: str = "triton") -> tuple[MixedSplit, torch.Tensor]:
    """The split of ``case`` puts ``decode_reqs`` on the decode side; its output's rows are those of each side's
    own launch, bit for bit, and the reference's within tolerance. Returns the split and the output."""
    group = case.q.shape[1] // case.pool.k.shape[1]
    split = split_mixed(case.meta, group)
    assert split is not None
    extend_reqs = [b for b in range(len(case.q_lens)) if b not in decode_reqs]
    assert split.decode.meta.qo_indptr_cpu[-1] == sum(case.q_lens[b] for b in decode_reqs)
    out = mixed_attention(case.q, case.pool.k, case.pool.v, case.loc, split, scale, window, case.positions,
                          backend=backend)
    dec_rows, ext_rows = case.rows(decode_reqs), case.rows(extend_reqs)
    want = decode_launch(case, decode_reqs, scale, window, backend)
    assert torch.equal(out[dec_rows], want), (out[dec_rows].float() - want.float()).abs().max()
    want = extend_launch(case, extend_reqs, scale, window, backend)
    assert torch.equal(out[ext_rows], want), (out[ext_rows].float() - want.float()).abs().max()
    ref = paged_attention_ref(case.q, case.pool.k, case.pool.v, case.meta, scale, window)
    torch.testing.assert_close(out.float(), ref.float(), **TOL[case.q.dtype])
    # This step's K/V handed over where the layer computed them (strided views of one wider buffer, as of
    # ``rope_store(keep_kv=True)``'s qkv) instead of gathered back from the cache: the same bits.
    k, v = case.pool.k[case.loc], case.pool.v[case.loc]
    wide = torch.empty(k.shape[0], 3, *k.shape[1:], dtype=k.dtype, device=k.device)
    wide[:, 1], wide[:, 2] = k, v
    kept = mixed_attention(case.q, case.pool.k, case.pool.v, case.loc, split, scale, window, case.positions,
                           backend=backend, kv_new=(wide[:, 1], wide[:, 2]))
    assert torch.equal(kept, out)
    # Into a destination of the caller's (the mixed steps' graph pieces hand their buffer): the same bits, there
    dest = torch.full_like(case.q, float("nan"))
    into = mixed_attention(case.q, case.pool.k, case.pool.v, case.loc, split, scale, window, case.positions,
                           backend=backend, out=dest)
    assert into is dest and torch.equal(dest, out)
    return split, out
