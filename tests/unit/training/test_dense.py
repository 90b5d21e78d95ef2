"""The dense training forward (``shared.training.dense``) computes what the engine serves."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from training_helpers import engine_logits

from shared.config import EngineConfig
from shared.engine import Engine
from shared.model.config import ModelConfig
from shared.model.factory import llama_hf_config, write_checkpoint
from shared.training.dense import causal_lm_loss, hidden_states, new_llama

ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32}


def test_dense_forward_equals_the_engine_on_the_written_checkpoint(tmp_path):
    cfg = llama_hf_config(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                          rope_theta=500000.0, rope_scaling=ROPE)
    torch.manual_seed(0)
    model = new_llama(ModelConfig.from_hf_dict(cfg), torch.device("cpu"), std=0.1)
    with torch.no_grad():  # norms away from one: a norm missed or misplaced would show
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.2 * torch.randn_like(p))
    write_checkpoint(tmp_path, cfg, model.state_dict())
    ids = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        dense = model.lm_head(hidden_states(model, ids))
        loss = causal_lm_loss(model, ids)
    served = engine_logits(Engine(tmp_path, config=EngineConfig(page_size=4, chunk_size=None)), ids.tolist())
    for b in range(2):
        assert (dense[b] - served[b]).abs().max().item() < 1e-4
    assert dense.abs().max() > 1.0
    want = F.cross_entropy(torch.stack(served)[:, :-1].reshape(-1, 300), ids[:, 1:].reshape(-1))
    assert abs(loss.item() - want.item()) < 1e-5
