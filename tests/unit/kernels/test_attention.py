"""Paged attention: the Triton kernel equals the torch reference on every shape of the contract.

Runs the kernel under TRITON_INTERPRET=1 on the CPU (conftest sets it) with tiny shapes: extend /
chunked prefill (ragged, with an empty request), decode with and without key splits, tree verify
(prefix + ancestor mask) and tree draft (prefix + arbitrary packed mask), page sizes 1, 4 and 16,
GQA and MHA, float32 and the half types. Pages are handed out in a shuffled order so neighbouring
positions are rarely neighbouring slots.
"""

from __future__ import annotations

import pytest
import torch
from kernel_checks import DEVICE, no_host_reads

from kernels.attention import AttnConfig, choose_config, paged_attention
from kernels.attention_ref import AttentionMetadata, paged_attention_ref
from kernels.spec_kernels import ancestor_mask

TOL = {torch.float32: {"atol": 2e-5, "rtol": 2e-5}, torch.float16: {"atol": 2e-3, "rtol": 2e-3},
       torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2}}


def tree_mask(parents: list[int]) -> torch.Tensor:
    """[N, N] ancestor-or-self mask of a tree given by parent indices (-1 = root)."""
    return ancestor_mask(torch.tensor([parents]), len(parents))[0]


def make_case(q_lens, prefix, extra, page_size, hq, hkv, d, dtype, masks=None, seed=0, host_copies=False,
              device=DEVICE):
    """Random q / caches and metadata; ``masks`` is None (causal) or a list of [q_len, extra] bool blocks."""
    g = torch.Generator().manual_seed(seed)
    kv_lens = [p + e for p, e in zip(prefix, extra)]
    pages_per = [-(-n // page_size) for n in kv_lens]
    num_pages = sum(pages_per)
    order = (torch.randperm(num_pages, generator=g) + 1).tolist()  # page 0 stays the sink
    kv_indices, used = [], 0
    for n, pp in zip(kv_lens, pages_per):
        pages = order[used:used + pp]
        used += pp
        kv_indices += [pages[i // page_size] * page_size + i % page_size for i in range(n)]
    num_slots = (num_pages + 2) * page_size
    k = torch.randn(num_slots, hkv, d, generator=g).to(dtype)
    v = torch.randn(num_slots, hkv, d, generator=g).to(dtype)
    q = torch.randn(sum(q_lens), hq, d, generator=g).to(dtype)
    qo, kv = [0], [0]
    for a, b in zip(q_lens, kv_lens):
        qo.append(qo[-1] + a)
        kv.append(kv[-1] + b)
    meta = AttentionMetadata(qo_indptr=torch.tensor(qo), kv_indptr=torch.tensor(kv),
                             kv_indices=torch.tensor(kv_indices, dtype=torch.int64),
                             prefix_lens=torch.tensor(prefix, dtype=torch.int64))
    if masks is not None:
        mi = [0]
        for m in masks:
            mi.append(mi[-1] + m.numel())
        meta.custom_mask = torch.cat([m.reshape(-1) for m in masks])
        meta.mask_indptr = torch.tensor(mi)
    if host_copies:
        meta.qo_indptr_cpu, meta.kv_indptr_cpu, meta.prefix_lens_cpu = qo, kv, list(prefix)
    dev = torch.device(device)
    for f in ("qo_indptr", "kv_indptr", "kv_indices", "prefix_lens", "custom_mask", "mask_indptr"):
        if getattr(meta, f) is not None:
            setattr(meta, f, getattr(meta, f).to(dev))
    return q.to(dev), k.to(dev), v.to(dev), meta


def check(q, k, v, meta, scale=0.37, **kw):
    ref = paged_attention_ref(q, k, v, meta, scale)
    out = paged_attention(q, k, v, meta, scale, backend="triton", **kw)
    torch.testing.assert_close(out.float(), ref.float(), **TOL[q.dtype])
    return out


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("heads", [(4, 2), (3, 3)], ids=["gqa", "mha"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_extend_ragged_matches_reference(page_size, heads, dtype):
    """Chunked prefill: a fresh prompt, a chunk after a prefix, an empty request, a one-token request."""
    q_lens, prefix = [9, 21, 0, 1], [0, 19, 6, 33]
    q, k, v, meta = make_case(q_lens, prefix, q_lens, page_size, *heads, 16, dtype, seed=page_size)
    check(q, k, v, meta)


def test_extend_spans_several_query_blocks():
    """A long chunk (more query blocks than one) with GQA 4 and a non power-of-two head dim."""
    q_lens, prefix = [70, 5], [37, 0]
    q, k, v, meta = make_case(q_lens, prefix, q_lens, 4, 8, 2, 24, torch.float32, seed=3)
    cfg = choose_config(q, 2, 2, max(q_lens), None)
    assert -(-70 // cfg.block_q) > 1
    check(q, k, v, meta)


def test_a_causal_launch_has_one_query_block_whatever_its_longest_query():
    """``BLOCK_Q`` is a constexpr: sized to the batch's longest query, each new length (a draft catching up 25 or
    31 positions) compiled the kernel again mid-serve. One size now, and a request's rows come out of it the same
    bits as out of a block of its own length (the rows are grouped alike: one block either way)."""
    configs = {(c.block_q, c.block_m) for c in (choose_config(torch.empty(n, 8, 16, dtype=torch.float16), 2, 2, n,
                                                                  64) for n in range(17, 60))}
    assert configs == {(32, 128)}
    q_lens, prefix = [20, 5], [11, 0]
    q, k, v, meta = make_case(q_lens, prefix, q_lens, 4, 8, 2, 16, torch.float16, seed=5)
    chosen = choose_config(q, 2, 2, max(q_lens), max(p + n for p, n in zip(prefix, q_lens)))
    own = AttnConfig(**{**chosen.__dict__, "block_q": max(q_lens)})  # the old choice: a block of 20 tokens
    out = check(q, k, v, meta, config=chosen)
    assert torch.equal(out, check(q, k, v, meta, config=own))


@pytest.mark.parametrize("num_splits", [None, 1, 3, 8])
@pytest.mark.parametrize("page_size", [1, 16])
def test_decode_split_kv_matches_reference(num_splits, page_size):
    """One query per request; splits that get no key (short rows, 8 splits) contribute nothing."""
    prefix = [150, 1, 64, 17]
    q, k, v, meta = make_case([1] * 4, prefix, [1] * 4, page_size, 8, 2, 32, torch.float32, seed=num_splits or 0)
    check(q, k, v, meta, num_splits=num_splits)


def test_decode_bfloat16_gqa8():
    prefix = [90, 33]
    q, k, v, meta = make_case([1, 1], prefix, [1, 1], 16, 8, 1, 32, torch.bfloat16, seed=11)
    check(q, k, v, meta, num_splits=2)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tree_verify_matches_reference(page_size, dtype):
    """Each request verifies a tree of N nodes after its prefix under the ancestor mask."""
    trees = [[-1, 0, 0, 1, 1, 2, 3, 6], [-1, 0, 1, 2, 3, 4, 5, 6], [-1, 0, 0, 0, 0, 1, 2, 3]]
    prefix = [12, 40, 1]
    masks = [tree_mask(p) for p in trees]
    q, k, v, meta = make_case([8] * 3, prefix, [8] * 3, page_size, 4, 2, 16, dtype, masks=masks, seed=5)
    check(q, k, v, meta, num_splits=2)


@pytest.mark.parametrize("page_size", [1, 4])
def test_tree_draft_matches_reference(page_size):
    """Draft step: k leaf queries see the prefix and a packed mask over more scratch slots than queries."""
    g = torch.Generator().manual_seed(2)
    q_lens, extra, prefix = [3, 3, 3], [6, 6, 6], [10, 0, 25]
    masks = []
    for ql, e in zip(q_lens, extra):
        m = torch.rand(ql, e, generator=g) < 0.4
        m[torch.arange(ql), e - ql + torch.arange(ql)] = True  # each leaf sees itself
        masks.append(m)
    q, k, v, meta = make_case(q_lens, prefix, extra, page_size, 4, 2, 16, torch.float32, masks=masks, seed=6)
    check(q, k, v, meta)
    check(q, k, v, meta, num_splits=3)


def test_static_bounds_from_host_copies_equal_explicit_bounds():
    """The grid bound can come from host copies, from max_q_len, or (worst case) from q's rows."""
    q_lens, prefix = [5, 2], [3, 9]
    q, k, v, meta = make_case(q_lens, prefix, q_lens, 1, 2, 1, 16, torch.float32, seed=8, host_copies=True)
    a = check(q, k, v, meta)
    meta.qo_indptr_cpu = meta.kv_indptr_cpu = None
    b = check(q, k, v, meta)
    meta.max_q_len, meta.max_kv_len = 5, 11
    c = check(q, k, v, meta)
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(a, c)


def test_kernel_path_reads_nothing_back_to_the_host(monkeypatch):
    """No .item() / .tolist() / nonzero on the kernel path: it can be captured in a CUDA graph."""
    q_lens, prefix = [4, 1], [6, 30]
    q, k, v, meta = make_case(q_lens, prefix, q_lens, 16, 4, 2, 16, torch.float32, seed=9)
    meta.max_q_len, meta.max_kv_len = 4, 31
    ref = paged_attention_ref(q, k, v, meta, 0.5)
    with no_host_reads(monkeypatch):
        out = paged_attention(q, k, v, meta, 0.5, backend="triton", num_splits=2)
    torch.testing.assert_close(out, ref, **TOL[torch.float32])


def test_forward_batch_metadata_carries_static_bounds():
    """shared/forward_batch.py fills the bounds the kernel sizes its grid with (host path and device path)."""
    from shared.forward_batch import build_forward_batch, build_uniform_batch
    from shared.memory.kv_cache import CacheLayout, KVCache

    cache = KVCache(CacheLayout(num_layers=1, num_kv_heads=1, head_dim=8, dtype=torch.float32,
                              device=torch.device("cpu"), page_size=4, num_pages=16, max_reqs=4, max_context=32))
    hs = [cache.open(), cache.open()]
    for h, n in zip(hs, (7, 12)):
        cache.reserve(h, n)
    ids = torch.zeros(5, dtype=torch.int64)
    fb = build_forward_batch(cache, [h.row for h in hs], [4, 10], [3, 2], ids, ids, torch.tensor([4, 5, 6, 10, 11]))
    assert (fb.attn.max_q_len, fb.attn.max_kv_len) == (3, 12)
    rows = torch.tensor([h.row for h in hs])
    ub = build_uniform_batch(cache, rows, torch.tensor([4, 9]), 2, 2, ids[:4], ids[:4],
                             torch.tensor([[4, 5], [9, 10]]))
    assert ub.attn.max_q_len == 2 and ub.attn.max_kv_len >= 11


def test_forward_batch_gathers_each_requests_slots_in_position_order():
    """kv_indices: each request's slots [0, prefix + extra) in position order, request after request; out_cache_loc:
    the slot of each query's write position; the host ints all arrive (built from one buffer, not a field each)."""
    from shared.forward_batch import build_forward_batch
    from shared.memory.kv_cache import CacheLayout, KVCache

    dev = torch.device(DEVICE)
    cache = KVCache(CacheLayout(num_layers=1, num_kv_heads=1, head_dim=8, dtype=torch.float32, device=dev,
                                page_size=4, num_pages=24, max_reqs=4, max_context=40))
    hs = [cache.open() for _ in range(3)]
    for n in (9, 3, 14, 17):  # interleaved growth: each request's pages are not contiguous
        for h in hs:
            cache.reserve(h, min(n, 17))
    rows, prefix, q_lens = [h.row for h in hs], [5, 0, 13], [4, 3, 1]
    write = torch.tensor([5, 6, 7, 8, 0, 1, 2, 13])
    ids, logits_rows = torch.arange(8) + 100, torch.tensor([3, 6, 7])
    fb = build_forward_batch(cache, rows, prefix, q_lens, ids, write, write, logits_rows=logits_rows)
    host = cache.req_to_token.host
    kv_lens = [p + q for p, q in zip(prefix, q_lens)]
    assert fb.attn.kv_indices.cpu().tolist() == [s for r, n in zip(rows, kv_lens) for s in host[r, :n].tolist()]
    owner = [r for r, q in zip(rows, q_lens) for _ in range(q)]
    assert fb.out_cache_loc.cpu().tolist() == [host[r, w].item() for r, w in zip(owner, write.tolist())]
    assert fb.attn.qo_indptr.cpu().tolist() == [0, 4, 7, 8] and fb.attn.kv_indptr.cpu().tolist() == [0, 9, 12, 26]
    assert fb.attn.prefix_lens.cpu().tolist() == prefix and fb.input_ids.cpu().tolist() == ids.tolist()
    assert fb.positions.cpu().tolist() == write.tolist() and fb.logits_rows.cpu().tolist() == [3, 6, 7]
    assert fb.input_ids.device.type == dev.type
    for t in (fb.input_ids, fb.positions, fb.logits_rows, fb.attn.qo_indptr, fb.attn.kv_indptr, fb.attn.prefix_lens):
        assert t.data_ptr() % 16 == 0  # Triton specialises a pointer on it: out of line, the kernel compiles again


def test_cpu_tensors_dispatch_to_the_reference():
    """backend='auto' on CPU tensors is the reference itself (bit-identical), not the interpreter."""
    q, k, v, meta = make_case([3], [2], [3], 1, 2, 2, 8, torch.float32, seed=1, device="cpu")
    torch.testing.assert_close(paged_attention(q, k, v, meta, 0.5), paged_attention_ref(q, k, v, meta, 0.5),
                               atol=0, rtol=0)


@pytest.mark.parametrize("masks", [False, True])
def test_unreferenced_slots_never_leak_into_the_output(masks):
    """NaN in every slot no request owns (the sink page included) and a NaN-filled ``out``: keys past
    a request's range read the sink slot but must contribute exactly nothing."""
    q_lens, prefix = [3, 1], [21, 50]
    blocks = [tree_mask([-1, 0, 1]), torch.ones(1, 1, dtype=torch.bool)] if masks else None
    q, k, v, meta = make_case(q_lens, prefix, q_lens, 16, 4, 2, 16, torch.float32, masks=blocks, seed=12)
    unused = torch.ones(k.shape[0], dtype=torch.bool, device=k.device)
    unused[meta.kv_indices] = False
    k[unused], v[unused] = float("nan"), float("nan")
    ref = paged_attention_ref(q, k, v, meta, 0.4)
    out = torch.full_like(q, float("nan"))
    paged_attention(q, k, v, meta, 0.4, backend="triton", num_splits=4, out=out)
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, **TOL[torch.float32])


class _Recorder:
    """Stands in for a Triton kernel: records each launch's compile key (its constexprs and launch options)."""

    def __init__(self):
        self.keys: set[tuple] = set()

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.keys.add(tuple(sorted((k, v) for k, v in kwargs.items() if k.isupper() or k.startswith("num_"))))
        return launch


def test_warm_launches_cover_every_unmasked_launch_a_step_takes(monkeypatch):
    """After ``warm_launches``, no launch of ``paged_attention`` without a mask has a compile key it did not run:
    decode steps and short extends (1 to 63 queries, the draft catching up), 1 to 256 requests, contexts up to
    far past the split count the combine unrolls. A key first met mid-serve stalls every stream (1.3 s, H100)."""
    import kernels.attention as attention

    attn, combine = _Recorder(), _Recorder()
    monkeypatch.setattr(attention, "_attn_kernel", attn)
    monkeypatch.setattr(attention, "_combine_kernel", combine)
    hq, hkv, d, split_len = 8, 2, 16, 64
    k = torch.zeros(4096, hkv, d, dtype=torch.float16)
    v = torch.zeros_like(k)
    runs = attention.warm_launches(torch.float16, hq, k, v, split_len)
    warm_attn, warm_combine = set(attn.keys), set(combine.keys)
    assert runs >= 6 and len(warm_attn) == 4 + 2 * (attention.TAIL_PROGRAMS > 1)  # 2 tiles x serial, split (tail)
    attn.keys.clear()
    combine.keys.clear()
    for batch in (1, 2, 8, 64, 256):
        for q_len in (1, 2, 16, 17, 40, 63):
            for context in (q_len, 100, 1000, 4000, 40000):
                qo = [i * q_len for i in range(batch + 1)]
                kv = [i * context for i in range(batch + 1)]
                meta = AttentionMetadata(
                    qo_indptr=torch.tensor(qo), kv_indptr=torch.tensor(kv),
                    kv_indices=torch.zeros(1, dtype=torch.int64), prefix_lens=torch.zeros(batch, dtype=torch.int64),
                    qo_indptr_cpu=qo, kv_indptr_cpu=kv, prefix_lens_cpu=[context - q_len] * batch,
                    max_q_len=q_len, max_kv_len=context, split_len=split_len)
                q = torch.zeros(batch * q_len, hq, d, dtype=torch.float16)
                attention.paged_attention(q, k, v, meta, 0.25, backend="triton")
    assert attn.keys and combine.keys
    assert attn.keys <= warm_attn, attn.keys - warm_attn
    assert combine.keys <= warm_combine, combine.keys - warm_combine
    assert not k.any() and not v.any()  # the caches are read, never written


def test_a_batchs_launch_is_decided_once_for_all_its_layers(monkeypatch):
    """A forward launches the attention once per layer over one metadata: the tile shapes and splits are chosen at
    the first call and reused (``AttentionMetadata.plans``), the same bits each time; a copy of the metadata
    (``dataclasses.replace``) and a launch with an override decide afresh."""
    import dataclasses

    import kernels.attention as attention

    calls = []
    real = attention.choose_config
    monkeypatch.setattr(attention, "choose_config", lambda *a, **kw: calls.append(a) or real(*a, **kw))
    q, k, v, meta = make_case([1, 1, 1], [40, 9, 70], [1, 1, 1], 16, 4, 2, 16, torch.float32, host_copies=True)
    first = check(q, k, v, meta)
    again = check(q, k, v, meta)  # the next layer
    assert len(calls) == 1 and torch.equal(first, again)
    assert len(meta.plans) == 1
    copy = dataclasses.replace(meta)
    assert copy.plans == {} and torch.equal(check(q, k, v, copy), first) and len(calls) == 2
    check(q[:, :2], k[:, :1], v[:, :1], meta)  # other shapes over the same metadata: a plan of their own
    assert len(calls) == 3 and len(meta.plans) == 2
    check(q, k, v, meta, num_splits=2)
    check(q, k, v, meta, num_splits=2)  # an override is never taken from, nor kept in, the plans
    assert len(calls) == 5 and len(meta.plans) == 2
