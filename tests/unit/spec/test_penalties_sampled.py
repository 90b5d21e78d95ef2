"""Sampled speculative decoding with penalties and filters keeps the target's distribution.

The trained tiny pair (``models/tiny-pair``: its EAGLE-3 head is accepted often, so a verify commits
several tokens and the later ones are drawn from deeper tree nodes' logits) samples the first DEPTH
output tokens of a prompt that repeats itself, with temperature, presence, frequency and repetition
penalties, min_p and logit_bias all on. The committed sequences of 1500 seeded requests, for an
EAGLE-3 chain, an EAGLE-3 tree and the target alone (``slow``), must follow the exact law of target-only
sampling with the same parameters, computed independently: ``transformers`` runs the same checkpoint,
and ``reference_probs`` applies the documented penalties (vLLM's meanings) in plain Python.

The law is enumerated down to the sequences whose probability is at least ``5 / n`` (any sequence
that likely has all its prefixes that likely, so none is missed); each is a chi-square cell and the
rest of the mass one more. The joint law of the first k tokens, for each k, is one view; the views make
one test at P_MIN (Bonferroni). The second output token onwards depends on the output before it
(frequency and presence), so tokens 3 and 4, drawn at tree nodes below the root, are right only if
each node is penalised with its own path's tokens.

Negative control: the classic bug (every tree node penalised with the counts of the committed tokens
only, ``_tree_prefix`` skipped) must fail the same test. About a minute on an idle 2-core CPU, the
law's ``transformers`` forwards included; the ``gpu`` variants run the Triton acceptance kernels.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from scipy.stats import chisquare

from shared.config import EngineConfig, SpecConfig
from shared.engine import Engine
from shared.logits_process import logits_rows, process_logits
from shared.model.default_pair import trained_tiny_pair
from shared.sampling import SamplingParams, target_probs

P_MIN = 1e-3
DEPTH = 4  # output tokens compared: the first from prefill, the next three from speculative verification
N = 1500  # seeded requests per run
BATCH = 500  # requests per engine batch
PROMPT_TEXT = "import os\nimport sys\nimport re\nimport "
FEATURES = dict(temperature=1.5, presence_penalty=1.0, frequency_penalty=2.0, repetition_penalty=1.3, min_p=0.05)
LOGIT_BIAS = ((1054, -1.5), (492, 1.0))  # the pair's favourite first token down, a frequent fourth one up
SPECS = {"chain": SpecConfig(topk=1, steps=3, num_draft_tokens=4), "tree": SpecConfig(topk=2, steps=3,
                                                                                        num_draft_tokens=6)}


def reference_probs(logits: torch.Tensor, prompt: list[int], output: list[int], params: SamplingParams) -> torch.Tensor:
    """[V] float64 sampling distribution after ``output``, written from the documented meanings, apart
    from shared.logits_process: logit_bias added; a token of the prompt or the output divided by
    repetition_penalty when positive, multiplied when not; frequency_penalty subtracted per occurrence
    in the output and presence_penalty once; softmax at the temperature; tokens below min_p times the
    largest probability dropped."""
    z = logits.double().clone()
    for tok, bias in params.logit_bias:
        z[tok] += bias
    for tok in set(prompt) | set(output):
        z[tok] = z[tok] / params.repetition_penalty if z[tok] > 0 else z[tok] * params.repetition_penalty
    for tok, count in Counter(output).items():
        z[tok] -= params.frequency_penalty * count + params.presence_penalty
    p = torch.softmax(z / params.temperature, dim=0)
    p = torch.where(p >= params.min_p * p.max(), p, 0.0)
    return p / p.sum()


def test_reference_distribution_is_the_engine_one():
    """``process_logits`` then ``target_probs`` (what target-only sampling draws from) is
    ``reference_probs``, so the law below is target-only sampling's."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 50, generator=g) * 2
    prompts, outputs = [[1, 2, 3, 2], [7], [4, 4]], [[2, 9, 9, 30], [], [8, 4, 8]]
    params = [SamplingParams(temperature=t, presence_penalty=0.5, frequency_penalty=f, repetition_penalty=r,
                             min_p=m, logit_bias=((9, 1.5), (11, -2.0)))
              for t, f, r, m in [(1.5, 1.0, 1.3, 0.05), (0.7, -0.5, 0.8, 0.2), (1.0, 2.0, 2.0, 0.0)]]
    rows = logits_rows(prompts, outputs, params, [()] * 3, 50, 3, "cpu")
    got = target_probs(process_logits(logits.unsqueeze(1), rows).squeeze(1), params)
    for b in range(3):
        want = reference_probs(logits[b], prompts[b], outputs[b], params[b])
        assert torch.allclose(got[b].double(), want, atol=1e-6), b


@pytest.fixture(scope="module")
def pair():
    found = trained_tiny_pair()
    assert found is not None, "models/tiny-pair is part of the repository"
    return found


@pytest.fixture(scope="module")
def prompt(pair) -> list[int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(pair.target / "tokenizer.json")).encode(PROMPT_TEXT).ids


@pytest.fixture(scope="module")
def params() -> SamplingParams:
    """Every feature on."""
    return SamplingParams(**FEATURES, logit_bias=LOGIT_BIAS, max_new_tokens=DEPTH, ignore_eos=True)


@pytest.fixture(scope="module")
def law(pair, prompt, params) -> list[dict[tuple, float]]:
    return exact_law(pair, prompt, params)


def exact_law(pair, prompt: list[int], params: SamplingParams) -> list[dict[tuple, float]]:
    """Per k = 1..DEPTH, every sequence of k output tokens whose probability is at least 5 / N, with its
    probability under target-only sampling (``transformers`` logits, ``reference_probs``)."""
    import transformers  # a test dependency: a missing one fails here, never skips

    hf = transformers.LlamaForCausalLM.from_pretrained(pair.target, dtype=torch.float32).eval()
    floor = 5 / N
    levels, frontier = [], {(): 1.0}
    for _ in range(DEPTH):
        prefixes = list(frontier)
        width = len(prompt) + len(prefixes[0])
        with torch.no_grad():
            ids = torch.tensor([prompt + list(p) for p in prefixes]).view(len(prefixes), width)
            last = hf(ids).logits[:, -1]
        level = {}
        for pre, row in zip(prefixes, last):
            probs = reference_probs(row, prompt, list(pre), params) * frontier[pre]
            for tok in (probs >= floor).nonzero().flatten().tolist():
                level[pre + (tok,)] = float(probs[tok])
        levels.append(level)
        frontier = level
    return levels


def chi_square_p(observed: Counter, cells: dict[tuple, float], n: int) -> float:
    """p-value of ``observed`` (n outcomes) against ``cells`` (outcome: probability, every outcome of
    probability >= 5 / n) plus one cell for all other outcomes; a rest cell expected below 5 is merged
    into the least likely listed cell."""
    obs = [observed.get(k, 0) for k in cells]
    exp = [p * n for p in cells.values()]
    rest_obs, rest_exp = n - sum(obs), n - sum(exp)
    if rest_exp >= 5:
        obs.append(rest_obs)
        exp.append(rest_exp)
    else:
        i = exp.index(min(exp))
        obs[i] += rest_obs
        exp[i] += max(rest_exp, 0.0)
    assert len(obs) >= 2, "too few cells for a meaningful test"
    scale = sum(obs) / sum(exp)  # float rounding only
    return float(chisquare(obs, [e * scale for e in exp]).pvalue)


def sample(pair, prompt: list[int], params: SamplingParams, shape: str | None, **cfg) -> list:
    """N seeded requests (seed i for request i) on an engine with the ``shape`` tree (None: target only)."""
    config = EngineConfig(page_size=4, max_running=BATCH, max_context=64, chunk_size=None,
                          spec=SPECS[shape] if shape else None, **cfg)
    engine = Engine(pair.target, pair.eagle3 if shape else None, config)
    out = []
    for start in range(0, N, BATCH):
        seeded = [params.model_copy(update={"seed": s}) for s in range(start, start + BATCH)]
        out += engine.generate([prompt] * BATCH, seeded)
        assert engine.is_idle_and_clean()
    return out


def pvalues(results: list, law: list[dict[tuple, float]]) -> dict[int, float]:
    """Per k, the p-value of the first k output tokens against the law."""
    seqs = [tuple(r.token_ids) for r in results]
    assert all(len(s) == DEPTH for s in seqs)
    return {k: chi_square_p(Counter(s[:k] for s in seqs), law[k - 1], len(seqs)) for k in range(1, DEPTH + 1)}


def accepted_runs(results: list) -> int:
    """Requests that accepted two drafts or more: their tokens 3 and 4 came from nodes below the root."""
    return sum(r.spec_stats["accepted_drafts"] >= 2 for r in results)


@pytest.mark.parametrize("shape", [*SPECS, pytest.param(None, marks=pytest.mark.slow, id="target-only")])
def test_sampled_output_with_penalties_follows_the_target_only_law(pair, prompt, params, law, shape):
    results = sample(pair, prompt, params, shape)
    p = pvalues(results, law)
    print(f"{shape}: chi-square p of the first k tokens " + ", ".join(f"k={k} {v:.3g}" for k, v in p.items())
          + (f"; {accepted_runs(results)} requests accepted two drafts or more" if shape else ""))
    assert min(p.values()) * DEPTH > P_MIN, p
    if shape is not None:
        assert accepted_runs(results) > N / 10, "few tokens were drawn below the root: the test proves little"


def test_negative_control_penalising_every_node_with_the_committed_counts_fails(pair, prompt, params, law,
                                                                               monkeypatch):
    """Every tree node penalised as if its path were not there (the counts of the committed tokens only):
    the same test rejects it."""
    import shared.logits_process as lp

    monkeypatch.setattr(lp, "_tree_prefix", lambda out, *rest: out)
    p = pvalues(sample(pair, prompt, params, "tree"), law)
    print(f"tree without the nodes' own prefixes: chi-square p {p}")
    assert min(p.values()) * DEPTH < P_MIN, p


@pytest.mark.gpu
@pytest.mark.parametrize("shape", list(SPECS))
def test_sampled_output_with_penalties_follows_the_target_only_law_on_the_gpu(pair, prompt, params, law, shape):
    """The same on CUDA: the Triton acceptance kernels, graphs on (a penalised batch replays the verify and
    extend graphs, processed between them)."""
    results = sample(pair, prompt, params, shape, device="cuda", dtype="float32", cuda_graph=True)
    p = pvalues(results, law)
    print(f"{shape} on the GPU: chi-square p " + ", ".join(f"k={k} {v:.3g}" for k, v in p.items()))
    assert min(p.values()) * DEPTH > P_MIN, p
    assert accepted_runs(results) > N / 10
