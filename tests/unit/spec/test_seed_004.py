"""Seed 004: tree drafting (topk > 1) is lossless for page size 1 and 16, and every per-token output
of verification is compacted by the one accept index.

SGLang needed the accepted path moved to the front of each request's block (KV slots, tokens and
hidden states gathered by ``accept_index``, stride ``steps + 1`` rather than ``num_draft_tokens``)
and left side outputs uncompacted; it supports page size 1 only. Here, for every draft kind, with a
batch of three requests and trees whose accepted paths skip nodes (so compaction really moves or
remaps slots): after every decode step each request's target K/V and every draft cache's K/V at its
committed positions, its draft hidden state and first tree level equal a fresh by-hand prefill of
its committed tokens (the hidden states / features were gathered right); at the end tokens and
logprobs equal target-only greedy decoding (tokens and logprobs were gathered right).
"""

from __future__ import annotations

import pytest
import torch
from draft_reference import assert_matches_reference
from spec_helpers import KINDS, PROMPTS, assert_same_greedy

from shared.sampling import SamplingParams

BATCH = [PROMPTS[4], PROMPTS[0], PROMPTS[3]]
PARAMS = SamplingParams(max_new_tokens=20, ignore_eos=True)
TREES = {"k4s3n8": dict(topk=4, steps=3, ndt=8), "k2s5n16": dict(topk=2, steps=5, ndt=16)}


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("tree", list(TREES))
@pytest.mark.parametrize("kind", KINDS)
def test_tree_compaction(oracle_models, kind, tree, page_size):
    check_compaction(oracle_models, kind, tree, page_size)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("kind", KINDS)
def test_tree_compaction_cuda_graphs(oracle_models_cuda, kind, page_size):
    """On the GPU under CUDA graph replay: the Triton tree build, verify, accepted-path gather and KV
    move, inside captured phases."""
    check_compaction(oracle_models_cuda, kind, "k4s3n8", page_size, cuda_graph=True)


def check_compaction(models, kind, tree, page_size, **cfg):
    oracle_models = models
    spec = TREES[tree]
    engine = oracle_models.fixed(kind, **spec, page_size=page_size, chunk_size=None, **cfg)
    w = engine.speculator
    accepted_paths = []
    commit = w._commit

    def recording_commit(reqs, inp, out):  # every decode step's accepted paths, greedy or sampled
        accepted_paths.append(out.accept_index[:len(reqs)].cpu())
        return commit(reqs, inp, out)

    w._commit = recording_commit
    reqs = [engine.add_request(p, PARAMS) for p in BATCH]
    checks = 0
    while engine.scheduler.has_work():
        engine.step()
        for r in reqs:
            if r.finish_reason is None and r.draft_state is not None:
                assert_matches_reference(engine, r, f"{kind} {tree} page {page_size} {r.rid} at {r.kv_len}")
                checks += 1
    assert engine.is_idle_and_clean()
    assert_same_greedy([engine.result(r) for r in reqs], oracle_models.reference(BATCH, PARAMS), f"{kind} {tree}")
    paths = torch.cat(accepted_paths)
    assert paths.shape[1] == spec["steps"] + 1  # the stride of every gather
    depth = torch.arange(paths.shape[1])
    skipped = ((paths >= 0) & (paths != depth)).any(dim=1)
    assert skipped.sum() >= 3, "too few accepted paths that skip tree nodes: compaction was not exercised"
    assert ((paths >= 0).sum(1) >= 3).any(), "no run of two accepted drafts"
    assert checks >= 10
