"""A bad speculative configuration is refused at load, with a message naming both sides: the tree
shape (topk, steps, num_draft_tokens) and a draft made for another target (hidden size, vocabulary,
EAGLE-3 ``d2t`` map, too few layers for the steps)."""

from __future__ import annotations

import shutil

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load_file, save_file
from spec_helpers import KINDS

from shared.config import EngineConfig, SpecConfig
from shared.engine import Engine
from shared.model.factory import make_tiny_target, write_random_drafts
from shared.model.loader import CheckpointError


@pytest.mark.parametrize("kwargs, words", [
    (dict(topk=0), ["topk must be >= 1", "got 0"]),
    (dict(steps=0), ["steps must be >= 1", "got 0"]),
    (dict(topk=1, steps=3, num_draft_tokens=5), ["num_draft_tokens=5", "steps + 1 = 4", "chain"]),
    (dict(topk=1, steps=3, num_draft_tokens=3), ["num_draft_tokens=3", "steps + 1 = 4"]),
    (dict(topk=2, steps=2, num_draft_tokens=8), ["num_draft_tokens=8", "[2, 7]", "topk=2, steps=2"]),
    (dict(topk=4, steps=1, num_draft_tokens=6), ["num_draft_tokens=6", "[2, 5]", "topk=4, steps=1"]),
    (dict(topk=2, steps=3, num_draft_tokens=1), ["num_draft_tokens=1", "[2, 11]"]),
])
def test_tree_shape_is_checked(kwargs, words):
    with pytest.raises(ValidationError) as err:
        SpecConfig(**kwargs)
    for w in words:
        assert w in str(err.value), (w, str(err.value))


def test_largest_trees_are_accepted():
    for topk, steps in [(1, 1), (1, 5), (2, 3), (4, 5)]:
        most = 1 + topk + (steps - 1) * topk ** 2
        if topk == 1:
            most = steps + 1
        assert SpecConfig(topk=topk, steps=steps, num_draft_tokens=most).num_draft_tokens == most


@pytest.fixture(scope="module")
def foreign(tmp_path_factory, tiny_model_dir):
    """Drafts written for other targets, and an EAGLE-3 head whose d2t leaves the vocabulary."""
    root = tmp_path_factory.mktemp("foreign")
    for name, overrides in {"h32": dict(hidden_size=32, num_attention_heads=2, num_key_value_heads=1),
                            "v256": dict(vocab_size=256)}.items():
        target = make_tiny_target(root / name, seed=3, **overrides)
        write_random_drafts(target, root / name, seed=3)
    for name, change in {"d2t_range": lambda d2t: d2t + 300, "d2t_size": lambda d2t: d2t[:-1]}.items():
        shutil.copytree(tiny_model_dir / "eagle3", root / name)
        state = load_file(root / name / "model.safetensors")
        state["d2t"] = change(state["d2t"]).contiguous()
        save_file(state, str(root / name / "model.safetensors"))
    return root


def load(tiny_model_dir, draft, **spec):
    config = EngineConfig(max_context=64, max_running=2, spec=SpecConfig(**spec) if spec else SpecConfig())
    return Engine(tiny_model_dir / "target", draft, config)


@pytest.mark.parametrize("kind", KINDS)
def test_draft_of_another_hidden_size(tiny_model_dir, foreign, kind):
    with pytest.raises(CheckpointError, match="draft hidden_size 32 != target hidden_size 64"):
        load(tiny_model_dir, foreign / "h32" / kind)


@pytest.mark.parametrize("kind", KINDS)
def test_draft_of_another_vocabulary(tiny_model_dir, foreign, kind):
    with pytest.raises(CheckpointError, match="draft vocab_size 256 != target vocab_size 512"):
        load(tiny_model_dir, foreign / "v256" / kind)


def test_eagle3_d2t_must_map_into_the_target_vocabulary(tiny_model_dir, foreign):
    with pytest.raises(CheckpointError, match=r"outside the target vocabulary \[0, 512\)"):
        load(tiny_model_dir, foreign / "d2t_range")
    with pytest.raises(CheckpointError, match="d2t has 255 entries != draft_vocab_size 256"):
        load(tiny_model_dir, foreign / "d2t_size")


def test_multi_layer_draft_needs_a_layer_per_step(tiny_model_dir):
    with pytest.raises(ValueError, match="5 layers, steps=6"):
        load(tiny_model_dir, tiny_model_dir / "mtp", topk=1, steps=6, num_draft_tokens=7)


def test_matching_drafts_load(tiny_model_dir):
    for kind in KINDS:
        engine = load(tiny_model_dir, tiny_model_dir / kind)
        assert engine.speculator.draft.kind == kind
        if kind == "eagle3":  # the factory's map: every other target token
            d2t = engine.speculator.draft.d2t
            assert torch.equal(torch.arange(d2t.numel()) + d2t, torch.arange(0, 512, 2))
