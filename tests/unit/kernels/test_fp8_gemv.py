"""The FP8 skinny-GEMM kernel equals the dequantized product (interpreter on the CPU, the kernel on a GPU), for
per-channel scales and for block scales whose blocks a K step spans several of, lies inside, or cuts the
matrix raggedly."""

import pytest
import torch
from kernel_checks import DEVICE

from kernels.fp8_gemv import MAX_ROWS, choose_config, fp8_linear, fp8_linear_ref
from shared.model.fp8 import quantize


@pytest.mark.parametrize("rows", [1, 3, MAX_ROWS])
@pytest.mark.parametrize("n, k", [(40, 64), (37, 96), (64, 256)], ids=["even", "ragged", "wide"])
@pytest.mark.parametrize("block", [None, (16, 32), (1, 32), (32, 64)], ids=["channel", "16x32", "1x32", "32x64"])
@pytest.mark.parametrize("config", [(16, 16, 4, 2), (16, 64, 4, 2)], ids=["step-in-block", "step-spans-blocks"])
def test_fp8_linear_matches_the_dequantized_product(rows, n, k, block, config):
    torch.manual_seed(rows * 7 + n + k)
    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    w = torch.randn(n, k)
    q, scale = quantize(w, "channel" if block is None else "block", block or (128, 128))
    blk = (1, k) if block is None else block
    x = torch.randn(rows, k, dtype=dtype, device=DEVICE)
    b = torch.randn(n, dtype=dtype, device=DEVICE)
    got = fp8_linear(x, q.to(DEVICE), scale.to(DEVICE), blk, b, backend="triton", config=config)
    ref = fp8_linear_ref(x.double().cpu(), q, scale, blk, b.double().cpu())
    assert got.shape == (rows, n) and got.dtype == dtype and torch.isfinite(got).all()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert ((got.double().cpu() - ref).norm() / ref.norm()).item() < tol


def test_config_steps_tile_the_scale_blocks_and_bad_ones_are_refused():
    for m in (1, 4):
        for k, bk in ((4096, 128), (14336, 128), (4096, 4096), (960, 96)):
            block_n, block_k, _, _ = choose_config(m, 4096, k, bk, 132)
            assert (bk % block_k == 0) if block_k <= bk else (block_k % bk == 0 and bk & (bk - 1) == 0)
    q, scale = quantize(torch.randn(32, 64), "block", (16, 32))
    with pytest.raises(ValueError, match="do not tile"):
        fp8_linear(torch.randn(1, 64, device=DEVICE), q.to(DEVICE), scale.to(DEVICE), (16, 32), backend="triton",
                   config=(16, 48, 4, 2))


def test_more_rows_than_the_kernel_takes_use_the_dequantized_product():
    q, scale = quantize(torch.randn(24, 32), "channel")
    x = torch.randn(MAX_ROWS + 1, 32)
    torch.testing.assert_close(fp8_linear(x, q, scale, (1, 32), backend="triton"),
                               fp8_linear_ref(x, q, scale, (1, 32)))
