"""A tensor-parallel rank's share of a target read straight from the checkpoint (shared/model/shard_loader.py).

Each rank's split model is the one ``shard_target(load_target(...))`` makes, bit for bit (every parameter, fused
projection, buffer and the vocabulary shard's start), for TP 2 and 4 and each family's weights: untied, tied,
Llama's biases on every projection, Qwen2's q/k/v biases, Qwen3's q/k norms, Gemma's norm offset and tied
embeddings from a bfloat16 checkpoint, a checkpoint in several files, and a ``.bin`` checkpoint (loaded whole
and split). A rank reads its share only: 1/N of the split tensors plus the replicated ones. A draft that copies
the target's LM head gets the whole one from the checkpoint. The ranks run in this process (the group's
collectives are not needed to load); the engine under TP loading this way is tests/unit/engine/
test_tensor_parallel.py's (and tests/e2e/test_tensor_parallel_stack.py's).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from shared.model import shard_loader
from shared.model.drafts import load_draft
from shared.model.factory import (
    PRESETS,
    draft_config,
    eagle3_state,
    llama_hf_config,
    random_llama_state,
    write_checkpoint,
)
from shared.model.loader import load_target
from shared.model.shard_loader import load_target_shard, read_lm_head
from shared.parallel import TPGroup, VocabParallelEmbedding, shard_target

# Four KV heads (TP 4 splits them), 160 MLP columns, and a vocabulary of 509 that no TP divides.
SHAPE = {**PRESETS["tiny"], "num_key_value_heads": 4, "vocab_size": 509, "num_hidden_layers": 2}
# name -> (config.json overrides, tensors added: "qkv_bias", "all_bias", "qk_norm")
FAMILIES = {
    "llama": ({}, ()),
    "llama_tied": ({"tie_word_embeddings": True}, ()),
    "llama_biases": ({"attention_bias": True, "mlp_bias": True}, ("all_bias",)),
    "qwen2": ({"architecture": "Qwen2ForCausalLM"}, ("qkv_bias",)),
    "qwen3": ({"architecture": "Qwen3ForCausalLM"}, ("qk_norm",)),
    "gemma": ({"architecture": "GemmaForCausalLM", "tie_word_embeddings": True, "hidden_act": "gelu_pytorch_tanh"},
              ()),
}


def fake_group(rank: int, size: int) -> TPGroup:
    return TPGroup(rank=rank, size=size, group=None, control=None)  # loading needs no collective


def write_family(root: Path, name: str, dtype: torch.dtype = torch.float32) -> Path:
    """A random checkpoint of family ``name`` (``FAMILIES``), its biases and norms far from 0 and 1."""
    overrides, extras = FAMILIES[name]
    cfg = llama_hf_config(**{**SHAPE, **overrides})
    g = torch.Generator().manual_seed(len(name))
    state = random_llama_state(cfg, g)
    hd = cfg["head_dim"]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        projs = {"qkv_bias": ("q", "k", "v"), "all_bias": ("q", "k", "v", "o")}.get(extras[0] if extras else "", ())
        for x in projs:
            state[f"{p}.self_attn.{x}_proj.bias"] = torch.randn(state[f"{p}.self_attn.{x}_proj.weight"].shape[0],
                                                                generator=g)
        if "all_bias" in extras:
            for x in ("gate", "up", "down"):
                state[f"{p}.mlp.{x}_proj.bias"] = torch.randn(state[f"{p}.mlp.{x}_proj.weight"].shape[0], generator=g)
        if "qk_norm" in extras:
            state[f"{p}.self_attn.q_norm.weight"] = 1 + 0.3 * torch.randn(hd, generator=g)
            state[f"{p}.self_attn.k_norm.weight"] = 1 + 0.3 * torch.randn(hd, generator=g)
    if name == "gemma":  # norms stored as w (the model scales by 1 + w): small, where 1 + w rounds in bfloat16
        state = {k: 0.1 * v if k.endswith("norm.weight") else v for k, v in state.items()}
    out = root / name
    write_checkpoint(out, cfg, {k: v.to(dtype) for k, v in state.items()})
    return out


def split_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor a split target holds: parameters, buffers and the fused projections (plain attributes)."""
    out = {}
    for prefix, module in model.named_modules():
        for key, value in [*vars(module).items(), *module._parameters.items(), *module._buffers.items()]:
            if isinstance(value, torch.Tensor):
                out[f"{prefix}.{key}"] = value
    return out


def assert_same_split(got: torch.nn.Module, want: torch.nn.Module, tp: TPGroup) -> None:
    a, b = split_state(got), split_state(want)
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype and a[key].shape == b[key].shape, key
        assert torch.equal(a[key], b[key]), f"{key} differs on rank {tp.rank} of {tp.size}"
    assert got.tp is tp and got.config == want.config
    embed = got.model.embed_tokens
    assert isinstance(embed, VocabParallelEmbedding) and embed.start == want.model.embed_tokens.start
    assert (got.lm_head.weight is embed.weight) == got.config.tie_word_embeddings
    for mine, theirs in zip(got.model.layers, want.model.layers):
        assert mine.self_attn.tp is mine.mlp.tp is tp
        assert (mine.self_attn.num_heads, mine.self_attn.num_kv_heads) == (theirs.self_attn.num_heads,
                                                                           theirs.self_attn.num_kv_heads)
    assert not got.training


@pytest.fixture(scope="module")
def families(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    paths = {name: write_family(root, name) for name in FAMILIES}
    paths["gemma_bf16"] = write_family(root / "bf16", "gemma", torch.bfloat16)
    return paths


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("name", [*FAMILIES, "gemma_bf16"])
def test_each_rank_loads_what_shard_target_keeps_bit_for_bit(families, name, size):
    for dtype in ("float32", "bfloat16") if name == "gemma_bf16" else ("float32",):
        whole = load_target(families[name], dtype)
        for rank in range(size):
            tp = fake_group(rank, size)
            want = shard_target(load_target(families[name], dtype), tp, torch.device("cpu"))
            assert_same_split(load_target_shard(families[name], tp, dtype), want, tp)
        assert whole.config.vocab_size == 509


def test_the_last_ranks_vocabulary_rows_are_padded_with_zeros(families):
    whole = load_target(families["llama"]).lm_head.weight
    parts = [load_target_shard(families["llama"], fake_group(r, 4)) for r in range(4)]
    assert [p.model.embed_tokens.start for p in parts] == [0, 128, 256, 384]
    rows = torch.cat([p.lm_head.weight for p in parts])
    assert rows.shape == (512, whole.shape[1]) and torch.equal(rows[:509], whole) and not rows[509:].any()


def test_a_checkpoint_in_several_files_loads_alike(families, tmp_path):
    src, out = families["llama_biases"], tmp_path / "sharded"
    shutil.copytree(src, out)
    state = load_file(out / "model.safetensors")
    (out / "model.safetensors").unlink()
    names = sorted(state)
    files = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in files.items():
        save_file({k: state[k] for k in keys}, out / file, metadata={"format": "pt"})
    weight_map = {k: file for file, keys in files.items() for k in keys}
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    for rank in range(2):
        tp = fake_group(rank, 2)
        assert_same_split(load_target_shard(out, tp), shard_target(load_target(src), tp, torch.device("cpu")), tp)


def test_a_bin_checkpoint_is_loaded_whole_and_split(families, tmp_path):
    out = tmp_path / "bin"
    out.mkdir()
    shutil.copy(families["llama_tied"] / "config.json", out)
    torch.save(load_file(families["llama_tied"] / "model.safetensors"), out / "pytorch_model.bin")
    tp = fake_group(1, 2)
    want = shard_target(load_target(families["llama_tied"]), tp, torch.device("cpu"))
    assert_same_split(load_target_shard(out, tp), want, tp)


class CountingOpen:
    """``safe_open`` that counts the bytes taken out of the file (slices and whole tensors)."""

    def __init__(self, real):
        self.real, self.bytes = real, 0

    def __call__(self, *args, **kwargs):
        return CountingFile(self, self.real(*args, **kwargs))


class CountingFile:
    def __init__(self, counter: CountingOpen, f):
        self.counter, self.f = counter, f

    def __enter__(self):
        self.f.__enter__()
        return self

    def __exit__(self, *exc):
        return self.f.__exit__(*exc)

    def get_slice(self, name):
        return CountingSlice(self.counter, self.f.get_slice(name))

    def get_tensor(self, name):
        t = self.f.get_tensor(name)
        self.counter.bytes += t.nbytes
        return t

    def keys(self):
        return self.f.keys()


class CountingSlice:
    def __init__(self, counter: CountingOpen, part):
        self.counter, self.part = counter, part

    def get_shape(self):
        return self.part.get_shape()

    def __getitem__(self, index):
        t = self.part[index]
        self.counter.bytes += t.nbytes
        return t


@pytest.mark.parametrize("size", [2, 4])
def test_a_rank_reads_its_share_of_the_split_tensors_and_the_replicated_ones(tmp_path, monkeypatch, size):
    """With a vocabulary every size divides, rank r reads exactly 1/N of every projection, embedding and LM
    head, and every norm whole (a few hundred bytes): nothing else of the checkpoint."""
    cfg = llama_hf_config(**{**SHAPE, "vocab_size": 512})
    write_checkpoint(tmp_path, cfg, random_llama_state(cfg, torch.Generator().manual_seed(0)))
    state = load_file(tmp_path / "model.safetensors")
    replicated = sum(t.nbytes for k, t in state.items() if k.endswith("norm.weight"))
    split = sum(t.nbytes for t in state.values()) - replicated
    for rank in range(size):
        counter = CountingOpen(shard_loader.safe_open)
        monkeypatch.setattr(shard_loader, "safe_open", counter)
        load_target_shard(tmp_path, fake_group(rank, size))
        assert counter.bytes == split // size + replicated
        assert counter.bytes < (split + replicated) / size * 1.05  # the checkpoint is ~all projections


def borrowing_eagle3(target: Path, out: Path) -> Path:
    """An EAGLE-3 head for ``target`` without an LM head of its own (SGLang: no draft_vocab_size): it copies
    the target's when loaded."""
    tcfg = json.loads((target / "config.json").read_text())
    cfg = draft_config(tcfg, "LlamaForCausalLMEagle3", 1, draft_vocab_size=tcfg["vocab_size"],
                       target_hidden_size=tcfg["hidden_size"])
    state = eagle3_state(cfg, torch.Generator().manual_seed(7), tcfg["hidden_size"])
    for name in ("lm_head.weight", "d2t", "t2d"):
        del state[name]
    del cfg["draft_vocab_size"]
    write_checkpoint(out, cfg, state)
    return out


@pytest.mark.parametrize("tied", [False, True])
def test_a_draft_copying_the_lm_head_of_a_split_target_gets_the_whole_one(families, tmp_path, tied):
    target = families["llama_tied" if tied else "llama"]
    draft = borrowing_eagle3(target, tmp_path / "eagle3")
    whole = load_target(target)
    split = load_target_shard(target, fake_group(1, 2))
    got = load_draft(draft, split, target_lm_head=lambda: read_lm_head(target)).lm_head.weight
    assert got.shape == (509, SHAPE["hidden_size"])
    assert torch.equal(got, whole.lm_head.weight) and torch.equal(got, load_draft(draft, whole).lm_head.weight)
    with pytest.raises(ValueError, match="split over tensor-parallel ranks"):
        load_draft(draft, split)  # the split target's own rows are not the whole head
