"""Which events invalidate a CUDA graph capture? Each hazard runs in a fresh process (a failed
capture poisons its process), once as torch.cuda.graph captures by default (global capture mode, the
garbage collector free to run) and once as ``shared.cuda_graphs.PhaseGraphs`` captures (collector paused,
``thread_local`` mode, kernels launched before capture). Prints one JSON object: per hazard and mode,
whether the capture survived, the error, and whether the CUDA generator was left poisoned.

    python bench/capture_hazards.py [--out FILE]

GPU only. The hazards are the candidate causes of issue 21's intermittent failure on a fresh machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap

PRELUDE = textwrap.dedent("""
    import gc, json, sys, threading, time
    import torch
    MODE = sys.argv[1]
    dev = torch.device("cuda")
    x = torch.zeros(1 << 20, device=dev)

    class Holder:  # a reference cycle: only the cyclic collector frees it
        def __init__(self, payload):
            self.payload, self.me = payload, self

    def capture(body):
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        torch.cuda.synchronize()
        if MODE == "contained":
            gc.collect(); gc.disable()
        err = None
        with torch.cuda.stream(s):
            g.capture_begin(capture_error_mode="thread_local" if MODE == "contained" else "global")
            try:
                body()
            except Exception as e:
                err = e
            try:
                g.capture_end()
            except Exception as e:
                err = err or e
        gc.enable()
        return g, err
""")

HAZARDS = {
    "gc_frees_dead_graph": """
        def make_dead_graph():
            y = torch.zeros(1 << 16, device=dev)
            g0 = torch.cuda.CUDAGraph()
            s0 = torch.cuda.Stream()
            with torch.cuda.stream(s0):
                g0.capture_begin(); z = y * 2; g0.capture_end()
            Holder((g0, z))
        for _ in range(8):
            make_dead_graph()
        def body():
            x.add_(1); gc.collect(); x.mul_(2)
    """,
    "gc_frees_dead_cuda_tensors": """
        for _ in range(64):
            Holder(torch.empty(1 << 22, device=dev))
        def body():
            x.add_(1); gc.collect(); x.mul_(2)
    """,
    "gc_frees_dead_pinned_copies": """
        for _ in range(64):
            Holder(x[:1024].to("cpu", non_blocking=True))
        def body():
            x.add_(1); gc.collect(); x.mul_(2)
    """,
    "other_thread_cudamalloc": """
        torch.cuda.empty_cache()
        def other():
            time.sleep(0.05); torch.empty(1 << 28, device=dev)
        def body():
            t = threading.Thread(target=other); t.start()
            for _ in range(200):
                x.add_(1)
            t.join()
    """,
    "other_thread_sync_copy": """
        def other():
            time.sleep(0.05); torch.ones(1 << 20).to(dev)
        def body():
            t = threading.Thread(target=other); t.start()
            for _ in range(200):
                x.add_(1)
            t.join()
    """,
    "first_triton_launch_inside": """
        import triton, triton.language as tl
        @triton.jit
        def k(p, n, BLOCK: tl.constexpr):
            i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            tl.store(p + i, tl.load(p + i, mask=i < n) + 1, mask=i < n)
        def body():
            k[(4,)](x, 4096, BLOCK=1024)
    """,
    "first_torch_kernel_inside": """
        def body():
            torch.cumsum(x.view(1024, 1024).double(), 1)
    """,
}

EPILOGUE = textwrap.dedent("""
    g, err = capture(body)
    poisoned = None
    try:
        torch.randn(4, device=dev); torch.cuda.synchronize()
    except Exception as e:
        poisoned = str(e).splitlines()[0]
    print(json.dumps({"survived": err is None, "error": None if err is None else str(err).splitlines()[0][:200],
                      "generator_poisoned": poisoned}))
""")


def run(name: str, mode: str) -> dict:
    code = PRELUDE + textwrap.dedent(HAZARDS[name]) + EPILOGUE
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:  # Triton's @jit needs a file
        f.write(code)
    p = subprocess.run([sys.executable, f.name, mode], capture_output=True, text=True, timeout=300)
    os.unlink(f.name)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    return json.loads(lines[-1]) if lines else {"crashed": p.returncode, "stderr": p.stderr[-400:]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    args = ap.parse_args()
    result = {name: {mode: run(name, mode) for mode in ("default", "contained")} for name in HAZARDS}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
