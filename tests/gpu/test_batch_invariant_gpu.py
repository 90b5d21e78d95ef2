"""On a GPU: the engine's ``batch_invariant`` (``shared/config.py``). A bf16 target's every projection and its LM
head run one launch (``kernels/fp8_gemv.py``) whose output for a row does not depend on the rows beside it, at every
row count, so greedy output with a draft is the target's own, token for token, at batch: cuBLAS and
``kernels/gemv.py`` sum a row in an order that depends on the row count, so a verify step's rows and a decode
step's can part at a near-tie (seen through the stack on the widened 8B pair, docs/benchmarks.md)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shared.config import EngineConfig, SpecConfig
from shared.engine import Engine
from shared.model import fp8
from shared.sampling import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]

# Llama-3.1-8B's projections (fused q/k/v, o, fused gate/up, down) and a 32k-vocabulary LM head.
SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (32000, 4096)]
ROWS = (1, 2, 7, 16, 17, 64, 300, 1024, 1025)


@pytest.mark.parametrize("n,k", SHAPES)
def test_a_rows_product_is_the_same_bits_at_every_row_count(n, k):
    gen = torch.Generator(device="cuda").manual_seed(n + k)
    holder = nn.Module()
    holder.weight = nn.Parameter(torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) / k ** 0.5,
                                 requires_grad=False)
    fp8.mark_same_rows(holder, every_row_count=True)
    x = torch.randn(2048, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    every = fp8.linear(x, holder.weight)
    ref = nn.functional.linear(x.float(), holder.weight.float())
    assert ((every.float() - ref).norm() / ref.norm()).item() < 1e-2
    for rows in ROWS:
        assert torch.equal(fp8.linear(x[:rows], holder.weight), every[:rows]), rows
    for row in (5, 1500, 2047):  # alone, as a batch-1 decode step runs it
        assert torch.equal(fp8.linear(x[row:row + 1], holder.weight), every[row:row + 1]), row


SHAPES_SPEC = {"chain": SpecConfig(topk=1, steps=3, num_draft_tokens=4),
               "tree": SpecConfig(topk=2, steps=3, num_draft_tokens=6)}
PROMPTS = [[5, 6, 7, 8], list(range(20, 60)), [300, 2, 2, 9], [11] * 30, list(range(100, 103)),
           [(i * 37 + 11) % 500 for i in range(50)], [42, 17], list(range(200, 290, 3)), [7, 7, 1, 2, 3],
           [(i * 13 + 5) % 400 for i in range(21)], [99], list(range(300, 340))]


@pytest.mark.parametrize("shape", ["chain", "tree"])
@pytest.mark.parametrize("graphs", [False, True])
def test_greedy_with_a_draft_is_the_bf16_targets_own_at_batch(oracle_model_dir, shape, graphs):
    cfg = EngineConfig(device="cuda", dtype="bfloat16", page_size=16, cuda_graph=graphs, max_running=16,
                       batch_invariant=True)
    plain = Engine(oracle_model_dir / "target", config=cfg)
    assert all(getattr(w, "same_rows_unbounded", False) for w in (plain.model.lm_head.weight,))
    spec = Engine(oracle_model_dir / "target", draft=oracle_model_dir / "eagle3",
                  config=cfg.model_copy(update={"spec": SHAPES_SPEC[shape], "spec_policy": "fixed"}))
    params = SamplingParams(max_new_tokens=48, ignore_eos=True)
    want = [r.token_ids for r in plain.generate(PROMPTS, params)]
    assert [r.token_ids for r in spec.generate(PROMPTS, params)] == want
    assert spec.spec_stats.totals.verify_steps > 0 and spec.spec_stats.totals.accept_length > 1.2
    assert plain.is_idle_and_clean() and spec.is_idle_and_clean()
