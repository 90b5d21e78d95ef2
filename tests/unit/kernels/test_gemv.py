"""The skinny-GEMM kernel equals F.linear (interpreter on the CPU, the kernel on a GPU)."""

import pytest
import torch
from kernel_checks import DEVICE

from kernels.gemv import MAX_ROWS, choose_config, linear, linear_ref


@pytest.mark.parametrize("rows", [1, 3, MAX_ROWS])
@pytest.mark.parametrize("n, k", [(40, 64), (37, 50)], ids=["even", "ragged"])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_reference(rows, n, k, bias):
    torch.manual_seed(rows * 7 + n + k)
    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    x = torch.randn(rows, k, device=DEVICE, dtype=dtype)
    w = torch.randn(n, k, device=DEVICE, dtype=dtype)
    b = torch.randn(n, device=DEVICE, dtype=dtype) if bias else None
    out = torch.full((rows, n), float("nan"), device=DEVICE, dtype=dtype)  # poisoned: every element written
    got = linear(x, w, b, backend="triton", config=(16, 32, 4, 2), out=out)
    ref = linear_ref(x.double(), w.double(), None if b is None else b.double())
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert torch.isfinite(got).all()
    assert ((got.double() - ref).norm() / ref.norm()).item() < tol


def test_linear_keeps_leading_dims_and_falls_back_for_many_rows():
    torch.manual_seed(0)
    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16  # tl.dot rounds float32 to tf32 on a GPU
    tol = 1e-4 if DEVICE == "cpu" else 2e-2
    w = torch.randn(24, 32, device=DEVICE, dtype=dtype)
    x = torch.randn(2, 1, 32, device=DEVICE, dtype=dtype)
    got = linear(x, w, backend="triton", config=(16, 32, 4, 2))
    assert got.shape == (2, 1, 24)
    torch.testing.assert_close(got, linear_ref(x, w), atol=tol, rtol=tol)
    many = torch.randn(MAX_ROWS + 1, 32, device=DEVICE, dtype=dtype)
    torch.testing.assert_close(linear(many, w, backend="triton"), linear_ref(many, w))  # cuBLAS / torch path


def test_config_gives_enough_programs():
    for n, k in ((4096, 4096), (6144, 4096), (28672, 4096), (4096, 14336), (128256, 4096), (1024, 4096)):
        block_n, block_k, _, _ = choose_config(1, n, k, 132)
        assert -(-n // block_n) >= 132  # at least one program per SM
        assert block_k * 2 >= 512  # wide loads
