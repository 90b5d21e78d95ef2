"""On the GPU: ``eyrie train-draft`` in bf16 (autocast, float32 master weights, the target in bf16
through the engine's CUDA kernels), the house target's pipeline, and widening on CUDA.

Outputs are compared in float32 (as the other GPU tests do), where the engine's greedy output is
reproducible token for token; bf16 is what the training runs in.
"""

from __future__ import annotations

import shutil
import sysconfig
from pathlib import Path

import pytest

from shared.config import EngineConfig, SpecConfig
from shared.engine import Engine
from shared.sampling import SamplingParams
from shared.training.trainer import TrainConfig, train_draft

pytestmark = pytest.mark.gpu

PROMPTS = [[5, 17, 33, 2, 9, 100, 200, 7], list(range(40, 77)), [3] * 5]
PARAMS = SamplingParams(max_new_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("corpus")
    for name in ("bisect.py", "colorsys.py", "keyword.py"):
        shutil.copy(Path(sysconfig.get_paths()["stdlib"]) / name, out / name)
    return out


def greedy(target: Path, draft: Path | None, device: str = "cuda", spec: SpecConfig | None = None):
    engine = Engine(target, draft, EngineConfig(device=device, dtype="float32", chunk_size=8, spec=spec))
    out = [r.token_ids for r in engine.generate(PROMPTS, PARAMS)]
    return out, (engine.spec_stats.totals.accept_length if engine.speculator is not None else None)


@pytest.mark.parametrize("kind", ["eagle3", "eagle", "mtp"])
def test_train_draft_in_bf16_on_cuda_learns_and_is_lossless(oracle_model_dir, corpus, tmp_path, kind):
    target = Path(oracle_model_dir) / "target"
    summary = train_draft(TrainConfig(target=str(target), corpus=[str(corpus)], out=str(tmp_path / kind), kind=kind,
                                      steps=200, seq_len=32, batch_tokens=128, ttt_steps=3, regenerate=16, lr=1e-2,
                                      warmup=20, eval_every=0, eval_prompts=4, eval_new_tokens=24, device="cuda",
                                      dtype="bfloat16", progress=False))
    untrained, final = summary["evals"][0], summary["evals"][-1]
    assert untrained["accept_length"] < 1.2 and final["accept_length"] >= 1.8, summary["evals"]
    spec = SpecConfig(topk=2, steps=3, num_draft_tokens=6)
    plain, _ = greedy(target, None)
    tokens, accept = greedy(target, tmp_path / kind, spec=spec)
    assert tokens == plain and accept > 1.3


def test_house_tiny_on_cuda_in_bf16(tmp_path):
    from bench.house.train_target import TINY, HouseConfig, build_house

    summary = build_house(HouseConfig(out=str(tmp_path), **{**TINY, "device": "cuda", "dtype": "bfloat16"}),
                          log=lambda line: None)
    curve = [c["loss"] for c in summary["train"]["loss_curve"]]
    assert curve[-1] < curve[0] - 1.0 and summary["train"]["heldout_perplexity"] < 400
    assert len(summary["samples"]) == 4 and all(s["token_ids"] for s in summary["samples"])


def test_widened_pair_on_cuda_decodes_the_same(oracle_model_dir, tmp_path):
    from bench.house.widen import widen_pair
    from shared.training.widen import Shape

    small = Path(oracle_model_dir)
    widen_pair(small / "target", small / "eagle3", tmp_path, Shape(8, 256, 512, 16, 4))
    spec = SpecConfig(topk=1, steps=3, num_draft_tokens=4)
    want, want_len = greedy(small / "target", small / "eagle3", spec=spec)
    got, got_len = greedy(tmp_path / "target", tmp_path / "eagle3", spec=spec)
    assert got == want and got_len == want_len and want_len > 1.5
