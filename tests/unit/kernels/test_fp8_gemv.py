"""The FP8 skinny-GEMM kernel equals the dequantized product (interpreter on the CPU, the kernel on a GPU), for
per-channel scales and for block scales whose blocks a K step spans several of, lies inside, or cuts the
matrix raggedly; a row's output at 2+ rows does not depend on the other rows; and every launch these tests
and the 8B shapes make compiles for sm_90a (the interpreter accepts code the compiler refuses)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from kernel_checks import DEVICE

from kernels.fp8_gemv import (
    _COUNTERS,
    MAX_ROWS,
    TILE_ROWS,
    check_config,
    choose_config,
    choose_split,
    fp8_linear,
    fp8_linear_ref,
    same_rows_linear,
)
from shared.model.fp8 import quantize


@pytest.mark.parametrize("rows", [1, 3, TILE_ROWS, 2 * TILE_ROWS + 3])
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


def test_block_sizes_the_compiler_refuses_are_refused_under_the_interpreter_too():
    assert check_config(4, 64, 32, (16, 64, 4, 2)) == 32  # 2+ rows: a step inside one scale block
    assert check_config(1, 64, 32, (16, 64, 4, 2)) == 64  # one row: a step may span power-of-two blocks
    for rows, config in ((1, (16, 8, 4, 2)), (1, (12, 16, 4, 2)), (4, (8, 32, 4, 2)), (1, (16, 32, 3, 2))):
        with pytest.raises(ValueError, match="power"):
            check_config(rows, 4096, 4096, config)
    q, scale = quantize(torch.randn(32, 64), "channel")
    with pytest.raises(ValueError, match="BLOCK_N 8"):
        fp8_linear(torch.randn(3, 64, device=DEVICE), q.to(DEVICE), scale.to(DEVICE), (1, 64), backend="triton",
                   config=(8, 64, 4, 2))


@pytest.mark.parametrize("block", [None, (16, 32)], ids=["channel", "16x32"])
def test_a_rows_output_does_not_depend_on_the_other_rows(block):
    """Verify's rows and a decode step's: the same launch at every row count from 2, the same bits per row."""
    torch.manual_seed(3)
    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    n, k = 48, 96
    q, scale = quantize(torch.randn(n, k), "channel" if block is None else "block", block or (128, 128))
    blk = (1, k) if block is None else block
    x = torch.randn(2 * TILE_ROWS + 5, k, dtype=dtype, device=DEVICE)
    args = (q.to(DEVICE), scale.to(DEVICE), blk)
    every = fp8_linear(x, *args, backend="triton")
    for lo, hi in ((0, 2), (3, 10), (TILE_ROWS - 1, TILE_ROWS + 6), (2 * TILE_ROWS, x.shape[0])):
        assert torch.equal(fp8_linear(x[lo:hi], *args, backend="triton"), every[lo:hi]), (lo, hi)


def test_every_launch_compiles_for_hopper(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    root = Path(__file__).resolve().parents[3]
    res = subprocess.run([sys.executable, "bench/compile_fp8.py", "--quick"], cwd=root, env=env,
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    assert " 0 launch(es) failed" in res.stdout


@pytest.mark.parametrize("order", ["wx", "xw"])
@pytest.mark.parametrize("block, k", [(None, 300), ((16, 32), 96), ((32, 64), 200)], ids=["channel", "16x32", "32x64"])
def test_a_rows_output_is_the_same_bits_at_one_row_and_at_more(block, k, order, monkeypatch):
    """A decode step's one row and a verify step's several: the same launch (a tile of 16) at 1, 2, 7, 16 and more
    rows, so a row's product is bit-identical whatever the row count (greedy speculation stays lossless), with
    either operand on the tl.dot's left (``EYRIE_FP8_DOT``); both orders give the dequantized product."""
    monkeypatch.setenv("EYRIE_FP8_DOT", order)
    torch.manual_seed(5)
    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    n = 37
    q, scale = quantize(torch.randn(n, k), "channel" if block is None else "block", block or (128, 128))
    args = (q.to(DEVICE), scale.to(DEVICE), (1, k) if block is None else block)
    x = torch.randn(2 * TILE_ROWS + 9, k, dtype=dtype, device=DEVICE)
    every = fp8_linear(x, *args, backend="triton")
    for rows in (1, 2, 7, TILE_ROWS, TILE_ROWS + 1, 2 * TILE_ROWS + 9):
        assert torch.equal(fp8_linear(x[:rows], *args, backend="triton"), every[:rows]), rows
    for row in (0, 5, TILE_ROWS, x.shape[0] - 1):  # each row alone, as a batch-1 decode step runs it
        assert torch.equal(fp8_linear(x[row:row + 1], *args, backend="triton"), every[row:row + 1]), row
    ref = fp8_linear_ref(x.double().cpu(), q, scale, args[2])
    assert ((every.double().cpu() - ref).norm() / ref.norm()).item() < (1e-5 if dtype == torch.float32 else 2e-2)


def test_the_one_row_tile_code_is_opt_in_and_still_matches_the_dequantized_product(monkeypatch):
    torch.manual_seed(6)
    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    q, scale = quantize(torch.randn(40, 64), "block", (16, 32))
    args = (q.to(DEVICE), scale.to(DEVICE), (16, 32))
    x = torch.randn(1, 64, dtype=dtype, device=DEVICE)
    ref = fp8_linear_ref(x.double().cpu(), q, scale, (16, 32))
    monkeypatch.setenv("EYRIE_FP8_ONE_ROW", "tile")
    got = fp8_linear(x, *args, backend="triton", config=(16, 64, 4, 2))  # a step spanning two scale blocks
    assert ((got.double().cpu() - ref).norm() / ref.norm()).item() < (1e-5 if dtype == torch.float32 else 2e-2)
    assert check_config(1, 64, 32, (16, 64, 4, 2)) == 64


def test_a_dense_weight_through_the_fp8_launch_is_the_same_bits_at_every_row_count():
    """An FP8 target's bf16 LM head (``same_rows_linear``): F.linear's product, the same bits per row at 1, 2,
    7, 16 and more rows (kernels/gemv.py sums one row, 2-16 rows and more in three orders)."""
    torch.manual_seed(7)
    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    w = torch.randn(45, 300, dtype=dtype, device=DEVICE)
    b = torch.randn(45, dtype=dtype, device=DEVICE)
    x = torch.randn(2 * TILE_ROWS + 9, 300, dtype=dtype, device=DEVICE)
    every = same_rows_linear(x, w, b, backend="triton")
    ref = torch.nn.functional.linear(x.double(), w.double(), b.double())
    assert ((every.double() - ref).norm() / ref.norm()).item() < (1e-5 if dtype == torch.float32 else 2e-2)
    for rows in (1, 2, 7, TILE_ROWS, TILE_ROWS + 1):
        assert torch.equal(same_rows_linear(x[:rows], w, b, backend="triton"), every[:rows]), rows
    for row in (3, TILE_ROWS + 2, x.shape[0] - 1):
        assert torch.equal(same_rows_linear(x[row:row + 1], w, b, backend="triton"), every[row:row + 1]), row


def test_every_row_count_runs_the_launch_past_max_rows_when_asked():
    """The engine's ``batch_invariant`` (``max_rows=None``): past ``MAX_ROWS`` rows (a long prefill chunk, a mixed
    step's decode rows beside one) the same launch still runs, a row the same bits as alone or among fewer rows;
    by default those rows go to the reference product instead."""
    torch.manual_seed(11)
    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    w = torch.randn(24, 32, dtype=dtype, device=DEVICE)
    x = torch.randn(MAX_ROWS + 3, 32, dtype=dtype, device=DEVICE)
    every = same_rows_linear(x, w, backend="triton", max_rows=None)
    ref = torch.nn.functional.linear(x.double(), w.double())
    assert ((every.double() - ref).norm() / ref.norm()).item() < (1e-5 if dtype == torch.float32 else 2e-2)
    for rows in (1, TILE_ROWS + 1, MAX_ROWS):
        assert torch.equal(same_rows_linear(x[:rows], w, backend="triton", max_rows=None), every[:rows]), rows
    last = x.shape[0] - 1
    assert torch.equal(same_rows_linear(x[last:], w, backend="triton"), every[last:])
    bounded = same_rows_linear(x, w, backend="triton")  # the reference past MAX_ROWS: F.linear's product
    torch.testing.assert_close(bounded, torch.nn.functional.linear(x, w))


@pytest.mark.parametrize("block, k", [(None, 320), ((16, 32), 256), ((32, 64), 448)], ids=["channel", "16x32", "32x64"])
@pytest.mark.parametrize("split", [2, 3, 4])
def test_split_k_shares_add_in_one_order_whatever_the_rows(block, k, split):
    """Split-K (``split`` programs per weight block, the last to arrive adding the shares): the dequantized
    product at every split; a row's bits the same alone, in a verify-sized batch and past a tile; the arrival
    counters back to zero after every launch (a CUDA graph's replays reuse them)."""
    torch.manual_seed(split * 11 + k)
    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    n = 45
    q, scale = quantize(torch.randn(n, k), "channel" if block is None else "block", block or (128, 128))
    args = (q.to(DEVICE), scale.to(DEVICE), (1, k) if block is None else block)
    b = torch.randn(n, dtype=dtype, device=DEVICE)
    x = torch.randn(TILE_ROWS + 5, k, dtype=dtype, device=DEVICE)
    config = (16, 32, 4, 2)
    every = fp8_linear(x, *args, b, backend="triton", config=config, split=split)
    ref = fp8_linear_ref(x.double().cpu(), q, scale, args[2], b.double().cpu())
    assert ((every.double().cpu() - ref).norm() / ref.norm()).item() < (1e-5 if dtype == torch.float32 else 2e-2)
    for rows in (1, 7, TILE_ROWS + 5):
        assert torch.equal(fp8_linear(x[:rows], *args, b, backend="triton", config=config, split=split),
                           every[:rows]), rows
    assert torch.equal(fp8_linear(x[3:4], *args, b, backend="triton", config=config, split=split), every[3:4])
    counters = _COUNTERS[(args[0].device, args[0].data_ptr())]
    assert counters.abs().sum().item() == 0


def test_split_k_is_chosen_from_the_shape_for_the_small_products_only(monkeypatch):
    monkeypatch.delenv("EYRIE_FP8_SPLIT", raising=False)
    # the 8B's down, o and qkv have fewer weight blocks than 3 per SM of an H100: split; gate_up and the head not
    assert choose_split(4096, 14336, 32, 256, 132) > 1
    assert choose_split(4096, 4096, 32, 256, 132) > 1
    assert choose_split(6144, 4096, 32, 256, 132) > 1
    assert choose_split(28672, 4096, 32, 256, 132) == 1
    assert choose_split(128256, 4096, 32, 256, 132) == 1
    assert choose_split(4096, 512, 32, 256, 132) == 1  # too little K to share
    monkeypatch.setenv("EYRIE_FP8_SPLIT", "1")
    assert choose_split(4096, 14336, 32, 256, 132) == 1
    monkeypatch.setenv("EYRIE_FP8_SPLIT", "0")
    with pytest.raises(ValueError, match="EYRIE_FP8_SPLIT"):
        choose_split(4096, 14336, 32, 256, 132)


def test_split_k_takes_many_rows_in_launches_of_whole_tiles_with_the_same_bits(monkeypatch):
    """Past ``SPLIT_ROWS`` rows (a prefill chunk) split-K launches per group of rows, so its float32 shares stay
    small: every row the same bits as in one launch."""
    from kernels import fp8_gemv

    torch.manual_seed(9)
    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    q, scale = quantize(torch.randn(45, 256), "block", (16, 32))
    args = (q.to(DEVICE), scale.to(DEVICE), (16, 32))
    x = torch.randn(3 * TILE_ROWS + 5, 256, dtype=dtype, device=DEVICE)
    whole = fp8_linear(x, *args, backend="triton", config=(16, 32, 4, 2), split=2)
    monkeypatch.setattr(fp8_gemv, "SPLIT_ROWS", 2 * TILE_ROWS)
    assert torch.equal(fp8_linear(x, *args, backend="triton", config=(16, 32, 4, 2), split=2), whole)
