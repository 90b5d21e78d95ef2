"""Shared pieces of the GPU benchmarks: the 8B-shaped models in memory, timing, the floor."""

from __future__ import annotations

import torch

from bench.timing import copy_bandwidth, time_cuda, write_json  # noqa: F401 (re-exported)
from shared.config import EngineConfig, SpecConfig
from shared.model.config import ModelConfig
from shared.model.drafts import Eagle3Draft, EagleDraft
from shared.model.factory import PRESETS, draft_config, llama_hf_config
from shared.model.layers import fuse_projections
from shared.model.llama import LlamaForCausalLM, default_aux_layers
from shared.model.loader import build_module


def llama8b_config() -> dict:
    return llama_hf_config(**PRESETS["llama3-8b-shape"], rope_theta=500000.0)


@torch.no_grad()
def random_init_(module: torch.nn.Module, std: float = 0.02) -> None:
    for p in module.parameters():
        p.normal_(0, std) if p.dim() > 1 else p.fill_(1.0)


def build_target(device="cuda", dtype=torch.bfloat16, tcfg: dict | None = None) -> LlamaForCausalLM:
    """Llama-3.1-8B's shape (or ``tcfg``'s) with random weights, built on the device (no disk)."""
    model = build_module(LlamaForCausalLM, ModelConfig.from_hf_dict(tcfg or llama8b_config()), dtype,
                         torch.device(device))
    random_init_(model)
    return fuse_projections(model).eval()


def build_draft(kind: str, target: LlamaForCausalLM, device="cuda", dtype=torch.bfloat16, tcfg: dict | None = None):
    tcfg = tcfg or llama8b_config()
    if kind == "eagle":
        cfg = ModelConfig.from_hf_dict(draft_config(tcfg, "LlamaForCausalLMEagle", 1))
        head = build_module(EagleDraft, cfg, dtype, torch.device(device), target)
    else:
        draft_vocab = min(32000, tcfg["vocab_size"])
        cfg = ModelConfig.from_hf_dict(draft_config(tcfg, "LlamaForCausalLMEagle3", 1, draft_vocab_size=draft_vocab))
        aux = default_aux_layers(target.config.num_hidden_layers)
        head = build_module(Eagle3Draft, cfg, dtype, torch.device(device), target, aux)
    random_init_(head)
    return fuse_projections(head).eval()


def engine_config(max_context: int, batch: int, page_size: int = 16, spec: SpecConfig | None = None,
                  cuda_graph: bool = True, device: str = "cuda", dtype: str = "bfloat16") -> EngineConfig:
    pages = batch * (-(-(max_context + 128) // page_size)) + 8
    return EngineConfig(device=device, dtype=dtype, page_size=page_size, num_pages=pages,
                        max_running=batch, max_context=max_context + 128, chunk_size=None, spec=spec,
                        cuda_graph=cuda_graph, cuda_graph_max_bs=max(batch, 1), spec_policy="fixed")  # one shape


def param_bytes(module: torch.nn.Module) -> int:
    """Bytes of every weight the forward reads: parameters, buffers and the fused projections that
    ``fuse_projections`` keeps as plain tensor attributes (each storage counted once)."""
    seen, total = set(), 0
    for m in module.modules():
        tensors = list(m.parameters(recurse=False)) + list(m.buffers(recurse=False))
        tensors += [v for v in vars(m).values() if isinstance(v, torch.Tensor)]
        for t in tensors:
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
    return total
