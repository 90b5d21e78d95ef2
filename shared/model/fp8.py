"""FP8 checkpoints: compressed-tensors FP8 (per-channel weight scales, dynamic per-token activations: RedHatAI's
``*-FP8-dynamic``) and the block-wise ``fp8`` format (Qwen3's and DeepSeek-V3's ``weight_block_size`` [128, 128]).

A quantized projection keeps its weight in ``float8_e4m3fn`` [N, K] and a float32 scale [ceil(N / bn),
ceil(K / bk)] with the weight ``W ~= fp8 * scale`` block by block: ``(bn, bk) = (1, K)`` for per-channel
scales (a per-tensor scale is widened to per-channel at load), the checkpoint's ``weight_block_size`` for
the block format (its ``weight_scale_inv`` multiplies, despite the name). The scale and block ride on the
weight tensor (``fp8_scale``, ``fp8_block``), so ``linear(x, weight, bias)`` dispatches on the weight's
dtype and every call site stays as it is; fused q/k/v and gate/up weights concatenate the scales with them
(``cat_weights``). Norms, embeddings and the LM head stay in the model's dtype, as these checkpoints keep them.

How the product is computed:

* CPU (and CI): the weight dequantized (``dequantize``, once per weight: ``dequantized``), times the
  activations as they are.
* CUDA, up to ``kernels.fp8_gemv.MAX_ROWS`` (1024) rows: every decode, verify and draft step, and prefill
  chunks that small: ``kernels/fp8_gemv.py``, which reads the FP8 bytes once and scales in registers (the
  batch-1 step reads half the bytes of bf16), weight-only, in one launch whatever the row count (one row
  included), so a row's product is the same bits in a decode step and in a verify step. The model's dense
  projections (its bf16 LM head) run that launch too (``mark_same_rows``): ``kernels/gemv.py`` sums one
  row, 2-16 rows and cuBLAS's more in three orders. One product for every step size is what keeps greedy
  speculation exactly lossless (an earlier cut at 16 rows sent verify's rows through the activation-quantized
  product below, and later one row summed in another order than 2+: greedy with a draft head parted from
  the target's own on a block-scaled target).
* CUDA, more rows (long prefill chunks): ``torch._scaled_mm`` on Hopper with the activations quantized
  dynamically (per token for per-channel weights, per 1 x bk group for block weights), as vLLM and SGLang
  run these checkpoints; where this torch cannot do the block-wise product, the weight is dequantized for it.
"""

from __future__ import annotations

import functools
import logging
import math
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kernels.gemv import linear as dense_linear
from shared.model.config import CheckpointError

log = logging.getLogger("eyrie.weights")
FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
SCALE_SUFFIXES = ("weight_scale", "weight_scale_inv")
KINDS = ("channel", "block")


@dataclass(frozen=True)
class Fp8Format:
    kind: str  # "channel" (compressed-tensors) or "block" (quant_method fp8, weight_block_size)
    block: tuple[int, int] | None = None  # the block format's (rows, columns)
    ignore: tuple[str, ...] = ()  # modules the checkpoint leaves unquantized (informative: the tensors decide)


def _field(q: dict, path: str, want, got) -> CheckpointError:
    return CheckpointError(f"quantization_config.{path}: {got!r} is not supported (FP8 checkpoints need {want})")


def _compressed_tensors(q: dict) -> Fp8Format:
    groups = q.get("config_groups")
    if not isinstance(groups, dict) or len(groups) != 1:
        raise _field(q, "config_groups", "one group of FP8 weights", groups if not isinstance(groups, dict)
                     else f"{len(groups)} groups")
    (name, group), = groups.items()
    w = group.get("weights") or {}
    if w.get("type") != "float" or w.get("num_bits") != 8:
        raise _field(q, f"config_groups.{name}.weights", "type float, num_bits 8", w)
    if w.get("strategy") not in ("channel", "tensor") or not w.get("symmetric", True) or w.get("dynamic", False):
        raise _field(q, f"config_groups.{name}.weights.strategy", "static symmetric channel or tensor scales",
                     w.get("strategy"))
    act = group.get("input_activations")
    if act is not None and not (act.get("dynamic") and act.get("strategy") in ("token", "tensor")):
        raise _field(q, f"config_groups.{name}.input_activations", "dynamic activation scales (static "
                     "input_scale is not supported)", act)
    return Fp8Format("channel", None, tuple(q.get("ignore") or ()))


def fp8_format(config: dict) -> Fp8Format | None:
    """The FP8 format ``config.json`` declares (None: not quantized); a quantization this loader cannot run is
    a ``CheckpointError`` naming the field."""
    q = config.get("quantization_config") or config.get("compression_config")
    if q is None:
        return None
    method = q.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors(q)
    if method == "fp8":
        if q.get("fmt", "e4m3") != "e4m3":
            raise _field(q, "fmt", "e4m3", q.get("fmt"))
        if q.get("activation_scheme", "dynamic") != "dynamic":
            raise _field(q, "activation_scheme", "dynamic", q.get("activation_scheme"))
        block = q.get("weight_block_size")
        if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
            raise _field(q, "weight_block_size", "[rows, columns] (per-tensor fp8 is not supported)", block)
        return Fp8Format("block", (block[0], block[1]), tuple(q.get("modules_to_not_convert") or ()))
    raise _field(q, "quant_method", "'compressed-tensors' (FP8) or 'fp8'", method)


# ---- the weights --------------------------------------------------------------------------------
def mark(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``weight`` (FP8) carrying its scale and block, which ``linear`` reads."""
    weight.fp8_scale, weight.fp8_block = scale, block
    return weight


def is_fp8(weight: torch.Tensor) -> bool:
    return weight.dtype == FP8


def expand_scale(scale: torch.Tensor, block: tuple[int, int], n: int, k: int) -> torch.Tensor:
    """[N, K] float32: each weight element's scale."""
    bn, bk = min(block[0], n), min(block[1], k)
    return scale.float().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]


def dequantize(weight: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The FP8 ``weight`` (marked) as ``dtype``: ``fp8 * scale`` element by element."""
    n, k = weight.shape
    return (weight.float() * expand_scale(weight.fp8_scale, weight.fp8_block, n, k)).to(dtype)


def dequantized(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``dequantize(weight, dtype)``, computed once per weight and dtype and kept beside it (the CPU's product:
    FP8 saves no time there, and dequantizing on every call would cost more than the product)."""
    cache = weight.__dict__.setdefault("fp8_dequantized", {})
    if dtype not in cache:
        cache[dtype] = dequantize(weight, dtype)
    return cache[dtype]


def quantize(w: torch.Tensor, kind: str, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 weight, float32 scale) of ``w`` [N, K] as the checkpoints store them: per output channel
    (``channel``: scale [N, 1], amax / 448) or per ``block`` (``block``: scale [ceil(N/bn), ceil(K/bk)])."""
    n, k = w.shape
    bn, bk = (1, k) if kind == "channel" else block
    rows, cols = math.ceil(n / bn), math.ceil(k / bk)
    padded = F.pad(w.float(), (0, cols * bk - k, 0, rows * bn - n))
    tiles = padded.reshape(rows, bn, cols, bk)
    scale = (tiles.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)
    q = (tiles / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).reshape(rows * bn, cols * bk)[:n, :k]
    return q.to(FP8).contiguous(), scale.float()


def checkpoint_scale(weight: torch.Tensor, scale: torch.Tensor, fmt: Fp8Format, name: str
                     ) -> tuple[torch.Tensor, tuple[int, int]]:
    """The checkpoint's ``scale`` of FP8 ``weight`` (tensor ``name``) as (float32 scale, block), its shape
    checked; a per-tensor scale widened to per-channel."""
    n, k = weight.shape
    scale = scale.float()
    if fmt.kind == "block":
        bn, bk = fmt.block
        want = (math.ceil(n / bn), math.ceil(k / bk))
        if tuple(scale.shape) != want:
            raise CheckpointError(f"{name}: block scale shape {tuple(scale.shape)} != {want} for weight "
                                  f"{(n, k)} in blocks {fmt.block}")
        return scale.contiguous(), (bn, bk)
    if scale.numel() == 1:
        return scale.reshape(1, 1).expand(n, 1).contiguous(), (1, k)
    if scale.numel() != n:
        raise CheckpointError(f"{name}: {scale.numel()} channel scales for a weight of {n} rows")
    return scale.reshape(n, 1).contiguous(), (1, k)


def split_state(state: dict[str, torch.Tensor], fmt: Fp8Format) -> dict[str, tuple[torch.Tensor, tuple]]:
    """Take every FP8 weight and its scale out of ``state`` (in place): {module name: (scale, block)}, each
    weight left in ``state`` as FP8. A weight without its scale, a scale without its weight, or a static
    activation scale is a ``CheckpointError`` naming it."""
    static = [k for k in state if k.endswith(("input_scale", "activation_scale"))]
    if static:
        raise CheckpointError(f"{static[0]}: static activation scales are not supported (dynamic FP8 only)")
    quantized = {}
    for key in [k for k, v in state.items() if k.endswith(".weight") and v.dtype == FP8]:
        module = key.removesuffix(".weight")
        if state[key].dim() != 2:
            raise CheckpointError(f"{key}: FP8, but {module} is not a projection (a {state[key].dim()}-d tensor)")
        found = [f"{module}.{s}" for s in SCALE_SUFFIXES if f"{module}.{s}" in state]
        if not found:
            raise CheckpointError(f"{key}: an FP8 weight without its scale ({module}.weight_scale"
                                  f"{'_inv' if fmt.kind == 'block' else ''})")
        quantized[module] = checkpoint_scale(state[key], state.pop(found[0]), fmt, found[0])
    orphans = [k for k in state if k.endswith(SCALE_SUFFIXES)]
    if orphans:
        raise CheckpointError(f"{orphans[0]}: a scale whose weight is not FP8")
    return quantized


def to_fp8_modules(model: nn.Module, quantized: dict[str, tuple[torch.Tensor, tuple]]) -> None:
    """Give each quantized ``nn.Linear`` of ``model`` an empty FP8 weight (the checkpoint's is copied in by
    ``load_weights``) and its scale, marked."""
    for module_name, (scale, block) in quantized.items():
        try:
            linear = model.get_submodule(module_name)
        except AttributeError:
            raise CheckpointError(f"{module_name}.weight: FP8, but the model has no such projection") from None
        if not isinstance(linear, nn.Linear):
            raise CheckpointError(f"{module_name}.weight: FP8, but {module_name} is not a projection")
        device = linear.weight.device
        linear.weight = nn.Parameter(torch.empty(linear.weight.shape, dtype=FP8, device=device),
                                     requires_grad=False)
        mark(linear.weight, scale.to(device), block)


def quantize_module_(model: nn.Module, kind: str, block: tuple[int, int] = (128, 128),
                     skip: tuple[str, ...] = ("lm_head",)) -> nn.Module:
    """Quantize every projection of the decoder layers of ``model`` in place (as ``make-model --fp8`` writes
    them; the GPU benchmarks' in-memory 8B-shaped targets), before ``fuse_projections``."""
    for name, linear in list(model.named_modules()):
        if isinstance(linear, nn.Linear) and not name.endswith(skip) and ".layers." in f".{name}":
            q, scale = quantize(linear.weight.detach(), kind, block)
            n, k = q.shape
            linear.weight = nn.Parameter(q, requires_grad=False)
            mark(linear.weight, scale, (1, k) if kind == "channel" else block)
    return model


def cat_weights(weights: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat`` of projection weights along their rows, FP8 ones with their scales (block scales that do
    not fall on block rows are widened to one scale row per weight row first)."""
    if not is_fp8(weights[0]):
        return torch.cat(weights)
    block = weights[0].fp8_block
    if any(w.fp8_block[1] != block[1] for w in weights):
        raise CheckpointError("fused FP8 projections with different column blocks")
    aligned = all(w.fp8_block == block and w.shape[0] % block[0] == 0 for w in weights[:-1]) and \
        weights[-1].fp8_block == block
    if aligned:
        scales = [w.fp8_scale for w in weights]
    else:
        scales = [w.fp8_scale.repeat_interleave(w.fp8_block[0], 0)[:w.shape[0]] for w in weights]
        block = (1, block[1])
    data = torch.cat([w.view(torch.uint8) for w in weights]).view(FP8)  # cat of uint8: every torch has it
    return mark(data, torch.cat(scales).contiguous(), block)


def fp8_weights_of(model: nn.Module) -> list[torch.Tensor]:
    """The FP8 weights ``model``'s forward reads (parameters and fused projections), each once."""
    found = {}
    for m in model.modules():
        for t in [*m.parameters(recurse=False), *(v for v in vars(m).values() if isinstance(v, torch.Tensor))]:
            if is_fp8(t):
                found[id(t)] = t
    return list(found.values())


def prepare(model: nn.Module) -> nn.Module:
    """After ``fuse_projections``: on CUDA, find out once whether ``torch._scaled_mm`` does this model's
    block-wise products (never inside a CUDA-graph capture) and log which products prefill will run; mark
    its dense projection weights (the LM head, modules the checkpoint left unquantized) ``same_rows``."""
    weights = fp8_weights_of(model)
    mark_same_rows(model)
    blocks = {w.fp8_block if w.fp8_block[1] < w.shape[1] else "channel" for w in weights}
    on_cuda = bool(weights) and weights[0].is_cuda
    paths = {}
    for b in blocks:
        if b == "channel":
            paths["channel"] = "scaled_mm rowwise" if on_cuda else "dequantized"
        else:
            block_ok = on_cuda and block_scaled_mm_ok(weights[0].device, *b)
            paths[f"{b[0]}x{b[1]}"] = "scaled_mm blockwise" if block_ok else "dequantized"
    log.info("fp8_weights", extra={"event": "fp8_weights", "fields": {"weights": len(weights), "prefill": paths}})
    return model


def mark_same_rows(model: nn.Module, every_row_count: bool = False) -> None:
    """Mark a model's dense projection weights (an FP8 model's bf16 LM head, unquantized modules; every one of
    a bf16 model's with ``every_row_count``): ``linear`` runs them through ``kernels.fp8_gemv.same_rows_linear``
    on CUDA, whose output for a row does not depend on the row count, so a decode step's logits and a verify
    step's are the same bits (``kernels/gemv.py`` sums one row, 2-16 rows and more in three orders).
    ``every_row_count`` (the engine's ``batch_invariant``): at every row count, not only up to ``MAX_ROWS``
    (long prefill chunks, and a mixed step's decode rows beside one, included), FP8 weights too. The unit scale
    the launch needs is made here, outside any capture."""
    for m in model.modules():
        if isinstance(m, nn.Embedding):
            continue
        for t in [*m.parameters(recurse=False), *(v for v in vars(m).values() if isinstance(v, torch.Tensor))]:
            if t.dim() == 2 and t.is_floating_point():
                if every_row_count:
                    t.same_rows_unbounded = True
                if is_fp8(t):
                    continue
                t.same_rows = True
                if t.is_cuda:
                    from kernels import fp8_gemv

                    fp8_gemv.unit_scale(t.device)


# ---- the product --------------------------------------------------------------------------------
def _gemv_on(rows: int) -> bool:
    from kernels import fp8_gemv

    return rows <= fp8_gemv.MAX_ROWS and os.environ.get("EYRIE_FP8_GEMV", "1") != "0"  # 0: _scaled_mm / cuBLAS


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T + b`` for a dense weight (``kernels/gemv.py``; an FP8 model's ``same_rows`` ones: the FP8
    kernel's launch) or an FP8 one (see the module's docstring)."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    every = getattr(weight, "same_rows_unbounded", False)  # ``mark_same_rows(every_row_count=True)``
    if not is_fp8(weight):
        if getattr(weight, "same_rows", False) and x.is_cuda and x.dtype == weight.dtype and 0 < rows \
                and (every or _gemv_on(rows)):
            from kernels import fp8_gemv

            return fp8_gemv.same_rows_linear(x, weight, bias, max_rows=None if every else fp8_gemv.MAX_ROWS)
        return dense_linear(x, weight, bias)
    if not x.is_cuda:
        return F.linear(x, dequantized(weight, x.dtype), bias)
    from kernels import fp8_gemv

    if every or _gemv_on(rows):
        return fp8_gemv.fp8_linear(x, weight, weight.fp8_scale, weight.fp8_block, bias,
                                   max_rows=None if every else fp8_gemv.MAX_ROWS)
    return scaled_mm_linear(x, weight, bias)


def quantize_activations(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 ``x`` [M, K], float32 scales [M, ceil(K / group)]): dynamic, per token and ``group`` columns."""
    m, k = x.shape
    cols = math.ceil(k / group)
    tiles = F.pad(x.float(), (0, cols * group - k)).reshape(m, cols, group)
    scale = (tiles.abs().amax(-1) / FP8_MAX).clamp(min=1e-12)
    q = (tiles / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).reshape(m, cols * group)[:, :k]
    return q.to(FP8), scale


def scaled_mm_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Many rows on the GPU: ``torch._scaled_mm`` of the dynamically quantized activations and the FP8
    weight (row-wise scales for per-channel weights, 1 x bk / bn x bk blocks for block weights), or, where
    this torch has no block-wise product for the weight's blocks, the dequantized weight."""
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    if m % 16:  # cuBLASLt's FP8 product wants rows in sixteens: zero rows (scale clamped, output dropped)
        x2 = F.pad(x2, (0, 0, 0, 16 - m % 16))
    bn, bk = weight.fp8_block
    if bk == k:  # per channel: row-wise scales
        xq, sx = quantize_activations(x2, k)
        out = torch._scaled_mm(xq, weight.t(), scale_a=sx, scale_b=weight.fp8_scale.reshape(1, -1),
                               out_dtype=x.dtype)
    elif block_scaled_mm_ok(x.device, bn, bk):
        xq, sx = quantize_activations(x2, bk)
        scale_b = weight.fp8_scale.t()  # [K/bk, N/bn]: outer-dim-major, as the block-wise product wants
        out = torch._scaled_mm(xq, weight.t(), scale_a=sx.t().contiguous().t(), scale_b=scale_b,
                               out_dtype=x.dtype)
    else:
        out = F.linear(x2, dequantize(weight, x.dtype))
    out = out[:m]
    if bias is not None:
        out = out + bias
    return out.reshape(*lead, weight.shape[0])


@functools.lru_cache(maxsize=8)
def block_scaled_mm_ok(device: torch.device, bn: int, bk: int) -> bool:
    """Whether ``torch._scaled_mm`` here computes the block-wise product of (bn, bk) blocks (1 x 128 by
    128 x 128 or 128 x 1 on Hopper with CUDA >= 12.9), checked once against the dequantized product."""
    if bk != 128 or bn not in (1, 128):
        return False
    try:
        gen = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(32, 256, device=device, dtype=torch.bfloat16, generator=gen)
        w, s = quantize(torch.randn(256, 256, device=device, generator=gen), "block", (bn, bk))
        w = mark(w, s, (bn, bk))
        xq, sx = quantize_activations(x, bk)
        got = torch._scaled_mm(xq, w.t(), scale_a=sx.t().contiguous().t(), scale_b=s.t(), out_dtype=torch.bfloat16)
        want = (xq.float() * sx.repeat_interleave(bk, 1)) @ dequantize(w).t()
        ok = bool(((got.float() - want).norm() / want.norm()) < 2e-2)
    except (RuntimeError, ValueError, TypeError) as e:
        log.warning("fp8_block_scaled_mm_unavailable", extra={"event": "fp8_block_scaled_mm_unavailable",
                                                              "fields": {"block": [bn, bk], "error": str(e)[:200]}})
        return False
    return ok


__all__ = ["FP8", "Fp8Format", "cat_weights", "dequantize", "fp8_format", "fp8_weights_of", "is_fp8", "linear", "mark",
           "prepare", "quantize", "quantize_activations", "quantize_module_", "split_state", "to_fp8_modules"]
