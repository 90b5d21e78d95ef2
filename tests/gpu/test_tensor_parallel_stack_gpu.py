"""On two GPUs: a tensor-parallel service in the stack (router -> prefill -> decode), NCCL between its ranks,
CUDA graphs on, gives the greedy output of one engine on one GPU (tests/e2e/test_tensor_parallel_stack.py is the
same over gloo on the CPU).

A TP-2 prefill on GPUs 0-1 hands off to a TP-1 decode on GPU 0 over CUDA IPC (rank 0's gathered pages written
into the decode pools on its own GPU); a TP-1 prefill on GPU 0 hands off to a TP-2 decode on GPUs 0-1 over the
gRPC stream (rank 0 scatters each rank its heads over NCCL). Small fixed pools, so that two engines share GPU 0.
Float32, so that token-for-token equality is meaningful.
"""

from __future__ import annotations

import pytest
import torch

from services.followers import Leader
from shared.config import EngineConfig, SpecConfig
from shared.engine import Engine
from shared.sampling import SamplingParams
from tests.e2e.conftest import redis_url as redis_url  # noqa: F401 (a fixture)
from tests.e2e.conftest import start_stack

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")]

PROMPTS = [[5, 17, 33, 2, 9], [(i * 37 + 11) % 500 for i in range(30)]]
NEW, CHUNK, MAX_CONTEXT = 16, 8, 64
SPEC = SpecConfig(topk=2, steps=3, num_draft_tokens=6)
ENGINE = dict(device="cuda:0", dtype="float32", page_size=16, chunk_size=CHUNK, max_context=MAX_CONTEXT, max_running=4,
              num_pages=64, cuda_graph=True)
CASES = [("prefill", "ipc"), ("decode", "grpc-stream")]


@pytest.fixture(scope="module")
def single(oracle_model_dir):
    config = EngineConfig(**ENGINE, spec=SPEC)
    engine = Engine(oracle_model_dir / "target", oracle_model_dir / "eagle3", config)
    return [r.token_ids for r in engine.generate(PROMPTS, SamplingParams(max_new_tokens=NEW, ignore_eos=True))]


@pytest.mark.parametrize("split, transport", CASES, ids=[f"tp2-{s}-{t}" for s, t in CASES])
def test_a_tp2_service_over_nccl_in_the_stack_gives_one_gpus_greedy_output(redis_url, oracle_model_dir,  # noqa: F811
                                                                           single, split, transport):
    tp2 = {"tensor_parallel": 2}
    stack = start_stack(redis_url, oracle_model_dir, "eagle3", spec_topk=SPEC.topk, spec_steps=SPEC.steps,
                        spec_draft_tokens=SPEC.num_draft_tokens, transport=transport, **ENGINE,
                        spec_policy="fixed",  # it asserts verify steps ran (adaptive follows timed costs)
                        prefill_extra=tp2 if split == "prefill" else None,
                        decode_extra=tp2 if split == "decode" else None)
    service = (stack.prefills if split == "prefill" else stack.decodes)[0]
    leader = service.engine_loop.engine
    try:
        assert isinstance(leader, Leader) and leader.engine.runner.tp.size == 2
        assert leader.engine.graph_failures == []
        for prompt, want in zip(PROMPTS, single):
            tokens, finish = stack.generate(prompt, max_new_tokens=NEW, ignore_eos=True, timeout=120)
            assert tokens == want
            assert finish.reason == "length" and finish.spec.verify_steps > 0
        assert stack.wait_clean()
        assert leader.broken is None and leader.engine.graph_failures == []
    finally:
        stack.stop()
    assert [p.exitcode for p in leader.ranks] == [0], "the follower did not end with its service"
