"""Compile the FP8 skinny-GEMM kernel's launches for Hopper without a GPU (the installed Triton, sm_90a): the
launches ``choose_config`` makes for the 8B shapes and the unit tests' configurations, at one row and at 2+
rows, per-channel and block scales. The interpreter the CPU tests run accepts code the compiler refuses (an
``arange`` of zero length after a constexpr ``if``'s return compiled anyway); this finds that without a GPU.

    python bench/compile_fp8.py [--quick]     # exit 1 when a launch fails to compile
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kernels.fp8_gemv import _fp8_gemv_kernel, check_config, choose_config, choose_split  # noqa: E402

SHAPES_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]
TEST_SHAPES = [(40, 64), (37, 96), (64, 256)]  # tests/unit/kernels/test_fp8_gemv.py
TEST_BLOCKS = [None, (16, 32), (1, 32), (32, 64)]
TEST_CONFIGS = [(16, 16, 4, 2), (16, 64, 4, 2)]


def launches(quick: bool) -> list[dict]:
    """One dict of constexprs (and warps, stages) per distinct launch."""
    out = []

    def add(rows, k, block, config, dtype="bf16", x_left=False, split=1):
        bn, bk = (1, k) if block is None else block
        block_k = check_config(rows, k, min(bk, k), config)
        out.append({"BN": bn, "BK": bk, "PER_CHANNEL": bk >= k, "BLOCK_M": 1 if rows == 1 else 16,
                    "BLOCK_N": config[0], "BLOCK_K": block_k, "HAS_BIAS": True,
                    "PRECISION": "ieee" if dtype == "fp32" else "tf32", "X_LEFT": x_left and rows > 1, "dtype": dtype,
                    "SPLIT": split if rows > 1 else 1, "num_warps": config[2], "num_stages": config[3]})

    for rows in (1, 4):
        for n, k in SHAPES_8B[:2] if quick else SHAPES_8B:
            for block in (None, (128, 128)):
                for x_left in (False, True):  # both tl.dot operand orders (EYRIE_FP8_DOT)
                    config = choose_config(rows, n, k, min(k, 128 if block else k), 132)
                    for split in {1, choose_split(n, k, config[0], config[1], 132)}:  # split-K's code and without
                        add(rows, k, block, config, x_left=x_left, split=split)
        for _n, k in TEST_SHAPES[:1] if quick else TEST_SHAPES:
            for block in TEST_BLOCKS:
                for config in TEST_CONFIGS:
                    for split in (1, 2):
                        add(rows, k, block, config, split=split)
    add(4, 64, (16, 32), TEST_CONFIGS[0], "fp32")
    unique = {tuple(sorted(d.items())): d for d in out}
    return list(unique.values())


def build(launch: dict):
    dt = launch["dtype"]
    types = {"X": f"*{dt}", "W": "*fp8e4nv", "S": "*fp32", "B": f"*{dt}", "Y": f"*{dt}", "P": "*fp32", "C": "*i32"}
    consts = {k: v for k, v in launch.items() if k not in ("dtype", "num_warps", "num_stages")}
    sig = {}
    for name in _fp8_gemv_kernel.arg_names:
        sig[name] = "constexpr" if name in consts else types.get(name, "i32")
    src = ASTSource(_fp8_gemv_kernel, sig, consts)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": launch["num_warps"], "num_stages": launch["num_stages"]})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer shapes (the unit test)")
    args = ap.parse_args()
    failed = 0
    for launch in launches(args.quick):
        t0 = time.time()
        try:
            build(launch)
            status = f"ok ({time.time() - t0:.1f} s)"
        except Exception as e:  # noqa: BLE001 - report each failure and go on
            failed += 1
            status = f"ERROR {type(e).__name__}: {str(e)[-300:]}"
        print({k: launch[k] for k in ("dtype", "BN", "BK", "BLOCK_M", "BLOCK_N", "BLOCK_K")}, status, flush=True)
    print(f"triton {triton.__version__}: {failed} launch(es) failed to compile")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
