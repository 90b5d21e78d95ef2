"""Draft heads in their public checkpoint formats load in Eyrie and compute what their authors' code does.

The fixtures are written by hand from the public formats (tests/unit/spec/public_formats.py, not
Eyrie's writer): a SafeAILab EAGLE head (``pytorch_model.bin`` with ``embed_tokens``, ``fc``,
``layers.N``; the plain ``LlamaForCausalLM`` architecture SafeAILab's configs name, or SGLang's
``LlamaForCausalLMEagle``) and an EAGLE-3 head as SpecForge saves it (``model.safetensors`` with
``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``, ``t2d``; ``LlamaForCausalLMEagle3`` with a
``draft_vocab_size``). Their logits and hidden states are held against forwards written in plain
torch from SafeAILab's ``cnets1.py`` and SGLang's ``llama_eagle3.py``, fed the target features
``transformers`` computes: once by calling the loaded head directly (every row of an extend, then a
draft step on its own hidden state) and once inside the engine's speculative loop.
"""

from __future__ import annotations

import pytest
import torch
from draft_reference import DraftCalls
from public_formats import (
    TARGET,
    hf_hidden_states,
    safeailab_eagle_forward,
    sglang_eagle3_fc,
    sglang_eagle3_forward,
    write_hf_target,
    write_safeailab_eagle,
    write_specforge_eagle3,
)
from safetensors.torch import load_file

from shared.config import EngineConfig, SpecConfig
from shared.engine import Engine
from shared.forward_batch import build_forward_batch
from shared.memory.sizing import make_cache
from shared.model.drafts import DraftHead, load_draft
from shared.model.loader import load_target
from shared.sampling import SamplingParams

TOL = 2e-4
PROMPT = [5, 17, 33, 2, 9, 100, 200, 7, 8, 9, 10, 77, 3, 250, 41]
NEXT = 123  # the token after the prompt, fed at the extend's last row
# the heads' own attention / MLP shape differs from the target's (GQA 4:1, another RoPE base)
HEAD_SHAPE = dict(num_attention_heads=4, num_key_value_heads=1, intermediate_size=96, rope_theta=50000.0,
                  rms_norm_eps=1e-5)
EAGLE3_IDS = [1, 3, 6]
VD = 96  # EAGLE-3 draft vocabulary


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf_target")
    _, hf = write_hf_target(path, seed=21)
    return path, hf, load_target(path)


def direct(head: DraftHead, ids: list[int], features: torch.Tensor, step_token: int):
    """The loaded head called directly: an extend over every row (positions 0..T-1), then one draft
    step at position T fed ``step_token`` and the extend's last hidden state. Fresh cache."""
    T = len(ids)
    cache = make_cache(head.config, head.layers_per_cache, EngineConfig(max_running=1, page_size=4, dtype="float32"),
                       64)
    h = cache.open()
    cache.reserve(h, T + 1)
    pos = torch.arange(T)
    ext = head(build_forward_batch(cache, [h.row], [0], [T], torch.tensor(ids), pos, pos), cache, 0,
               features, from_target=True)
    at = torch.tensor([T])
    step = head(build_forward_batch(cache, [h.row], [T], [1], torch.tensor([step_token]), at, at), cache, 0,
                ext.hidden[-1:], from_target=False)
    return ext, step


def close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    err = (got.float() - want.float()).abs().max().item()
    scale = want.abs().max().item()
    assert err <= TOL * max(1.0, scale), f"{what}: max |diff| {err:.2e} (values up to {scale:.2f})"


def engine_and_calls(model, draft_dir, prompt: list[int], n: int = 6):
    """Greedy speculative generation (chain, 3 steps) with every draft forward recorded; the output
    must equal target-only greedy decoding."""
    cfg = dict(max_running=2, max_context=96, page_size=4, chunk_size=None)
    engine = Engine(model, draft_dir, EngineConfig(**cfg, spec=SpecConfig(topk=1, steps=3, num_draft_tokens=4)))
    params = SamplingParams(max_new_tokens=n, ignore_eos=True)
    with DraftCalls(engine) as calls:
        got = engine.generate([prompt], params)[0]
    want = Engine(model, None, EngineConfig(**cfg)).generate([prompt], params)[0]
    assert got.token_ids == want.token_ids
    return engine, calls, got


@pytest.mark.parametrize("architecture, bias", [("LlamaForCausalLM", None), ("LlamaForCausalLMEagle", False)],
                         ids=["safeailab_config", "sglang_config"])
def test_safeailab_eagle_head(target, tmp_path, architecture, bias):
    path, hf, model = target
    embed = hf.model.embed_tokens.weight.detach()
    d = write_safeailab_eagle(tmp_path / "eagle", TARGET, embed, seed=5, num_layers=2, bias=bias,
                              architecture=architecture, **HEAD_SHAPE)
    assert sorted(p.name for p in d.iterdir()) == ["config.json", "pytorch_model.bin"]
    sd = torch.load(d / "pytorch_model.bin", weights_only=True)
    assert ("fc.bias" in sd) == (bias is None) and "layers.0.input_layernorm.weight" not in sd
    cfg = {**TARGET, **HEAD_SHAPE, "num_hidden_layers": 2}
    lm_head = hf.lm_head.weight.detach()
    head = load_draft(d, model)
    assert head.kind == "eagle" and (head.fc.bias is not None) == (bias is None)

    feats = hf_hidden_states(hf, PROMPT)[-1]  # the target's last hidden state, after its final norm
    ids = PROMPT[1:] + [NEXT]
    ext, step = direct(head, ids, feats, step_token=NEXT + 1)
    want_logits, want_hidden = safeailab_eagle_forward(sd, cfg, torch.tensor(ids + [NEXT + 1]),
                                                       torch.cat([feats, ext.hidden[-1:]]), lm_head)
    close(ext.logits, want_logits[:-1], "extend logits")
    close(ext.hidden, want_hidden[:-1], "extend hidden")
    close(step.logits, want_logits[-1:], "draft step logits")
    close(step.hidden, want_hidden[-1:], "draft step hidden")
    # control: dropping the fc bias, or giving layer 0 an input norm, moves the logits far past TOL
    if bias is None:
        no_bias = {k: v for k, v in sd.items() if k != "fc.bias"}
        assert (safeailab_eagle_forward(no_bias, cfg, torch.tensor(ids), feats, lm_head)[0]
                - want_logits[:-1]).abs().max() > 100 * TOL

    # Inside the engine: the prompt's extend gets the same features and tokens, so the same logits;
    # the first draft step of the loop runs on the extend's last hidden state at position len(PROMPT).
    engine, calls, got = engine_and_calls(model, d, PROMPT)
    first = next(c for c in calls.calls if c.from_target)
    assert first.input_ids.tolist() == PROMPT[1:] + [got.token_ids[0]]
    close(first.features, feats, "features the engine fed")
    ref_logits, ref_hidden = safeailab_eagle_forward(sd, cfg, first.input_ids, feats, lm_head)
    close(first.logits, ref_logits[-1:], "engine extend logits")
    close(first.hidden, ref_hidden, "engine extend hidden")
    loop = calls.loop()[0]
    assert loop.positions.tolist() == [len(PROMPT)]
    ref_logits, _ = safeailab_eagle_forward(sd, cfg, torch.cat([first.input_ids, loop.input_ids]),
                                            torch.cat([feats, ref_hidden[-1:]]), lm_head)
    close(loop.logits, ref_logits[-1:], "engine draft-step logits")


def test_specforge_eagle3_head(target, tmp_path):
    path, hf, model = target
    d = write_specforge_eagle3(tmp_path / "eagle3", TARGET, seed=6, draft_vocab_size=VD, layer_ids=EAGLE3_IDS,
                               **HEAD_SHAPE)
    assert sorted(p.name for p in d.iterdir()) == ["config.json", "model.safetensors"]
    sd = load_file(d / "model.safetensors")
    assert sd["d2t"].dtype == torch.int64 and sd["t2d"].dtype == torch.bool and sd["t2d"].sum() == VD
    cfg = {**TARGET, **HEAD_SHAPE}
    embed = hf.model.embed_tokens.weight.detach()
    head = load_draft(d, model)
    assert head.kind == "eagle3" and head.aux_layers == (2, 4, 7)
    hot = torch.arange(VD) + sd["d2t"]  # draft id -> target id
    assert torch.equal(head.to_target_ids(torch.arange(VD)), hot) and torch.equal(sd["t2d"].nonzero()[:, 0], hot)

    hs = hf_hidden_states(hf, PROMPT)
    feats = torch.cat([hs[k + 1] for k in EAGLE3_IDS], dim=-1)  # SGLang: the outputs of layers 1, 3, 6
    ids = PROMPT[1:] + [NEXT]
    ext, step = direct(head, ids, feats, step_token=NEXT + 1)
    h_in = torch.cat([sglang_eagle3_fc(sd, feats), ext.hidden[-1:]])  # a draft step feeds its own hidden
    want_logits, want_hidden = sglang_eagle3_forward(sd, cfg, torch.tensor(ids + [NEXT + 1]), h_in, embed)
    assert ext.logits.shape == (len(ids), VD)
    close(ext.logits, want_logits[:-1], "extend logits")
    close(ext.hidden, want_hidden[:-1], "extend hidden")
    close(step.logits, want_logits[-1:], "draft step logits")
    close(step.hidden, want_hidden[-1:], "draft step hidden")
    # control: the residual taken after the norm instead of before moves the logits far past TOL
    swapped = {**sd, "midlayer.hidden_norm.weight": torch.ones(TARGET["hidden_size"])}
    assert (sglang_eagle3_forward(swapped, cfg, torch.tensor(ids), h_in[:-1], embed)[0]
            - want_logits[:-1]).abs().max() > 100 * TOL

    engine, calls, got = engine_and_calls(model, d, PROMPT)
    first = next(c for c in calls.calls if c.from_target)
    assert first.input_ids.tolist() == PROMPT[1:] + [got.token_ids[0]]
    close(first.features, feats, "features the engine fed")
    ref_logits, ref_hidden = sglang_eagle3_forward(sd, cfg, first.input_ids, sglang_eagle3_fc(sd, feats), embed)
    close(first.logits, ref_logits[-1:], "engine extend logits")
    close(first.hidden, ref_hidden, "engine extend hidden")
    loop = calls.loop()[0]
    # the token the loop feeds is the target id of the extend's best draft id
    assert loop.input_ids.tolist() == [int(hot[ref_logits[-1].argmax()])]
    ref_logits, _ = sglang_eagle3_forward(sd, cfg, torch.cat([first.input_ids, loop.input_ids]),
                                          torch.cat([sglang_eagle3_fc(sd, feats), ref_hidden[-1:]]), embed)
    close(loop.logits, ref_logits[-1:], "engine draft-step logits")


def test_eagle3_head_without_its_own_lm_head_reads_the_targets(target, tmp_path):
    """SGLang: no ``draft_vocab_size`` and no ``lm_head.weight`` -> the target's LM head, full vocabulary."""
    import json

    from safetensors.torch import save_file

    path, hf, model = target
    d = write_specforge_eagle3(tmp_path / "e3", TARGET, seed=7, draft_vocab_size=VD, layer_ids=EAGLE3_IDS)
    sd = load_file(d / "model.safetensors")
    for k in ("lm_head.weight", "d2t", "t2d"):
        sd.pop(k)
    save_file(sd, str(d / "model.safetensors"))
    cfg = json.loads((d / "config.json").read_text())
    del cfg["draft_vocab_size"]
    (d / "config.json").write_text(json.dumps(cfg))
    head = load_draft(d, model)
    assert torch.equal(head.lm_head.weight, hf.lm_head.weight.detach())
    assert torch.equal(head.to_target_ids(torch.arange(TARGET["vocab_size"])), torch.arange(TARGET["vocab_size"]))
