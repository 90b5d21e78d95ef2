"""On two GPUs: tensor parallelism over NCCL, with CUDA graphs capturing the collectives, gives the greedy
output of one GPU without a split (tests/unit/engine/test_tensor_parallel.py is the same over gloo on the CPU).

Each rank runs on its own GPU (rank r on ``cuda:r``); the TP-1 reference runs on ``cuda:0`` in this process.
In float32, so that token-for-token equality is meaningful. With graphs on, each rank must have captured its
phases (collectives inside) and none may have fallen back to eager: a failed capture would still give the
right tokens, eagerly, and hide that the graphs do not hold the collectives.
"""

from __future__ import annotations

import pytest
import torch

from shared.sampling import SamplingParams
from tests.oracle_model import make_oracle_model
from tests.unit.engine.tp_ranks import engine_outputs, graphed_collectives, handoff_cached_from_one_rank, run_group

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")]

PROMPTS = [[5, 6, 7, 8, 9], list(range(3, 33)), [7]]
GREEDY = [SamplingParams(max_new_tokens=16, ignore_eos=True)] * len(PROMPTS)
CASES = [(kind, shape, page_size, 8) for kind in (None, "eagle", "eagle3", "mtp") for shape in ("chain", "tree")
         for page_size in (1, 16) if kind is not None or shape == "chain"]


@pytest.fixture(scope="module")
def oracle_root(tmp_path_factory):
    return str(make_oracle_model(tmp_path_factory.mktemp("tp-oracle"), seed=0, alpha=0.05))


def test_collectives_captured_in_a_cuda_graph_replay_on_new_inputs():
    """NCCL all-reduce and all-gather captured by ``PhaseGraphs`` (the communicator made by the group's warm-up)
    give on every replay what they give eagerly, on both ranks."""
    for r, rank in enumerate(run_group(2, graphed_collectives, "cuda", 5, device="cuda")):
        assert rank["failures"] == [] and rank["captured"] == [4], f"rank {r}: {rank}"
        assert rank["same"] == [True] * 5, f"rank {r}"


@pytest.mark.parametrize("graphs", [False, True])
def test_tp2_over_nccl_equals_one_gpu(oracle_root, graphs):
    ranks = run_group(2, engine_outputs, oracle_root, CASES, PROMPTS, GREEDY, "cuda", graphs, device="cuda")
    want = engine_outputs(None, oracle_root, CASES, PROMPTS, GREEDY, "cuda", graphs)
    for case in CASES:
        for r, rank in enumerate(ranks):
            got = rank[case]
            assert got["tokens"] == want[case]["tokens"], f"{case} rank {r}"
            assert got["finish"] == want[case]["finish"], f"{case} rank {r}"
            assert got["clean"] and got["kv_heads"] * 2 == want[case]["kv_heads"], case
            assert got["graph_failures"] == [], f"{case} rank {r}: {got['graph_failures']}"
            assert (got["graphs"] > 0) == graphs, f"{case} rank {r}: {got['graphs']} graphs captured"
            if case[0] is not None:  # drafts accepted (not compared: a near-tie among draft candidates may
                # fall the other way after the split's sums in another order; the output cannot)
                assert max(got["accept_length"]) > 1.2, f"{case} rank {r}: {got['accept_length']}"


CACHED_PAGE = 4
SHARED = [(i * 29 + 3) % 500 for i in range(22)]  # 5 whole pages and 2 tokens shared by the two prompts
CACHED_PROMPTS = [SHARED + [7, 8, 9, 10, 11], SHARED + [40, 41, 42]]


@pytest.mark.parametrize("topk,transport", [(1, "wire"), (4, "ipc")])
def test_a_tp2_decode_over_nccl_takes_the_pages_its_prefix_cache_holds(oracle_root, topk, transport):
    """Issue 33 on two GPUs: a TP-1 prefill on GPU 0 hands two prompts sharing 5 pages to a TP-2 decode engine with
    its prefix cache on (NCCL scatters, CUDA graphs on); the second takes the 5 pages on both ranks and is sent only
    the other 2 (ipc: written into rank 0's landing cache), the output and the bytes are TP 1's, each rank's K/V
    at every position is its heads of the prefill's, and after a flush every pool of both ranks is full."""
    args = (oracle_root, "eagle3", topk, transport, CACHED_PAGE, CACHED_PROMPTS, GREEDY[0], "cuda")
    ranks = run_group(2, handoff_cached_from_one_rank, *args, device="cuda")
    one = handoff_cached_from_one_rank(None, *args)
    want = [(q["tokens"], q["held"], q["sent"]) for q in one["requests"]]
    assert [q["held"] for q in one["requests"]] == [0, len(SHARED) // CACHED_PAGE]
    for r, rank in enumerate(ranks):
        got = [(q["tokens"], q["held"], q["sent"] if r == 0 else s) for q, (_, _, s) in zip(rank["requests"], want)]
        assert got == want, f"rank {r}"
        assert all(q["same_kv"] for q in rank["requests"] + one["requests"]), f"rank {r}: K/V not the prefill's"
        assert rank["cached"] == one["cached"] and rank["referenced"] == 0 and rank["clean"], f"rank {r}"
