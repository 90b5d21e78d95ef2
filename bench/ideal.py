"""What the device allows a closed-loop fixed workload (issue 30): the figure a serving point is compared to.

A decode step of ``c`` requests cannot beat reading the weights once and the batch's KV once at the device's
copy bandwidth; a prompt of ``p`` tokens cannot beat its matmuls (2 FLOP per parameter per token) at the
device's bf16 matmul rate. In a closed loop of ``c`` streams, each request of ``p`` prompt and ``o`` output
tokens takes its share of ``o`` decode steps (``o x step / c``) and its whole prefill, so the most output
tokens a second is ``o / (o x step / c + prefill)``. The KV read per step is the batch's mean context (the
prompt and half the output). Plain decoding: speculation may beat it, which the ratio then shows above 1.
The device's two rates are measured in the same run (``measure_device``), the model's figures read off its
checkpoint (``model_shape``).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class DeviceRates:
    copy_bytes_s: float  # device-to-device copy bandwidth (bytes read per second)
    matmul_flop_s: float  # a large bf16 matmul's rate


@dataclass(frozen=True)
class ModelShape:
    weight_bytes: int  # every weight a decode step reads (the checkpoint's tensors)
    kv_bytes_per_token: int  # K and V of one token over every layer
    flop_per_token: float  # 2 x parameters


def model_shape(model_dir: str | Path, dtype: str = "auto", device: str = "cuda") -> ModelShape:
    """The target's figures as an engine of ``dtype`` on ``device`` serves its checkpoint: tensor bytes from the
    safetensors headers (halved for a float32 checkpoint served in a half type, as ``auto`` serves it on a GPU),
    KV from config.json in the served dtype."""
    from shared.config import checkpoint_dtype, resolve_dtype

    model_dir = Path(model_dir)
    stored = checkpoint_dtype(model_dir)
    served = resolve_dtype(dtype, device, stored)
    cfg = json.loads((model_dir / "config.json").read_text())
    weight_bytes, params = 0, 0
    for f in sorted(model_dir.glob("*.safetensors")):
        with open(f, "rb") as fh:
            header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
        for name, t in header.items():
            if name == "__metadata__":
                continue
            n = 1
            for d in t["shape"]:
                n *= d
            params += n
            weight_bytes += t["data_offsets"][1] - t["data_offsets"][0]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    itemsize = 2 if served in ("bfloat16", "float16") else 4
    if stored in (None, "float32") and itemsize == 2:
        weight_bytes //= 2  # read as the half type it is converted to at load
    kv = 2 * cfg["num_hidden_layers"] * kv_heads * head_dim * itemsize
    return ModelShape(weight_bytes=weight_bytes, kv_bytes_per_token=kv, flop_per_token=2.0 * params)


def ideal(rates: DeviceRates, shape: ModelShape, concurrency: int, prompt: int, output: int) -> dict:
    """The decode step's floor at ``concurrency`` requests, one request's GPU time and the output tok/s they allow."""
    context = prompt + output / 2
    step_s = (shape.weight_bytes + concurrency * context * shape.kv_bytes_per_token) / rates.copy_bytes_s
    prefill_s = prompt * shape.flop_per_token / rates.matmul_flop_s
    request_s = output * step_s / concurrency + prefill_s
    return {"step_floor_ms": round(step_s * 1e3, 3), "request_gpu_ms": round(request_s * 1e3, 2),
            "ideal_tok_s": round(output / request_s, 1)}


def measure_device(device: str = "cuda") -> DeviceRates | None:
    """The copy bandwidth and the bf16 matmul rate of ``device`` (None off CUDA)."""
    import torch

    if not device.startswith("cuda") or not torch.cuda.is_available():
        return None
    from bench.timing import copy_bandwidth, time_cuda

    with torch.cuda.device(torch.device(device)):
        bw = copy_bandwidth()
        n = 8192
        a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
        b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
        seconds = time_cuda(lambda: a @ b, iters=20, warmup=5) / 1e3
    return DeviceRates(copy_bytes_s=bw, matmul_flop_s=2 * n**3 / seconds)


def annotate(report: dict, rates: DeviceRates | None, shape: ModelShape | None) -> None:
    """Every fixed-workload point of ``report`` (the engine's, each stack's, each layout's) gains its ideal and
    its ``of_ideal`` ratio; the device's rates and the model's figures go into ``report["ideal"]``."""
    if rates is None or shape is None:
        return
    report["ideal"] = {"device": asdict(rates), "model": asdict(shape)}
    groups = [report.get("engine") or {}] + list(report.get("stacks") or []) + list(report.get("layouts") or [])
    for group in groups:
        for p in group.get("points", []):
            prompt, output = p.get("prompt") or (0, 1), p.get("output") or (0, 1)
            if p.get("workload") != "fixed" or prompt[0] != prompt[1] or output[0] != output[1]:
                continue
            p.update(ideal(rates, shape, p["concurrency"], prompt[0], output[0]))
            if p.get("output_tok_s"):
                p["of_ideal"] = round(p["output_tok_s"] / p["ideal_tok_s"], 3)


def measured_in_subprocess(device: str, timeout_s: float = 120.0) -> DeviceRates | None:
    """``measure_device`` in a process of its own: the benchmark's own process holds no CUDA context (its memory
    would be missing from the services' share of the device). None off CUDA or when it fails."""
    import subprocess
    import sys

    if not device.startswith("cuda"):
        return None
    try:
        out = subprocess.run([sys.executable, "-m", "bench.ideal", device], capture_output=True, text=True,
                             timeout=timeout_s, cwd=Path(__file__).resolve().parents[1])
        return DeviceRates(**json.loads(out.stdout.strip().splitlines()[-1]))
    except (subprocess.SubprocessError, ValueError, IndexError, TypeError) as e:
        print(f"ideal: the device's rates were not measured ({type(e).__name__}: {e})", flush=True)
        return None


def format_ideal(report: dict) -> list[str]:
    """One line per fixed point that has an ideal: measured tok/s, the ideal and their ratio."""
    lines = []
    groups = [("engine", report.get("engine") or {})]
    groups += [(f"stack[{s.get('label', s.get('transport'))}]", s) for s in report.get("stacks") or []]
    groups += [(f"layout[{lay.get('layout')}]", lay) for lay in report.get("layouts") or []]
    for where, group in groups:
        for p in group.get("points", []):
            if "ideal_tok_s" in p:
                got = p.get("output_tok_s")
                lines.append(f"{where} {p.get('api', '')} fixed c{p['concurrency']}: "
                             f"{'-' if got is None else f'{got:.0f}'} tok/s of an ideal {p['ideal_tok_s']:.0f} "
                             f"(step floor {p['step_floor_ms']:.2f} ms): {p.get('of_ideal', '-')}")
    return lines


if __name__ == "__main__":
    import sys

    rates = measure_device(sys.argv[1] if len(sys.argv) > 1 else "cuda")
    print(json.dumps(None if rates is None else asdict(rates)))
