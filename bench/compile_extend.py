"""Compile extend-attention launch configurations for Hopper without a GPU and report what ptxas says.

For each candidate ``ExtendConfig`` this builds the kernel for ``sm_90a`` (bf16, head_dim 128, GQA 4, the
TMA path) with the installed Triton, then runs Triton's own ``ptxas -v`` on the PTX: registers per
thread, bytes spilled, and the shared memory Triton allocates. A screen before spending device time:
a configuration that spills heavily in its main loop, or needs more than the SM's 227 KiB of shared
memory, is not worth timing. The figures are for this machine's Triton, which may differ from the
version on the GPU machine.

    python bench/compile_extend.py [--out docs/bench/extend_compile_sm90.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from bench.bench_extend import fmt_cfg, shape_configs  # noqa: E402
from kernels.extend_attention import HOPPER_CONFIG, LONG_CONFIG, ExtendConfig, _extend_kernel  # noqa: E402

HEAD_DIM, GROUP = 128, 4
SMEM_LIMIT = 227 * 1024  # sm90: the most one block may allocate


def signature(cfg: ExtendConfig) -> tuple[dict, dict]:
    """Argument types and constexprs of one launch (bf16 q / k_new / v_new / caches, int32 metadata)."""
    dt = "bf16"
    desc_q = f"tensordesc<{dt}[{cfg.block_m}, {HEAD_DIM}]>" if cfg.tma and cfg.pack == 1 else f"*{dt}"
    desc_kv = f"tensordesc<{dt}[{cfg.block_n}, {HEAD_DIM}]>" if cfg.tma else f"*{dt}"
    types = {"Q": f"*{dt}", "QD": desc_q, "Kn": f"*{dt}", "KnD": desc_kv, "Vn": f"*{dt}", "VnD": desc_kv,
             "Kc": f"*{dt}", "Vc": f"*{dt}", "O": f"*{dt}", "qo_indptr": "*i32", "kv_indptr": "*i32",
             "kv_indices": "*i32", "prefix_lens": "*i32", "qk_scale": "fp32", "num_q_heads": "i32",
             "window": "i32"}
    for name in _extend_kernel.arg_names:
        if name.startswith("stride_"):
            types[name] = "i32"
    consts = {"GROUP": GROUP, "HEAD_DIM": HEAD_DIM, "BLOCK_D": HEAD_DIM, "BLOCK_M": cfg.block_m,
              "BLOCK_N": cfg.block_n, "USE_TMA": cfg.tma, "WARP_SPEC": cfg.warp_specialize, "PRECISION": "tf32",
              "UPCAST": False, "HEAD_MAJOR": cfg.head_major, "PACK": cfg.pack,
              "REQUEST_MAJOR": cfg.request_major, "SLIDING": False}
    types.update(dict.fromkeys(consts, "constexpr"))
    return {n: types[n] for n in _extend_kernel.arg_names}, consts


def divisibility_attrs() -> dict:
    """What a launch on real tensors specialises: 16-byte aligned pointers, strides divisible by 16."""
    attrs = {}
    for i, name in enumerate(_extend_kernel.arg_names):
        if name in ("Q", "Kn", "Vn", "Kc", "Vc", "O", "qo_indptr", "kv_indptr", "kv_indices", "prefix_lens") \
                or name.startswith("stride_"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    return attrs


def resource_usage(cubin: bytes) -> dict:
    """Registers per thread and local memory (spills) per thread of the compiled kernel, from Triton's cuobjdump."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        Path(path).write_bytes(cubin)
        text = subprocess.run([tool, "--dump-resource-usage", path], capture_output=True, text=True, check=True).stdout
    regs, local = re.search(r"REG:(\d+)", text), re.search(r"LOCAL:(\d+)", text)
    return {"registers": int(regs.group(1)), "local_bytes": int(local.group(1)) if local else 0}


def build(cfg: ExtendConfig, arch: int = 90):
    """The compiled kernel (Triton's ``CompiledKernel``: ``.asm`` holds ttgir, ptx, cubin) for one launch."""
    sig, consts = signature(cfg)
    src = ASTSource(_extend_kernel, sig, consts, divisibility_attrs())
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})


def compile_one(cfg: ExtendConfig, arch: int = 90) -> dict:
    t0 = time.time()
    k = build(cfg, arch)
    row = {"config": cfg.__dict__, "compile_s": round(time.time() - t0, 1), "shared_bytes": k.metadata.shared,
           "wgmma": "wgmma" in k.asm["ptx"]}
    row.update(resource_usage(k.asm["cubin"]))
    row["fits_smem"] = row["shared_bytes"] <= SMEM_LIMIT
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="write the rows as JSON here")
    args = ap.parse_args()
    configs = list(dict.fromkeys([HOPPER_CONFIG, LONG_CONFIG, *shape_configs()]))
    rows = []
    print(f"triton {triton.__version__}, sm_90a, bf16, head_dim {HEAD_DIM}, GQA {GROUP}")
    for cfg in configs:
        try:
            row = compile_one(cfg)
        except Exception as e:  # noqa: BLE001 - report the failure and go on with the others
            row = {"config": cfg.__dict__, "error": f"{type(e).__name__}: {str(e)[:200]}"}
        rows.append(row)
        if "error" in row:
            print(f"{fmt_cfg(cfg):32s} ERROR {row['error']}", flush=True)
        else:
            print(f"{fmt_cfg(cfg):32s} {row['registers']:4d} regs  local (spills) {row['local_bytes']:5d} B  "
                  f"smem {row['shared_bytes'] / 1024:6.1f} KiB"
                  f"{'' if row['fits_smem'] else '  (over the limit)'}  ({row['compile_s']} s)", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"triton": triton.__version__, "arch": "sm_90a", "rows": rows},
                                             indent=1) + "\n")


if __name__ == "__main__":
    main()
