"""Seed 002: draft steps run at computed positions, and their logits are those of a direct forward.

SGLang advanced ``positions`` in place before the forward (draft step i ran at p+1 for a token at
p) and had to undo the additions around CUDA graph capture. Here, for every draft kind, for a chain
and for a tree, over a few decode steps of a batch of three requests of different lengths, EVERY
forward of the draft loop (every draft step, i.e. every tree depth, every leaf) is compared with a
by-hand draft forward (fresh caches, positions written out, nothing from shared/spec): forward i of a
request with committed length L runs at position L + i on the cache of draft step i + 1, feeds the
token of its leaf, sees the committed prefix and its own ancestors, starts from its parent's hidden
state, and gives the same logits. The leaves are grown by hand too (EAGLE-2: children scored by the
path probability, the best ``topk`` expanded next), so every tree depth is reached along the paths
the loop really took. After every step the caches, hidden state and first tree level equal the
by-hand ones. Eagerly, with the graph padding path (batch 3 padded to 4 rows, on the CPU), and under
real CUDA graph replay (GPU: there the chain's tokens, argmaxes of the loop's logits, are compared,
since the logits stay inside the graph).

Both ends of acceptance run: the oracle drafts (accepted often, so committed lengths advance by
several tokens per step; checked) and random drafts (rejected, so every request advances by one).
The drafts' outputs depend on the position: every compared forward, computed by hand at L + i + 1
(SGLang's bug) instead of L + i, differs from the right one by far more than the tolerance. That
holds for every random head (EAGLE-3's with its reduced vocabulary included) and for the oracle
EAGLE and multi-layer heads; the oracle EAGLE-3 head attends (saturated) only to the current token,
so its output does not depend on the position and that one check is not asked of it. A negative
control runs the engine with the draft loop's positions shifted by one and checks that the logits
comparison alone (not only the position check) fails, at every compared forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from draft_reference import DraftCalls, Reference, assert_matches_reference, reference_extend
from spec_helpers import KINDS, PROMPTS, SMALL, Models

import shared.spec.phases as phases
from shared.config import EngineConfig, SpecConfig
from shared.engine import Engine
from shared.forward_batch import build_forward_batch
from shared.sampling import SamplingParams

BATCH = [PROMPTS[2], PROMPTS[4], PROMPTS[3]]  # 7, 18 and 37 tokens
PARAMS = SamplingParams(max_new_tokens=14, ignore_eos=True)
TOL = 1e-4  # loop logits vs the by-hand forward (float32 noise)
POSITION_MATTERS = 1e-2  # the same forward one position off must differ by at least this much
SHAPES = {"chain": dict(topk=1, steps=4), "tree": dict(topk=3, steps=4, ndt=10)}


@pytest.fixture(scope="module")
def models(random_models, oracle_models) -> dict[str, Models]:
    return {"random": random_models, "oracle": oracle_models}


# ---- the by-hand draft loop ----------------------------------------------------------------------
@dataclass
class LeafForward:
    path: list[int]  # target ids from the first tree level down to this leaf (the token fed last)
    position: int
    cache_index: int
    logits: torch.Tensor  # [Vd]
    wrong_position_logits: torch.Tensor | None  # the same forward at position + 1 (SGLang's bug)


def path_forward(engine: Engine, ref: Reference, path: list[int], shift: int = 0):
    """The draft forwards along one root-to-leaf path: forward j feeds path[j] at position L + j
    (+ ``shift``) on the cache of draft step j + 1, where it sees the committed prefix and the path's
    earlier forwards on that cache (written after the prefix), starting from the hidden state of
    the last committed position and then its parent's. Returns the last forward's output."""
    draft = engine.speculator.draft
    L = ref.L
    hidden = ref.hidden.view(1, -1)
    written: dict[int, int] = {}
    for j, token in enumerate(path):
        c = draft.cache_for_step(j + 1) if draft.kind == "mtp" else 0
        cache, row = ref._caches[c]
        n = written.get(c, 0)
        batch = build_forward_batch(cache, [row], [L + n], [1], torch.tensor([token]),
                                    torch.tensor([L + j + shift]), torch.tensor([L + n]))
        out = draft(batch, cache, c, hidden, from_target=False)
        written[c] = n + 1
        hidden = out.hidden
    return out


def reference_loop(engine: Engine, ref: Reference, wrong_positions: bool = True) -> list[list[LeafForward]]:
    """Per draft-loop forward i (0 .. steps - 2), its ``topk`` leaves in the loop's order: leaves of
    forward 0 are the first tree level (top-k of the extend's logits); the leaves of forward i + 1
    are the best ``topk`` children of forward i's leaves by path probability."""
    w = engine.speculator
    draft, k = w.draft, w.spec.topk
    p, ids = torch.softmax(ref.logits.float(), -1).topk(k)
    leaves = [([int(t)], s) for t, s in zip(draft.to_target_ids(ids).tolist(), p)]
    out = []
    for i in range(w.spec.steps - 1):
        c = draft.cache_for_step(i + 1) if draft.kind == "mtp" else 0
        forwards = []
        for path, _ in leaves:
            logits = path_forward(engine, ref, path).logits[0].clone()
            wrong = path_forward(engine, ref, path, shift=1).logits[0].clone() if wrong_positions else None
            forwards.append(LeafForward(path, ref.L + i, c, logits, wrong))
        out.append(forwards)
        child_p, child = torch.softmax(torch.stack([f.logits.float() for f in forwards]), -1).topk(k, dim=-1)
        scores = (torch.stack([s for _, s in leaves]).unsqueeze(1) * child_p).view(-1)
        child = draft.to_target_ids(child).view(-1).tolist()
        leaves = [(leaves[b // k][0] + [child[b]], scores[b]) for b in scores.topk(k).indices.tolist()]
    return out


class Recording:
    """Wraps a phase's graphs: records the draft tree's tokens each call returned, copied at once (a
    replayed graph returns its static buffers, which the next replay, e.g. a draft launched ahead,
    overwrites)."""

    def __init__(self, graphs, out: list):
        self._graphs, self._out = graphs, out

    def __getattr__(self, name):
        return getattr(self._graphs, name)

    def __call__(self, *args):
        result = self._graphs(*args)
        self._out.append(result.tokens.clone())
        return result


@dataclass
class Checked:
    forwards: int = 0  # loop forwards (one leaf of one request) compared
    depths: set | None = None  # draft steps (tree depths) reached
    max_err: float = 0.0  # loop logits vs by hand, over every compared forward
    min_err: float = float("inf")
    min_position_effect: float = float("inf")  # by hand at L + i vs at L + i + 1
    position_mismatches: int = 0
    token_mismatches: int = 0
    advances: list | None = None  # committed tokens per request per compared decode step


def decode_and_compare(engine: Engine, max_steps: int = 3, wrong_positions: bool = True) -> Checked:
    """Prefill the batch, then compare the draft loop with the by-hand loop on up to ``max_steps``
    decode steps that run every request. Returns what was compared; positions, tokens and caches are
    asserted here, logits errors returned (the negative control needs them)."""
    w = engine.speculator
    k, steps = w.spec.topk, w.spec.steps
    reqs = [engine.add_request(p, PARAMS) for p in BATCH]
    while any(r.draft_state is None for r in reqs):
        engine.step()
    replayed = w.graphs["draft"].capture  # real CUDA graphs: Python hooks do not run on replay
    trees = []
    w.graphs["draft"] = Recording(w.graphs["draft"], trees)
    got = Checked(depths=set(), advances=[])
    for step in range(max_steps):
        if any(r.finish_reason is not None for r in reqs):
            break
        states = [(r.all_ids[:r.draft_state.committed_len], r.draft_state.bonus_token) for r in reqs]
        recorded, used_ahead = len(trees), w.ahead.used
        with DraftCalls(engine) as calls:
            got.advances += [len(toks) for _, toks in engine.step()]
        # The tree this step verified: drafted during the step, or (drafting ahead, on by default on
        # the GPU) during the last one, from the same committed states; a draft launched ahead for the
        # next step may follow it.
        tree = trees[recorded - 1] if w.ahead.used > used_ahead else trees[recorded] if replayed else None
        for r in reqs:  # what the extend left (under replay too): K/V, hidden state, first tree level
            if r.finish_reason is None:
                assert_matches_reference(engine, r, f"after decode step {step}")
        loop = calls.loop()
        if replayed:  # the graph ran: no forward was seen from Python, only the tree it output
            assert step == 0 or not loop, "a captured step ran eagerly"
        else:
            assert len(loop) == steps - 1
        for b, (committed, bonus) in enumerate(states):
            ref = reference_extend(engine, committed, bonus)
            by_hand = reference_loop(engine, ref, wrong_positions and not replayed)
            if replayed:  # a chain: its tokens are the argmaxes of the loop's logits
                assert tree[b, 1:steps].tolist() == [f[0].path[-1] for f in by_hand], "chain under replay"
                got.forwards += len(by_hand)
                continue
            for i, (call, leaves) in enumerate(zip(loop, by_hand)):
                assert call.cache_index == leaves[0].cache_index, f"draft step {i} ran on the wrong cache"
                for m, want in enumerate(leaves):
                    r = b * k + m
                    got.position_mismatches += int(call.positions[r]) != want.position
                    got.token_mismatches += int(call.input_ids[r]) != want.path[-1]
                    err = (call.logits[r].float() - want.logits.float()).abs().max().item()
                    got.max_err, got.min_err = max(got.max_err, err), min(got.min_err, err)
                    if want.wrong_position_logits is not None:
                        effect = (want.wrong_position_logits.float() - want.logits.float()).abs().max().item()
                        got.min_position_effect = min(got.min_position_effect, effect)
                    got.forwards += 1
                    got.depths.add(i)
    engine.run_until_done()
    assert engine.is_idle_and_clean()
    return got


def make_engine(models: Models, kind: str, shape: str, graphs: bool = False) -> Engine:
    s = SHAPES[shape]
    return models.fixed(kind, s["topk"], s["steps"], s.get("ndt"), page_size=4 if shape == "chain" else 1,
                         chunk_size=16 if shape == "chain" else None, cuda_graph=graphs)


def forwards_per_step(shape: str) -> int:
    """Loop forwards compared per decode step: requests x draft steps x leaves."""
    s = SHAPES[shape]
    return len(BATCH) * (s["steps"] - 1) * s["topk"]


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "padded"])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("drafts", ["oracle", "random"])
def test_every_draft_step_equals_a_direct_forward(models, drafts, kind, shape, graphs):
    engine = make_engine(models[drafts], kind, shape, graphs)
    assert engine.speculator.graphs["draft"].bucket(3) == (4 if graphs else None)
    got = decode_and_compare(engine)
    assert got.forwards == 3 * forwards_per_step(shape)  # three decode steps
    assert got.depths == set(range(SHAPES[shape]["steps"] - 1)), "every draft step (tree depth) was compared"
    assert got.position_mismatches == 0, "draft steps ran at the wrong positions"
    assert got.token_mismatches == 0, "draft steps were fed other tokens than the by-hand tree's"
    assert got.max_err < TOL, f"draft loop logits differ from a direct forward by {got.max_err:.2e}"
    if drafts == "oracle":  # accepted runs: committed lengths advanced by several tokens at once
        assert max(got.advances) >= 3, got.advances
    else:
        assert max(got.advances) <= 2, got.advances
    if drafts == "random" or kind != "eagle3":  # one position off would not have passed
        assert got.min_position_effect > POSITION_MATTERS, \
            f"position changes the logits by only {got.min_position_effect:.2e}"


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("kind", KINDS)
def test_negative_control_a_shifted_position_is_caught(models, monkeypatch, kind, shape):
    """The draft loop run one position ahead (SGLang's bug), everything else unchanged: the logits
    comparison alone fails, at every compared forward."""
    engine = make_engine(models["random"], kind, shape)
    real = phases.build_uniform_batch

    def shifted(cache, rows, prefix_lens, q_len, extra, input_ids, positions, *args, **kwargs):
        if cache is not engine.cache and kwargs.get("custom_mask") is not None:  # draft loop forwards only
            positions = positions + 1
        return real(cache, rows, prefix_lens, q_len, extra, input_ids, positions, *args, **kwargs)

    monkeypatch.setattr(phases, "build_uniform_batch", shifted)
    got = decode_and_compare(engine, max_steps=1, wrong_positions=False)
    assert got.forwards == forwards_per_step(shape)
    assert got.position_mismatches == got.forwards  # what the position check sees
    assert got.min_err > POSITION_MATTERS, f"a shifted position went unseen by the logits ({got.min_err:.2e})"


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
def test_under_cuda_graph_replay(oracle_model_dir, kind):
    """Real CUDA graphs: the draft, verify and extend phases are captured, then replayed. The loop's
    logits stay inside the graph, so the chain it proposed is compared (its tokens are the argmax of
    those logits), and the continuous outputs of the replayed extend (draft K/V, hidden state, first
    tree level) are compared after every step, with the target K/V the replayed verify wrote."""
    root = Path(oracle_model_dir)
    config = EngineConfig(**SMALL, device="cuda", dtype="float32", page_size=4, chunk_size=16, cuda_graph=True,
                          spec=SpecConfig(topk=1, steps=4, num_draft_tokens=5), spec_policy="fixed")
    engine = Engine(root / "target", root / kind, config)
    assert decode_and_compare(engine).forwards == 3 * 3 * 3
    assert engine.speculator.graphs["draft"]._graphs, "no graph was captured"
