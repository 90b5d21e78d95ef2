"""On two GPUs: tensor parallelism over NCCL, with CUDA graphs capturing the collectives, gives the greedy
output of one GPU without a split (tests/unit/engine/test_tensor_parallel.py is the same over gloo on the CPU).

Each rank runs on its own GPU (rank r on ``cuda:r``); the TP-1 reference runs on ``cuda:0`` in this process.
In float32, so that token-for-token equality is meaningful.
"""

from __future__ import annotations

import pytest
import torch

from shared.sampling import SamplingParams
from tests.oracle_model import make_oracle_model
from tests.unit.engine.tp_ranks import engine_outputs, run_group

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")]

PROMPTS = [[5, 6, 7, 8, 9], list(range(3, 33)), [7]]
GREEDY = [SamplingParams(max_new_tokens=16, ignore_eos=True)] * len(PROMPTS)
CASES = [(kind, shape, page_size, 8) for kind in (None, "eagle", "eagle3", "mtp") for shape in ("chain", "tree")
         for page_size in (1, 16) if kind is not None or shape == "chain"]


@pytest.mark.parametrize("graphs", [False, True])
def test_tp2_over_nccl_equals_one_gpu(tmp_path, graphs):
    root = str(make_oracle_model(tmp_path / "oracle", seed=0, alpha=0.05))
    ranks = run_group(2, engine_outputs, root, CASES, PROMPTS, GREEDY, "cuda", graphs, device="cuda")
    want = engine_outputs(None, root, CASES, PROMPTS, GREEDY, "cuda", graphs)
    for case in CASES:
        for r, rank in enumerate(ranks):
            got = rank[case]
            assert got["tokens"] == want[case]["tokens"], f"{case} rank {r}"
            assert got["clean"] and got["kv_heads"] * 2 == want[case]["kv_heads"], case
