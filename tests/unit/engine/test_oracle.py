"""Eyrie's Llama against ``transformers`` on checkpoints that ``transformers`` itself wrote.

Float32 on the CPU: logits over a batch of prompts of different lengths agree to 1e-4, and greedy
generations of 32 tokens are identical, for several shapes (GQA 4:1 and 1:1, tied embeddings,
llama3 rope scaling, odd sizes with an explicit head_dim, Llama attention_bias, Qwen2 qkv bias, a
sharded checkpoint). Controls show the 1e-4 bound has teeth: dropping the rope scaling or the
biases on the ``transformers`` side moves its logits by far more than the bound.
"""

from __future__ import annotations

import json
import shutil
import zlib
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from shared.config import EngineConfig
from shared.engine import Engine
from shared.model.loader import CheckpointError, load_target
from shared.sampling import SamplingParams
from tests.unit.engine.engine_checks import eyrie_logits

TOL = 1e-4
# initializer_range 0.1 (HF's default is 0.02) makes attention peaked and logits O(1), so a wrong
# rotary frequency, head mapping or bias shows up far above TOL instead of hiding in uniform attention.
BASE = dict(vocab_size=320, hidden_size=64, intermediate_size=112, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=1, max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=1,
            initializer_range=0.1)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
WINDOW = 6  # Mistral's sliding window in the oracle: the prompts of PROMPTS but one are longer
# name -> (transformers config class, overrides of BASE)
CONFIGS: dict[str, tuple[str, dict]] = {
    "gqa4to1": ("LlamaConfig", {}),
    "mha1to1": ("LlamaConfig", dict(num_key_value_heads=4)),
    "tied": ("LlamaConfig", dict(tie_word_embeddings=True, num_key_value_heads=2)),
    "llama3_rope": ("LlamaConfig", dict(rope_theta=500000.0, max_position_embeddings=2048, rope_scaling=LLAMA3_ROPE)),
    "odd_sizes": ("LlamaConfig", dict(vocab_size=301, hidden_size=72, intermediate_size=100, num_attention_heads=6,
                                      num_key_value_heads=3, head_dim=20)),
    "llama_attention_bias": ("LlamaConfig", dict(attention_bias=True, num_key_value_heads=2)),
    "qwen2_qkv_bias": ("Qwen2Config", dict(num_key_value_heads=2, tie_word_embeddings=False,
                                           use_sliding_window=False)),
    "sharded": ("LlamaConfig", dict(num_hidden_layers=4, num_key_value_heads=2)),
    "llama_mlp_bias": ("LlamaConfig", dict(attention_bias=True, mlp_bias=True, num_key_value_heads=2)),
    "qwen3_qk_norm": ("Qwen3Config", dict(num_key_value_heads=2, head_dim=16, tie_word_embeddings=False,
                                          use_sliding_window=False)),
    "mistral_full": ("MistralConfig", dict(num_key_value_heads=2, sliding_window=None)),
    # A window shorter than most prompts and every generation: past it, full attention differs.
    "mistral_window": ("MistralConfig", dict(num_key_value_heads=2, sliding_window=WINDOW)),
    "gemma": ("GemmaConfig", dict(num_key_value_heads=2, head_dim=24, hidden_act="gelu_pytorch_tanh")),
}
PROMPTS = [[5, 17, 33, 2, 9, 100, 200, 7, 8, 9, 10], [3, 4], list(range(40, 77)), [250] * 5]


def hf_config(name: str, **extra):
    cls_name, overrides = CONFIGS[name]
    return getattr(transformers, cls_name)(**{**BASE, **overrides, **extra})


def write_hf_checkpoint(path: Path, name: str) -> None:
    """A random checkpoint saved by ``transformers`` (safetensors), deterministic per config name."""
    cfg = hf_config(name)
    torch.manual_seed(zlib.crc32(name.encode()))
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # HF initialises norms to 1 and biases to 0: perturb them so they matter
        for n, p in model.named_parameters():
            if n.endswith("norm.weight") or n.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.1)
    kwargs = {"max_shard_size": "60KB"} if name == "sharded" else {}
    model.save_pretrained(path, safe_serialization=True, **kwargs)


class Checkpoints:
    """Each config's checkpoint directory and ``transformers`` model, written once per module."""

    def __init__(self, root: Path, tokenizer_json: Path):
        self.root, self.tokenizer_json = root, tokenizer_json
        self._made: dict[str, tuple[Path, torch.nn.Module]] = {}

    def __call__(self, name: str) -> tuple[Path, torch.nn.Module]:
        if name not in self._made:
            path = self.root / name
            write_hf_checkpoint(path, name)
            shutil.copy(self.tokenizer_json, path / "tokenizer.json")
            hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            self._made[name] = (path, hf)
        return self._made[name]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tiny_model_dir) -> Checkpoints:
    return Checkpoints(tmp_path_factory.mktemp("hf"), tiny_model_dir / "target" / "tokenizer.json")


def hf_logits(hf: torch.nn.Module, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([prompt])).logits[0]


def max_diff(ours: list[torch.Tensor], hf: torch.nn.Module) -> float:
    return max((got - hf_logits(hf, p)).abs().max().item() for p, got in zip(PROMPTS, ours))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_match_transformers(checkpoints, name):
    path, hf = checkpoints(name)
    engine = Engine(path, config=EngineConfig(page_size=4, chunk_size=None))
    ours = eyrie_logits(engine, PROMPTS)
    for prompt, got in zip(PROMPTS, ours):
        want = hf_logits(hf, prompt)
        assert got.shape == want.shape == (len(prompt), hf.config.vocab_size)
        diff = (got - want).abs().max().item()
        assert diff <= TOL, f"{name}: max abs logit diff {diff} on a prompt of {len(prompt)} tokens"
        assert want.abs().max().item() > 1.0, "logits too flat for the comparison to mean anything"
    assert engine.is_idle_and_clean()


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_greedy_generation_matches_transformers(checkpoints, name):
    path, hf = checkpoints(name)
    engine = Engine(path, config=EngineConfig(page_size=16, chunk_size=8))
    results = engine.generate(PROMPTS, SamplingParams(max_new_tokens=32, ignore_eos=True))
    for prompt, res in zip(PROMPTS, results):
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0)
        want = out[0, len(prompt):].tolist()
        assert len(want) == 32  # eos_token_id=None: transformers ignores EOS too
        assert res.token_ids == want, name
        assert res.finish_reason == "length"
    assert engine.is_idle_and_clean()


def test_llama3_rope_scaling_is_applied(checkpoints):
    """Eyrie's rotary frequencies are the scaled ones, and unscaled rope would fail the oracle by far."""
    path, hf = checkpoints("llama3_rope")
    assert json.loads((path / "config.json").read_text())["rope_parameters"]["rope_type"] == "llama3"
    engine = Engine(path, config=EngineConfig(chunk_size=None))
    ours = engine.model.model.layers[0].self_attn.rotary.inv_freq
    assert torch.allclose(ours, hf.model.rotary_emb.inv_freq.float(), rtol=1e-6)
    plain = transformers.LlamaForCausalLM(hf_config("llama3_rope", rope_scaling=None,
                                                    rope_parameters={"rope_type": "default",
                                                                     "rope_theta": 500000.0})).eval()
    plain.load_state_dict(hf.state_dict())
    assert not torch.allclose(ours, plain.model.rotary_emb.inv_freq.float())
    assert max_diff(eyrie_logits(engine, PROMPTS), plain) > 100 * TOL


@pytest.mark.parametrize("name, o_proj_bias", [("llama_attention_bias", True), ("qwen2_qkv_bias", False)])
def test_attention_biases_are_loaded(checkpoints, name, o_proj_bias):
    """Llama's attention_bias covers q/k/v/o, Qwen2's only q/k/v; zeroing them moves HF's logits."""
    path, hf = checkpoints(name)
    engine = Engine(path, config=EngineConfig(chunk_size=None))
    attn = engine.model.model.layers[0].self_attn
    assert attn.qkv_bias is not None and attn.qkv_bias.abs().max() > 0
    assert (attn.o_proj.bias is not None) == o_proj_bias
    ablated = transformers.AutoModelForCausalLM.from_config(hf.config).eval()
    ablated.load_state_dict(hf.state_dict())
    with torch.no_grad():
        for n, p in ablated.named_parameters():
            if n.endswith("_proj.bias"):
                p.zero_()
    assert max_diff(eyrie_logits(engine, PROMPTS), ablated) > 100 * TOL


def test_sharded_checkpoint_has_an_index(checkpoints):
    path, _ = checkpoints("sharded")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1 and shards == {p.name for p in path.glob("*.safetensors")}
    model = load_target(path, "float32", "cpu")
    assert model.config.num_hidden_layers == 4


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_loads_runs_and_stays_close(checkpoints, dtype):
    path, hf = checkpoints("gqa4to1")
    full = Engine(path, config=EngineConfig(chunk_size=None))
    half = Engine(path, config=EngineConfig(dtype=dtype, chunk_size=4, page_size=4))
    want = getattr(torch, dtype)
    assert all(p.dtype == want for p in half.model.parameters())
    assert all(k.dtype == want for k in half.cache.k + half.cache.v)
    a = eyrie_logits(full, PROMPTS)
    b = eyrie_logits(half, PROMPTS)
    for x, y in zip(a, b):
        assert y.dtype == torch.float32 and torch.isfinite(y).all()
        assert (x - y).abs().max().item() < 0.05 * x.abs().max().item()
    res = half.generate(PROMPTS, SamplingParams(max_new_tokens=6, ignore_eos=True))
    assert all(len(r.token_ids) == 6 and r.finish_reason == "length" for r in res)
    assert half.is_idle_and_clean()


def test_missing_weight_is_a_clear_error(tmp_path):
    from safetensors.torch import load_file, save_file

    write_hf_checkpoint(tmp_path, "gqa4to1")
    state = load_file(tmp_path / "model.safetensors")
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="up_proj"):
        load_target(tmp_path, "float32", "cpu")


def test_sliding_window_is_applied(checkpoints):
    """Every Mistral layer attends over the window, and full attention would fail the oracle by far."""
    path, hf = checkpoints("mistral_window")
    assert json.loads((path / "config.json").read_text())["sliding_window"] == WINDOW
    engine = Engine(path, config=EngineConfig(chunk_size=None))
    assert [layer.self_attn.window for layer in engine.model.model.layers] == [WINDOW] * BASE["num_hidden_layers"]
    full = transformers.AutoModelForCausalLM.from_config(hf_config("mistral_window", sliding_window=None)).eval()
    full.load_state_dict(hf.state_dict())
    assert max_diff(eyrie_logits(engine, PROMPTS), full) > 100 * TOL
    plain, _ = checkpoints("mistral_full")
    assert all(layer.self_attn.window == 0 for layer in Engine(plain).model.model.layers)


def test_qwen3_qk_norm_is_loaded(checkpoints):
    """Qwen3's per-head q/k norm weights are HF's, and plain (weight 1) norms would fail the oracle."""
    path, hf = checkpoints("qwen3_qk_norm")
    engine = Engine(path, config=EngineConfig(chunk_size=None))
    ours = engine.model.model.layers[1].self_attn
    theirs = hf.model.layers[1].self_attn
    assert torch.equal(ours.q_norm.weight, theirs.q_norm.weight) and torch.equal(ours.k_norm.weight,
                                                                                theirs.k_norm.weight)
    ablated = transformers.AutoModelForCausalLM.from_config(hf.config).eval()
    ablated.load_state_dict(hf.state_dict())
    with torch.no_grad():
        for n, p in ablated.named_parameters():
            if n.endswith(("q_norm.weight", "k_norm.weight")):
                p.fill_(1.0)
    assert max_diff(eyrie_logits(engine, PROMPTS), ablated) > 100 * TOL


def test_llama_mlp_bias_is_loaded(checkpoints):
    path, hf = checkpoints("llama_mlp_bias")
    mlp = Engine(path, config=EngineConfig(chunk_size=None)).model.model.layers[0].mlp
    assert mlp.gate_up_bias is not None and mlp.down_proj.bias is not None
    assert torch.equal(mlp.down_proj.bias, hf.model.layers[0].mlp.down_proj.bias)


def test_gemma_scale_norm_offset_and_geglu(checkpoints):
    """Gemma: embeddings x sqrt(hidden), norms scale by 1 + w, GeGLU; SwiGLU instead fails the oracle."""
    path, hf = checkpoints("gemma")
    engine = Engine(path, config=EngineConfig(chunk_size=None))
    cfg = engine.model.config
    assert cfg.embed_scale == BASE["hidden_size"] ** 0.5 and cfg.hidden_act == "gelu_tanh" and cfg.head_dim == 24
    assert cfg.tie_word_embeddings and engine.model.lm_head.weight is engine.model.model.embed_tokens.weight
    assert torch.allclose(engine.model.model.norm.weight, 1 + hf.model.norm.weight)
    swiglu = transformers.AutoModelForCausalLM.from_config(hf_config("gemma", hidden_act="silu")).eval()
    swiglu.load_state_dict(hf.state_dict())
    assert max_diff(eyrie_logits(engine, PROMPTS), swiglu) > 100 * TOL
