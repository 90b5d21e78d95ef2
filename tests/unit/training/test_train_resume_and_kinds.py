"""Resuming gives the run that was never stopped; EAGLE-1 and the multi-layer draft train too."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from shared.config import EngineConfig, SpecConfig
from shared.engine import Engine
from shared.sampling import SamplingParams
from shared.training.trainer import TrainConfig, Trainer, train_draft

QUICK = dict(seq_len=32, batch_tokens=64, ttt_steps=3, lr=1e-2, warmup=2, eval_every=0, eval_prompts=2,
             eval_new_tokens=8, progress=False)


class Killed(Exception):
    pass


def test_resumed_run_ends_with_the_weights_of_an_uninterrupted_one(oracle_model_dir, small_corpus, tmp_path,
                                                                   monkeypatch):
    target = str(Path(oracle_model_dir) / "target")

    def config(out: Path, resume: bool = False) -> TrainConfig:
        return TrainConfig(target=target, corpus=[str(small_corpus)], out=str(out), steps=6, save_every=3,
                           resume=resume, **QUICK)

    whole = train_draft(config(tmp_path / "whole"))
    # The same run killed during step 5 (its last checkpoint: step 3), then resumed.
    step = Trainer.train_step

    def dies_at_step_5(self):
        if self.step == 4:
            raise Killed
        return step(self)
    with monkeypatch.context() as m:
        m.setattr(Trainer, "train_step", dies_at_step_5)
        with pytest.raises(Killed):
            train_draft(config(tmp_path / "cut"))
    assert torch.load(tmp_path / "cut" / "train_state" / "state.pt", weights_only=False)["step"] == 3
    ran = []
    with monkeypatch.context() as m:  # the resumed run does steps 4..6 only
        m.setattr(Trainer, "train_step", lambda self: (ran.append(self.step), step(self))[1])
        resumed = train_draft(config(tmp_path / "cut", resume=True))
    assert ran == [3, 4, 5]
    a, b = load_file(tmp_path / "whole" / "model.safetensors"), load_file(tmp_path / "cut" / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert [e["step"] for e in whole["evals"]] == [e["step"] for e in resumed["evals"]] == [0, 6]
    assert whole["evals"][-1]["accept_length"] == resumed["evals"][-1]["accept_length"]


@pytest.mark.parametrize("kind", ["eagle", "mtp"])
def test_eagle_and_multi_layer_heads_learn_and_stay_lossless(oracle_model_dir, small_corpus, tmp_path, kind):
    target = Path(oracle_model_dir) / "target"
    out = tmp_path / kind
    summary = train_draft(TrainConfig(target=str(target), corpus=[str(small_corpus)], out=str(out), kind=kind,
                                      steps=100, seq_len=32, batch_tokens=128, ttt_steps=3, regenerate=16, lr=1e-2,
                                      warmup=10, eval_every=0, eval_prompts=4, eval_new_tokens=24, progress=False))
    untrained, final = summary["evals"][0], summary["evals"][-1]
    # Measured after 120 steps: 2.6 (EAGLE), 2.7 (multi-layer), from 1.0.
    assert untrained["accept_length"] < 1.2 and final["accept_length"] >= 1.8
    assert final["heldout_loss"] < untrained["heldout_loss"]
    prompts = [[5, 17, 33, 2, 9, 100, 200, 7], list(range(40, 77))]
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    plain = [r.token_ids for r in Engine(target).generate(prompts, params)]
    engine = Engine(target, draft=out, config=EngineConfig(spec=SpecConfig(topk=2, steps=3, num_draft_tokens=6),
                                                              spec_policy="fixed"))  # the head's own acceptance
    assert [r.token_ids for r in engine.generate(prompts, params)] == plain
    assert engine.speculator.draft.kind == kind and engine.spec_stats.totals.accept_length > 1.3
