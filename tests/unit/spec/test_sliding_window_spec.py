"""Speculative decoding over a sliding-window target (Mistral) is lossless past the window.

Tree verify runs the windowed target over the tree with the nodes' positions (a node at depth d
sees the prefix keys of its own window and its ancestors); the draft heads attend over the whole
context. Greedy speculative output equals the target-only output token for token, chain and tree,
for prompts and generations longer than the window.
"""

from __future__ import annotations

import pytest
from spec_helpers import KINDS

from shared.config import EngineConfig, SpecConfig
from shared.engine import Engine
from shared.model.drafts import load_draft
from shared.model.loader import CheckpointError, load_target
from shared.sampling import SamplingParams
from tests.oracle_model import make_oracle_model

WINDOW = 8
PROMPTS = [[7, 8, 9], [100 + (i * 37) % 300 for i in range(29)], list(range(3, 40)),
           [60 + (i * 11) % 97 for i in range(12)]]
GREEDY = SamplingParams(max_new_tokens=16, ignore_eos=True)
SMALL = dict(max_running=8, max_context=96)


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    root = make_oracle_model(tmp_path_factory.mktemp("mistral"), seed=0, architecture="MistralForCausalLM",
                             sliding_window=WINDOW)
    target = load_target(root / "target")
    return root, target, {kind: load_draft(root / kind, target) for kind in KINDS}


def test_window_reaches_every_target_layer_but_no_draft(windowed):
    _, target, drafts = windowed
    assert all(layer.self_attn.window == WINDOW for layer in target.model.layers)
    assert all(m.window == 0 for d in drafts.values() for m in d.modules() if hasattr(m, "window"))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("topk, steps, ndt", [(1, 3, 4), (2, 3, 6)], ids=["chain", "tree"])
def test_greedy_speculative_equals_target_only_past_the_window(windowed, kind, topk, steps, ndt):
    _, target, drafts = windowed
    ref = Engine(target, None, EngineConfig(**SMALL, page_size=1, chunk_size=None)).generate(PROMPTS, GREEDY)
    spec = SpecConfig(topk=topk, steps=steps, num_draft_tokens=ndt)
    engine = Engine(target, drafts[kind], EngineConfig(**SMALL, page_size=4, chunk_size=8, spec=spec))
    got = engine.generate(PROMPTS, GREEDY)
    assert [r.token_ids for r in got] == [r.token_ids for r in ref]
    assert engine.spec_stats is not None and engine.is_idle_and_clean()


def test_the_window_changes_the_output(windowed):
    """Control: the same weights with full attention generate differently (the window is live here)."""
    _, target, _ = windowed
    logits = {}
    for window in (WINDOW, 0):
        for layer in target.model.layers:
            layer.self_attn.window = window
        engine = Engine(target, None, EngineConfig(**SMALL, page_size=1, chunk_size=None))
        logits[window] = [engine.generate([p], SamplingParams(max_new_tokens=8, ignore_eos=True))[0].token_ids
                          for p in PROMPTS]
    for layer in target.model.layers:
        layer.self_attn.window = WINDOW
    assert logits[WINDOW] != logits[0]


def test_tree_deeper_than_the_window_is_refused(windowed):
    """A node WINDOW deep would need the window applied to its ancestors too: refused, one line."""
    _, target, drafts = windowed
    spec = SpecConfig(topk=1, steps=WINDOW, num_draft_tokens=WINDOW + 1)
    with pytest.raises(CheckpointError, match="sliding_window") as err:
        Engine(target, drafts["eagle"], EngineConfig(**SMALL, spec=spec))
    assert "\n" not in str(err.value)
