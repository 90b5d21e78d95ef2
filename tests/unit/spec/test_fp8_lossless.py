"""Speculative sampling stays lossless against an FP8 target: ``test_sampling_lossless``'s engine-level
chi-square test, run on the 16-token oracle target quantized to FP8 (per-channel for the chain, 16 x 32 blocks
for the tree) with its drafts left unquantized. The exact law comes from ``transformers`` on the target's
dequantized twin (a plain checkpoint of ``fp8 * scale``: what the FP8 target computes on the CPU), so the
committed tokens must follow the FP8 target's own distribution, not the unquantized model's."""

from __future__ import annotations

import itertools

import pytest
import torch
from test_sampling_lossless import (
    DEPTH,
    P_MIN,
    PER_SETTING,
    PROMPT,
    SETTINGS,
    VIEWS,
    check_setting,
    engine_runs,
    reference_probs,
)

from shared.config import EngineConfig
from shared.engine import Engine
from shared.model.factory import quantize_checkpoint
from shared.sampling import SamplingParams
from tests.oracle_model import make_oracle_model
from tests.unit.engine.test_fp8 import dequantized_twin

FP8_SETTINGS = ("temperature", "all")
CASES = {"chain": ("channel", [128, 128]), "tree": ("block", [16, 32])}


def exact_laws(model_dir, vocab: int) -> dict[str, dict[tuple, float]]:
    import transformers  # a test dependency: a missing one fails here, never skips

    hf = transformers.LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    prefixes = [p for n in range(DEPTH) for p in itertools.product(range(vocab), repeat=n)]
    with torch.no_grad():
        ids = torch.tensor([PROMPT + list(p) + [0] * (DEPTH - 1 - len(p)) for p in prefixes])
        logits = hf(ids).logits
    last = torch.stack([logits[i, len(PROMPT) + len(p) - 1] for i, p in enumerate(prefixes)])
    laws = {}
    for name in FP8_SETTINGS:
        probs = dict(zip(prefixes, reference_probs(last, **SETTINGS[name]).tolist()))
        law = {(): 1.0}
        for _ in range(DEPTH):
            law = {seq + (x,): p * q for seq, p in law.items() if p > 0 for x, q in enumerate(probs[seq]) if q > 0}
        laws[name] = law
    return laws


@pytest.mark.parametrize("shape", list(CASES))
def test_engine_sampling_matches_the_fp8_target(tmp_path, shape):
    kind, block = CASES[shape]
    root = make_oracle_model(tmp_path / "v16", seed=0, vocab_size=16, num_hidden_layers=2)
    quantize_checkpoint(root / "target", kind, block)
    laws = exact_laws(dequantized_twin(root / "target", tmp_path / "twin"), 16)
    runs = engine_runs(root, shape, FP8_SETTINGS, PER_SETTING)
    target_only = Engine(root / "target", None, EngineConfig(page_size=4, max_context=32))
    want = target_only.generate(PROMPT, SamplingParams(max_new_tokens=DEPTH, ignore_eos=True))[0].token_ids
    assert runs["greedy"] and all(r.token_ids == want for r in runs["greedy"])
    for name in FP8_SETTINGS:
        rows = runs[name]
        pvalues = check_setting(shape, name, rows, laws[name])
        accepted = [r.spec_stats["accepted_drafts"] for r in rows]
        print(f"fp8 {kind} {shape} {name}: chi-square p " + ", ".join(f"{v} {p:.3g}" for v, p in pvalues.items())
              + f"; accepted {sum(accepted)}, two or more in {sum(a >= 2 for a in accepted)} requests")
        view = min(pvalues, key=pvalues.get)
        assert pvalues[view] * len(VIEWS) > P_MIN, f"{shape} {name} {view}: chi-square p = {pvalues[view]:.2e}"
        assert sum(accepted) > PER_SETTING / 4, f"{shape} {name}: only {sum(accepted)} drafts accepted"
        assert sum(a >= 2 for a in accepted) > PER_SETTING / 20, f"{shape} {name}: few runs of two drafts"
