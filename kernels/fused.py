"""Fusions on the decode path, each beside a torch reference of the same contract.

* ``rope_store(qkv, cos, sin, k_cache, v_cache, slots, num_heads, num_kv_heads)``: from the fused
  projection output ``qkv [T, (Hq + 2 Hk) D]``, rotate q and k (half-split RoPE, cos/sin [T, D/2]
  float32), write rotated k and v to ``k_cache[slots]`` / ``v_cache[slots]`` and return rotated q
  ``[T, Hq, D]``. One launch instead of two copies, two RoPE launches and two scatter launches.
* ``silu_mul(gate_up)``: ``silu(gate) * up`` for ``gate_up [T, 2I]`` split in halves. One launch
  instead of three.
On the CPU (or under TRITON_INTERPRET without ``backend="triton"``) the references run.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.launch import fast
from kernels.norm_rope import apply_rope_ref

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None


def rope_store_ref(qkv, cos, sin, k_cache, v_cache, slots, num_heads, num_kv_heads, keep_kv: bool = False):
    T = qkv.shape[0]
    d = k_cache.shape[-1]
    q, k, v = qkv.split([num_heads * d, num_kv_heads * d, num_kv_heads * d], dim=-1)
    q, k = apply_rope_ref(q.reshape(T, num_heads, d), k.reshape(T, num_kv_heads, d), cos, sin)
    k_cache[slots] = k.to(k_cache.dtype)
    v_cache[slots] = v.reshape(T, num_kv_heads, d).to(v_cache.dtype)
    if not keep_kv:
        return q
    return q, *_kept(qkv, k, num_heads, num_kv_heads, d)


def _kept(qkv, k_rotated, num_heads, num_kv_heads, d):
    """(k, v) as [T, Hkv, D] views of ``qkv``'s columns, the rotated keys written into its k columns (when
    ``k_rotated`` is given: the reference; the kernel writes them itself)."""
    T = qkv.shape[0]
    k = qkv[:, num_heads * d:(num_heads + num_kv_heads) * d]
    if k_rotated is not None:
        k.copy_(k_rotated.reshape(T, num_kv_heads * d))
    v = qkv[:, (num_heads + num_kv_heads) * d:]
    return k.unflatten(1, (num_kv_heads, d)), v.unflatten(1, (num_kv_heads, d))


def silu_mul_ref(gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


if triton is not None:
    @triton.jit
    def _rope_store_kernel(qkv_ptr, cos_ptr, sin_ptr, q_out, k_cache, v_cache, slots_ptr, stride_t,
                           stride_ct, stride_ch, n_q: tl.constexpr, n_kv: tl.constexpr, HALF: tl.constexpr,
                           KEEP_K: tl.constexpr = False):
        t = tl.program_id(0)
        h = tl.program_id(1)  # [0, n_q): q heads, [n_q, n_q + n_kv): k heads, then v heads
        offs = tl.arange(0, HALF)
        src = qkv_ptr + t * stride_t + h * 2 * HALF
        x1 = tl.load(src + offs)
        x2 = tl.load(src + HALF + offs)
        if h < n_q + n_kv:
            c = tl.load(cos_ptr + t * HALF + offs)
            s = tl.load(sin_ptr + t * HALF + offs)
            f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
            y1, y2 = f1 * c - f2 * s, f2 * c + f1 * s
            if h < n_q:
                dst = q_out + (t * n_q + h) * 2 * HALF
                tl.store(dst + offs, y1.to(q_out.dtype.element_ty))
                tl.store(dst + HALF + offs, y2.to(q_out.dtype.element_ty))
            else:
                slot = tl.load(slots_ptr + t)
                dst = k_cache + slot * stride_ct + (h - n_q) * stride_ch
                tl.store(dst + offs, y1.to(k_cache.dtype.element_ty))
                tl.store(dst + HALF + offs, y2.to(k_cache.dtype.element_ty))
                if KEEP_K:  # the rotated key into qkv too (this program alone reads these columns)
                    tl.store(src + offs, y1.to(qkv_ptr.dtype.element_ty))
                    tl.store(src + HALF + offs, y2.to(qkv_ptr.dtype.element_ty))
        else:
            slot = tl.load(slots_ptr + t)
            dst = v_cache + slot * stride_ct + (h - n_q - n_kv) * stride_ch
            tl.store(dst + offs, x1.to(v_cache.dtype.element_ty))
            tl.store(dst + HALF + offs, x2.to(v_cache.dtype.element_ty))

    @triton.jit
    def _silu_mul_kernel(x_ptr, out_ptr, n_cols, stride_x, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = cols < n_cols
        g = tl.load(x_ptr + row * stride_x + cols, mask=m, other=0.0).to(tl.float32)
        u = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=m, other=0.0).to(tl.float32)
        y = g / (1.0 + tl.exp(-g)) * u
        tl.store(out_ptr + row * n_cols + cols, y.to(out_ptr.dtype.element_ty), mask=m)


def _use_triton(x: torch.Tensor, backend: str) -> bool:
    return triton is not None and (backend == "triton" or (backend == "auto" and x.is_cuda))


def rope_store(qkv, cos, sin, k_cache, v_cache, slots, num_heads, num_kv_heads, backend: str = "auto",
               keep_kv: bool = False, q_out: torch.Tensor | None = None):
    """q [T, Hq, D] rotated, with the rotated keys and the values stored in the caches' ``slots``. ``keep_kv``:
    also (k, v) [T, Hkv, D], views of ``qkv`` holding the same rows (the keys rotated in place), so a prefill
    step's attention reads this step's K/V densely without gathering them back from the cache. ``q_out``: a
    contiguous [T, Hq, D] tensor of qkv's dtype the queries are written to (and returned)."""
    d = k_cache.shape[-1]
    half = d // 2
    T = qkv.shape[0]
    if q_out is not None and (q_out.shape != (T, num_heads, d) or q_out.dtype != qkv.dtype
                              or not q_out.is_contiguous()):
        raise ValueError(f"q_out must be a contiguous [{T}, {num_heads}, {d}] tensor of {qkv.dtype}")
    if (not _use_triton(qkv, backend) or qkv.shape[0] == 0 or half & (half - 1) or qkv.stride(-1) != 1
            or k_cache.stride() != v_cache.stride()):
        out = rope_store_ref(qkv, cos, sin, k_cache, v_cache, slots, num_heads, num_kv_heads, keep_kv)
        if q_out is None:
            return out
        q_out.copy_(out[0] if keep_kv else out)
        return (q_out, *out[1:]) if keep_kv else q_out
    q = q_out if q_out is not None else torch.empty(T, num_heads, d, dtype=qkv.dtype, device=qkv.device)
    fast(_rope_store_kernel)[(T, num_heads + 2 * num_kv_heads)](
        qkv, cos.contiguous(), sin.contiguous(), q, k_cache, v_cache, slots, qkv.stride(0),
        k_cache.stride(0), k_cache.stride(1), n_q=num_heads, n_kv=num_kv_heads, HALF=half, KEEP_K=keep_kv)
    return (q, *_kept(qkv, None, num_heads, num_kv_heads, d)) if keep_kv else q


def silu_mul(gate_up, backend: str = "auto"):
    if not _use_triton(gate_up, backend) or gate_up.shape[0] == 0 or gate_up.stride(-1) != 1:
        return silu_mul_ref(gate_up)
    T, n = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(T, n, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    fast(_silu_mul_kernel)[(T, triton.cdiv(n, block))](gate_up, out, n, gate_up.stride(0), BLOCK=block)
    return out
