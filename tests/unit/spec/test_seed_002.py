"""Seed 002: draft steps run at computed positions, and their logits are those of a direct forward.

SGLang advanced ``positions`` in place before the forward (draft step i ran at p+1 for a token at
p) and had to undo the additions around CUDA graph capture. Here, for every draft kind and a few
decode steps of a batch of three requests, each draft-loop forward is compared with a by-hand draft
forward (fresh caches, positions written out): for a chain, step i of a request with committed
length L runs at position L + i, feeds the token the previous step chose, runs on the cache of that
step, and gives the same logits; for a tree, every first-level leaf runs at L; after every step the
caches, hidden state and first tree level equal the by-hand ones. Eagerly, with the graph padding
path (batch 3 padded to 4 rows, on the CPU), and under real CUDA graph replay (GPU: there the chain's
tokens, argmaxes of the loop's logits, are compared, since the logits stay inside the graph).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from draft_reference import DraftCalls, assert_matches_reference, reference_chain, reference_extend
from spec_helpers import KINDS, PROMPTS, SMALL

from shared.batch import build_forward_batch
from shared.config import EngineConfig, SpecConfig
from shared.engine import Engine
from shared.sampling import SamplingParams

BATCH = [PROMPTS[2], PROMPTS[4], PROMPTS[3]]  # 7, 18 and 37 tokens
PARAMS = SamplingParams(max_new_tokens=14, ignore_eos=True)


class Recording:
    """Wraps a phase's graphs: records what each call returned (the draft tree)."""

    def __init__(self, graphs, out: list):
        self._graphs, self._out = graphs, out

    def __getattr__(self, name):
        return getattr(self._graphs, name)

    def __call__(self, *args):
        result = self._graphs(*args)
        self._out.append(result)
        return result


def decode_and_compare(engine: Engine, max_steps: int = 3) -> int:
    """Prefill the batch, then compare the draft loop with the reference on up to ``max_steps``
    decode steps that run every request; returns the number of loop forwards checked."""
    w = engine.spec
    k, steps = w.spec.topk, w.spec.steps
    reqs = [engine.add_request(p, PARAMS) for p in BATCH]
    while any(r.draft_state is None for r in reqs):
        engine.step()
    replayed = w.graphs["draft"].capture  # real CUDA graphs: Python hooks do not run on replay
    trees = []
    w.graphs["draft"] = Recording(w.graphs["draft"], trees)
    checked = 0
    for step in range(max_steps):
        live = [r for r in reqs if r.finish_reason is None]
        if len(live) < len(reqs):
            break
        states = [(r.all_ids[:r.draft_state.committed_len], r.draft_state.bonus_token) for r in reqs]
        with DraftCalls(engine) as calls:
            engine.step()
        for r in reqs:  # what the extend left (under replay too): K/V, hidden state, first tree level
            if r.finish_reason is None:
                assert_matches_reference(engine, r, f"after decode step {step}")
        loop = calls.loop()
        if replayed:  # the graph ran: no forward was seen from Python, only the tree it output
            assert step == 0 or not loop, "a captured step ran eagerly"
        else:
            assert len(loop) == steps - 1
        for b, (committed, bonus) in enumerate(states):
            L = len(committed)
            ref = reference_extend(engine, committed, bonus)
            if replayed:
                chain = reference_chain(engine, ref)
                assert trees[-1].tokens[b, 1:steps].tolist() == [s.token for s in chain], "chain under replay"
                checked += len(chain)
            elif k == 1:
                for i, (call, want) in enumerate(zip(loop, reference_chain(engine, ref))):
                    assert call.cache_index == want.cache_index
                    assert int(call.positions[b]) == L + i == want.position, "draft step position"
                    assert int(call.input_ids[b]) == want.token, f"draft step {i} token"
                    err = (call.logits[b].float() - want.logits.float()).abs().max().item()
                    assert err < 1e-4, f"draft step {i} of request {b}: logits differ by {err:.2e}"
                    checked += 1
            else:
                first = loop[0]
                leaves = torch.softmax(ref.logits, -1).topk(k).indices
                cache, row = ref._caches[first.cache_index]
                for m in range(k):
                    token = int(w.draft.to_target_ids(leaves[m].view(1)))
                    r = b * k + m
                    assert int(first.positions[r]) == L and int(first.input_ids[r]) == token
                    batch = build_forward_batch(cache, [row], [L], [1], torch.tensor([token]), torch.tensor([L]),
                                                torch.tensor([L]))
                    want = w.draft(batch, cache, first.cache_index, ref.hidden.view(1, -1), from_target=False)
                    err = (first.logits[r].float() - want.logits[0].float()).abs().max().item()
                    assert err < 1e-4, f"leaf {m} of request {b}: logits differ by {err:.2e}"
                    checked += 1
    engine.run_until_done()
    assert engine.is_idle_and_clean()
    return checked


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "padded"])
@pytest.mark.parametrize("kind", KINDS)
def test_chain_draft_logits_equal_a_direct_forward(oracle_models, kind, graphs):
    engine = oracle_models.engine(kind, topk=1, steps=4, page_size=4, chunk_size=16, cuda_graph=graphs)
    assert engine.spec.graphs["draft"].bucket(3) == (4 if graphs else None)
    assert decode_and_compare(engine) == 3 * 3 * 3


@pytest.mark.parametrize("kind", KINDS)
def test_tree_first_level_logits_equal_a_direct_forward(oracle_models, kind):
    engine = oracle_models.engine(kind, topk=3, steps=2, ndt=6, page_size=1, chunk_size=None)
    assert decode_and_compare(engine, max_steps=2) == 2 * 3 * 3


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
def test_under_cuda_graph_replay(oracle_model_dir, kind):
    """Real CUDA graphs: the draft, verify and extend phases are captured, then replayed. The loop's
    logits stay inside the graph, so the chain it proposed is compared (its tokens are the argmax of
    those logits), and the continuous outputs of the replayed extend (draft K/V, hidden state, first
    tree level) are compared after every step, with the target K/V the replayed verify wrote."""
    root = Path(oracle_model_dir)
    config = EngineConfig(**SMALL, device="cuda", page_size=4, chunk_size=16, cuda_graph=True,
                          spec=SpecConfig(topk=1, steps=4, num_draft_tokens=5))
    engine = Engine(root / "target", root / kind, config)
    assert decode_and_compare(engine) == 3 * 3 * 3
    assert engine.spec.graphs["draft"]._graphs, "no graph was captured"
