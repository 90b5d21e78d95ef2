"""EAGLE-3 capture layers: which target hidden states the draft is fed.

SGLang's ``set_eagle3_layers_to_capture`` reads ``eagle_config.eagle_aux_hidden_state_layer_ids``
(SpecForge writes them, e.g. [1, 15, 28] for 32 layers) and captures before layer ``id + 1``: an id
names the layer whose OUTPUT is taken, ``transformers``' ``hidden_states[id + 1]``. Without ids the
capture points are the inputs of layers 2, L//2 and L-3 (``hidden_states[2]``, ...). The tests hold
Eyrie's captured features against ``transformers`` on a checkpoint ``transformers`` wrote, through
the target forward and through the engine's draft extend; controls show the off-by-one has teeth.
"""

from __future__ import annotations

import json

import pytest
import torch
from draft_reference import DraftCalls
from public_formats import TARGET, hf_hidden_states, write_hf_target, write_specforge_eagle3

from shared.config import EngineConfig, SpecConfig
from shared.engine import Engine
from shared.forward_batch import build_forward_batch
from shared.memory.sizing import make_cache
from shared.model.drafts import aux_layers_of, capture_points, load_draft
from shared.model.factory import eagle3_layer_config, make_model
from shared.model.llama import default_aux_layers
from shared.model.loader import CheckpointError, load_target
from shared.sampling import SamplingParams

TOL = 1e-4
L = TARGET["num_hidden_layers"]  # 8: default capture points (2, 4, 5), all distinct
PROMPT = [5, 17, 33, 2, 9, 100, 200, 7, 8, 9, 10, 77, 3]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf_target")
    _, hf = write_hf_target(path, seed=11)
    return path, hf, load_target(path)


def captured(model, prompt: list[int], capture: str, aux: tuple[int, ...] = ()) -> torch.Tensor:
    """Eyrie's target forward over ``prompt`` in a fresh cache: the captured features, every row."""
    config = EngineConfig(max_running=1, page_size=4, dtype="float32")
    cache = make_cache(model.config, model.config.num_hidden_layers, config, 64)
    h = cache.open()
    cache.reserve(h, len(prompt))
    pos = torch.arange(len(prompt))
    batch = build_forward_batch(cache, [h.row], [0], [len(prompt)], torch.tensor(prompt), pos, pos)
    out = model(batch, cache, capture=capture, aux_layers=aux)
    return out.aux_hidden if capture == "aux" else out.hidden


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def test_default_capture_points_are_the_inputs_of_layers_2_mid_and_L_minus_3(target):
    _, hf, model = target
    hs = hf_hidden_states(hf, PROMPT)
    assert default_aux_layers(L) == (2, 4, 5)
    got = captured(model, PROMPT, "aux", default_aux_layers(L))
    assert max_diff(got, torch.cat([hs[2], hs[4], hs[5]], dim=-1)) <= TOL
    # control: the outputs of those layers (one later) are far from it
    assert max_diff(got, torch.cat([hs[3], hs[5], hs[6]], dim=-1)) > 100 * TOL
    # the EAGLE feature is the last hidden state after the final norm
    assert max_diff(captured(model, PROMPT, "last"), hs[L]) <= TOL


@pytest.mark.parametrize("ids", [[0, 3, 6], [1, 4, 5]])
def test_configured_ids_name_layer_outputs_through_the_engine(target, tmp_path, ids):
    """The engine feeds the draft extend ``transformers``' hidden_states[id + 1] for each id."""
    path, hf, model = target
    draft_dir = write_specforge_eagle3(tmp_path / "eagle3", TARGET, seed=3, draft_vocab_size=96, layer_ids=ids)
    engine = Engine(model, draft_dir, EngineConfig(max_running=2, max_context=64, page_size=4, chunk_size=None,
                                                   spec=SpecConfig(topk=1, steps=2, num_draft_tokens=3)))
    assert engine.speculator.aux_layers == tuple(k + 1 for k in ids)
    with DraftCalls(engine) as calls:
        engine.generate([PROMPT], SamplingParams(max_new_tokens=4, ignore_eos=True))
    extend = [c for c in calls.calls if c.from_target]  # the prompt's extend, then one after each verify
    assert extend[0].features.shape == (len(PROMPT), 3 * TARGET["hidden_size"])
    hs = hf_hidden_states(hf, PROMPT)
    assert max_diff(extend[0].features, torch.cat([hs[k + 1] for k in ids], dim=-1)) <= TOL
    # control: read as layer inputs (no shift), the ids name other hidden states
    assert max_diff(extend[0].features, torch.cat([hs[k] for k in ids], dim=-1)) > 100 * TOL


def test_draft_config_ids_give_shifted_capture_points(target, tmp_path):
    path, _, model = target

    def head(name: str, ids, **cfg_extra):
        d = write_specforge_eagle3(tmp_path / name, TARGET, seed=4, draft_vocab_size=96, layer_ids=ids)
        if cfg_extra:
            cfg = json.loads((d / "config.json").read_text())
            cfg.update(cfg_extra)
            (d / "config.json").write_text(json.dumps(cfg))
        return d

    assert aux_layers_of(head("spec", [1, 3, 6]), model) == (2, 4, 7)
    assert load_draft(head("last", [0, 0, 6]), model).aux_layers == (1, 1, 7)  # L-2: the last capturable
    assert aux_layers_of(head("none", None), model) == (2, 4, 5)  # SGLang's default without ids
    for bad, named in (([1, 3, 7], "layer id 7"), ([-1, 3, 5], "layer id -1")):
        with pytest.raises(CheckpointError, match=rf"{named} of \[.*\] is outside \[0, 6\] for a target of 8 layers"):
            load_draft(head(f"bad{bad[0]}{bad[2]}", bad), model)
    with pytest.raises(CheckpointError, match="fc.weight takes 192 inputs .* 2 layers"):
        load_draft(head("two", [1, 3]), model)
    d = head("toplevel", None, eagle_aux_hidden_state_layer_ids=[2, 4, 5])
    with pytest.raises(CheckpointError, match="top-level eagle_aux_hidden_state_layer_ids"):
        load_draft(d, model)
    with pytest.raises(CheckpointError, match="non-empty list"):
        capture_points([], L)


def test_make_model_writes_the_capture_ids_sglang_reads(tmp_path):
    """``eyrie make-model`` writes eagle_config ids in SGLang's convention; loaded back, they are the
    default capture points, so SGLang and Eyrie feed the head the same target states."""
    out = make_model("tiny", tmp_path / "m", seed=0)
    cfg = json.loads((out / "eagle3" / "config.json").read_text())
    n = json.loads((out / "target" / "config.json").read_text())["num_hidden_layers"]
    ids = cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert ids == [p - 1 for p in default_aux_layers(n)] == [1, 1, 0]
    target = load_target(out / "target")
    assert load_draft(out / "eagle3", target).aux_layers == default_aux_layers(n) == (2, 2, 1)
    # what SpecForge writes for a 32-layer Llama; too-shallow targets get no ids (the same default)
    assert eagle3_layer_config(32)["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 15, 28]
    assert eagle3_layer_config(2) == {}
