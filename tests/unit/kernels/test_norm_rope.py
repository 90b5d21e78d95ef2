"""Fused RMSNorm and RoPE: the Triton kernels equal their torch references (interpreter on CPU)."""


import pytest
import torch
from kernel_checks import DEVICE

from kernels.norm_rope import apply_rope, apply_rope_ref, rms_norm, rms_norm_ref


@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("hidden", [16, 48])
def test_rms_norm_kernel_matches_reference(with_residual, hidden):
    g = torch.Generator().manual_seed(hidden)
    x = torch.randn(5, hidden, generator=g).to(DEVICE)
    w = torch.randn(hidden, generator=g).to(DEVICE)
    res = torch.randn(5, hidden, generator=g).to(DEVICE) if with_residual else None
    out, summed = rms_norm(x, w, 1e-6, res, backend="triton")
    ref_out, ref_sum = rms_norm_ref(x, w, 1e-6, res)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(summed, ref_sum)


def test_rope_kernel_matches_reference():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(6, 4, 16, generator=g).to(DEVICE)
    k = torch.randn(6, 2, 16, generator=g).to(DEVICE)
    ang = torch.rand(6, 8, generator=g).to(DEVICE) * 10
    oq, ok = apply_rope(q, k, ang.cos(), ang.sin(), backend="triton")
    rq, rk = apply_rope_ref(q, k, ang.cos(), ang.sin())
    torch.testing.assert_close(oq, rq, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ok, rk, atol=1e-5, rtol=1e-5)


def test_rope_reference_is_a_rotation():
    """The reference preserves norms per pair and matches the rotate_half formulation."""
    q = torch.randn(3, 2, 8)
    ang = torch.rand(3, 4)
    rq, _ = apply_rope_ref(q, q, ang.cos(), ang.sin())
    torch.testing.assert_close(rq.norm(dim=-1), q.norm(dim=-1))
    cos = torch.cat([ang.cos(), ang.cos()], -1).unsqueeze(1)
    sin = torch.cat([ang.sin(), ang.sin()], -1).unsqueeze(1)
    rotate_half = torch.cat([-q[..., 4:], q[..., :4]], -1)
    torch.testing.assert_close(rq, q * cos + rotate_half * sin)
