"""A tensor-parallel service in the stack: router -> prefill -> decode with one of the two split over two gloo
ranks (the service is rank 0, its follower a process it started), over each hand-off transport.

Greedy output equals the single-process engine's; the hand-off crosses between groups of different sizes (a
TP-2 prefill gathers every KV head on rank 0 as its prompt's pages complete; a TP-2 decode receives them on
rank 0, over ipc written in place into its landing cache, and gives each rank its heads); every pool is full
again afterwards (the landing cache's too); the follower ends with its service.
"""

from __future__ import annotations

import pytest

from services.followers import Leader
from shared.config import EngineConfig, SpecConfig
from shared.engine import Engine
from shared.sampling import SamplingParams
from tests.e2e.conftest import start_stack

PROMPTS = [[5, 17, 33, 2, 9], [(i * 37 + 11) % 500 for i in range(30)]]  # shorter than a chunk, several chunks
NEW, CHUNK, MAX_CONTEXT = 12, 8, 64
SPEC = SpecConfig(topk=2, steps=3, num_draft_tokens=6)
CASES = [("prefill", "grpc-stream"), ("prefill", "ipc"), ("decode", "grpc-stream"), ("decode", "ipc")]


@pytest.fixture(scope="module")
def single(oracle_model_dir):
    engine = Engine(oracle_model_dir / "target", oracle_model_dir / "eagle3",
                    EngineConfig(page_size=4, chunk_size=CHUNK, spec=SPEC, max_context=MAX_CONTEXT, max_running=4))
    return [r.token_ids for r in engine.generate(PROMPTS, SamplingParams(max_new_tokens=NEW, ignore_eos=True))]


@pytest.mark.parametrize("split, transport", CASES, ids=[f"tp2-{s}-{t}" for s, t in CASES])
def test_a_tp2_service_in_the_stack_gives_the_single_engines_greedy_output(redis_url, oracle_model_dir, single,
                                                                           split, transport):
    tp2 = {"tensor_parallel": 2}
    stack = start_stack(redis_url, oracle_model_dir, "eagle3", page_size=4, chunk_size=CHUNK, spec_topk=SPEC.topk,
                        spec_steps=SPEC.steps, spec_draft_tokens=SPEC.num_draft_tokens, max_context=MAX_CONTEXT,
                        max_running=4, transport=transport, spec_policy="fixed",  # it asserts verify steps ran
                        prefill_extra=tp2 if split == "prefill" else None,
                        decode_extra=tp2 if split == "decode" else None)
    service = (stack.prefills if split == "prefill" else stack.decodes)[0]
    leader = service.engine_loop.engine
    try:
        assert isinstance(leader, Leader) and leader.engine.runner.tp.size == 2
        assert [p.is_alive() for p in leader.ranks] == [True]
        for prompt, want in zip(PROMPTS, single):
            tokens, finish = stack.generate(prompt, max_new_tokens=NEW, ignore_eos=True)
            assert tokens == want
            assert finish.reason == "length" and finish.spec.verify_steps > 0
        assert stack.wait_clean()
        assert leader.broken is None
    finally:
        stack.stop()
    assert [p.exitcode for p in leader.ranks] == [0], "the follower did not end with its service"
