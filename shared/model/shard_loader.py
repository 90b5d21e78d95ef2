"""Load one tensor-parallel rank's share of a target straight from its safetensors files.

``shard_target`` (shared/parallel.py) splits a target already in memory; loading a checkpoint whole to split it
would hold the whole model on every rank's host at once (a 70B in bfloat16: 141 GB per rank). Here a rank reads
only the rows or columns it keeps (``get_slice``), one tensor at a time, each cast to the model's dtype and placed
on the rank's device before the next is read, into a model built on the ``meta`` device with the rank's shapes.
The file is opened for each tensor, so no more than one tensor's pages of it are mapped at a time. The result
equals ``shard_target(load_target(path, dtype), tp, device)``, bit for bit.

What a rank keeps of each checkpoint tensor (``how_split``), as ``shard_target`` splits the fused model:

* ``rows``: q/k/v and gate/up weights and biases (column-parallel), by output rows;
* ``columns``: o and down weights (row-parallel), by input columns;
* ``once``: o and down biases, added once: rank 0's whole, zeros on the others (nothing read);
* ``vocab``: the embedding and the LM head, rows [start, start + ceil(V / size)), the last rank's padded with zero
  rows past V;
* ``whole``: everything else (norms, Qwen3's q/k norms).

An FP8 checkpoint's projections (``shared/model/fp8.py``) keep their FP8 bytes: a rank reads its rows or columns
of each and the part of its scale that covers them (per-channel scales by row; block scales by block, so a share
must start on a block boundary). ``.bin`` checkpoints (``torch.load``) cannot be read in part: they are loaded
whole and split (FP8 ones are refused).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from shared.model import fp8
from shared.model.config import CheckpointError, ModelConfig
from shared.model.layers import RotaryEmbedding, fuse_projections
from shared.model.llama import LlamaForCausalLM
from shared.model.loader import (
    build_module,
    checkpoint_files,
    checkpoint_fp8_format,
    fold_norm_offset,
    load_target,
    log_loaded,
    parse_dtype,
    read_tensor,
    tensor_shapes,
    unreadable,
)
from shared.parallel import (
    TPGroup,
    VocabParallelEmbedding,
    check_split,
    local_config,
    pad_vocab_rows,
    shard_target,
    vocab_range,
)

ROW_SPLIT = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # column-parallel: their output rows
COLUMN_SPLIT = ("o_proj", "down_proj")  # row-parallel: their input columns; their bias added once
VOCAB_SPLIT = ("model.embed_tokens.weight", "lm_head.weight")
META = torch.device("meta")


def how_split(name: str) -> str:
    """How a rank takes checkpoint tensor ``name``: "rows", "columns", "once", "vocab" or "whole"."""
    if name in VOCAB_SPLIT:
        return "vocab"
    module, kind = name.split(".")[-2:]
    if module in ROW_SPLIT:
        return "rows"
    if module in COLUMN_SPLIT:
        return "columns" if kind == "weight" else "once"
    return "whole"


def read_share(file: Path, name: str, how: str, tp: TPGroup) -> torch.Tensor:
    """This rank's part of tensor ``name`` of ``file`` as ``how_split`` says (``once``: the whole, which only rank
    0 reads; ``vocab``: the rows up to V, unpadded), in the checkpoint's dtype: a view of the file's mapping."""
    with safe_open(str(file), framework="pt") as f:
        part = f.get_slice(name)
        shape = part.get_shape()
        if how == "rows":
            return part[tp.span(shape[0], name)]
        if how == "columns":
            return part[:, tp.span(shape[1], name)]
        if how == "vocab":
            start, per = vocab_range(shape[0], tp)
            return part[min(start, shape[0]):min(start + per, shape[0])]
        return part[:]


def rank_shapes(config: ModelConfig, tp: TPGroup) -> ModelConfig:
    """``config`` with this rank's sizes: its heads, its share of the MLP, its vocabulary rows (padded)."""
    return local_config(config, tp).model_copy(update={"intermediate_size": config.intermediate_size // tp.size,
                                                       "vocab_size": vocab_range(config.vocab_size, tp)[1]})


def load_target_shard(path: str | Path, tp: TPGroup, dtype="float32", device="cpu") -> LlamaForCausalLM:
    """Rank ``tp.rank``'s share of the target at ``path``, split for ``tp`` and on ``device`` (``model.tp`` set):
    what ``shard_target(load_target(path, dtype), tp, device)`` gives, reading only this rank's share."""
    path, device = Path(path), torch.device(device)
    fmt = checkpoint_fp8_format(path)
    files = checkpoint_files(path)
    if any(f.suffix == ".bin" for f in files):
        if fmt is not None:
            raise CheckpointError(f"{path}: an FP8 checkpoint in .bin files cannot be split: use safetensors")
        return shard_target(load_target(path, dtype, "cpu"), tp, device)
    t0 = time.perf_counter()
    config = ModelConfig.from_dir(path)
    config.check_target(path)
    check_split(config, tp.size)
    dtype = parse_dtype(dtype)
    model = build_module(LlamaForCausalLM, rank_shapes(config, tp), dtype, META)
    model.config = config  # the whole model's: the vocabulary the logits are cut to, the heads a hand-off carries
    whole = dict(build_module(LlamaForCausalLM, config, dtype, META).named_parameters())  # shapes to check against
    shapes = tensor_shapes(files)
    scales = _fp8_scales(shapes, fmt)  # taken out of shapes
    found = _check_names(shapes, whole, config)
    for name, param in model.named_parameters():
        file, shape = found[name]
        if shape != tuple(whole[name].shape):
            raise CheckpointError(f"{name}: checkpoint shape {shape} != model {tuple(whole[name].shape)}")
        if name.removesuffix(".weight") in scales:
            _set_fp8(model, name, file, shape, scales[name.removesuffix(".weight")], fmt, tp, device)
        else:
            _set_param(model, name, _rank_tensor(file, name, tuple(param.shape), config, tp, dtype, device))
    _join(model, config, tp, device)
    if scales:
        fp8.prepare(model)
    log_loaded(path, f"target (tensor-parallel rank {tp.rank} of {tp.size})", model, t0)
    return model


def _fp8_scales(shapes: dict, fmt: fp8.Fp8Format | None) -> dict[str, tuple[str, Path]]:
    """An FP8 checkpoint's weight scales, taken out of ``shapes`` (in place): {module: (scale name, its file)}.
    Static activation scales are refused by name."""
    if fmt is None:
        return {}
    static = [k for k in shapes if k.endswith(("input_scale", "activation_scale"))]
    if static:
        raise CheckpointError(f"{static[0]}: static activation scales are not supported (dynamic FP8 only)")
    names = [k for k in shapes if k.endswith(fp8.SCALE_SUFFIXES)]
    return {k.rsplit(".", 1)[0]: (k, shapes.pop(k)[0]) for k in names}


def _set_fp8(model: nn.Module, name: str, file: Path, shape: tuple[int, ...], scale_at: tuple[str, Path],
             fmt: fp8.Fp8Format, tp: TPGroup, device: torch.device) -> None:
    """This rank's rows (q/k/v, gate/up) or columns (o, down) of FP8 weight ``name`` and the scales that cover
    them (per-channel scales by row; block scales by block, so a rank's share must start on a block)."""
    how = how_split(name)
    try:
        part = read_share(file, name, how, tp)
        with safe_open(str(scale_at[1]), framework="pt") as f:
            whole_scale = f.get_tensor(scale_at[0])
    except (OSError, SafetensorError, RuntimeError) as e:
        raise unreadable(file, e) from None
    if part.dtype != fp8.FP8 or how not in ("rows", "columns"):
        raise CheckpointError(f"{name}: a scale ({scale_at[0]}) beside a weight that is not an FP8 projection")
    scale, block = fp8.checkpoint_scale(torch.empty(shape, device=META), whole_scale, fmt, scale_at[0])
    span = tp.span(shape[0] if how == "rows" else shape[1], name)
    # the scale's rows or columns this share covers (none to cut: the columns of per-channel scales)
    step = block[0] if how == "rows" else (block[1] if block[1] < shape[1] else None)
    if step is not None:
        if span.start % step:
            raise CheckpointError(f"{name}: rank {tp.rank}'s share starts at {span.start}, inside a scale block "
                                  f"of {step}: {tp.size} ranks cannot split this FP8 weight")
        cut = slice(span.start // step, -(-span.stop // step))
        scale = scale[cut] if how == "rows" else scale[:, cut]
    _set_param(model, name, torch.empty(part.shape, dtype=fp8.FP8, device=device).copy_(part))
    fp8.mark(model.get_parameter(name), scale.contiguous().to(device), block)


def _check_names(found: dict, whole: dict, config: ModelConfig) -> dict:
    """``found`` (the checkpoint's tensors) less a tied model's ``lm_head.weight``; a missing or unexpected
    tensor is the error ``load_weights`` gives."""
    if config.tie_word_embeddings:
        found = {k: v for k, v in found.items() if k != "lm_head.weight"}
    missing = [k for k in whole if k not in found]
    unexpected = [k for k in found if k not in whole]
    if missing or unexpected:
        raise CheckpointError(f"checkpoint mismatch: missing {missing[:8]}, unexpected {unexpected[:8]}")
    return found


def _rank_tensor(file: Path, name: str, local: tuple[int, ...], config: ModelConfig, tp: TPGroup,
                 dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """This rank's ``local``-shaped tensor for checkpoint tensor ``name``, cast on the host as ``load_weights``
    casts, in memory of its own on ``device``."""
    how = how_split(name)
    if how == "once" and tp.rank:
        return torch.zeros(local, dtype=dtype).to(device)
    try:
        part = fold_norm_offset(name, read_share(file, name, how, tp), config).to(dtype)
    except (OSError, SafetensorError, RuntimeError) as e:
        raise unreadable(file, e) from None
    if how == "vocab":
        part = pad_vocab_rows(part, local[0])
    return torch.empty(local, dtype=dtype, device=device).copy_(part)


def _set_param(model: nn.Module, name: str, value: torch.Tensor) -> None:
    owner, attr = name.rsplit(".", 1)
    setattr(model.get_submodule(owner), attr, nn.Parameter(value, requires_grad=False))


def _join(model: LlamaForCausalLM, config: ModelConfig, tp: TPGroup, device: torch.device) -> None:
    """Finish the loaded share as ``shard_target`` leaves a split target (in place): tied head, rotary tables
    (computed on the host, as the whole model's are), fused projections, the vocabulary-parallel embedding."""
    embed = model.model.embed_tokens.weight
    if config.tie_word_embeddings:
        model.lm_head.weight = embed
    for layer in model.model.layers:
        layer.self_attn.rotary = RotaryEmbedding(config.rope, config.head_dim).to(device)
        layer.self_attn.tp = layer.mlp.tp = tp
    fuse_projections(model)
    model.model.embed_tokens = VocabParallelEmbedding(embed, vocab_range(config.vocab_size, tp)[0], tp)
    model.tp = tp
    model.eval()
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"the split load left {left[:4]} unread on the meta device")


def read_lm_head(path: str | Path) -> torch.Tensor:
    """The whole target's LM head weight [V, H] from the checkpoint at ``path`` (the embedding when tied), in the
    checkpoint's dtype: what a draft head without its own LM head copies when the target is loaded split."""
    config = ModelConfig.from_dir(path)
    return read_tensor(path, "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight")
