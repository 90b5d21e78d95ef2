"""``eyrie train-draft`` on the CPU: a few hundred steps make a head the engine accepts, losslessly.

The target is the oracle model (``make_oracle_model``: its next token depends mostly on the current
one, so it has structure a small head can learn in seconds). The corpus is three modules of the
standard library; each training window's last half is the target's own greedy continuation
(``--regenerate``), what the head is asked to predict when serving greedily. The acceptance is the
engine's: the head written in its public format, loaded by ``Engine(draft=...)``, decoding held-out
prompts. The untrained head (step 0) is the random baseline.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from shared.config import EngineConfig, SpecConfig
from shared.engine import Engine
from shared.model.drafts import Eagle3Draft, load_draft
from shared.model.loader import load_target
from shared.sampling import SamplingParams
from shared.training.evaluate import heldout_prompts
from shared.training.trainer import TrainConfig, train_draft

STEPS = 200
SETTINGS = dict(steps=STEPS, seq_len=32, batch_tokens=128, ttt_steps=3, regenerate=16, lr=1e-2, warmup=20,
                eval_every=100, eval_prompts=4, eval_new_tokens=24, eval_spec_steps=3, progress=False)


@pytest.fixture(scope="module")
def trained(one_thread_module, oracle_model_dir, small_corpus, tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("head") / "eagle3"
    summary = train_draft(TrainConfig(target=str(Path(oracle_model_dir) / "target"), corpus=[str(small_corpus)],
                                      out=str(out), kind="eagle3", **SETTINGS))
    return out, summary


def test_training_raises_heldout_acceptance_far_above_the_untrained_head(trained):
    _, summary = trained
    evals = summary["evals"]
    assert [e["step"] for e in evals] == [0, 100, STEPS]
    untrained, final = evals[0], evals[-1]
    # Measured: 1.00 untrained, 2.5-2.6 after 200 steps (a chain of 3: at most 4).
    assert untrained["accept_length"] < 1.2
    assert final["accept_length"] >= 2.0
    assert final["accept_length"] - untrained["accept_length"] >= 0.8
    assert final["heldout_loss"] < untrained["heldout_loss"]
    assert final["heldout_accuracy"][0] > 0.3 > untrained["heldout_accuracy"][0]
    assert summary["heldout_docs"] == 1 and summary["train_docs"] == 2


def test_written_head_is_lossless_and_accepted_through_the_engine(trained, oracle_model_dir):
    out, _ = trained
    target = Path(oracle_model_dir) / "target"
    prompts = [[5, 17, 33, 2, 9, 100, 200, 7], [3, 4], list(range(40, 77))]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    plain = [r.token_ids for r in Engine(target, config=EngineConfig(chunk_size=8)).generate(prompts, params)]
    for spec in (SpecConfig(topk=1, steps=3, num_draft_tokens=4), SpecConfig(topk=2, steps=3, num_draft_tokens=6)):
        engine = Engine(target, draft=out, config=EngineConfig(chunk_size=8, spec=spec, spec_policy="fixed"))
        assert [r.token_ids for r in engine.generate(prompts, params)] == plain, spec
        # The trained head, not a random one: every step the shape asked for (``fixed``; the adaptive default
        # chooses by measured step times, so a loaded machine's steps would move the figure).
        assert engine.spec_stats.totals.accept_length > 1.5, spec
        assert engine.is_idle_and_clean()


def test_written_head_is_the_public_eagle3_format(trained, oracle_model_dir):
    out, summary = trained
    cfg = json.loads((out / "config.json").read_text())
    target_cfg = json.loads((Path(oracle_model_dir) / "target" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["draft_vocab_size"] == summary["draft_vocab_size"] == target_cfg["vocab_size"]
    assert cfg["target_hidden_size"] == target_cfg["hidden_size"]
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 1, 0]  # SGLang's ids for 4 layers
    state = load_file(out / "model.safetensors")
    h, vd, v = cfg["hidden_size"], cfg["draft_vocab_size"], target_cfg["vocab_size"]
    assert state["fc.weight"].shape == (h, 3 * h) and state["lm_head.weight"].shape == (vd, h)
    assert not any(k.startswith("embed_tokens") for k in state)  # the target's embedding is shared
    assert state["d2t"].dtype == torch.int64 and state["t2d"].dtype == torch.bool
    assert torch.equal(torch.arange(vd) + state["d2t"], state["t2d"].nonzero().view(-1))
    assert state["t2d"].numel() == v
    assert (out / "train_state" / "state.pt").exists()  # beside the head, out of the loader's glob:
    assert list(out.glob("*.safetensors")) == [out / "model.safetensors"]  # the loader reads every one
    head = load_draft(out, load_target(Path(oracle_model_dir) / "target"))
    assert isinstance(head, Eagle3Draft) and head.aux_layers == (2, 2, 1)


def test_eagle3_draft_vocabulary_is_the_corpus_most_frequent_tokens(oracle_model_dir, small_corpus, tmp_path):
    """A draft vocabulary smaller than the target's: d2t names the training split's most frequent
    tokens; the head loads and stays lossless."""
    from shared.model.tokenizer import Tokenizer
    from shared.training.corpus import read_documents, tokenize_split

    target = Path(oracle_model_dir) / "target"
    out = tmp_path / "head"
    summary = train_draft(TrainConfig(target=str(target), corpus=[str(small_corpus)], out=str(out),
                                      draft_vocab=64, max_windows=10, **{**SETTINGS, "steps": 3, "regenerate": 0}))
    assert summary["draft_vocab_size"] == 64
    assert torch.load(out / "train_state" / "data.pt", weights_only=False)["windows"].shape == (10, 32)
    hot = torch.arange(64) + load_file(out / "model.safetensors")["d2t"]
    split = tokenize_split(read_documents([small_corpus]), Tokenizer(target).encode, 1, 512, 0.05)
    counts = torch.bincount(split.train, minlength=512)
    cold = torch.ones(512, dtype=torch.bool).index_fill_(0, hot, False)
    assert counts[hot].min() >= counts[cold].max() and counts[hot].min() > 0
    prompts = heldout_prompts(split.heldout, 2, 16)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    plain = [r.token_ids for r in Engine(target).generate(prompts, params)]
    spec = Engine(target, draft=out, config=EngineConfig(spec=SpecConfig(topk=2, steps=2, num_draft_tokens=4)))
    assert [r.token_ids for r in spec.generate(prompts, params)] == plain
