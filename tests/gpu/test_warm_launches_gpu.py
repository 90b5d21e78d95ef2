"""On CUDA, at the 8B attention shape (32 query / 8 KV heads x 128, bf16, pages of 16): after
``kernels.attention.warm_launches``, no launch of ``paged_attention`` without a mask compiles Triton again:
decode steps, short extends (17 to 63 queries: a draft catching up a backlog, which compiled the causal tiles
mid-serve at c128 for 1.3 s on an H100), 1 to 256 requests, contexts from a few keys to far past the combine's
unrolled split counts (tests/unit/kernels/test_attention.py checks the same compile keys under the interpreter).
"""

from __future__ import annotations

import pytest
import torch

import kernels.attention as attention

pytestmark = pytest.mark.gpu


def compiled(fn) -> int:
    """Kernels a Triton JIT function holds compiled, over every device."""
    return sum(len(entry[0]) for entry in fn.device_caches.values())


def test_no_compile_after_warm_launches():
    dev = torch.device("cuda")
    hq, hkv, d, context, slots = 32, 8, 128, 32768, 1 << 17
    split_len = attention.choose_split_len(context, hkv, dev)
    k = torch.randn(slots, hkv, d, dtype=torch.bfloat16, device=dev)
    v = torch.randn_like(k)
    k0, v0 = k.clone(), v.clone()
    runs = attention.warm_launches(torch.bfloat16, hq, k, v, split_len)
    torch.cuda.synchronize()
    assert runs >= 10 and torch.equal(k, k0) and torch.equal(v, v0)
    before = compiled(attention._attn_kernel), compiled(attention._combine_kernel)
    g = torch.Generator().manual_seed(0)
    for batch in (1, 3, 64, 256):
        for q_len in (1, 4, 17, 33, 63):
            for ctx in (q_len + 5, 700, 5000, 30000):
                ctx = min(ctx, slots // batch)
                if ctx < q_len:
                    continue
                qo = [i * q_len for i in range(batch + 1)]
                kv = [i * ctx for i in range(batch + 1)]
                idx = torch.randint(0, slots, (batch * ctx,), generator=g).to(dev)
                qo_t, kv_t, pre_t = attention.pack_int64([qo, kv, [ctx - q_len] * batch], dev)
                meta = attention.AttentionMetadata(
                    qo_indptr=qo_t, kv_indptr=kv_t, kv_indices=idx, prefix_lens=pre_t, qo_indptr_cpu=qo,
                    kv_indptr_cpu=kv, prefix_lens_cpu=[ctx - q_len] * batch, max_q_len=q_len, max_kv_len=ctx,
                    split_len=split_len)
                q = torch.randn(batch * q_len, hq, d, dtype=torch.bfloat16, device=dev)
                out = attention.paged_attention(q, k, v, meta, d ** -0.5)
                assert torch.isfinite(out).all()
    torch.cuda.synchronize()
    assert (compiled(attention._attn_kernel), compiled(attention._combine_kernel)) == before
