"""The engine's ``batch_invariant``: every projection of the target and its LM head is marked for the launch whose
output for a row does not depend on the rows beside it, at every row count (``shared.model.fp8.linear`` runs it
on CUDA: tests/gpu/test_batch_invariant_gpu.py); the embedding is a lookup, not a product; off, nothing is."""

from __future__ import annotations

import torch
from torch import nn

from shared.config import EngineConfig
from shared.engine import Engine


def _marked(engine: Engine) -> dict[str, bool]:
    """Per 2-D weight of the target (parameters, and the fused q/k/v and gate/up tensors its modules hold), but
    the embedding's: whether it is marked."""
    out = {}
    for name, m in engine.model.named_modules():
        if isinstance(m, nn.Embedding):
            continue
        held = {**dict(m.named_parameters(recurse=False)),
                **{k: v for k, v in vars(m).items() if isinstance(v, torch.Tensor)}}
        out |= {f"{name}.{k}": getattr(t, "same_rows_unbounded", False) for k, t in held.items() if t.dim() == 2}
    return out


def test_batch_invariant_marks_every_projection_of_the_target_and_only_then(oracle_model_dir):
    on = _marked(Engine(oracle_model_dir / "target", config=EngineConfig(batch_invariant=True)))
    assert any("qkv" in n for n in on) and any("gate_up" in n for n in on) and any("down_proj" in n for n in on)
    assert any(n.startswith("lm_head") for n in on)
    assert all(on.values()), [n for n, v in on.items() if not v]
    off = _marked(Engine(oracle_model_dir / "target", config=EngineConfig()))
    assert off.keys() == on.keys() and not any(off.values())
