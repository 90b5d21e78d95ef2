"""The decode-path fusions against their torch references (interpreter on the CPU)."""

import pytest
import torch
from kernel_checks import DEVICE

from kernels.fused import rope_store, rope_store_ref, silu_mul, silu_mul_ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq, hk", [(4, 2), (4, 4)])
def test_rope_store_matches_reference(dtype, hq, hk):
    torch.manual_seed(0)
    T, d, slots_total = 5, 16, 40
    qkv = torch.randn(T, (hq + 2 * hk) * d, dtype=dtype, device=DEVICE)
    pos = torch.tensor([3, 7, 8, 20, 21], device=DEVICE).float()
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, device=DEVICE).float() / d))
    freqs = pos[:, None] * inv[None]
    cos, sin = freqs.cos(), freqs.sin()
    slots = torch.tensor([11, 2, 30, 5, 17], device=DEVICE)
    caches = [torch.full((slots_total, hk, d), float("nan"), dtype=dtype, device=DEVICE) for _ in range(4)]
    q_ref = rope_store_ref(qkv, cos, sin, caches[0], caches[1], slots, hq, hk)
    q = rope_store(qkv, cos, sin, caches[2], caches[3], slots, hq, hk, backend="triton")
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(q, q_ref, atol=tol, rtol=tol)
    for ref, got in ((caches[0], caches[2]), (caches[1], caches[3])):
        torch.testing.assert_close(got[slots], ref[slots], atol=tol, rtol=tol)
        untouched = torch.ones(slots_total, dtype=torch.bool, device=DEVICE)
        untouched[slots] = False
        assert torch.isnan(got[untouched]).all()  # nothing written outside the slots


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_matches_reference(dtype):
    torch.manual_seed(1)
    x = torch.randn(3, 2 * 1500, dtype=dtype, device=DEVICE)  # a column count that is not a block multiple
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(silu_mul(x, backend="triton"), silu_mul_ref(x), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_store_can_keep_the_rotated_keys_and_values_in_qkv(dtype):
    """``keep_kv``: (k, v) views of qkv holding exactly the rows stored in the caches (the keys rotated in
    place), the kernel and the reference alike; q as without it."""
    torch.manual_seed(1)
    T, d, hq, hk = 5, 16, 4, 2
    qkv = torch.randn(T, (hq + 2 * hk) * d, dtype=dtype, device=DEVICE)
    pos = torch.tensor([3, 7, 8, 20, 21], device=DEVICE).float()
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, device=DEVICE).float() / d))
    cos, sin = (pos[:, None] * inv[None]).cos(), (pos[:, None] * inv[None]).sin()
    slots = torch.tensor([11, 2, 30, 5, 17], device=DEVICE)
    for backend in ("triton", "torch"):
        caches = [torch.full((40, hk, d), float("nan"), dtype=dtype, device=DEVICE) for _ in range(2)]
        plain = rope_store(qkv.clone(), cos, sin, *[c.clone() for c in caches], slots, hq, hk, backend=backend)
        mine = qkv.clone()
        q, k, v = rope_store(mine, cos, sin, *caches, slots, hq, hk, backend=backend, keep_kv=True)
        assert torch.equal(q, plain)
        assert torch.equal(k, caches[0][slots]) and torch.equal(v, caches[1][slots])
        assert k.data_ptr() == mine[:, hq * d:].data_ptr() and k.shape == v.shape == (T, hk, d)
        assert torch.equal(mine[:, :hq * d], qkv[:, :hq * d])  # the queries' columns untouched



@pytest.mark.parametrize("keep_kv", [False, True])
def test_rope_store_writes_the_queries_where_it_is_told(keep_kv):
    """``q_out``: the queries land in the caller's buffer (the mixed steps' graph pieces pass theirs), the same
    bits as without it, kernel and reference; a buffer of another shape is refused."""
    torch.manual_seed(2)
    T, d, hq, hk = 5, 16, 4, 2
    qkv = torch.randn(T, (hq + 2 * hk) * d, dtype=torch.bfloat16, device=DEVICE)
    pos = torch.tensor([3, 7, 8, 20, 21], device=DEVICE).float()
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, device=DEVICE).float() / d))
    cos, sin = (pos[:, None] * inv[None]).cos(), (pos[:, None] * inv[None]).sin()
    slots = torch.tensor([11, 2, 30, 5, 17], device=DEVICE)
    for backend in ("triton", "torch"):
        caches = [torch.zeros(40, hk, d, dtype=torch.bfloat16, device=DEVICE) for _ in range(2)]
        want = rope_store(qkv.clone(), cos, sin, *caches, slots, hq, hk, backend=backend)
        buf = torch.full((T + 3, hq, d), float("nan"), dtype=torch.bfloat16, device=DEVICE)
        got = rope_store(qkv.clone(), cos, sin, *caches, slots, hq, hk, backend=backend, keep_kv=keep_kv,
                         q_out=buf[:T])
        q = got[0] if keep_kv else got
        assert q.data_ptr() == buf.data_ptr() and torch.equal(buf[:T], want) and torch.isnan(buf[T:]).all()
        with pytest.raises(ValueError, match="q_out"):
            rope_store(qkv.clone(), cos, sin, *caches, slots, hq, hk, backend=backend, q_out=buf[:T - 1])
