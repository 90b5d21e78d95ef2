"""Compile the paged attention kernel's launches for Hopper without a GPU (the installed Triton, sm_90a).

Every variant an engine launches at the 8B shape (bf16 and float32, head_dim 128, GQA 4): decode-like tiles
with and without a custom mask, one program per split and one for all of them, with and without a sliding
window, the long causal tile, and the combine kernel. Reports registers, spills and shared memory, and
whether the decode and verify variants (no mask vs mask) put their tiles in the same layouts: a row's bits
are the same in both only if its dots and row sums run in the same layouts (the TTGIR's ``#mma`` /
``#blocked`` encodings). The interpreter the CPU tests run accepts code the compiler refuses; this finds
that without a GPU.

    python bench/compile_attention.py [--quick]   # exit 1 when a launch fails to compile, or decode's and
                                                  # verify's dots differ in layout
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from bench.compile_extend import resource_usage  # noqa: E402
from kernels.attention import MASK_COLS, _attn_kernel, _combine_kernel  # noqa: E402

HEAD_DIM, GROUP = 128, 4
POINTERS = ("Q", "K", "V", "O", "Opart", "Lse", "Range", "qo_indptr", "kv_indptr", "kv_indices", "prefix_lens",
            "mask_ptr", "mask_indptr", "QPos")


def attn_launch(dtype: str, block_m: int, block_n: int, warps: int, stages: int, serial: bool, mask: bool,
                sliding: bool, tail: bool = False) -> dict:
    return {"dtype": dtype, "BLOCK_M": block_m, "BLOCK_N": block_n, "SERIAL": serial, "HAS_MASK": mask,
            "SLIDING": sliding, "TAIL": tail, "num_warps": warps, "num_stages": stages}


def launches(quick: bool = False) -> list[dict]:
    out = []
    for dtype in ("bf16",) if quick else ("bf16", "fp32"):
        for serial in (True, False):
            for mask in (False, True):
                for sliding in (False, True):
                    out.append(attn_launch(dtype, 64, 32, 4, 3, serial, mask, sliding))
            if not serial:  # EYRIE_ATTN_TAIL's launch: a block of few splits alone, a long one's shared
                out += [attn_launch(dtype, 64, 32, 4, 3, False, mask, False, tail=True) for mask in (False, True)]
    if not quick:
        out.append(attn_launch("bf16", 128, 64, 8, 3, True, False, False))  # long causal (extend) tiles
    return out


def build_attn(launch: dict):
    dt = launch["dtype"]
    pointer_types = {"Q": dt, "K": dt, "V": dt, "O": dt, "Opart": "fp32", "Lse": "fp32", "Range": "i32",
                     "mask_ptr": "u8", "QPos": "i64"}
    consts = {"GROUP": GROUP, "HEAD_DIM": HEAD_DIM, "BLOCK_D": HEAD_DIM, "BLOCK_Q": launch["BLOCK_M"] // GROUP,
              "BLOCK_M": launch["BLOCK_M"], "BLOCK_N": launch["BLOCK_N"], "BLOCK_E": MASK_COLS,
              "SERIAL": launch["SERIAL"], "HAS_MASK": launch["HAS_MASK"], "TAIL": launch.get("TAIL", False),
              "PRECISION": "ieee" if dt == "fp32" else "tf32", "UPCAST": False, "SLIDING": launch["SLIDING"]}
    sig = {}
    for name in _attn_kernel.arg_names:
        if name in consts:
            sig[name] = "constexpr"
        elif name in POINTERS:
            sig[name] = "*" + pointer_types.get(name, "i64")
        else:
            sig[name] = "fp32" if name == "qk_scale" else "i32"
    src = ASTSource(_attn_kernel, sig, consts)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": launch["num_warps"], "num_stages": launch["num_stages"]})


def build_combine(dtype: str, unroll: bool):
    consts = {"HEAD_DIM": HEAD_DIM, "BLOCK_D": HEAD_DIM, "SPLITS_P2": 32 if unroll else 1, "UNROLL": unroll}
    types = {"Opart": "*fp32", "Lse": "*fp32", "O": f"*{dtype}", "Range": "*i32"}
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in _combine_kernel.arg_names}
    return triton.compile(ASTSource(_combine_kernel, sig, consts), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": 4, "num_stages": 1})


def dot_layouts(ttgir: str) -> list[str]:
    """The operand/result types of the kernel's dots, deduplicated, each layout alias (``#mma``, ``#blocked1``)
    replaced by its definition: what decides a tile row's summation order (its row sums run on the dot's
    result layout). Aliases are numbered per kernel, so two kernels compare by definition."""
    defs = dict(re.findall(r"^(#\w+) = (#ttg\.\w+<.*>)$", ttgir, flags=re.M))
    dots = {m.split(" : ", 1)[1].split(" loc(")[0] for m in re.findall(r"(?:warp_group_dot|tt\.dot) .*", ttgir)}
    alias = re.compile(r"#\w+")
    return sorted(alias.sub(lambda a: defs.get(a.group(0), a.group(0)), d) for d in dots)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="bf16 only (the unit test)")
    quick = ap.parse_args().quick
    failed = 0
    built = {}
    for launch in launches(quick):
        t0 = time.time()
        try:
            k = build_attn(launch)
            built[tuple(sorted(launch.items()))] = k
            use = resource_usage(k.asm["cubin"])
            status = (f"ok ({time.time() - t0:.1f} s) {use['registers']} regs, spills {use['local_bytes']} B, "
                      f"smem {k.metadata.shared / 1024:.1f} KiB, wgmma {'wgmma' in k.asm['ptx']}")
        except Exception as e:  # noqa: BLE001 - report each failure and go on
            failed += 1
            status = f"ERROR {type(e).__name__}: {str(e)[-400:]}"
        print({k: v for k, v in launch.items()}, status, flush=True)
    for dtype in ("bf16",) if quick else ("bf16", "fp32"):
        for unroll in (True, False):
            t0 = time.time()
            try:
                build_combine(dtype, unroll)
                print(f"combine {dtype} unroll={unroll}: ok ({time.time() - t0:.1f} s)", flush=True)
            except Exception as e:  # noqa: BLE001
                failed += 1
                print(f"combine {dtype} unroll={unroll}: ERROR {type(e).__name__}: {str(e)[-400:]}", flush=True)
    for dtype in ("bf16",) if quick else ("bf16", "fp32"):
        for serial in (True, False):
            pair = [built.get(tuple(sorted(attn_launch(dtype, 64, 32, 4, 3, serial, m, False).items())))
                    for m in (False, True)]
            if all(pair):
                same = dot_layouts(pair[0].asm["ttgir"]) == dot_layouts(pair[1].asm["ttgir"])
                failed += not same
                print(f"{dtype} serial={serial}: decode and mask variants' dots in the same layouts: {same}")
    print(f"triton {triton.__version__}: {failed} launch(es) failed to compile or differ in their dots' layouts")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
