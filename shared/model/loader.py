"""Load Hugging Face checkpoint directories (safetensors, sharded or not) into Eyrie modules.

Reading shows a progress bar on stderr when it is a terminal (tqdm), and each load logs one
``weights_loaded`` event with its timing (seconds, tensors, bytes).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn
from tqdm import tqdm

from shared.model import fp8
from shared.model.config import CheckpointError, ModelConfig
from shared.model.layers import fuse_projections
from shared.model.llama import LlamaForCausalLM

log = logging.getLogger("eyrie.weights")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


__all__ = ["CheckpointError", "load_target", "load_weights", "log_loaded", "read_state_dict", "read_tensor"]


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise CheckpointError(f"dtype: {name!r} is not one of {sorted(DTYPES)}")
    return DTYPES[name]


def checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return [path / name for name in sorted(set(weight_map.values()))]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        files = sorted(path.glob("*.bin"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors or *.bin weights found")
    return files


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint at ``path``; a file that cannot be read is a ``CheckpointError`` naming it."""
    files = checkpoint_files(Path(path))
    state: dict[str, torch.Tensor] = {}
    with tqdm(total=sum(f.stat().st_size for f in files), unit="B", unit_scale=True, leave=False,
              desc=f"loading {Path(path).name}", disable=None) as bar:  # disable=None: off when not a TTY
        for file in files:
            try:
                state.update(_read_file(file))
            except (OSError, SafetensorError, RuntimeError, ValueError) as e:
                raise unreadable(file, e) from None
            bar.update(file.stat().st_size)
    return state


def unreadable(file: Path, e: Exception) -> CheckpointError:
    return CheckpointError(f"{file}: cannot read the weights: {str(e).splitlines()[0]}")


def _read_file(file: Path) -> dict[str, torch.Tensor]:
    if file.suffix == ".bin":
        return torch.load(file, map_location="cpu", weights_only=True)
    with safe_open(str(file), framework="pt") as f:
        return {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118 (safe_open is not a dict)


def tensor_shapes(files: list[Path]) -> dict[str, tuple[Path, tuple[int, ...]]]:
    """Each tensor of the safetensors ``files``: the file that holds it and its shape (read from the headers
    only, no weights)."""
    found = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                found.update({key: (file, tuple(f.get_slice(key).get_shape())) for key in f.keys()})  # noqa: SIM118
        except (OSError, SafetensorError, RuntimeError, ValueError) as e:
            raise unreadable(file, e) from None
    return found


def read_tensor(path: str | Path, name: str) -> torch.Tensor:
    """One tensor of the checkpoint at ``path``, whole (a ``.bin`` checkpoint is read whole to find it)."""
    files = checkpoint_files(Path(path))
    if any(f.suffix == ".bin" for f in files):
        state = read_state_dict(path)
        if name not in state:
            raise CheckpointError(f"{path}: no tensor {name}")
        return state[name]
    shapes = tensor_shapes(files)
    if name not in shapes:
        raise CheckpointError(f"{path}: no tensor {name}")
    file = shapes[name][0]
    try:
        with safe_open(str(file), framework="pt") as f:
            return f.get_tensor(name).clone()  # memory of its own, not the file's mapping
    except (OSError, SafetensorError, RuntimeError, ValueError) as e:
        raise unreadable(file, e) from None


def log_loaded(path: str | Path, kind: str, module: nn.Module, t0: float) -> None:
    """One ``weights_loaded`` event: what was loaded, from where, how big, in how many seconds."""
    params = list(module.parameters())
    fields = {"path": str(path), "kind": kind, "seconds": round(time.perf_counter() - t0, 3),
              "tensors": len(params), "bytes": sum(p.numel() * p.element_size() for p in params)}
    log.info("weights_loaded", extra={"event": "weights_loaded", "fields": fields})


def build_module(cls, config: ModelConfig, dtype: torch.dtype, device: torch.device, *args) -> nn.Module:
    """Construct directly on the device in the target dtype (no float32 copy of a large model)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return cls(config, *args)
    finally:
        torch.set_default_dtype(previous)


def load_weights(module: nn.Module, state: dict[str, torch.Tensor], optional: tuple[str, ...] = ()) -> None:
    """Copy ``state`` into ``module``; a missing or unexpected tensor is an error naming it."""
    params = dict(module.named_parameters())
    missing = [k for k in params if k not in state and not k.startswith(optional)]
    unexpected = [k for k in state if k not in params]
    if missing or unexpected:
        raise CheckpointError(f"checkpoint mismatch: missing {missing[:8]}, unexpected {unexpected[:8]}")
    with torch.no_grad():
        for name, tensor in state.items():
            p = params[name]
            if p.shape != tensor.shape:
                raise CheckpointError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(p.shape)}")
            p.copy_(tensor.to(p.dtype))


def load_target(path: str | Path, dtype="float32", device="cpu") -> LlamaForCausalLM:
    t0 = time.perf_counter()
    path = Path(path)
    config = ModelConfig.from_dir(path)
    config.check_target(path)
    dtype = parse_dtype(dtype)
    model = build_module(LlamaForCausalLM, config, dtype, torch.device(device))
    state = read_state_dict(path)
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    state = {k: fold_norm_offset(k, v, config) for k, v in state.items()}
    quantized = fp8_weights(path, state, model)
    load_weights(model, state)
    model = fuse_projections(model).eval()
    if quantized:
        fp8.prepare(model)
    log_loaded(path, "target" + (f" (FP8, {quantized} projections)" if quantized else ""), model, t0)
    return model


def checkpoint_fp8_format(path: str | Path) -> fp8.Fp8Format | None:
    """The FP8 format the checkpoint at ``path`` declares in ``config.json`` (None: not quantized)."""
    with open(Path(path) / "config.json") as f:
        return fp8.fp8_format(json.load(f))


def fp8_weights(path: Path, state: dict[str, torch.Tensor], model: nn.Module) -> int:
    """Prepare an FP8 checkpoint's ``state`` for ``load_weights`` (in place): its scales taken out and given to
    the model's projections, which become FP8. Returns how many; 0 for a checkpoint that is not FP8 (FP8
    tensors without a ``quantization_config`` are a ``CheckpointError``)."""
    fmt = checkpoint_fp8_format(path)
    if fmt is None:
        stray = next((k for k, v in state.items() if v.dtype == fp8.FP8), None)
        if stray is not None:
            raise CheckpointError(f"{stray}: FP8 weights, but config.json has no quantization_config")
        return 0
    quantized = fp8.split_state(state, fmt)
    fp8.to_fp8_modules(model, quantized)
    return len(quantized)


def fold_norm_offset(name: str, tensor: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """Checkpoint tensor ``name`` with Gemma's (1 + w) folded into a norm's weight (in the checkpoint's dtype,
    before the cast to the model's): one multiply per norm at run time, as Llama's."""
    if config.norm_weight_offset and name.endswith("norm.weight"):
        return tensor + config.norm_weight_offset
    return tensor
