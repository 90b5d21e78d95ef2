"""On the GPU, at Llama-3's vocabulary (128256): the sampled-verification kernels against their torch
references (kernels/spec_sampling.py), over many seeds, bit for bit where the contract is integer.

The float walk these replace failed once here (seed 1341017230: bonus 68449 from the kernel, 68450
from the reference, an inverse-CDF draw on a boundary that two summation orders put on different
sides). Fresh inputs every run (seeded from the clock, printed on failure), destinations poisoned.
"""

from __future__ import annotations

import pytest
import torch

from kernels.spec_sampling import SamplingRows, target_weights, thresholds_ref, tree_verify, tree_verify_ref
from tests.gpu.gpu_checks import poison_allocator, seeded_generator

pytestmark = pytest.mark.gpu

VOCAB = 128256
SETTINGS = [(0.0, 0, 1.0), (0.8, 0, 1.0), (1.0, 50, 1.0), (1.0, 0, 0.9), (0.7, 40, 0.95), (1.3, 0, 0.5),
            (0.6, 1, 1.0), (1.0, 0, 1e-4)]  # (temperature, top_k, top_p); greedy first


@pytest.fixture
def gen():
    return seeded_generator()


def random_rows(gen, B: int) -> SamplingRows:
    pick = torch.arange(B, device="cuda") % len(SETTINGS)
    t, k, p = (torch.tensor([s[i] for s in SETTINGS], device="cuda")[pick] for i in range(3))
    return SamplingRows(temperature=t.float(), top_k=k.long(), top_p=p.float(),
                        seed=torch.randint(-2**63, 2**63 - 1, (B,), device="cuda", generator=gen))


def random_tree(gen, B: int, n: int, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Parents: each node hangs from an earlier node of depth < steps; tokens: random, with a few
    repeated siblings."""
    parents = torch.full((B, n), -1, dtype=torch.int64, device="cuda")
    depth = torch.zeros(B, n, dtype=torch.int64, device="cuda")
    for i in range(1, n):
        weight = (depth[:, :i] < steps).float()
        parents[:, i] = torch.multinomial(weight, 1, generator=gen).squeeze(1)
        depth[:, i] = depth.gather(1, parents[:, i:i + 1]).squeeze(1) + 1
    tokens = torch.randint(0, VOCAB, (B, n), device="cuda", generator=gen)
    same = torch.rand(B, n, device="cuda", generator=gen) < 0.1
    tokens[:, 2:] = torch.where(same[:, 2:], tokens[:, 1:-1], tokens[:, 2:])
    return parents, tokens


def target_logits(gen, parents, tokens, boost: float) -> torch.Tensor:
    B, n = tokens.shape
    logits = torch.randn(B, n, VOCAB, device="cuda", generator=gen) * 3
    rows = torch.arange(B, device="cuda").unsqueeze(1).expand(B, n - 1)
    logits[rows, parents[:, 1:], tokens[:, 1:]] += boost  # children likely: accepts happen
    return logits


def test_target_weights_match_reference(gen):
    B, n = 24, 6
    parents, tokens = random_tree(gen, B, n, 5)
    logits = target_logits(gen, parents, tokens, 12.0)
    rows = random_rows(gen, B)
    poison_allocator()
    out = target_weights(logits, rows)
    sampled = rows.temperature > 0
    z = logits.float() / torch.where(sampled, rows.temperature, 1.0).view(B, 1, 1)
    torch.testing.assert_close(out.weights[sampled], torch.exp(z - z.amax(-1, keepdim=True))[sampled],
                               rtol=1e-5, atol=1e-7)
    ref = thresholds_ref(out.weights, rows)  # the integer half, given the kernel's weights: exactly
    assert torch.equal(out.thresh[sampled], ref.thresh[sampled]) and torch.equal(out.total[sampled], ref.total[sampled])
    assert not bool(out.thresh[~sampled].any() or out.total[~sampled].any())


@pytest.mark.parametrize("B,n,steps", [(200, 6, 5), (200, 16, 5), (50, 64, 6)])
def test_tree_verify_matches_reference_over_many_seeds(gen, B, n, steps):
    """20 rounds of B requests (seeds), each row its own sampling settings; every accept index, length
    and bonus token equal."""
    rounds = 20
    parents, tokens = random_tree(gen, B, n, steps)
    logits = target_logits(gen, parents, tokens, 10.0)
    rows = random_rows(gen, B)
    tw = target_weights(logits, rows)
    argmax = logits.argmax(-1)
    accepted = 0
    for r in range(rounds):
        rows.seed = torch.randint(-2**63, 2**63 - 1, (B,), device="cuda", generator=gen)
        L = torch.randint(0, 1 << 20, (B,), device="cuda", generator=gen)
        poison_allocator(1 << 28)
        out = tree_verify(tw, argmax, parents, tokens, rows, L, steps)
        ref = tree_verify_ref(tw, argmax, parents, tokens, rows, L, steps)
        for f in ("accept_index", "accept_len", "bonus"):
            bad = (getattr(out, f) != getattr(ref, f)).view(B, -1).any(1).nonzero().flatten().tolist()
            assert not bad, f"round {r}, {f} differs at rows {bad[:5]}"
        accepted += int((out.accept_len > 1).sum())
    assert accepted > B * rounds // 10
