"""Eyrie's Llama against ``transformers`` on checkpoints that ``transformers`` itself wrote.

Float32 on the CPU: logits over a batch of prompts of different lengths agree to 1e-4, and greedy
generations of 32 tokens are identical, for several shapes (GQA 4:1 and 1:1, tied embeddings,
llama3 rope scaling, odd sizes, qkv bias, a sharded checkpoint).
"""

from __future__ import annotations

import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")

from shared.batch import build_forward_batch
from shared.config import EngineConfig
from shared.engine import Engine
from shared.model.loader import load_target
from shared.sampling import SamplingParams

BASE = dict(vocab_size=320, hidden_size=64, intermediate_size=112, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=1, max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=1)
CONFIGS = {
    "gqa4to1": {},
    "mha1to1": dict(num_key_value_heads=4),
    "tied": dict(tie_word_embeddings=True, num_key_value_heads=2),
    "llama3_rope": dict(rope_theta=500000.0, max_position_embeddings=2048,
                        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "odd_sizes": dict(vocab_size=301, hidden_size=72, intermediate_size=100, num_attention_heads=6,
                      num_key_value_heads=3, num_hidden_layers=2),
    "qkv_bias": dict(attention_bias=True, num_key_value_heads=2),
    "sharded": dict(num_hidden_layers=4, num_key_value_heads=2),
}
PROMPTS = [[5, 17, 33, 2, 9, 100, 200, 7, 8, 9, 10], [3, 4], list(range(40, 77)), [250] * 5]


def write_hf_checkpoint(path, name: str) -> None:
    cfg = transformers.LlamaConfig(**{**BASE, **CONFIGS[name]})
    torch.manual_seed(hash(name) % 1000)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # HF initialises norms to 1 and biases to 0: perturb so they matter
        for n, p in model.named_parameters():
            if n.endswith("norm.weight") or n.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.1)
    kwargs = {"max_shard_size": "60KB"} if name == "sharded" else {}
    model.save_pretrained(path, safe_serialization=True, **kwargs)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def checkpoint(request, tmp_path_factory, tiny_model_dir):
    path = tmp_path_factory.mktemp(request.param)
    write_hf_checkpoint(path, request.param)
    shutil.copy(tiny_model_dir / "target" / "tokenizer.json", path / "tokenizer.json")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    return request.param, path, hf


def eyrie_logits(engine: Engine, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Every position's logits for each prompt, all prompts in one batched prefill forward."""
    cache = engine.cache
    handles = [cache.open() for _ in prompts]
    try:
        for h, p in zip(handles, prompts):
            cache.reserve(h, len(p))
        ids = torch.tensor([t for p in prompts for t in p])
        pos = torch.cat([torch.arange(len(p)) for p in prompts])
        batch = build_forward_batch(cache, [h.row for h in handles], [0] * len(prompts), [len(p) for p in prompts],
                                    ids, pos, pos)
        logits = engine.model(batch, cache).logits
    finally:
        for h in handles:
            cache.close(h)
    return list(logits.split([len(p) for p in prompts]))


def test_logits_match_transformers(checkpoint):
    name, path, hf = checkpoint
    engine = Engine(path, config=EngineConfig(page_size=4, chunk_size=None))
    ours = eyrie_logits(engine, PROMPTS)
    for prompt, got in zip(PROMPTS, ours):
        with torch.no_grad():
            want = hf(torch.tensor([prompt])).logits[0]
        assert got.shape == want.shape
        diff = (got - want).abs().max().item()
        assert diff <= 1e-4, f"{name}: max abs logit diff {diff}"
    assert engine.is_idle_and_clean()


def test_greedy_generation_matches_transformers(checkpoint):
    name, path, hf = checkpoint
    engine = Engine(path, config=EngineConfig(page_size=16, chunk_size=8))
    results = engine.generate(PROMPTS, SamplingParams(max_new_tokens=32, ignore_eos=True))
    for prompt, res in zip(PROMPTS, results):
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert res.token_ids == out[0, len(prompt):].tolist(), name
        assert res.finish_reason == "length"
    assert engine.is_idle_and_clean()


def test_sharded_checkpoint_has_an_index(tmp_path):
    write_hf_checkpoint(tmp_path, "sharded")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    model = load_target(tmp_path, "float32", "cpu")
    assert model.config.num_hidden_layers == 4


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_loads_and_stays_close(tiny_model_dir, dtype):
    full = Engine(tiny_model_dir / "target", config=EngineConfig(chunk_size=None))
    half = Engine(tiny_model_dir / "target", config=EngineConfig(dtype=dtype, chunk_size=None))
    assert next(iter(half.model.parameters())).dtype == getattr(torch, dtype)
    a = eyrie_logits(full, PROMPTS[:2])
    b = eyrie_logits(half, PROMPTS[:2])
    for x, y in zip(a, b):
        assert torch.isfinite(y).all()
        assert (x - y.float()).abs().max().item() < 0.1 * x.abs().max().item()


def test_missing_weight_is_a_clear_error(tmp_path):
    from safetensors.torch import load_file, save_file

    write_hf_checkpoint(tmp_path, "gqa4to1")
    state = load_file(tmp_path / "model.safetensors")
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="up_proj"):
        load_target(tmp_path, "float32", "cpu")
