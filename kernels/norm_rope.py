"""Fused RMSNorm (with the residual add) and rotary embedding: Triton kernels and torch references.

Contracts:
* ``rms_norm(x, weight, eps, residual=None)``: with a residual, ``s = x + residual`` and the result is
  ``(weight * s / rms(s), s)``; without, ``(weight * x / rms(x), x)``. Statistics in float32, the
  normalised value cast to x's dtype before the weight multiply (as Hugging Face Llama does).
* ``apply_rope(q, k, cos, sin)``: half-split rotation of every head of q [T, Hq, D] and k [T, Hk, D]
  by cos/sin [T, D/2] (float32); returns new tensors.
On the CPU (or TRITON_INTERPRET) the references run; on CUDA the kernels, one launch each.
"""

from __future__ import annotations

import torch

from kernels.launch import fast

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None


def rms_norm_ref(x, weight, eps, residual=None):
    s = x if residual is None else x + residual
    xf = s.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return weight * normed, s


def apply_rope_ref(q, k, cos, sin):
    def rot(x):
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half].float(), x[..., half:].float()
        c, s = cos.unsqueeze(1), sin.unsqueeze(1)
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)
    return rot(q), rot(k)


if triton is not None:
    @triton.jit
    def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, n_cols, eps,
                         HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        m = cols < n_cols
        x = tl.load(x_ptr + row * n_cols + cols, mask=m, other=0.0)
        if HAS_RES:
            x = x + tl.load(res_ptr + row * n_cols + cols, mask=m, other=0.0)
            tl.store(sum_ptr + row * n_cols + cols, x, mask=m)
        xf = x.to(tl.float32)
        var = tl.sum(xf * xf, axis=0) / n_cols
        normed = (xf * tl.rsqrt(var + eps)).to(x.dtype)
        w = tl.load(w_ptr + cols, mask=m, other=0.0)
        tl.store(out_ptr + row * n_cols + cols, w * normed, mask=m)

    @triton.jit
    def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, n_heads, HALF: tl.constexpr):
        t = tl.program_id(0)
        h = tl.program_id(1)
        offs = tl.arange(0, HALF)
        base = (t * n_heads + h) * 2 * HALF
        x1 = tl.load(x_ptr + base + offs).to(tl.float32)
        x2 = tl.load(x_ptr + base + HALF + offs).to(tl.float32)
        c = tl.load(cos_ptr + t * HALF + offs)
        s = tl.load(sin_ptr + t * HALF + offs)
        tl.store(out_ptr + base + offs, (x1 * c - x2 * s).to(out_ptr.dtype.element_ty))
        tl.store(out_ptr + base + HALF + offs, (x2 * c + x1 * s).to(out_ptr.dtype.element_ty))


def _use_triton(x: torch.Tensor, backend: str) -> bool:
    return triton is not None and (backend == "triton" or (backend == "auto" and x.is_cuda))


def rms_norm(x, weight, eps, residual=None, backend: str = "auto"):
    if not _use_triton(x, backend) or x.numel() == 0:
        return rms_norm_ref(x, weight, eps, residual)
    x = x.contiguous()
    n = x.shape[-1]
    out = torch.empty_like(x)
    summed = torch.empty_like(x) if residual is not None else x
    rows = x.numel() // n
    fast(_rms_norm_kernel)[(rows,)](
        x, residual.contiguous() if residual is not None else x, weight, out, summed, n, eps,
        HAS_RES=residual is not None, BLOCK=triton.next_power_of_2(n))
    return out, summed


def apply_rope(q, k, cos, sin, backend: str = "auto"):
    if not _use_triton(q, backend) or q.numel() == 0 or (q.shape[-1] // 2) & (q.shape[-1] // 2 - 1):
        return apply_rope_ref(q, k, cos, sin)
    outs = []
    for x in (q, k):
        x = x.contiguous()
        out = torch.empty_like(x)
        fast(_rope_kernel)[(x.shape[0], x.shape[1])](x, cos.contiguous(), sin.contiguous(), out, x.shape[1],
                                                     HALF=x.shape[-1] // 2)
        outs.append(out)
    return outs[0], outs[1]
