"""Extend attention: the Triton kernel equals the paged torch reference on every causal shape.

Runs the kernel under TRITON_INTERPRET=1 on the CPU (conftest sets it) with tiny shapes: ragged
batches with and without a cached prefix (an empty request, a one-token request, chunks that are not
a multiple of the tiles), page sizes 1 and 4 with pages handed out in shuffled order, GQA and MHA,
float32 and the half types, both load paths (tensor descriptors, as on Hopper, and plain pointers),
several tile shapes. Every output starts as NaN; slots and rows no request owns are NaN too.
"""

from __future__ import annotations

import pytest
import torch
from kernel_checks import DEVICE, no_host_reads

from kernels.attention_ref import AttentionMetadata, paged_attention_ref
from kernels.extend_attention import ExtendConfig, choose_extend_config, extend_attention, tma_supported

TOL = {torch.float32: {"atol": 2e-5, "rtol": 2e-5}, torch.float16: {"atol": 2e-3, "rtol": 2e-3},
       torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2}}
NAN = float("nan")


def make_case(q_lens, prefix, page_size, hq, hkv, d, dtype, seed=0, pad_rows=0, host_copies=False, device=DEVICE):
    """Random caches (pages in shuffled order, page 0 the sink, unowned slots NaN), q, causal metadata and
    this step's k_new / v_new: the cache rows of each request's last q_len slots, row-aligned with q.
    ``pad_rows`` extra rows at the end of q / k_new / v_new belong to no request (NaN)."""
    g = torch.Generator().manual_seed(seed)
    kv_lens = [p + n for p, n in zip(prefix, q_lens)]
    pages_per = [-(-n // page_size) for n in kv_lens]
    num_pages = sum(pages_per)
    order = (torch.randperm(num_pages, generator=g) + 1).tolist()
    kv_indices, new_slots, used = [], [], 0
    for n, pp, p in zip(kv_lens, pages_per, prefix):
        pages = order[used:used + pp]
        used += pp
        slots = [pages[i // page_size] * page_size + i % page_size for i in range(n)]
        kv_indices += slots
        new_slots += slots[p:]
    num_slots = (num_pages + 2) * page_size
    k = torch.full((num_slots, hkv, d), NAN)
    v = torch.full((num_slots, hkv, d), NAN)
    owned = torch.tensor(kv_indices, dtype=torch.int64)
    k[owned] = torch.randn(len(kv_indices), hkv, d, generator=g)
    v[owned] = torch.randn(len(kv_indices), hkv, d, generator=g)
    k, v = k.to(dtype), v.to(dtype)
    t = sum(q_lens)
    q = torch.cat([torch.randn(t, hq, d, generator=g), torch.full((pad_rows, hq, d), NAN)]).to(dtype)
    pad = torch.full((pad_rows, hkv, d), NAN, dtype=dtype)
    new = torch.tensor(new_slots, dtype=torch.int64)
    k_new, v_new = torch.cat([k[new], pad]), torch.cat([v[new], pad])
    qo, kv = [0], [0]
    for a, b in zip(q_lens, kv_lens):
        qo.append(qo[-1] + a)
        kv.append(kv[-1] + b)
    meta = AttentionMetadata(qo_indptr=torch.tensor(qo), kv_indptr=torch.tensor(kv), kv_indices=owned,
                             prefix_lens=torch.tensor(prefix, dtype=torch.int64))
    if host_copies:
        meta.qo_indptr_cpu, meta.kv_indptr_cpu, meta.prefix_lens_cpu = qo, kv, list(prefix)
    dev = torch.device(device)
    for f in ("qo_indptr", "kv_indptr", "kv_indices", "prefix_lens"):
        setattr(meta, f, getattr(meta, f).to(dev))
    return tuple(x.to(dev) for x in (q, k_new, v_new, k, v)) + (meta,)


def check(q, k_new, v_new, k, v, meta, scale=0.37, **kw):
    """Kernel (into a NaN-filled ``out``) against the reference on every owned row; unowned rows stay NaN."""
    ref = paged_attention_ref(q, k, v, meta, scale)
    out = torch.full_like(q, NAN)
    got = extend_attention(q, k_new, v_new, k, v, meta, scale, backend="triton", out=out, **kw)
    assert got is out
    n = int(meta.qo_indptr[-1])
    assert not out[:n].isnan().any()
    assert out[n:].isnan().all()
    torch.testing.assert_close(out[:n].float(), ref[:n].float(), **TOL[q.dtype])
    return out


def config(block_m, block_n, tma=True):
    return ExtendConfig(block_m=block_m, block_n=block_n, num_warps=4, num_stages=1, tma=tma)


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("tma", [True, False], ids=["tma", "pointer"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ragged_batch_matches_reference(page_size, tma, dtype):
    """Fresh prompts and chunks after a prefix (full and partial prefix tiles), an empty and a one-token
    request, chunks spanning several query blocks, and padding rows that belong to no request."""
    q_lens, prefix = [9, 21, 0, 1, 40, 32], [0, 19, 6, 33, 0, 16]
    case = make_case(q_lens, prefix, page_size, 4, 2, 16, dtype, seed=page_size, pad_rows=3)
    check(*case, config=config(32, 16, tma))


@pytest.mark.parametrize("tiles", [(16, 16), (32, 16), (64, 32), (128, 64)], ids=lambda t: f"m{t[0]}n{t[1]}")
def test_tile_shapes(tiles):
    """One or several diagonal tiles per query block, prefixes and chunks on and off the tile grid (MHA)."""
    q_lens, prefix = [70, 5, 128, 33], [37, 0, 64, 0]
    check(*make_case(q_lens, prefix, 4, 3, 3, 32, torch.float16, seed=tiles[0] + tiles[1]),
          config=config(*tiles))


@pytest.mark.parametrize("tiles", [(32, 16, 2), (64, 16, 4), (32, 32, 4), (64, 64, 2), (16, 32, 1)],
                         ids=lambda t: f"m{t[0]}n{t[1]}p{t[2]}")
@pytest.mark.parametrize("tma", [True, False], ids=["tma", "pointer"])
def test_packed_heads_and_key_tiles_wider_than_the_query_block(tiles, tma):
    """GQA packing (``pack`` query heads of one KV head per program, ``block_m / pack`` tokens each) and
    key tiles wider than a program's query tokens (the diagonal run starts on the key tile grid)."""
    bm, bn, pack = tiles
    q_lens, prefix = [70, 5, 33, 1, 48], [37, 0, 16, 3, 0]
    cfg = ExtendConfig(block_m=bm, block_n=bn, num_warps=4, num_stages=1, tma=tma, pack=pack)
    check(*make_case(q_lens, prefix, 4, 8, 2, 16, torch.bfloat16, seed=bm + bn + pack, pad_rows=2), config=cfg)


def test_pack_must_divide_the_group():
    q, k_new, v_new, k, v, meta = make_case([5], [0], 1, 4, 2, 16, torch.float32, seed=2)
    with pytest.raises(ValueError, match="pack"):
        extend_attention(q, k_new, v_new, k, v, meta, 0.5, backend="triton",
                         config=ExtendConfig(block_m=32, block_n=16, num_warps=4, num_stages=1, tma=False, pack=4))


@pytest.mark.parametrize("order", [(True, False, 1), (False, True, 1), (True, True, 1), (False, True, 2)],
                         ids=["head_major", "request_major", "both", "request_major_pack2"])
@pytest.mark.parametrize("tma", [True, False], ids=["tma", "pointer"])
def test_other_launch_orders(tma, order):
    """The other launch orders (every query block of a head, then the next head; request by request,
    the request as the grid's third axis) compute the same."""
    head_major, request_major, pack = order
    q_lens, prefix = [70, 5, 33], [37, 0, 16]
    cfg = ExtendConfig(block_m=32, block_n=16, num_warps=4, num_stages=1, tma=tma, head_major=head_major,
                       request_major=request_major, pack=pack)
    check(*make_case(q_lens, prefix, 4, 4, 2, 16, torch.float16, seed=13, pad_rows=2), config=cfg)


@pytest.mark.parametrize("d", [64, 128])
def test_real_head_dims(d):
    """Llama head dims, GQA 4, the default (interpreter) launch, both with and without a prefix."""
    case = make_case([37, 20], [0, 45], 4, 8, 2, d, torch.bfloat16, seed=d)
    check(*case)


def test_non_power_of_two_head_dim_uses_pointer_loads():
    q, k_new, v_new, k, v, meta = make_case([30, 7], [5, 0], 1, 4, 2, 24, torch.float32, seed=4)
    assert not tma_supported(q, k_new, v_new)
    assert not choose_extend_config(q, 30, False).tma
    check(q, k_new, v_new, k, v, meta)
    with pytest.raises(ValueError, match="descriptors"):
        extend_attention(q, k_new, v_new, k, v, meta, 0.5, backend="triton", config=config(16, 16, True))


@pytest.mark.parametrize("tma", [True, False], ids=["tma", "pointer"])
def test_views_of_a_packed_qkv_buffer(tma):
    """q / k_new / v_new as column slices of one [T, Hq + 2 Hkv, D] projection output (row stride > H * D)."""
    q, k_new, v_new, k, v, meta = make_case([19, 26], [8, 0], 4, 4, 2, 16, torch.float16, seed=7)
    qkv = torch.cat([q, k_new, v_new], dim=1)
    q2, k2, v2 = qkv[:, :4], qkv[:, 4:6], qkv[:, 6:]
    assert q2.stride(0) == 8 * 16 and tma_supported(q2, k2, v2)
    check(q2, k2, v2, k, v, meta, config=config(16, 16, tma))


@pytest.mark.parametrize("tma", [True, False], ids=["tma", "pointer"])
def test_this_steps_keys_come_from_k_new(tma):
    """The kernel reads this step's K/V from k_new / v_new, only the prefix from the caches: NaN in the
    caches' new slots changes nothing."""
    q_lens, prefix = [23, 12], [10, 0]
    q, k_new, v_new, k, v, meta = make_case(q_lens, prefix, 1, 4, 2, 16, torch.float32, seed=5)
    ref = paged_attention_ref(q, k, v, meta, 0.37)
    for b, (n, p) in enumerate(zip(q_lens, prefix)):
        start = int(meta.kv_indptr[b]) + p
        k[meta.kv_indices[start:start + n]] = NAN
        v[meta.kv_indices[start:start + n]] = NAN
    out = extend_attention(q, k_new, v_new, k, v, meta, 0.37, backend="triton", config=config(16, 16, tma))
    torch.testing.assert_close(out, ref, **TOL[torch.float32])


def test_static_bounds_from_host_copies_equal_explicit_bounds():
    """The grid bound can come from max_q_len, from host copies, or (worst case) from q's rows."""
    q, k_new, v_new, k, v, meta = make_case([5, 40], [3, 9], 1, 2, 1, 16, torch.float32, seed=8, host_copies=True)
    a = check(q, k_new, v_new, k, v, meta)
    meta.qo_indptr_cpu = meta.kv_indptr_cpu = None
    b = check(q, k_new, v_new, k, v, meta)
    meta.max_q_len = 40
    c = check(q, k_new, v_new, k, v, meta)
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(a, c)


def test_kernel_path_reads_nothing_back_to_the_host(monkeypatch):
    """No .item() / .tolist() / nonzero on the kernel path: it can be captured in a CUDA graph."""
    q, k_new, v_new, k, v, meta = make_case([4, 17], [6, 30], 4, 4, 2, 16, torch.float32, seed=9)
    meta.max_q_len, meta.max_kv_len = 17, 36
    ref = paged_attention_ref(q, k, v, meta, 0.5)
    with no_host_reads(monkeypatch):
        out = extend_attention(q, k_new, v_new, k, v, meta, 0.5, backend="triton")
    torch.testing.assert_close(out, ref, **TOL[torch.float32])


def test_cpu_tensors_dispatch_to_the_reference():
    """backend='auto' on CPU tensors is the reference itself (bit-identical), not the interpreter."""
    q, k_new, v_new, k, v, meta = make_case([3], [2], 1, 2, 2, 8, torch.float32, seed=1, device="cpu")
    torch.testing.assert_close(extend_attention(q, k_new, v_new, k, v, meta, 0.5),
                               paged_attention_ref(q, k, v, meta, 0.5), atol=0, rtol=0)


def test_rejects_custom_masks_and_mismatched_shapes():
    q, k_new, v_new, k, v, meta = make_case([3], [2], 1, 2, 2, 8, torch.float32, seed=1, device="cpu")
    with pytest.raises(ValueError, match="k_new"):
        extend_attention(q, k_new[:2], v_new, k, v, meta, 0.5)
    meta.custom_mask = torch.ones(9, dtype=torch.bool)
    meta.mask_indptr = torch.tensor([0, 9])
    with pytest.raises(ValueError, match="causal"):
        extend_attention(q, k_new, v_new, k, v, meta, 0.5)


def test_a_batchs_launch_is_decided_once_for_all_its_layers(monkeypatch):
    """Every layer's extend over one metadata reuses the launch chosen at the first (``AttentionMetadata.plans``),
    keyed by the shapes and the layout the descriptors need: a misaligned view decides again."""
    import kernels.extend_attention as extend

    calls = []
    real = extend.choose_extend_config
    monkeypatch.setattr(extend, "choose_extend_config", lambda *a, **kw: calls.append(a) or real(*a, **kw))
    q, k_new, v_new, k, v, meta = make_case([9, 21, 1], [0, 19, 33], 16, 4, 2, 16, torch.float32, host_copies=True)
    first = check(q, k_new, v_new, k, v, meta)
    assert torch.equal(check(q, k_new, v_new, k, v, meta), first) and len(calls) == 1
    shifted = torch.empty(q.numel() + 1, dtype=q.dtype)[1:].view(q.shape).copy_(q)  # 4 bytes off: no descriptor
    assert not tma_supported(shifted, k_new, v_new)
    torch.testing.assert_close(check(shifted, k_new, v_new, k, v, meta), first)
    assert len(calls) == 2 and calls[1][2] is False and len(meta.plans) == 2
